"""How Dask weighs and ships the objects between a step's tasks; registered on import.

Imported by every module whose objects cross processes (the task bodies on workers, the
graph on the controller), so the registrations exist wherever those objects are sized,
sent or received.
"""
from __future__ import annotations

from dask.sizeof import sizeof
from distributed.protocol import dask_deserialize, dask_serialize, deserialize, serialize

from tasks.finalize.assemble import FinalizedGroup, rebuild_group
from tasks.finalize.verify import RolloutResult

from .task_outputs import Piece, VerifyOut

_GROUP_TENSORS = ("input_ids", "input_lengths", "prompt_lengths", "logprobs", "token_mask",
                  "sample_mask", "rewards", "routed_experts", "has_routes")


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
