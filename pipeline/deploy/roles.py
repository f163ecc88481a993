"""Worker roles as Dask resources: what a ``dask worker --resources`` line advertises.

``generation`` (1: hosts generation actors and engines), ``storage`` (1: the store host
gives every hosted store a unit on it) and ``finalize`` (N slots: verify tasks run there,
``finalize.slots-per-worker`` by default). A worker advertising none of them has no role.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from tasks.errors import InvalidInput

from ..actors import workers_now

if TYPE_CHECKING:
    from distributed import Client

ROLES = ("generation", "storage", "finalize")
WORKER_PRELOAD = "pipeline.deploy.worker_preload"


def check_roles(roles: Iterable[str]) -> tuple[str, ...]:
    """``roles`` in :data:`ROLES` order, deduplicated; :class:`InvalidInput` naming an
    unknown one (or none at all)."""
    given = [str(r).strip() for r in roles if str(r).strip()]
    unknown = sorted(set(given) - set(ROLES))
    if unknown or not given:
        what = f"unknown role(s) {', '.join(unknown)}" if unknown else "no role"
        raise InvalidInput(f"{what}; a host's roles are some of {', '.join(ROLES)} (e.g. generation,finalize)")
    return tuple(r for r in ROLES if r in given)


def role_resources(roles: Iterable[str], finalize_slots: float) -> dict[str, float]:
    """The resources a worker of ``roles`` advertises (``finalize_slots`` verify slots for
    the finalize role, 1 for the others)."""
    return {r: (float(finalize_slots) if r == "finalize" else 1.0) for r in check_roles(roles)}


def resources_arg(resources: Mapping[str, float]) -> str:
    """``dask worker --resources`` text for ``resources``: ``"finalize=2,storage=1"``."""
    return ",".join(f"{name}={value:g}" for name, value in resources.items())


def roles_of(resources: Mapping[str, float] | None) -> tuple[str, ...]:
    """The roles a worker's resources give it (each resource > 0), in :data:`ROLES` order."""
    have = resources or {}
    return tuple(r for r in ROLES if float(have.get(r, 0) or 0) > 0)


def workers_with_role(client: Client, role: str) -> list[str]:
    """Addresses of the workers advertising ``role`` now, sorted (``InvalidInput`` for a
    role not in :data:`ROLES`)."""
    check_roles([role])
    workers = workers_now(client)
    return sorted(a for a, w in workers.items() if role in roles_of(w.get("resources")))
