"""``python -m pipeline bench scale`` at its --quick size, one run per mode, on real
LocalHosts clusters (1, 2 and 4 hosts on 127.0.0.2...). Asserted as counts, never times:
store calls per step follow the units (hosts), not the rollouts; verify tasks stay within
the layout's bound; bytes cross hosts only when there is more than one."""
from __future__ import annotations

import argparse
import math

import pytest

from pipeline.bench import scale
from pipeline.finalize.settings import FinalizeSettings

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def result():
    return scale.run(argparse.Namespace(quick=True, runs=1, rollouts_per_host=16, quiet=True))


def test_store_calls_grow_with_hosts_not_with_rollouts(result):
    """Per unit and step: one staging get, one routes get, one clear delete; one unit per host."""
    assert result["failures"] == [] and scale.exit_status(result) == 0
    for hosts, m in result["weak"].items():
        assert m["store_calls"] == 3 * int(hosts), (hosts, m)
        assert m["accepted"] == m["rollouts"] == 8 * int(hosts)
    growth = result["growth"]
    assert [growth[k]["store_calls"] for k in ("1x", "4x")] == [12, 12]
    assert result["ratios"]["growth_store_calls_4x_vs_1x"] == 1.0


def test_verify_tasks_stay_within_the_layout_bound(result):
    """A site's rollouts are split by assembling site (at most one per site), each split
    packed by the verify token budget: verify tasks <= sites^2 + ceil(tokens / budget),
    so 4x the rollouts does not make 4x the verify tasks while they fit the budget. The
    step's task count is exactly the layout's (checked against the graph's own count
    of fetch tasks in every run: fetch <= 2 per site)."""
    budget = FinalizeSettings.from_config().verify_token_budget
    for m in [*result["weak"].values(), *result["growth"].values()]:
        hosts, tokens = m["hosts"], m["rollouts"] * scale.CALLS * scale.DELTA
        assert m["verify_tasks"] <= hosts * hosts + math.ceil(tokens / budget), m
        groups = math.ceil(m["rollouts"] / scale.ROLLOUTS_PER_GROUP)
        # fetches (<= 2 per site) + pieces (<= 2 per verify task) + verify + one assemble per group
        assert m["verify_tasks"] + groups <= m["tasks"] <= 2 * hosts + 3 * m["verify_tasks"] + groups, m
    assert result["weak"]["1"]["tasks"] == 4  # one site, one task: fetch staging, fetch routes, verify, assemble


def test_bytes_cross_hosts_only_with_more_than_one_and_match_the_plan(result):
    weak = result["weak"]
    assert weak["1"]["cross_host_bytes_per_rollout"] == 0
    for hosts in ("2", "4"):
        assert weak[hosts]["cross_host_bytes_per_rollout"] > 0
        assert weak[hosts]["cross_host_bytes_per_rollout"] == weak[hosts]["cross_host_bytes_planned_per_rollout"]
    assert all(m["controller_cpu_s_per_rollout"] > 0 and m["messages_sent"] >= 1 for m in weak.values())
