"""The GRPO example's trainer step (examples/grpo_tiny_moe.py) on a step whose every
rollout was rejected: no forward, no update, an empty mismatch report; the run goes on.
Skipped without the ``hf`` extra."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from pipeline.finalize import StepResult  # noqa: E402
from pipeline.finalize import monitor  # noqa: E402
from tasks import reasons as R  # noqa: E402
from tasks.engines.hf_moe import HFMoEConfig, HFMoEEngine  # noqa: E402
from tasks.finalize.assemble import assemble_group  # noqa: E402
from tasks.finalize.verify import rejected_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _example(monkeypatch):
    spec = importlib.util.spec_from_file_location("grpo_tiny_moe", ROOT / "examples" / "grpo_tiny_moe.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mod)  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("replay", [True, False])
def test_a_step_whose_every_rollout_was_rejected_trains_nothing_and_does_not_fail(replay, monkeypatch):
    published = []
    monkeypatch.setattr(monitor.events, "publish", lambda kind, event: published.append(event))
    ex = _example(monkeypatch)
    args = ex.parse_args(["--small"])
    model = HFMoEEngine(HFMoEConfig(layers=2, hidden=32, experts=4, top_k=2, seed=5)).model
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    group = assemble_group([rejected_result(f"r{i}", R.CORRUPT_DIGEST, "test") for i in range(3)], [0.0, 1.0, 0.5])
    result = StepResult("all-rejected", {"g": group}, {}, mismatch_eps=(0.1, 0.2))
    batch, rep, paired, loss = ex.trainer_step(model, opt, result, 3, args, replay)
    assert batch["sample_mask"].sum() == 0 and rep.tokens == 0 and loss == 0.0
    assert paired == {True: 0.0, False: 0.0}
    assert [e["tokens"] for e in published] == [0]  # the monitor still hears of the step
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
