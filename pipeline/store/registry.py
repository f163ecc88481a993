"""Per-partition field registry: each field's dtype and trailing shape, pinned at first write.

A partition is a namespace of keys in a storage unit ("staging", "cut"). The first row
that carries a field fixes that field's ``(dtype string, trailing shape)`` for the
partition; a later batch whose field differs is refused with ``dtype_mismatch`` naming
the field, the existing and the incoming spec. Pinning per field (not per row) keeps
the check O(fields) per batch: a packed batch has one dtype per field.

The registry lives in one unit; units do not coordinate (no central metadata hop), so
two units may in principle pin different specs for one field. The client's merge of
``get_many`` results refuses keys whose spec disagrees with the rest of the answer.
"""
from __future__ import annotations

from dataclasses import dataclass, field

Spec = tuple[str, tuple[int, ...]]  # (numpy dtype string, trailing shape)


def format_spec(spec: Spec) -> str:
    """``"<i8[]"`` / ``"<i2[4, 2]"``: how a spec reads in error details."""
    dtype, trailing = spec
    return f"{dtype}{list(trailing)}"


@dataclass
class FieldRegistry:
    """Field specs of ONE partition."""

    specs: dict[str, Spec] = field(default_factory=dict)

    def mismatch(self, name: str, spec: Spec) -> str | None:
        """``None`` if ``spec`` agrees with the pinned one (or none is pinned), else a detail
        naming the field, the existing and the incoming dtype/trailing shape."""
        have = self.specs.get(name)
        if have is None or have == spec:
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
            reg = self.partitions[partition] = FieldRegistry()
        return reg

    def get(self, partition: str) -> FieldRegistry | None:
        return self.partitions.get(partition)

    def to_dict(self) -> dict[str, dict[str, list]]:
        """JSON-able view: ``{partition: {field: [dtype, [trailing...]]}}``."""
        return {
            p: {n: [s[0], list(s[1])] for n, s in reg.specs.items()} for p, reg in self.partitions.items()
        }
