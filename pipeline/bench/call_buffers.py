"""The generation calls the cut and restore benchmarks build: real :class:`CallBuffer`
objects, as a generation worker fills them (digest of ``capture.digest``, routes in the
dtype its engine picks for the profile's experts), with seeded random content."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

if TYPE_CHECKING:
    from tasks.profiles import MoeProfile

    from ..generation.call_buffer import CallBuffer

VOCAB = 512  # token ids lie in [0, VOCAB)
CONTEXT_TOKENS = 16  # context tokens of every cut benchmark call (the rest is generated)


def call_buffers(rng: np.random.Generator, rollout_ids: Sequence[str], call_id: str, ctx: int, tokens: int,
                 prof: MoeProfile | None, max_new_tokens: int | None = None) -> list[CallBuffer]:
    """One call per rollout id: ``ctx`` context tokens, then ``tokens - ctx`` generated in
    one append (ids, logprobs), with ``prof``'s routed experts (ids in ``[0, experts)``)
    unless it is None. Drawn from ``rng`` call by call, in a fixed order: the same seed
    builds the same calls again."""
    from tasks.schema import routes_dtype_for

    from .. import config
    from ..generation.call_buffer import CallBuffer

    gen_n = tokens - ctx
    shape = None if prof is None else (prof.layers, prof.top_k)
    # As a generation worker builds them (digest of capture.digest, its engine's routes dtype).
    kinds = {"digest_version": config.digest_version(), "routes_dtype": routes_dtype_for(None if prof is None else prof.experts)}

    def routes(n: int) -> np.ndarray | None:
        return None if prof is None else rng.integers(0, prof.experts, (n, *shape), dtype=np.int16)

    calls = []
    for rollout in rollout_ids:
        b = CallBuffer(rollout, call_id, rng.integers(0, VOCAB, ctx), max_new_tokens=max_new_tokens,
                       routes_shape=shape, context_routes=routes(ctx), **kinds)
        b.append(rng.integers(0, VOCAB, gen_n), -rng.random(gen_n, dtype=np.float32), routes(gen_n))
        calls.append(b)
    return calls


def refill_cpu_s(calls: Sequence[CallBuffer]) -> float:
    """CPU seconds (this thread) to build ``calls`` again from their tokens as a generation
    worker does: the constructor (context) and one append each, with every running hash
    they feed (the part of the capture cost paid as tokens arrive, not at a cut)."""
    import time

    from ..generation.call_buffer import CallBuffer

    jobs = []
    for b in calls:
        out, n_ctx = b.output(), len(b.context_ids)
        routes = out.get("routed_experts")
        jobs.append(((b.rollout_id, b.model_call_id, out["token_ids"][:n_ctx]),
                     dict(max_new_tokens=b.max_new_tokens, routes_shape=b.routes_shape, digest_version=b.digest_version,
                          routes_dtype=b.routes_dtype, context_routes=None if routes is None else routes[:n_ctx]),
                     (out["token_ids"][n_ctx:], out["logprobs"][n_ctx:], None if routes is None else routes[n_ctx:])))
    t0 = time.thread_time()
    for args, kwargs, piece in jobs:
        CallBuffer(*args, **kwargs).append(*piece)
    return time.thread_time() - t0


def client_calls(client_idx: int, n_calls: int, tokens: int, tag: str, prof: MoeProfile | None) -> list[CallBuffer]:
    """``bench cut``'s calls of writer client ``client_idx``: ``tokens``-token prefixes
    (:data:`CONTEXT_TOKENS` of context, the rest generated), rollouts ``{tag}c{client}r{i}``,
    with ``prof``'s routed experts (ids in ``[0, experts)``) unless it is None; the same
    arguments build the same calls."""
    rollouts = [f"{tag}c{client_idx}r{i}" for i in range(n_calls)]
    return call_buffers(np.random.default_rng(client_idx), rollouts, "call-0", CONTEXT_TOKENS, tokens, prof,
                        max_new_tokens=tokens - CONTEXT_TOKENS + 1)
