"""Project configuration: the ``token-capture`` namespace of ``dask.config``.

``dask-config.yaml`` holds the defaults; it ships inside this package (in the repository,
``pipeline/dask-config.yaml`` links to the one file at the root). They are merged into
``dask.config`` once at import (``update_defaults``), so user settings, environment
variables (``DASK_TOKEN_CAPTURE__STORE__UNITS=4``) and ``dask.config.set`` win. Each
long-lived object reads its knobs through :func:`get` once, when it is built (a frozen
settings dataclass), never into module globals.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import dask.config
import yaml

NAMESPACE = "token-capture"
DEFAULTS_PATH = Path(__file__).resolve().parent / "dask-config.yaml"


def _load_defaults() -> None:
    with open(DEFAULTS_PATH) as f:
        defaults = yaml.safe_load(f)
    # priority "old": values already set (env variables, dask.config.set) keep winning.
    dask.config.update_defaults(defaults)


def get(key: str) -> Any:
    """``dask.config.get("token-capture.<key>")``, read now (not cached).

    No fallback argument: every key has its default in ``dask-config.yaml``, the one place
    defaults live. A missing key is a ``KeyError`` naming it.
    """
    return dask.config.get(f"{NAMESPACE}.{key}")


def digest_algorithm() -> str:
    """``capture.digest``: the algorithm every bulk hash is written with (``"blake3"`` or
    ``"sha256"``), read now; anything else raises
    :class:`~tasks.digests.UnsupportedDigest` naming the setting."""
    from tasks.digests import ALGORITHMS, UnsupportedDigest

    value = get("capture.digest")
    if value not in ALGORITHMS:
        raise UnsupportedDigest(f"token-capture.capture.digest is {value!r}; set one of {', '.join(ALGORITHMS)}")
    return str(value)


def digest_version() -> int:
    """The digest version rows are written with under ``capture.digest`` (read now)."""
    from tasks.digests import version_of

    return version_of(digest_algorithm())


def parse_bytes(value: int | str) -> int:
    """A size (``"256MiB"``, ``"64 KiB"`` or an int) as bytes."""
    return int(dask.utils.parse_bytes(value))


def get_bytes(key: str) -> int:
    """A size knob (``"256MiB"`` or an int) as bytes."""
    return parse_bytes(get(key))


if os.environ.get("TOKEN_CAPTURE_SKIP_DEFAULTS") != "1":
    _load_defaults()
