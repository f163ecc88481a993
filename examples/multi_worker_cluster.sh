#!/usr/bin/env bash
# A cluster started from the command line: one scheduler with the token-capture preload
# (dashboard page, /metrics series, downscaling protection) and workers that advertise
# `finalize` slots, all on 127.0.0.1; then the demo runs against it.
#
#   bash examples/multi_worker_cluster.sh            # 2 workers, default demo
#   WORKERS=3 DEMO_ARGS="--steps 2" bash examples/multi_worker_cluster.sh
#
# On several machines, start `dask worker` the same way on each (with --host set to that
# machine's address) and point them at the scheduler's address.
set -euo pipefail
WORKERS=${WORKERS:-2}
DEMO_ARGS=${DEMO_ARGS:-}
dir=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$dir"' EXIT

dask scheduler --host 127.0.0.1 --port 0 --dashboard-address 127.0.0.1:0 \
  --scheduler-file "$dir/scheduler.json" --preload pipeline.dashboard.preload >"$dir/scheduler.log" 2>&1 &
for _ in $(seq 100); do [ -s "$dir/scheduler.json" ] && break; sleep 0.2; done
for i in $(seq "$WORKERS"); do
  dask worker --scheduler-file "$dir/scheduler.json" --host 127.0.0.1 --nthreads 2 \
    --resources "finalize=2" --preload pipeline.deploy.worker_preload --no-dashboard >"$dir/worker-$i.log" 2>&1 &
done
addr=$(python -c "import json,sys; print(json.load(open(sys.argv[1]))['address'])" "$dir/scheduler.json")
python - "$addr" "$WORKERS" <<'PY'
import sys
from distributed import Client
with Client(sys.argv[1], timeout=60) as c:
    c.wait_for_workers(int(sys.argv[2]), timeout=120)
PY
echo "scheduler: $addr"
# shellcheck disable=SC2086
python -m pipeline demo --scheduler "$addr" $DEMO_ARGS
