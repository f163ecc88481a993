"""``hash_streams_vs_hash``: what the verifier's hashing alone costs, in its own pattern,
next to one pass of the same algorithm over the same fetched bytes.

The verifier hashes every call's row in three streams with different prefixes, so no
pass can be shared: the row digest (its ids, mask, logprobs and routes, a few kilobytes
each), the chain hash (the ids again) and, once per rollout, the cumulative hash (the
rollout's ids again, its whole row). Here each stream is fed the same buffers, call by
call, timed on the controller (best of ``repeats``, this thread), without the small
headers and none of the verifier's checks: a floor under ``verify_vs_hash``. Small
updates cost a hash more per byte than one large pass (BLAKE3 most: its tree runs wide
only over large inputs), so this floor sits above 1.0 by the stream count and by the
update size.

``hash_streams_layout_ms`` / ``_vs_hash``: the same streams as the rows' digest layout
feeds them (each hash opens with its tag and header; version 1/2: the digest's fields sit
between small length fields, so none starts on a BLAKE3 chunk boundary; version 3: each
field hashed alone, then a small outer hash): the verifier's hashing floor in the layout
it reads (docs/performance.md).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Sequence

import numpy as np

from tasks.digests import Hasher, file_hash
from tasks.schema import ROUTES_FIELDS

if TYPE_CHECKING:
    from tasks.packed import PackedBatch

    from .finalize_verify_vs_hash import Fetched


def _row_views(batch: PackedBatch, name: str) -> list[memoryview]:
    field = batch.fields[name]
    flat = memoryview(np.ascontiguousarray(field.values)).cast("B")
    per = field.values.dtype.itemsize * int(np.prod(field.values.shape[1:], dtype=np.int64))
    off = field.offsets
    return [flat[int(off[i]) * per : int(off[i + 1]) * per] for i in range(len(off) - 1)]


def stream_buffers(rows: PackedBatch, routes: PackedBatch | None, rollouts: Sequence[Sequence[int]]
                   ) -> tuple[list[list[memoryview]], list[memoryview], list[memoryview]]:
    """Per call the digest stream's buffers, per call the chain stream's (the ids), per
    rollout the cumulative stream's (its calls' ids back to back, one buffer when they
    are). ``rollouts[r]``: rollout ``r``'s row indices in ``rows``, chain order."""
    ids, mask, lps = (_row_views(rows, n) for n in ("token_ids", "token_mask", "logprobs"))
    routed = {}
    if routes is not None:
        # The routes field the rows were stored in (a get asking for every encoding's
        # field answers the others empty).
        name = max((f for f in ROUTES_FIELDS if f in routes.fields), key=lambda f: routes.fields[f].values.nbytes, default=None)
        if name is not None:
            routed = dict(zip(routes.keys, _row_views(routes, name)))
    digest = [[ids[i], mask[i], lps[i]] + ([routed[rows.keys[i]]] if rows.keys[i] in routed else []) for i in range(len(ids))]
    ids_all = np.ascontiguousarray(rows.fields["token_ids"].values)
    off = rows.fields["token_ids"].offsets
    cumulative = [memoryview(ids_all[int(off[rs[0]]) : int(off[rs[-1] + 1])]).cast("B") for rs in rollouts if rs]
    return digest, ids, cumulative


# Bytes the digest layout puts before and between a call's fields (tasks.hashing):
# TAG_CALL (23) + versions (4) + three ids with their lengths (~50 at these ids) + the
# parent marker and lengths (~40) + the ids' length; an 8-byte length before the mask and
# the logprobs; the routes' (L, K, length) head; the chain and cumulative hashes at the end.
DIGEST_HEAD, FIELD_HEAD, ROUTES_HEAD, DIGEST_TAIL = 120, 8, 16, 64
CHAIN_HEAD = 23 + 1 + 32  # TAG_CHAIN, the parent marker, the parent's chain hash
CUMULATIVE_HEAD = 24  # TAG_PREFIX


def _digest_layout(h: Hasher, bufs: list[memoryview]) -> None:
    """``bufs`` (ids, mask, logprobs[, routes]) fed as :func:`tasks.hashing.digest_raw` feeds them."""
    for k, b in enumerate(bufs):
        if k:
            h.update(bytes(ROUTES_HEAD if k == 3 else FIELD_HEAD))
        h.update(b)
    h.update(bytes(DIGEST_TAIL))


def hash_streams(fetched: Fetched, algorithm: str, repeats: int = 3, field_digests: bool = False) -> dict[str, float]:
    """``hash_streams_ms`` (the three streams, best of ``repeats``), ``hash_pass_ms`` (one
    pass over the same fetched field buffers) and their ratio ``hash_streams_vs_hash``;
    ``hash_streams_layout_ms`` / ``_vs_hash``: the streams with the layout's headers
    (``field_digests``: the field-digest layout of digest version 3)."""
    rows = fetched.rows
    at = {k: i for i, k in enumerate(rows.keys)}
    rollouts = [[at[k] for k in p.keys if k in at] for p in fetched.plan.rollouts]
    digest, chain, cumulative = stream_buffers(rows, fetched.routes, rollouts)
    whole = fetched.buffers()

    def streams(layout: bool) -> None:
        """The three streams; ``layout``: each hash opens with its header's bytes and the
        digest's fields are fed between their length fields (:func:`_digest_layout`)."""
        for bufs in digest:
            h = file_hash(algorithm)
            if layout and field_digests:  # each field alone, then the outer hash of their digests
                for b in bufs:
                    f = file_hash(algorithm)
                    f.update(b)
                    f.digest()
                h.update(bytes(DIGEST_HEAD + (FIELD_HEAD + 32) * len(bufs) + DIGEST_TAIL))
            elif layout:
                h.update(bytes(DIGEST_HEAD))
                _digest_layout(h, bufs)
            else:
                for b in bufs:
                    h.update(b)
            h.digest()
        for head, bufs in ((CHAIN_HEAD, chain), (CUMULATIVE_HEAD, cumulative)):
            for b in bufs:
                h = file_hash(algorithm)
                if layout:
                    h.update(bytes(head))
                h.update(b)
                h.digest()

    def one_pass() -> None:
        for b in whole:
            h = file_hash(algorithm)
            h.update(memoryview(b).cast("B"))
            h.digest()

    best = {"streams": float("inf"), "layout": float("inf"), "pass": float("inf")}
    for _ in range(repeats):
        for name, fn in (("streams", lambda: streams(False)), ("layout", lambda: streams(True)), ("pass", one_pass)):
            t0 = time.thread_time()
            fn()
            best[name] = min(best[name], (time.thread_time() - t0) * 1e3)

    def vs(ms: float) -> float:
        return round(ms / best["pass"], 2) if best["pass"] > 0 else 0.0

    return {"hash_streams_ms": round(best["streams"], 3), "hash_pass_cpu_ms": round(best["pass"], 3),
            "hash_streams_vs_hash": vs(best["streams"]), "hash_streams_layout_ms": round(best["layout"], 3),
            "hash_streams_layout_vs_hash": vs(best["layout"])}
