"""Digest algorithms by version: which hash function and domain tags a digest version uses. Pure.

A row's, receipt record's and cut acknowledgement's ``digest_version`` names the
algorithm of its hashes: 1 SHA-256 (tags ``token-capture/<kind>/v1\x00``), 2 BLAKE3
(tags ``.../v2\x00``), 3 BLAKE3 with field digests (``.../v3\x00``: the call digest
hashes each token field's keyed digest instead of its bytes, so writers feed those as
tokens arrive; :mod:`tasks.hashing` has both layouts). Writers pick one from
``capture.digest`` (``blake3``, the default, writes version 3, or ``sha256``);
verifiers recompute with the version each record declares. An unknown version is an
:class:`UnsupportedDigest` (a ``ValueError``). :func:`scheme` hands out a
:class:`DigestScheme` whose ``new(data)`` starts a running state (``update``,
``digest``, ``copy``; single-threaded: on one row's buffers a second thread does not pay
for itself), so hot paths pick the constructor once per rollout or chunk. Checkpoint
data files are hashed by algorithm name (:func:`file_hash`). docs/design.md, "Digest
algorithms".
"""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import blake3

from .errors import UnsupportedDigest  # defined with every other error

SHA256 = "sha256"
BLAKE3 = "blake3"
ALGORITHMS: tuple[str, ...] = (SHA256, BLAKE3)
DIGEST_SHA256 = 1  # digest_version of rows hashed with SHA-256 (every row before BLAKE3)
DIGEST_BLAKE3 = 2  # digest_version of rows hashed with BLAKE3 (one stream over every field)
DIGEST_BLAKE3_FIELDS = 3  # digest_version of rows hashed with BLAKE3 over field digests
DEFAULT_ALGORITHM = BLAKE3
DIGEST_BYTES = 32


class Hasher(Protocol):
    """A running hash state (``hashlib.sha256`` or ``blake3.blake3``)."""

    def update(self, data: Any, /) -> Any: ...

    def digest(self) -> bytes: ...

    def hexdigest(self) -> str: ...

    def copy(self) -> "Hasher": ...


@dataclass(frozen=True)
class DigestScheme:
    """One digest version: its algorithm, its constructor and its domain tags.

    ``new(data)`` starts a running state fed ``data`` (bytes or any buffer); the tags
    are the first bytes of each hash kind, so a value of one kind (or version) is never
    another's. ``chain_root`` / ``chain_link`` are ``tag_chain`` followed by the root
    marker ``\\x00`` / the link marker ``\\x01`` (a parent chain hash follows the latter).
    ``field_new`` (field-digest layout only, else None) starts a running field digest: keyed,
    no tag, so a field's bytes start on the hash's own block boundary.
    """

    version: int
    algorithm: str
    new: Callable[..., Hasher]
    tag_chain: bytes
    tag_prefix: bytes
    tag_call: bytes
    tag_cut_prefix: bytes
    field_new: Callable[..., Hasher] | None = None
    chain_root: bytes = field(init=False, repr=False)
    chain_link: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "chain_root", self.tag_chain + b"\x00")
        object.__setattr__(self, "chain_link", self.tag_chain + b"\x01")


def _tags(v: int) -> dict[str, bytes]:
    return {f"tag_{kind.replace('-', '_')}": f"token-capture/{kind}/v{v}\x00".encode()
            for kind in ("chain", "prefix", "call", "cut-prefix")}


# The key of version 3's field digests: BLAKE3's key derivation of a fixed context string.
FIELD_KEY = blake3.blake3(b"field digest v3", derive_key_context="token-capture 2026-12 field digest").digest()
SCHEMES: dict[int, DigestScheme] = {
    DIGEST_SHA256: DigestScheme(DIGEST_SHA256, SHA256, hashlib.sha256, **_tags(1)),
    DIGEST_BLAKE3: DigestScheme(DIGEST_BLAKE3, BLAKE3, blake3.blake3, **_tags(2)),
    DIGEST_BLAKE3_FIELDS: DigestScheme(DIGEST_BLAKE3_FIELDS, BLAKE3, blake3.blake3, **_tags(3),
                                       field_new=functools.partial(blake3.blake3, key=FIELD_KEY)),
}
SUPPORTED_VERSIONS: tuple[int, ...] = tuple(SCHEMES)
DEFAULT_VERSION = DIGEST_BLAKE3_FIELDS
_BY_NAME = {s.algorithm: s for s in SCHEMES.values()}  # the newest version of each algorithm
_FILE_HASHES: dict[str, Callable[..., Hasher]] = {SHA256: hashlib.sha256, BLAKE3: blake3.blake3}


def scheme(version: int) -> DigestScheme:
    """The scheme of digest ``version``; :class:`UnsupportedDigest` naming the known ones."""
    try:
        return SCHEMES[version]
    except (KeyError, TypeError):
        raise UnsupportedDigest(
            f"unsupported digest_version {version!r} (this build: {described()})"
        ) from None


def described() -> str:
    """``"1 (sha256), 2 (blake3), 3 (blake3, field digests)"``: the versions this build
    computes, for messages."""
    return ", ".join(f"{v} ({s.algorithm}{', field digests' if s.field_new else ''})" for v, s in SCHEMES.items())


def version_of(algorithm: str) -> int:
    """The digest version written under setting ``algorithm`` (``"blake3"``: 3, ``"sha256"``: 1)."""
    s = _BY_NAME.get(algorithm) if isinstance(algorithm, str) else None
    if s is None:
        raise UnsupportedDigest(f"digest algorithm {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    return s.version


def algorithm_of(version: int) -> str:
    """The algorithm name of digest ``version``."""
    return scheme(version).algorithm


def file_hash(algorithm: str) -> Hasher:
    """A fresh running state of ``algorithm`` for a checkpoint data file (no tag: the
    file's bytes alone, as ``sha256sum`` / ``b3sum`` print them)."""
    new = _FILE_HASHES.get(algorithm) if isinstance(algorithm, str) else None
    if new is None:
        raise UnsupportedDigest(f"file digest {algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    return new()
