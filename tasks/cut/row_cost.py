"""What one cut row costs a put: its planner signature and its bytes. Pure.

The :class:`~tasks.cut.batching.BatchPlanner` puts rows of one signature (the token
fields' dtypes and trailing shapes) together and bounds each put's bytes; these are the
numbers it plans with, for a staged row (:func:`row_signature`, :func:`put_nbytes`) and
for a chunk not packed yet (:func:`chunk_signature`, :func:`token_nbytes`), equal for the
same row.
"""
from __future__ import annotations

from typing import Hashable

import numpy as np

from ..schema import (
    HASH_BYTES,
    HASH_FIELDS,
    ID_FIELDS,
    ROUTES_DTYPE,
    SCALAR_FIELDS,
    TOKEN_FIELDS,
    StagedRow,
    routes_encoding_of,
    routes_field,
)

# Bytes a packed row costs besides its token payload: scalars, hashes and one offset per
# field (ids are counted from their actual length).
ROW_FIXED_BYTES = len(SCALAR_FIELDS) * 8 + len(HASH_FIELDS) * HASH_BYTES + (len(ID_FIELDS) + len(SCALAR_FIELDS) + len(HASH_FIELDS) + len(TOKEN_FIELDS) + 1) * 8

# Rows of one signature may share a put: (field, dtype, trailing shape) per token field.
Signature = Hashable

_TOKEN_SIGNATURE = tuple((name, dt.str, ()) for name, dt in TOKEN_FIELDS.items())


def row_signature(row: StagedRow) -> Signature:
    """(field, dtype, trailing shape) of every token field the row carries (its routes
    under its encoding's field: int16 and uint8 rows never share a put)."""
    sig = tuple((name, np.asarray(getattr(row, name)).dtype.str, ()) for name in TOKEN_FIELDS)
    if row.routes_encoding and row.routed_experts is not None:
        r = row.routed_experts
        sig += ((routes_field(row.routes_encoding), r.dtype.str, tuple(r.shape[1:])),)
    return sig


def put_nbytes(row: StagedRow) -> int:
    """Bytes the row adds to a packed put: token payload + routed experts + fixed fields."""
    ids = sum(len((getattr(row, n) or "").encode("utf-8")) for n in ID_FIELDS)
    routes = row.routed_experts.nbytes if (row.routes_encoding and row.routed_experts is not None) else 0
    return int(row.token_ids.nbytes + row.token_mask.nbytes + row.logprobs.nbytes + routes + ids + ROW_FIXED_BYTES)


def chunk_signature(routes_shape: tuple[int, int] | None, routes_dtype: np.dtype = ROUTES_DTYPE) -> Signature:
    """The planner signature of every chunk with ``routes_shape`` and routes of
    ``routes_dtype`` (int16 or uint8; :func:`row_signature`)."""
    if routes_shape is None:
        return _TOKEN_SIGNATURE
    dtype = np.dtype(routes_dtype)
    return _TOKEN_SIGNATURE + ((routes_field(routes_encoding_of(dtype)), dtype.str, tuple(routes_shape)),)


def token_nbytes(routes_shape: tuple[int, int] | None, routes_itemsize: int = ROUTES_DTYPE.itemsize) -> int:
    """Bytes one token adds to a packed row: ids, mask, logprobs (and routed experts of
    ``routes_itemsize`` bytes per id)."""
    return 16 + (0 if routes_shape is None else routes_itemsize * routes_shape[0] * routes_shape[1])
