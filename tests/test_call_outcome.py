"""How a store call to a unit ended, as BOTH its readers see it: the call's answer
(:func:`~pipeline.store.calls.settle`) and the process's memory of the unit
(:meth:`~pipeline.store.unit_health.UnitHealth.outcome`). Each failure kind with the
exception Dask (or the unit) raises for it; the closed unit end to end is in
``tests/test_unit_health.py``."""
from __future__ import annotations

import pytest
from distributed.comm.core import CommClosedError

from pipeline.store.calls import Call, settle
from pipeline.store.merging import empty_get
from pipeline.store.protocol import UNIT_UNAVAILABLE
from pipeline.store.unit_health import UnitHealth
from tasks.errors import InvalidStoreRequest, StoreBusy, StoreUnavailable, UnitSkipped

UNIT = ("unit-key", "tcp://127.0.0.1:1")
KEYS = ["k0", "k1"]

# (the exception a call raised, its kind, whether its unit is then not called)
UNAVAILABLE = [
    pytest.param(CommClosedError("in <TCP (closed)>: Stream is closed"), "unreachable", True, id="comm-closed"),
    pytest.param(OSError("Timed out trying to connect to tcp://127.0.0.1:1 after 3 s"), "unreachable", True, id="connect-timeout"),
    pytest.param(ConnectionRefusedError("refused"), "unreachable", True, id="refused"),
    pytest.param(RuntimeError("Worker holding Actor was lost.  Status: lost"), "unreachable", True, id="worker-lost"),
    pytest.param(TimeoutError(), "timeout", False, id="deadline"),
    pytest.param(StoreUnavailable("storage unit 0 is closed"), "closed", True, id="unit-closed"),
]
BUGS = [
    pytest.param(TypeError("get_many() takes 6 positional arguments"), id="type-error"),
    pytest.param(KeyError("k0"), id="key-error"),
    pytest.param(InvalidStoreRequest("unknown partition 'x'"), id="invalid-request"),
    pytest.param(StoreBusy("storage unit 0 is moving keys"), id="busy"),
]


def call() -> Call:
    return Call(0, "get_many", lambda: (), KEYS, empty_get)


def recorded(outcome: object) -> tuple[dict, bool]:
    """The counters a fresh :class:`UnitHealth` has after ``outcome``, and whether the
    unit is then not called."""
    health = UnitHealth()
    health.outcome(UNIT, outcome)
    skipped = health.skip(UNIT, 60.0)
    figures = health.figures()
    figures["skipped"] -= skipped
    return figures, skipped


@pytest.mark.parametrize("error, kind, remembered", UNAVAILABLE)
def test_a_unit_failing_as_a_whole_fails_its_keys_and_is_counted_as_its_kind(error, kind, remembered):
    out = settle(call(), error, ["tcp://127.0.0.1:1"])
    assert set(out.failed) == set(KEYS) and len(out.batch) == 0
    for reason, detail in out.failed.values():
        assert reason == UNIT_UNAVAILABLE and detail.startswith(f"storage unit 0 on tcp://127.0.0.1:1 is unavailable: {kind}")
    figures, skipped = recorded(error)
    assert skipped is remembered
    counter = "timeouts" if kind == "timeout" else kind
    assert {k: v for k, v in figures.items() if v} == {counter: 1}


@pytest.mark.parametrize("error", BUGS)
def test_a_bug_or_a_refused_request_raises_and_the_unit_counts_as_reached(error):
    with pytest.raises(type(error)):
        settle(call(), error, ["tcp://127.0.0.1:1"])
    health = UnitHealth()
    health.outcome(UNIT, OSError("refused"))  # found unreachable, then it answered (an error of its own)
    health.outcome(UNIT, error)
    assert not health.skip(UNIT, 60.0)
    assert health.figures()["unreachable"] == 1


def test_a_skipped_call_fails_its_keys_and_leaves_the_memory_as_it_was():
    skipped = UnitSkipped("not called: unit unit-key on tcp://127.0.0.1:1 was unreachable or closed moments ago")
    out = settle(call(), skipped, ["tcp://127.0.0.1:1"])
    assert {r for r, _ in out.failed.values()} == {UNIT_UNAVAILABLE} and set(out.failed) == set(KEYS)
    figures, still = recorded(skipped)
    assert not still and not any(figures.values())
    health = UnitHealth()
    health.outcome(UNIT, OSError("refused"))
    health.outcome(UNIT, skipped)  # a skip is not an answer: the unit stays remembered
    assert health.skip(UNIT, 60.0)


def test_an_answer_is_returned_as_it_is_and_clears_the_unit():
    answer = empty_get()
    assert settle(call(), answer, ["tcp://127.0.0.1:1"]) is answer
    health = UnitHealth()
    health.outcome(UNIT, StoreUnavailable("closed"))
    health.outcome(UNIT, answer)
    assert not health.skip(UNIT, 60.0)
