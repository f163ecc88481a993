"""A fetched batch as lookup tables for the verifier, with its whole-batch pre-scans.

:class:`RowTable` indexes the staging rows by key and runs the numpy scans that clear
sound rows from per-call checks; :class:`RoutesTable` does the same for the
routes batch (one table per routes encoding: each reads its own field). Built once per
verify task, read-only afterwards, shared by
every rollout of the task. Nothing here raises on bad data: a failed scan only means
the per-call checks run.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..digests import SUPPORTED_VERSIONS
from ..packed import PackedBatch, PackedField
from ..schema import (
    HASH_BYTES,
    HASH_FIELDS,
    ID_FIELDS,
    ROUTES_ENCODINGS,
    ROUTES_INT16,
    SCALAR_FIELDS,
    SCHEMA_VERSION,
    TOKEN_FIELDS,
)

_U8 = np.dtype("u1")
# A batch whose needed rows hold under this share of its tokens is not pre-scanned whole:
# per-call checks on the needed rows are cheaper than a scan of everything.
_PRESCAN_MIN_SHARE = 0.25
# prev_len and delta_len below this keep the batch's cum_len == prev_len + delta_len check
# exact in int64; a row past it takes the per-call checks (Python ints).
_LEN_BOUND = 1 << 62
# Elements per step of the whole-buffer scan: its boolean temporaries stay small enough
# to be reused from the heap (a fresh large temporary costs a page fault per 4 KiB).
_SCAN_CHUNK = 1 << 15


def routes_tables(batch: PackedBatch | None, num_experts: int | None) -> dict[int, "RoutesTable"]:
    """One :class:`RoutesTable` per routes encoding over the same fetched batch (sharing
    one key index: the batch's keys are walked once, not once per encoding)."""
    index = None if batch is None else key_index(batch.keys)
    return {enc: RoutesTable(batch, num_experts, enc, index) for enc in ROUTES_ENCODINGS}


def key_index(keys: Sequence[str]) -> dict[str, int]:
    """``key -> position`` of its first occurrence in ``keys`` (a duplicate key's later
    rows are never read: the per-token reference agrees)."""
    index: dict[str, int] = {}
    for i, k in enumerate(keys):
        index.setdefault(k, i)
    return index


def _byte_view(a: np.ndarray) -> memoryview:
    """Flat byte view of a contiguous array, without a copy (empty arrays too)."""
    return memoryview(a.reshape(-1).view(np.uint8))


def _field_problem(name: str, f: PackedField | None, n: int, dtype: np.dtype) -> str | None:
    """Batch-level structure of one field: present, dtype, 1-D, sane offsets."""
    if f is None:
        return f"field {name} not in the batch"
    v, off = f.values, f.offsets
    if not isinstance(v, np.ndarray) or not isinstance(off, np.ndarray):
        return f"field {name} is not numpy"
    if v.dtype != dtype or v.ndim != 1:
        return f"field {name} dtype {v.dtype} ndim {v.ndim}, expected {dtype} 1-D"
    if off.ndim != 1 or off.shape[0] != n + 1 or off.dtype.kind not in "iu":
        return f"field {name} offsets malformed"
    if n and (off[0] < 0 or off[-1] > v.shape[0] or (np.diff(off) < 0).any()):
        return f"field {name} offsets out of range"
    if f.present is not None and (not isinstance(f.present, np.ndarray) or f.present.shape != (n,)):
        return f"field {name} presence mask malformed"
    return None


class RowTable:
    """One fetched staging batch, indexed by key, with its whole-batch validity pre-scans.

    Public, read-only attributes (the per-field ones are filled only when
    ``batch_problem`` is None; per-row entries are meaningful only where ``struct_ok``):

    - ``batch``: the :class:`PackedBatch`; ``index``: key -> row (first occurrence wins).
    - ``batch_problem``: why no row of the batch is usable (a field absent, wrong dtype,
      bad offsets), or None.
    - ``struct_ok[i]``: row ``i`` has every field, one value per scalar, 32-byte hashes.
    - ``good[i]``: ``struct_ok`` and supported versions, sound lengths
      (``cum_len == prev_len + delta_len``, ``delta_len > 0``) and token arrays
      ``delta_len`` long: such a row skips those per-call checks.
    - ``content_ok[i]``: the mask, token and logprob rules surely hold (None: not scanned).
    - ``offsets[field]``: the field's offsets as a Python list (elements along axis 0).
    - ``raw_bytes[field]``: the whole buffer of an id or hash field as ``bytes``.
    - ``scalars[field]``: one Python int per row for each scalar field.
    - ``values[field]`` / ``mv[field]``: each token field as one contiguous array and a
      flat byte view of it (hashed without copies).
    """

    def __init__(self, batch: PackedBatch, vocab_size: int, needed: Sequence[str] | None = None) -> None:
        self.batch = batch
        n = len(batch.keys)
        self.index = key_index(batch.keys)  # first occurrence wins (the reference agrees)
        specs = {**{k: _U8 for k in ID_FIELDS + HASH_FIELDS}, **SCALAR_FIELDS, **TOKEN_FIELDS}
        problems = (_field_problem(name, batch.fields.get(name), n, dt) for name, dt in specs.items())
        # A field unusable batch-wide (absent, wrong dtype) makes every row invalid.
        self.batch_problem: str | None = next((p for p in problems if p), None)
        self.offsets: dict[str, list[int]] = {}
        self.raw_bytes: dict[str, bytes] = {}
        self.scalars: dict[str, list[int]] = {}
        self.struct_ok: list[bool] = []
        self.good: list[bool] = [False] * n
        self.values: dict[str, np.ndarray] = {}
        self.mv: dict[str, memoryview] = {}
        if self.batch_problem is None:
            self._scan_structure({name: batch.fields[name] for name in specs}, n)
        self.content_ok: list[bool] | None = None
        scan = self._prescan(vocab_size, needed)
        if scan is not None:
            self.content_ok = scan.tolist()

    def _scan_structure(self, fields: dict[str, PackedField], n: int) -> None:
        """Fill the per-field tables and ``struct_ok`` / ``good`` (one numpy pass)."""
        ok = np.ones(n, dtype=bool)
        for name, f in fields.items():
            if f.present is not None:
                ok &= f.present
            lengths = np.diff(f.offsets)
            if name in SCALAR_FIELDS:
                ok &= lengths == 1
            elif name in HASH_FIELDS:
                ok &= lengths == HASH_BYTES
        self.struct_ok = ok.tolist()
        # Python lists and bytes once per batch: per-row access is then plain indexing.
        self.offsets = {name: f.offsets.tolist() for name, f in fields.items()}
        self.raw_bytes = {name: fields[name].values.tobytes() for name in ID_FIELDS + HASH_FIELDS}
        cols: dict[str, np.ndarray] = {}
        for name in SCALAR_FIELDS:
            f = fields[name]
            at = np.minimum(f.offsets[:-1], max(len(f.values) - 1, 0))
            cols[name] = f.values[at].astype(np.int64) if len(f.values) else np.zeros(n, np.int64)
            self.scalars[name] = cols[name].tolist()
        for name in TOKEN_FIELDS:
            v = np.ascontiguousarray(fields[name].values)
            self.values[name] = v
            self.mv[name] = _byte_view(v)
        prev, delta, cum = cols["prev_len"], cols["delta_len"], cols["cum_len"]
        good = ok & (cols["schema_version"] == SCHEMA_VERSION) & np.isin(cols["digest_version"], SUPPORTED_VERSIONS)
        # The check_lengths rules; the bounds keep prev + delta clear of int64 overflow.
        good &= (delta > 0) & (delta < _LEN_BOUND) & (prev >= 0) & (prev < _LEN_BOUND) & (cum == prev + delta)
        for name in TOKEN_FIELDS:
            good &= np.diff(fields[name].offsets) == delta
        self.good = good.tolist()

    def _prescan(self, vocab_size: int, needed: Sequence[str] | None) -> np.ndarray | None:
        """bool[n]: True where mask, token and logprob rules surely hold (None: not scanned)."""
        if self.batch_problem is None:
            fs = [self.batch.fields[name] for name in TOKEN_FIELDS]
        if self.batch_problem is not None or len(fs[0].offsets) < 2:
            return None
        off = fs[0].offsets
        if any(f.present is not None for f in fs) or not all(np.array_equal(off, f.offsets) for f in fs[1:]):
            return None  # misaligned buffers (a malformed batch): per-call checks only
        total = int(off[-1] - off[0])
        if needed is not None and total:
            idx = [self.index[k] for k in needed if k in self.index]
            share = float(np.sum(off[np.add(idx, 1)] - off[idx])) / total if idx else 0.0
            if share < _PRESCAN_MIN_SHARE:
                return None
        ids, mask, lps = (self.values[name] for name in TOKEN_FIELDS)
        if not ids.size == mask.size == lps.size:
            return None  # buffers longer than their rows, unequally: per-call checks only
        drops = _scan_all_valid(ids, mask, lps, vocab_size)
        if drops is not None:
            return _zeros_then_ones(off, mask, drops)
        # Some element somewhere is bad: name the rows that hold one (cumulative counts).
        is_one = mask == 1.0
        is_zero = mask == 0.0
        bad = ~(is_one | is_zero)
        bad |= (ids < 0) | (ids >= vocab_size)
        bad |= ~np.isfinite(lps) | (lps > 0.0) | (is_zero & (lps != 0.0))
        cb = np.concatenate(([0], np.cumsum(bad)))
        c1 = np.concatenate(([0], np.cumsum(is_one)))
        start, end = off[:-1], off[1:]
        n_ones = c1[end] - c1[start]
        ones_suffix = c1[end] - c1[end - n_ones]
        return (cb[end] - cb[start] == 0) & (n_ones > 0) & (ones_suffix == n_ones)

    # -- per-row accessors (valid once ``batch_problem`` is None and ``struct_ok[i]``) --

    def view(self, name: str, i: int) -> np.ndarray:
        """Row ``i`` of field ``name``: a view of the batch buffer."""
        off = self.offsets[name]
        return self.batch.fields[name].values[off[i] : off[i + 1]]

    def raw(self, name: str, i: int) -> bytes:
        """Row ``i`` of an id or hash field as ``bytes``."""
        off = self.offsets[name]
        return self.raw_bytes[name][off[i] : off[i + 1]]

    def row_problem(self, i: int) -> str:
        """Why ``struct_ok[i]`` is False (slow path, bad rows only)."""
        for name, f in self.batch.fields.items():
            if name in self.offsets and not f.has(i):
                return f"field {name} absent"
        for name in SCALAR_FIELDS:
            if self.offsets[name][i + 1] - self.offsets[name][i] != 1:
                return f"{name} is not one value"
        for name in HASH_FIELDS:
            n = self.offsets[name][i + 1] - self.offsets[name][i]
            if n != HASH_BYTES:
                return f"{name} is {n} bytes, expected {HASH_BYTES}"
        return "malformed row"


def _scan_all_valid(ids: np.ndarray, mask: np.ndarray, lps: np.ndarray, vocab_size: int) -> np.ndarray | None:
    """If EVERY element of the (equally long) buffers passes the per-element content rules
    (ids in ``[0, vocab_size)``, mask 0.0 or 1.0, logprobs finite and <= 0, and 0 where the
    mask is 0), the positions ``p`` where ``mask[p] == 1`` and ``mask[p + 1] == 0``;
    otherwise None.

    Reductions and chunked comparisons only: the common, all-valid case.
    """
    n = mask.size
    if not n:
        return np.zeros(0, dtype=np.int64)
    if not _all_below(ids, vocab_size):
        return None
    # NaN fails both comparisons (min/max propagate it); -inf fails the first.
    if not (lps.min() > -np.inf and lps.max() <= 0.0):
        return None
    drops = []
    for a in range(0, n, _SCAN_CHUNK):
        b = min(a + _SCAN_CHUNK + 1, n)  # one element of overlap: steps across chunks
        one = mask[a:b] == 1.0
        zero = mask[a:b] == 0.0
        if np.count_nonzero(one) + np.count_nonzero(zero) != b - a:
            return None
        # Every logprob is <= 0 now, so "!= 0" is "< 0".
        if np.any(zero & (lps[a:b] < 0.0)):
            return None
        d = np.flatnonzero(one[:-1] & zero[1:])
        if d.size:
            drops.append(d + a)
    return np.concatenate(drops) if drops else np.zeros(0, dtype=np.int64)


def _zeros_then_ones(off: np.ndarray, mask: np.ndarray, drops: np.ndarray) -> np.ndarray:
    """bool[n]: row is zeros then ones with at least one 1, given every mask value is 0 or 1
    and ``drops`` (every ``p`` with ``mask[p] == 1`` and ``mask[p + 1] == 0``).

    Such a row ends with a 1 and has no 1 -> 0 step inside it; steps at row boundaries
    are allowed. Vectorized over rows, no cumulative sums.
    """
    start, end = off[:-1], off[1:]
    ok = end > start
    if mask.size:
        ok &= mask[np.clip(end - 1, 0, mask.size - 1)] == 1.0
        if drops.size:
            r = np.searchsorted(off, drops, side="right") - 1  # the row holding p
            inside = (r >= 0) & (r < len(start))
            r, p = r[inside], drops[inside]
            ok[r[p + 1 < end[r]]] = False
    return ok


def _all_below(v: np.ndarray, bound: int) -> bool:
    """Every element of the integer array ``v`` is in ``[0, bound)``; one reduction where
    a negative value viewed unsigned is surely ``>= bound``."""
    if v.dtype.kind == "i" and 0 < bound <= 1 << (8 * v.itemsize - 1) and v.flags.c_contiguous:
        return int(v.view(v.dtype.str.replace("i", "u")).max()) < bound
    return bool(v.min() >= 0 and v.max() < bound)


def _ids_in_range(v: np.ndarray, num_experts: int | None) -> bool:
    """Every expert id of the integer array ``v`` is in ``[0, num_experts)``, or ``>= 0``
    when ``num_experts`` is None (:func:`tasks.validation.check_expert_range`'s rule)."""
    if num_experts is not None:
        return _all_below(v, num_experts)
    return v.dtype.kind == "u" or bool(v.min() >= 0)


class RoutesTable:
    """The routes of one encoding in a fetched routes batch (or ``None``), indexed by
    key, range pre-scanned.

    Public, read-only attributes:

    - ``encoding``: the routes encoding read (its field: ``routed_experts`` for int16,
      ``routed_experts_u8`` for uint8; :data:`tasks.schema.ROUTES_ENCODINGS`).
    - ``index``: key -> row; ``field``: the batch's field of that encoding when its
      offsets are sane, else None (no routes are readable).
    - ``sound``: the field is one ``[total, L, K]`` buffer of the encoding's dtype with a sane presence
      mask, so a row present with ``delta_len`` tokens passes :func:`check_routes`'
      presence, dtype and shape rules without calling it. Only then are these set:
      ``values`` (the contiguous buffer), ``mv`` (its flat byte view), ``route_shape``
      (``(L, K)``), ``bytes_per_token``, ``offsets`` and ``present`` (Python lists).
    - ``in_range[j]``: every expert id of row ``j`` is in ``[0, num_experts)`` (``>= 0``
      when ``num_experts`` is None, as :func:`tasks.validation.check_expert_range`; None:
      not scanned, the field is not integer ``[total, L, K]``).
    """

    def __init__(self, batch: PackedBatch | None, num_experts: int | None, encoding: int = ROUTES_INT16,
                 index: dict[str, int] | None = None) -> None:
        self.encoding = encoding
        name, dtype = ROUTES_ENCODINGS[encoding]
        self.index: dict[str, int] = {}
        self.field: PackedField | None = None
        self.in_range: list[bool] | None = None
        self.sound = False
        self.values: np.ndarray | None = None
        self.mv: memoryview | None = None
        self.route_shape: tuple[int, int] = (0, 0)
        self.bytes_per_token = 0
        self.offsets: list[int] = []
        self.present: list[bool] = []
        if batch is None:
            return
        self.index = key_index(batch.keys) if index is None else index  # shared, read only
        f = batch.fields.get(name)
        if f is None or not isinstance(f.values, np.ndarray) or f.offsets.shape != (len(batch.keys) + 1,):
            return
        n = len(batch.keys)
        if n and (f.offsets[0] < 0 or f.offsets[-1] > f.values.shape[0] or (np.diff(f.offsets) < 0).any()):
            return
        self.field = f
        v = f.values
        present_ok = f.present is None or (
            isinstance(f.present, np.ndarray) and f.present.dtype == bool and f.present.shape == (n,)
        )
        if v.dtype == dtype and v.ndim == 3 and present_ok:
            self.sound = True
            self.values = np.ascontiguousarray(v)
            self.mv = _byte_view(self.values)
            self.route_shape = (int(v.shape[1]), int(v.shape[2]))
            self.bytes_per_token = int(v.shape[1] * v.shape[2] * v.itemsize)
            self.offsets = f.offsets.tolist()
            self.present = [True] * n if f.present is None else f.present.tolist()
        if v.ndim == 3 and v.dtype.kind in "iu":
            if not v.size or _ids_in_range(v, num_experts):
                self.in_range = [True] * n  # one pass over the whole buffer: the common case
            else:
                bad = v < 0 if num_experts is None else (v < 0) | (v >= num_experts)
                bad = bad.any(axis=(1, 2))  # per token
                cb = np.concatenate(([0], np.cumsum(bad)))
                self.in_range = (cb[f.offsets[1:]] - cb[f.offsets[:-1]] == 0).tolist()

    def get(self, key: str) -> tuple[np.ndarray | None, int]:
        """The routes row of ``key`` and its index, or ``(None, -1)``."""
        i = self.index.get(key, -1)
        if i < 0 or self.field is None:
            return None, -1
        return self.field.row(i), i
