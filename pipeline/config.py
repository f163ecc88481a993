"""Project configuration: the ``token-capture`` namespace of ``dask.config``.

``dask-config.yaml`` at the repository root holds the defaults. They are merged into
``dask.config`` once at import (``update_defaults``), so user settings, environment
variables (``DASK_TOKEN_CAPTURE__STORE__UNITS=4``) and ``dask.config.set`` win. Every
knob is read at call time through :func:`get`, never cached in module globals.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import dask.config
import yaml

NAMESPACE = "token-capture"
DEFAULTS_PATH = Path(__file__).resolve().parent.parent / "dask-config.yaml"


def _load_defaults() -> None:
    with open(DEFAULTS_PATH) as f:
        defaults = yaml.safe_load(f)
    # priority "old": values already set (env variables, dask.config.set) keep winning.
    dask.config.update_defaults(defaults)


def get(key: str, default: Any = ...) -> Any:
    """``dask.config.get("token-capture.<key>")``, read now (not cached)."""
    full = f"{NAMESPACE}.{key}"
    if default is ...:
        return dask.config.get(full)
    return dask.config.get(full, default=default)


def get_bytes(key: str) -> int:
    """A size knob (``"256MiB"`` or an int) as bytes."""
    return int(dask.utils.parse_bytes(get(key)))


if os.environ.get("TOKEN_CAPTURE_SKIP_DEFAULTS") != "1":
    _load_defaults()
