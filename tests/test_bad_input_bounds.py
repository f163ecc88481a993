"""Values past the bounds of their fields are refused with a typed error that names the
field, before anything changes: weight versions outside int64 and routes dimensions past
the digest's 32-bit fields (gate and capture client), rewards the finalizer would reject
(capture client ``finish``: the rollout stays open for a good finish), and a ``tls://``
scheduler address without the TLS security settings (the command line says which keys).

The capture client runs on an in-memory store here: the bounds are checked on the
caller's thread, before any row reaches a store.
"""
from __future__ import annotations

import dask
import numpy as np
import pytest

from pipeline.cli import main as cli_main
from pipeline.client import CaptureClient
from pipeline.store.protocol import StoreResult
from tasks import reasons as R
from tasks.errors import InvalidInput, InvalidRecord
from tasks.finalize.plan import plan_step
from tasks.gate import CaptureGate
from tasks.hashing import row_digest

VOCAB, EXPERTS = 16, 4
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
TLS_KEYS = ("distributed.comm.tls.ca-file", "distributed.comm.tls.client.cert", "distributed.comm.tls.client.key")


class MemoryStore:
    """A store that accepts every row of every put (the bounds are checked before it)."""

    def __init__(self) -> None:
        self.keys: list[str] = []

    def put_many(self, batch, partition: str = "staging", adopt: bool = False, timeout: float | None = None) -> StoreResult:
        self.keys.extend(batch.keys)
        return StoreResult(ok=list(batch.keys))


def delta(n_ctx: int = 1, n_gen: int = 2) -> dict:
    """A valid call delta: ``n_ctx`` context tokens, then ``n_gen`` generated ones."""
    n = n_ctx + n_gen
    mask = np.concatenate([np.zeros(n_ctx, np.float32), np.ones(n_gen, np.float32)])
    return dict(token_ids=np.arange(n, dtype=np.int64) % VOCAB, token_mask=mask, logprobs=np.where(mask > 0, -0.5, 0.0).astype(np.float32))


def short_id(value: object) -> str:
    """A test id that stays readable for 10**400."""
    text = repr(value)
    return text if len(text) <= 12 else text[:6] + f"...({len(text)} chars)"


@pytest.fixture
def capture():
    store = MemoryStore()
    with CaptureClient(store, flush_ms=1.0) as cap:
        yield cap, store


# ---- weight_version: the digest's <q> field -------------------------------------------------


@pytest.mark.parametrize("weight_version", [2**63, -(2**63) - 1, 2**64, 1.5, "3", True, None], ids=short_id)
def test_gate_refuses_a_weight_version_that_is_not_an_int64_naming_it(weight_version):
    gate = CaptureGate("wv-r", vocab_size=VOCAB)
    with pytest.raises(InvalidRecord) as err:
        gate.stage_call("c0", None, **delta(), weight_version=weight_version)
    assert err.value.reason == R.INVALID_STAGING_ROW
    assert "weight_version" in err.value.detail
    # Nothing was kept: the same call id stages afterwards, and is the receipt's only call.
    row = gate.stage_call("c0", None, **delta(), weight_version=1)
    assert [c.model_call_id for c in gate.receipt(0.0).calls] == ["c0"] and row.weight_version == 1


@pytest.mark.parametrize("weight_version", [I64_MIN, I64_MAX, np.int64(I64_MAX), np.int32(-7)])
def test_gate_stages_the_int64_bounds_of_weight_version(weight_version):
    row = CaptureGate("wv-ok", vocab_size=VOCAB).stage_call("c0", None, **delta(), weight_version=weight_version)
    assert row.weight_version == int(weight_version) and row.digest == row_digest(row)


def test_gate_refuses_routes_dimensions_past_the_digests_32_bit_fields():
    gate = CaptureGate("routes-r", vocab_size=VOCAB, num_experts=EXPERTS)
    d = delta()
    wide = np.zeros((len(d["token_ids"]), 2**32, 0), np.int16)  # no elements: fits in memory
    with pytest.raises(InvalidRecord) as err:
        gate.stage_call("c0", None, **d, routed_experts=wide)
    assert err.value.reason == R.INVALID_ROUTES and "32-bit" in err.value.detail
    gate.stage_call("c0", None, **d, routed_experts=np.zeros((len(d["token_ids"]), 2, 2), np.int16))
    assert len(gate.receipt(0.0).calls) == 1


@pytest.mark.parametrize("weight_version", [2**63, -(2**63) - 1])
def test_capture_client_refuses_an_out_of_range_weight_version_and_stages_nothing(capture, weight_version):
    cap, store = capture
    rc = cap.open("wv-client", vocab_size=VOCAB)
    with pytest.raises(InvalidRecord) as err:
        rc.stage("c0", None, **delta(), weight_version=weight_version)
    assert err.value.reason == R.INVALID_STAGING_ROW and "weight_version" in str(err.value)
    assert cap.stats()["queued"] == 0 and rc.refusal is None
    rc.stage("c0", None, **delta(), weight_version=I64_MAX)
    receipt = rc.finish(1.0)
    assert not receipt.poisoned and [c.weight_version for c in receipt.calls] == [I64_MAX]
    assert store.keys == ["wv-client/c0"]


# ---- finish: the reward (and the other arguments) before the rollout is finished -----------


BAD_REWARDS = [10**400, -(10**400), float("nan"), float("inf"), -float("inf"), 1e39, True, "1.0", None]


@pytest.mark.parametrize("reward", BAD_REWARDS, ids=short_id)
def test_finish_refuses_a_bad_reward_and_a_good_finish_then_gets_the_receipt(capture, reward):
    cap, store = capture
    rc = cap.open("reward-r", vocab_size=VOCAB)
    rc.stage("c0", None, **delta())
    with pytest.raises(InvalidRecord) as err:
        rc.finish(reward=reward)
    assert err.value.reason == R.INVALID_RECEIPT and "reward" in err.value.detail
    assert cap.stats()["open_rollouts"] == 1  # still open: not finished
    receipt = rc.finish(reward=0.25)
    assert receipt.reward == 0.25 and not receipt.poisoned
    assert receipt.staging_keys == ["reward-r/c0"] and store.keys == ["reward-r/c0"]
    assert not plan_step([receipt]).rejected


@pytest.mark.parametrize("reward", BAD_REWARDS, ids=short_id)
def test_a_reward_finish_refuses_is_one_the_finalizer_rejects(reward):
    gate = CaptureGate("same-rule", vocab_size=VOCAB)
    gate.stage_call("c0", None, **delta())
    with pytest.raises(InvalidRecord):
        gate.receipt(reward)
    d = gate.receipt(0.0).to_dict()
    d["reward"] = reward
    assert plan_step([d]).rejected["same-rule"][0] == R.INVALID_RECEIPT


@pytest.mark.parametrize("reward", [np.float32(-0.5), np.int64(3), 3.4e38, -3.4e38, 7])
def test_finish_takes_every_reward_the_finalizer_accepts(capture, reward):
    cap, _ = capture
    rc = cap.open("good-reward", vocab_size=VOCAB)
    rc.stage("c0", None, **delta())
    receipt = rc.finish(reward)
    assert type(receipt.reward) is float and receipt.reward == float(reward)
    assert not plan_step([receipt]).rejected


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf"), -1.0, 10**400, "soon", True], ids=short_id)
def test_finish_refuses_a_bad_timeout_before_finishing(capture, timeout_s):
    cap, _ = capture
    rc = cap.open("timeout-r", vocab_size=VOCAB)
    rc.stage("c0", None, **delta())
    with pytest.raises(InvalidInput, match="timeout_s"):
        rc.finish(1.0, timeout_s=timeout_s)
    assert not rc.finish(1.0, timeout_s=60).poisoned


def test_finish_refuses_a_terminal_that_is_not_a_str_before_finishing(capture):
    cap, _ = capture
    rc = cap.open("terminal-r", vocab_size=VOCAB)
    rc.stage("c0", None, **delta())
    with pytest.raises(InvalidRecord) as err:
        rc.finish(1.0, terminal_model_call_id=0)
    assert err.value.reason == R.INVALID_RECEIPT and "terminal_model_call_id" in err.value.detail
    assert rc.finish(1.0, terminal_model_call_id="c0").terminal_model_call_id == "c0"


# ---- the command line: a tls:// address without the TLS settings -----------------------------


def _one_error_line(capsys, code: int, want: int) -> str:
    """The command ended with ``want`` and one ``error: ...; fix`` line on stderr, nothing
    on stdout, no traceback (run through ``pipeline.cli.main`` in this process: the same
    code path as ``python -m pipeline``, without a second interpreter)."""
    out = capsys.readouterr()
    err = [line for line in out.err.splitlines() if line.strip()]
    assert code == want, (code, out.out, out.err)
    assert len(err) == 1 and "Traceback" not in out.err, out.err
    assert out.out == ""  # refused before the demo printed its run id
    assert err[0].startswith("error: ") and "; " in err[0], err[0]
    return err[0]


def test_cli_tls_address_without_security_settings_names_the_keys(capsys):
    with dask.config.set({key: None for key in TLS_KEYS}):
        code = cli_main(["demo", "--scheduler", "tls://127.0.0.1:8786", "--connect-timeout", "2"])
    line = _one_error_line(capsys, code, 2)
    assert "'tls://127.0.0.1:8786'" in line and "TLS security settings" in line
    assert all(key in line for key in TLS_KEYS) and "distributed.comm.require-encryption" in line
    assert "not a scheduler address" not in line and "tcp://HOST:PORT" not in line


def test_cli_plain_tcp_while_encryption_is_required_is_one_line_not_a_traceback(capsys):
    with dask.config.set({"distributed.comm.require-encryption": True}):
        code = cli_main(["bench", "store", "--scheduler", "tcp://127.0.0.1:8786", "--connect-timeout", "2"])
    line = _one_error_line(capsys, code, 2)
    assert "distributed.comm.require-encryption is true" in line and "tls://" in line


def test_cli_tls_settings_naming_a_missing_file_say_which(tmp_path, capsys):
    missing = str(tmp_path / "no-such-ca.pem")
    cert = tmp_path / "client.pem"
    cert.write_text("not checked here: only that the file exists")
    settings = {"distributed.comm.tls.ca-file": missing, "distributed.comm.tls.client.cert": str(cert)}
    with dask.config.set(settings):
        code = cli_main(["demo", "--scheduler", "tls://127.0.0.1:8786", "--connect-timeout", "2"])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    [line] = out.err.splitlines()
    assert line.startswith("error: ") and f"distributed.comm.tls.ca-file {missing!r} is not a file" in line



def test_python_api_tls_address_without_security_settings_names_the_keys():
    """The same check guards the Python entry points that take an address."""
    from pipeline.client import CaptureClient
    from pipeline.cluster import attach
    from tasks.errors import InvalidSchedulerAddress

    cleared = {key: None for key in TLS_KEYS}
    with dask.config.set(cleared):
        for connect in (lambda: attach("tls://127.0.0.1:8786", timeout=2), lambda: CaptureClient.connect("tls://127.0.0.1:8786")):
            with pytest.raises(InvalidSchedulerAddress) as info:
                connect()
            assert "TLS security settings" in str(info.value) and all(key in str(info.value) for key in TLS_KEYS)
            assert "not a scheduler address" not in str(info.value)
