"""How Dask weighs and ships the objects between a step's tasks; registered on import.

Imported by every module whose objects cross processes (the task bodies on workers, the
graph on the controller), so the registrations exist wherever those objects are sized,
sent or received.

A verify task's output (:class:`VerifyOut`) travels as ONE buffer per training-row field
(ids, mask, logprobs, routes) plus a small pickled header: its rows are views of the
fetched batch, back to back (a task's rollouts are a contiguous run of its site's fetch),
so each field's buffer is one view spanning them, sent without a copy; rows that are not
back to back are concatenated once. The receiver cuts the buffers into per-row views
again. A few large frames land in the controller's receive pool (frames of 1 MiB or more),
where hundreds of per-row frames would each take fresh pages.
"""
from __future__ import annotations

import dataclasses
import pickle
from typing import Sequence

import numpy as np
from dask.sizeof import sizeof
from distributed.protocol import dask_deserialize, dask_serialize, deserialize, serialize

from tasks.finalize.assemble import FinalizedGroup, rebuild_group
from tasks.finalize.linearize import Linearized
from tasks.finalize.verify import RolloutResult

from .task_outputs import Piece, VerifyOut

_GROUP_TENSORS = ("input_ids", "input_lengths", "prompt_lengths", "logprobs", "token_mask",
                  "sample_mask", "rewards", "routed_experts", "has_routes",
                  "weight_version_oldest", "weight_version_newest", "verified_tokens")


def linearized_bytes(result: RolloutResult) -> int:
    """Bytes of a verified rollout's training row (0 when it was rejected)."""
    lin = result.linearized
    if lin is None:
        return 0
    arrays = (lin.input_ids, lin.token_mask, lin.logprobs, lin.routed_experts)
    return sum(int(a.nbytes) for a in arrays if a is not None)


# What the objects between tasks weigh, in bytes: Dask would take each for ~56 bytes, so
# work stealing would move "free" pieces and memory accounting would miss them.


@sizeof.register(Piece)
def piece_bytes(piece: Piece) -> int:
    return int(piece.batch.nbytes) + int(piece.row_bytes.nbytes) + 64 * len(piece.batch.keys)


@sizeof.register(VerifyOut)
def verify_out_bytes(out: VerifyOut) -> int:
    return sum(linearized_bytes(r) + 256 for r in out.results.values())


@sizeof.register(FinalizedGroup)
def group_bytes(group: FinalizedGroup) -> int:
    tensors = (getattr(group, n) for n in _GROUP_TENSORS)
    return sum(t.element_size() * t.nelement() for t in tensors if t is not None) + 256 * len(group.status)


# A FinalizedGroup travels as its numpy buffers, frame by frame, whatever the pickle
# protocol: Dask's scheduler talks protocol 4 (in-band copies of every tensor).


@dask_serialize.register(FinalizedGroup)
def dump_group(group: FinalizedGroup) -> tuple[dict, list]:
    _, args = group.__reduce__()
    header, frames = serialize(args, serializers=("dask", "pickle"), on_error="raise")
    return {"sub": header}, frames


@dask_deserialize.register(FinalizedGroup)
def load_group(header: dict, frames: list) -> FinalizedGroup:
    return rebuild_group(*deserialize(header["sub"], frames))


# ---- a verify task's output: one buffer per row field -------------------------------------

_ROW_ARRAYS = ("input_ids", "token_mask", "logprobs", "routed_experts")


def _root(a: np.ndarray) -> np.ndarray:
    """The array at the bottom of ``a``'s chain of numpy views (itself if it owns its data
    or views a non-numpy buffer)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _data_address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def span(arrays: Sequence[np.ndarray]) -> np.ndarray | None:
    """ONE ``uint8`` view covering ``arrays`` when they lie back to back, in order, in one
    C-contiguous buffer (each C-contiguous); else ``None``. No copy."""
    if not arrays or not all(a.flags.c_contiguous for a in arrays):
        return None
    root = _root(arrays[0])
    if not root.flags.c_contiguous:
        return None
    at = _data_address(arrays[0])
    for a in arrays:
        if _data_address(a) != at or _root(a) is not root:
            return None
        at += a.nbytes
    start = _data_address(arrays[0]) - _data_address(root)
    if start < 0 or at - _data_address(root) > root.nbytes:
        return None
    return root.reshape(-1).view(np.uint8)[start : at - _data_address(root)]


def field_buffer(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """``arrays``' bytes as one ``uint8`` buffer: :func:`span` when they are back to back,
    else one concatenation."""
    whole = span(arrays)
    if whole is not None:
        return whole
    if not arrays:
        return np.empty(0, np.uint8)
    return np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in arrays])


def _stripped(lin: Linearized) -> tuple[Linearized, tuple]:
    """A training row without its arrays (``None`` in their place; every other field as it
    is) and each array's ``(dtype, shape)`` (``None``: the row has no such array)."""
    arrays = [getattr(lin, n) for n in _ROW_ARRAYS]
    specs = tuple(None if a is None else (a.dtype.str, a.shape) for a in arrays)
    return dataclasses.replace(lin, **dict.fromkeys(_ROW_ARRAYS)), specs


@dask_serialize.register(VerifyOut)
def dump_verify_out(out: VerifyOut) -> tuple[dict, list]:
    """A header frame (everything but the rows' arrays) and one buffer per row field."""
    per_field: list[list[np.ndarray]] = [[] for _ in _ROW_ARRAYS]
    results: dict[int, tuple[RolloutResult, tuple | None]] = {}
    for r, res in out.results.items():
        lin = res.linearized
        if lin is None:
            results[r] = (res, None)
            continue
        bare, specs = _stripped(lin)
        results[r] = (dataclasses.replace(res, linearized=bare), specs)
        for k, name in enumerate(_ROW_ARRAYS):
            a = getattr(lin, name)
            if a is not None:
                per_field[k].append(a)
    meta = dataclasses.replace(out, results=results)
    buffers = [field_buffer(arrays) for arrays in per_field]
    return {"fields": len(buffers)}, [pickle.dumps(meta, protocol=5)] + [memoryview(b) for b in buffers]


@dask_deserialize.register(VerifyOut)
def load_verify_out(header: dict, frames: list) -> VerifyOut:
    """:func:`dump_verify_out` undone: each row's arrays are views of the field buffers."""
    out = pickle.loads(frames[0])
    buffers = [np.frombuffer(f, dtype=np.uint8) for f in frames[1 : 1 + header["fields"]]]
    at = [0] * len(buffers)
    results: dict[int, RolloutResult] = {}
    for r, (res, specs) in out.results.items():
        if specs is not None:
            arrays: dict[str, np.ndarray | None] = {}
            for k, spec in enumerate(specs):
                if spec is None:
                    arrays[_ROW_ARRAYS[k]] = None
                    continue
                dtype, shape = np.dtype(spec[0]), spec[1]
                n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
                arrays[_ROW_ARRAYS[k]] = buffers[k][at[k] : at[k] + n].view(dtype).reshape(shape)
                at[k] += n
            res = dataclasses.replace(res, linearized=dataclasses.replace(res.linearized, **arrays))
        results[r] = res
    out.results = results
    return out
