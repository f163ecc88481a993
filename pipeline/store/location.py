"""Where a store checkpoint lives: a local directory, or any fsspec URL (``s3://bucket/prefix``).

:func:`parse` turns a path or URL into a :class:`Location` (a protocol, a root and the
fsspec storage options), which travels to the storage units' worker processes with the
save, so each unit writes its own files straight to the location. Its operations are all
a checkpoint needs: write a whole object, read a bounded object, list, remove, exists,
create-if-absent (the lease). A plain path, ``file://`` or ``local://`` URL is LOCAL and
keeps every local hardening (data files atomic by temp+fsync+rename through
:func:`~pipeline.store.batch_file.write_atomic`, small files read by
:func:`~pipeline.store.regular_file.read_regular_bounded`); any other protocol is REMOTE:
every object name is validated (plain components, no ``..``), every read bounded in bytes
(an object over its bound is refused unread), and listings never come from a cache.
``memory://`` is refused: each process has its own, and units write from theirs.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from tasks.digests import SHA256, file_hash
from tasks.errors import CheckpointError

from .. import config
from . import batch_file
from .regular_file import read_regular_bounded

OPTIONS_CONFIG = "store.checkpoint-storage-options"
LOCAL_PROTOCOLS = frozenset({"file", "local"})
_PRIVATE_PROTOCOLS = frozenset({"memory"})
# Backends whose whole-object puts take S3's conditions (If-Match, If-None-Match).
CONDITIONAL_PROTOCOLS = frozenset({"s3", "s3a"})
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,255}$")
_URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
_GLOB_RE = re.compile(r"[*?\[]")  # what fsspec.asyn.has_magic looks for


def _one_line(text: object) -> str:
    """``text`` as one line (exception texts may span several)."""
    return " ".join(str(text).split())


@dataclass(frozen=True)
class Location:
    """A checkpoint location: ``protocol`` (``""``: a local directory), ``root`` (the
    absolute local path, or the backend's path such as ``bucket/prefix``), ``url`` (for
    messages) and ``options`` (fsspec storage options; never shown in its repr)."""

    url: str
    protocol: str
    root: str
    options: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def local(self) -> bool:
        return not self.protocol

    def child(self, name: str) -> "Location":
        """The location ``<root>/<name>`` (a generation), same backend and options."""
        return Location(f"{self.url.rstrip('/')}/{name}", self.protocol, self.path(name), self.options)

    def path(self, name: str) -> str:
        """The full path of ``name`` (``a/b``: plain components only) under the root."""
        parts = name.split("/")
        if any(p in (".", "..") or not _NAME_RE.match(p) for p in parts):
            raise CheckpointError(f"{self.url}: object name {name!r} is not a plain relative name; refused")
        if self.local:
            return os.path.join(self.root, *parts)
        return "/".join([self.root.rstrip("/"), *parts])

    def fs(self) -> Any:
        """The fsspec filesystem of a remote location (fsspec caches instances per process)."""
        import fsspec

        return fsspec.filesystem(self.protocol, **dict(self.options))

    # ---- operations ---------------------------------------------------------------

    def write(self, name: str, buffers: Sequence[bytes | memoryview], algorithm: str = SHA256) -> tuple[str, int]:
        """Write ``buffers`` as the whole object ``name``: (hex digest of the bytes written
        under ``algorithm``, ``"sha256"`` or ``"blake3"``; size in bytes). Local: temp,
        fsync, rename. Remote: one whole-object put (an object store shows it whole or not
        at all)."""
        if self.local:
            # Through the module (not an imported name): one patch point for every atomic write.
            return batch_file.write_atomic(self.path(name), list(buffers), algorithm)
        data = b"".join(buffers)
        self.fs().pipe_file(self.path(name), data)
        h = file_hash(algorithm)
        h.update(data)
        return h.hexdigest(), len(data)

    def create(self, name: str, data: bytes) -> bool:
        """Write ``name`` only if it does not exist (True), else leave it (False). Remote:
        a conditional put (``If-None-Match: *`` on S3) where the backend has one."""
        if self.local:
            try:
                fd = os.open(self.path(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            except FileExistsError:
                return False
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            return True
        try:
            self.fs().pipe_file(self.path(name), data, mode="create")
        except FileExistsError:
            return False
        return True

    @property
    def conditional(self) -> bool:
        """Whether :meth:`replace` is compare-and-swap here (S3's ``If-Match``)."""
        return self.protocol in CONDITIONAL_PROTOCOLS

    def etag(self, name: str) -> str | None:
        """The entity tag of object ``name`` now (None: no such object, or a local location)."""
        if self.local:
            return None
        fs = self.fs()
        try:
            fs.invalidate_cache(self.path(name))
            info = fs.info(self.path(name))
        except FileNotFoundError:
            return None
        return info.get("ETag") or info.get("etag")

    def replace(self, name: str, data: bytes, expected: str | None) -> bool:
        """Write ``name`` whole only if it is still the object of entity tag ``expected``
        (None: only if there is none): True, else False (another writer replaced it). Only
        where :attr:`conditional`; elsewhere a plain whole-object write."""
        if not self.conditional:
            self.write(name, [data])
            return True
        fs, path = self.fs(), self.path(name)
        condition = {"mode": "create"} if expected is None else {"IfMatch": expected}
        try:
            fs.pipe_file(path, data, **condition)
        except (FileExistsError, OSError) as e:
            if self.etag(name) != expected:
                return False
            raise CheckpointError(f"{self.url.rstrip('/')}/{name}: conditional write failed: {_one_line(e)}") from None
        return True

    def read(self, name: str, limit_bytes: int, knob: str | None, error: type[CheckpointError]) -> bytes:
        """The bytes of object ``name``, at most ``limit_bytes`` (``knob`` names the setting
        of the bound in messages). Raises ``error`` for a missing object, one that is not a
        regular file / object, one over the bound (refused unread) or an unreadable one."""
        path = self.path(name)
        if self.local:
            return read_regular_bounded(path, limit_bytes, knob, error)
        where = f"{self.url.rstrip('/')}/{name}"
        bound = f"{limit_bytes}-byte limit" + (f" of {knob} (raise {knob} if this object is genuine)" if knob else "")
        fs = self.fs()
        try:
            fs.invalidate_cache(path)
            info = fs.info(path)
            if info.get("type") != "file":
                raise error(f"{where}: is a {info.get('type')}, not an object; refused unread")
            if int(info.get("size") or 0) > limit_bytes:
                raise error(f"{where}: {info.get('size')} bytes, over the {bound}; refused unread")
            data = fs.cat_file(path, start=0, end=limit_bytes + 1)
        except CheckpointError:
            raise
        except (OSError, ValueError) as e:
            raise error(f"{where}: unreadable: {_one_line(e)}") from None
        if len(data) > limit_bytes:
            raise error(f"{where}: grew past the {bound} while read; refused")
        return bytes(data)

    def sizes(self) -> dict[str, int | None]:
        """Every entry directly under the root: name -> size in bytes (``None``: a
        directory or prefix). Never from a listing cache. A missing root lists empty."""
        if self.local:
            try:
                names = os.listdir(self.root)
            except FileNotFoundError:
                return {}
            out: dict[str, int | None] = {}
            for n in names:
                st = os.lstat(os.path.join(self.root, n))
                out[n] = st.st_size if not os.path.isdir(os.path.join(self.root, n)) else None
            return out
        fs = self.fs()
        fs.invalidate_cache(self.root)
        try:
            listed = fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return {}
        return {
            e["name"].rstrip("/").rsplit("/", 1)[-1]: (int(e.get("size") or 0) if e.get("type") == "file" else None)
            for e in listed
        }

    def exists(self, name: str) -> bool:
        if self.local:
            return os.path.exists(self.path(name))
        fs = self.fs()
        path = self.path(name)
        fs.invalidate_cache(path)
        return bool(fs.exists(path))

    def remove(self, name: str) -> None:
        """Remove object or generation ``name`` (recursively); a missing one is no error."""
        path = self.path(name)
        if self.local:
            import shutil

            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            return
        fs = self.fs()
        try:
            fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        fs.invalidate_cache(self.root)

    def sync(self) -> None:
        """Make a local directory's renames durable (fsync the directory); remote: nothing."""
        if self.local:
            batch_file.fsync_dir(self.root)


# ---- parsing ----------------------------------------------------------------------


def storage_options() -> dict[str, Any]:
    """``token-capture.store.checkpoint-storage-options``: the fsspec storage options of
    remote checkpoint locations (``null``: none), read now. Credentials belong in the
    backend's usual places (``AWS_*`` variables, ``~/.aws``) rather than here."""
    value = config.get(OPTIONS_CONFIG)
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
        raise CheckpointError(
            f"token-capture.{OPTIONS_CONFIG} must be null or a mapping of fsspec storage options, got {type(value).__name__}"
        )
    return dict(value)


def local(path: str | os.PathLike) -> Location:
    """The local directory ``path`` (made absolute)."""
    root = os.path.abspath(os.fspath(path))
    return Location(root, "", root)


def parse(where: "str | os.PathLike | Location", options: Mapping[str, Any] | None = None) -> Location:
    """``where`` as a :class:`Location`: a plain path, ``file://`` or ``local://`` URL is a
    local directory; any other URL uses its fsspec backend with ``options`` (default:
    :func:`storage_options`, read now). A URL whose backend is unknown, not installed,
    private to one process (``memory://``) or chained (``a::b``) raises
    :class:`CheckpointError` naming it and the fix."""
    if isinstance(where, Location):
        return where
    text = os.fspath(where)
    if not isinstance(text, str) or not text:
        raise CheckpointError(f"a checkpoint location must be a non-empty path or URL, got {where!r}")
    if "::" in text and "://" in text:
        raise CheckpointError(f"checkpoint location {text!r}: chained fsspec URLs (a::b) are not supported; give one URL")
    if not _URL_RE.match(text):  # no "proto://" in front: a path (even one holding "://" further on)
        return local(text)
    protocol, _, rest = text.partition("://")
    protocol = protocol.lower()
    if protocol in LOCAL_PROTOCOLS:
        return local(rest)
    if protocol in _PRIVATE_PROTOCOLS:
        raise CheckpointError(
            f"checkpoint location {text!r}: {protocol}:// is private to each process and the storage units write "
            "from their own; use a local path or a shared store's URL (s3://bucket/prefix)"
        )
    cls = _backend(text, protocol)
    root = str(cls._strip_protocol(f"{protocol}://{rest}")).rstrip("/")  # S3:// is s3://
    if not root or any(p in ("", ".", "..") for p in root.split("/")):
        raise CheckpointError(f"checkpoint location {text!r}: needs a bucket or directory without '.', '..' or empty parts; refused")
    if _GLOB_RE.search(root):  # fsspec globs them in removes; s3fs reads '?' as a version id
        raise CheckpointError(
            f"checkpoint location {text!r}: '*', '?' and '[' are refused in a remote location (fsspec would match "
            "other objects when removing); use a prefix without them"
        )
    return Location(text.rstrip("/"), protocol, root, dict(storage_options() if options is None else options))


def _backend(url: str, protocol: str) -> Any:
    """The fsspec filesystem class of ``protocol``, or a one-line CheckpointError."""
    import fsspec

    try:
        return fsspec.get_filesystem_class(protocol)
    except ImportError as e:
        raise CheckpointError(
            f"checkpoint location {url!r}: the backend for {protocol}:// is not installed ({_one_line(e)}); install it "
            f"(for s3:// pip install 'dask-token-capture[s3]') on the controller and every storage worker, or use another location"
        ) from None
    except ValueError:
        raise CheckpointError(
            f"checkpoint location {url!r}: unknown protocol {protocol!r}; use a local path or the URL of an "
            "installed fsspec backend (s3://bucket/prefix with the s3 extra)"
        ) from None
