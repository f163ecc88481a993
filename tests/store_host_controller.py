"""A controller process for tests/test_store_host.py: starts a store, stages rows, dies.

    python tests/store_host_controller.py SCHEDULER NAME SEED (hosted|owned)

``hosted``: the store is started by the scheduler's store host; ``owned``: by this process
(``StagingStore.start`` + ``publish_store``). Either way the process stages two groups of
rows made from ``SEED`` (the test rebuilds the same rows), prints ``staged <n>`` and exits
at once (``os._exit``: no close, no cleanup), as a killed controller would.
"""
from __future__ import annotations

import os
import sys

import numpy as np


def main(scheduler: str, name: str, seed: int, mode: str) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from distributed import Client
    from rollout_factory import make_group

    from pipeline.client.discovery import publish_store
    from pipeline.store import StagingStore
    from pipeline.store.hosted import start_hosted
    from tasks.packed import pack_rows

    client = Client(scheduler, set_as_default=True)
    if mode == "hosted":
        store = start_hosted(client, name, n_units=3)
    else:
        store = StagingStore.start(client, n_units=3)
        publish_store(client, store, name)
    rows = staged_rows(make_group, seed)
    res = store.put_many(pack_rows(rows))
    assert not res.failed, list(res.failed.items())[:3]
    print(f"staged {len(rows)}", flush=True)
    os._exit(0)


def staged_rows(make_group, seed: int) -> list:
    """The rows a controller of ``seed`` stages (the same in every process)."""
    rng = np.random.default_rng(seed)
    groups = [make_group(rng, f"h{seed}g{g}", 3, n_calls=2, routes=(2, 2, 8)) for g in range(2)]
    return [r for built in groups for b in built for r in b.rows]


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
