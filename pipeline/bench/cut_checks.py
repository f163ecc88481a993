"""What ``bench cut`` checks and counts around its timed runs: rows read back bit-exact
against the same calls frozen again, and CPU seconds of the controller and every worker."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from .call_buffers import client_calls

if TYPE_CHECKING:
    from distributed import Client

    from tasks.cut.receipt import CutReceipt
    from tasks.profiles import MoeProfile

    from ..store.protocol import StoreLike

SAMPLE_ROWS = 4  # rows of client 0 read back and compared bit-exact per run


def check_cut_content(store: StoreLike, receipt: CutReceipt, tokens: int, tag: str, prof: MoeProfile | None) -> list[str]:
    """The first ``SAMPLE_ROWS`` durable prefixes of client 0: sealed under the key their
    freeze names, and read back bit-exact (:func:`check_content`)."""
    acks = [a for a in receipt.acks if a.durable][:SAMPLE_ROWS]
    keys = [a.staging_keys[-1] for a in acks if a.staging_keys]
    if len(keys) != len(acks):
        return ["a durable ack carries no sealed key"]
    return check_content(store, keys, tokens, tag, prof)


def check_content(store: StoreLike, keys: Sequence[str], tokens: int, tag: str, prof: MoeProfile | None) -> list[str]:
    """Read back ``keys`` (first-cut rows of client 0) and compare them bit-exact (every
    field) with the same calls rebuilt (same seeds) and frozen again."""
    from tasks.keys import CUT_PARTITION
    from tasks.packed import PackedBatch, pack_rows

    from .common import compare_rows

    if not keys:
        return []
    # The client's calls are drawn in order from one seeded generator: its first calls again.
    # A cut key is cut/<checkpoint>/<rollout>/<call>/<seq>; client 0's rollouts end in r<i>.
    rollouts = [k.split("/")[-3] for k in keys]
    n = max(int(r.rsplit("r", 1)[1]) for r in rollouts) + 1
    again = {b.rollout_id: b for b in client_calls(0, n, tokens, tag, prof)}
    rows = []
    for key, rollout in zip(keys, rollouts):
        frozen = again[rollout].freeze(f"{tag}ck")
        if frozen.key != key:
            return [f"{rollout}: written under {key}, its freeze names {frozen.key}"]
        rows.append(frozen.row)
    want = PackedBatch(list(keys), pack_rows(rows).fields)
    got = store.get_many(list(keys), partition=CUT_PARTITION)
    if got.failed:
        key, why = next(iter(got.failed.items()))
        return [f"read-back get: {len(got.failed)} key(s) failed, e.g. {key}: {why}"]
    return compare_rows(want, got.batch, what="read back ")


def process_cpu_s() -> float:
    import psutil

    t = psutil.Process().cpu_times()
    return t.user + t.system


def cpu_seconds(client: Client | None) -> dict[str, float]:
    """CPU seconds (user + system) of this process and of every worker process so far."""
    out = {"controller": process_cpu_s()}
    for addr, cpu in (client.run(process_cpu_s) if client is not None else {}).items():
        out[addr] = cpu
    return out
