"""A move's copy paced to a byte rate (pipeline/store/pacing.py): pure, on a clock the
test turns, so the waits are exact."""
import pytest

from pipeline.store.pacing import Pacer
from pipeline.store.rebalance import RebalanceSettings


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_waits_keep_the_average_rate_at_the_cap():
    clock = Clock()
    pacer = Pacer(1000.0, clock=clock)
    assert pacer.sent(500) == pytest.approx(0.5)  # 500 bytes at 1000 B/s: due 0.5 s after the start
    clock.now += 0.5
    assert pacer.sent(250) == pytest.approx(0.25)
    clock.now += 2.0  # slow sends: behind the rate, no wait
    assert pacer.sent(100) == 0.0
    assert pacer.sent_bytes == 850


def test_no_cap_never_waits_and_a_negative_rate_is_refused():
    pacer = Pacer(0.0, clock=Clock())
    assert pacer.sent(10**12) == 0.0
    with pytest.raises(ValueError, match="rate_bytes_s"):
        Pacer(-1.0)


def test_rebalance_settings_read_the_copy_knobs_once():
    import dask

    with dask.config.set({"token-capture.store.rebalance-inflight": 3, "token-capture.store.rebalance-rate-bytes-s": 5e8}):
        s = RebalanceSettings.from_config()
    assert (s.inflight, s.rate_bytes_s) == (3, 5e8)
    with dask.config.set({"token-capture.store.rebalance-inflight": 0}):
        assert RebalanceSettings.from_config().inflight == 1  # at least one copy in flight
