"""Per-partition field registry: each field's dtype and trailing shape.

A partition is a namespace of keys in a storage unit ("staging", "cut"). In the staged-row
partitions (:data:`SCHEMA_PARTITIONS`) the fields of the row schema (``tasks/schema.py``)
have their specs from the schema (:data:`SCHEMA_SPECS`), never from the first writer:
only the routes fields' trailing ``(L, K)`` is per deployment, so their dtypes come from
the schema and their trailing shape (two dims) is pinned by the first write. Each routes
encoding has its own field (``routed_experts`` int16, ``routed_experts_u8`` uint8), so
rows of both encodings live side by side in one partition, and in its checkpoint. Any other
field, in any partition, is pinned by the first row that carries it. A batch whose field
differs is refused with ``dtype_mismatch`` naming the field, the expected and the
incoming spec. Checking per field (not per row) keeps it O(fields) per batch: a packed
batch has one dtype per field.

The registry lives in one unit; units do not coordinate (no central metadata hop), so
two units may in principle pin different specs for one field. The client's merge of
``get_many`` results refuses keys whose spec disagrees with the rest of the answer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tasks.keys import CUT_PARTITION, STAGING_PARTITION
from tasks.schema import HASH_FIELDS, ID_FIELDS, ROUTES_ENCODINGS, SCALAR_FIELDS, TOKEN_FIELDS

Spec = tuple[str, tuple[int, ...]]  # (numpy dtype string, trailing shape)

_BYTES = np.dtype("u1").str
SCHEMA_SPECS: dict[str, tuple[str, tuple[int, ...] | None]] = {
    **{name: (_BYTES, ()) for name in ID_FIELDS},  # UTF-8 bytes
    **{name: (np.dtype(dt).str, ()) for name, dt in SCALAR_FIELDS.items()},
    **{name: (_BYTES, ()) for name in HASH_FIELDS},  # 32 bytes per row
    **{name: (np.dtype(dt).str, ()) for name, dt in TOKEN_FIELDS.items()},
    # None: trailing (L, K) pinned by first write
    **{name: (np.dtype(dt).str, None) for name, dt in ROUTES_ENCODINGS.values()},
}
"""Each row-schema field's ``(dtype string, trailing shape)``; trailing ``None``: two
dims, fixed per partition by the first write (routed experts' ``(L, K)``, per field)."""
SCHEMA_PARTITIONS = frozenset({STAGING_PARTITION, CUT_PARTITION})
"""Partitions holding staged rows: their schema fields are typed by :data:`SCHEMA_SPECS`."""


def format_spec(spec: Spec) -> str:
    """``"<i8[]"`` / ``"<i2[4, 2]"``: how a spec reads in error details."""
    dtype, trailing = spec
    return f"{dtype}{list(trailing)}"


@dataclass
class FieldRegistry:
    """Field specs of ONE partition."""

    specs: dict[str, Spec] = field(default_factory=dict)
    # Specs fixed in advance (a schema partition: SCHEMA_SPECS); trailing None = 2 dims,
    # pinned by first write.
    schema: dict[str, tuple[str, tuple[int, ...] | None]] = field(default_factory=dict)

    def mismatch(self, name: str, spec: Spec) -> str | None:
        """``None`` if ``spec`` agrees with the schema's and the pinned one (or none is
        pinned), else a detail naming the field, the expected and the incoming
        dtype/trailing shape."""
        have = self.specs.get(name)
        if have == spec:
            return None
        fixed = self.schema.get(name)
        if fixed is not None:
            dtype, trailing = fixed
            if spec[0] != dtype or (trailing is None and len(spec[1]) != 2) or (trailing is not None and spec[1] != trailing):
                want = f"{dtype}[L, K]" if trailing is None else format_spec(fixed)
                return f"field {name!r}: expected {want} (row schema), incoming {format_spec(spec)}"
        if have is None:
            return None
        return f"field {name!r}: existing {format_spec(have)}, incoming {format_spec(spec)}"

    def pin(self, name: str, spec: Spec) -> None:
        """Fix ``name`` to ``spec`` if nothing is pinned yet (first write wins)."""
        self.specs.setdefault(name, (str(spec[0]), tuple(int(d) for d in spec[1])))


@dataclass
class PartitionRegistry:
    """``partition -> FieldRegistry``; partitions appear on first use."""

    partitions: dict[str, FieldRegistry] = field(default_factory=dict)

    def __getitem__(self, partition: str) -> FieldRegistry:
        reg = self.partitions.get(partition)
        if reg is None:
            schema = SCHEMA_SPECS if partition in SCHEMA_PARTITIONS else {}
            reg = self.partitions[partition] = FieldRegistry(schema=dict(schema))
        return reg

    def get(self, partition: str) -> FieldRegistry | None:
        return self.partitions.get(partition)

    def to_dict(self) -> dict[str, dict[str, list]]:
        """JSON-able view: ``{partition: {field: [dtype, [trailing...]]}}``."""
        return {
            p: {n: [s[0], list(s[1])] for n, s in reg.specs.items()} for p, reg in self.partitions.items()
        }
