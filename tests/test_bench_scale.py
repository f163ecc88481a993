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
    assert result["profile"] == "toy" and result["bytes_per_token"] == 16 + 4 * 2  # one byte per expert id
    for hosts, m in result["weak"].items():
        assert m["store_calls"] == 3 * int(hosts), (hosts, m)
        assert m["gb_s"] > 0
        assert m["accepted"] == m["rollouts"] == 8 * int(hosts)
    growth = result["growth"]
    assert [growth[k]["store_calls"] for k in ("1x", "4x")] == [12, 12]
    assert result["ratios"]["growth_store_calls_4x_vs_1x"] == 1.0


def test_verify_tasks_stay_within_the_layout_bound(result):
    """A site's rollouts are packed by the verify token budget: verify tasks <= sites +
    ceil(tokens / budget), so 4x the rollouts does not make 4x the verify tasks while
    they fit the budget. The step's task count is exactly the layout's (checked against
    the graph's own count of fetch tasks in every run: fetch <= 2 per site); the groups
    are assembled by the controller, no task."""
    budget = FinalizeSettings.from_config().verify_token_budget
    for m in [*result["weak"].values(), *result["growth"].values()]:
        hosts, tokens = m["hosts"], m["rollouts"] * scale.CALLS * scale.DELTA
        assert m["verify_tasks"] <= hosts + math.ceil(tokens / budget), m
        # fetches (<= 2 per site) + pieces (<= 2 per verify task) + verify
        assert m["verify_tasks"] < m["tasks"] <= 2 * hosts + 3 * m["verify_tasks"], m
    assert result["weak"]["1"]["tasks"] == 3  # one site, one task: fetch staging, fetch routes, verify


def test_no_row_crosses_between_hosts_every_verified_row_goes_to_the_controller_once(result):
    """Verified rows travel from their site straight to the controller (which assembles
    the groups): nothing crosses between workers at any size, as measured and as
    planned, and the controller gathers the same bytes per rollout at every size."""
    weak = result["weak"]
    for m in [*weak.values(), *result["growth"].values()]:
        assert m["cross_host_bytes_per_rollout"] == m["cross_host_bytes_planned_per_rollout"] == 0, m
    collected = {m["collected_bytes_per_rollout"] for m in [*weak.values(), *result["growth"].values()]}
    assert len(collected) == 1 and collected.pop() > 0
    assert all(m["controller_cpu_s_per_rollout"] > 0 and m["messages_sent"] >= 1 for m in weak.values())
