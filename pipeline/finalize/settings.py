"""A finalizer's knobs, read once when the :class:`~pipeline.finalize.controller.Finalizer`
is built (``token-capture.finalize.*`` and ``policy.*``).

``dask.config.set`` applies to finalizers built afterwards;
:meth:`~pipeline.finalize.controller.Finalizer.with_settings` changes a built one from its
next step on. Worker-side tasks are handed the values they need as arguments (the fetch
timeout), so a controller's settings hold on every worker, whatever the worker's config.
"""
from __future__ import annotations

from dataclasses import dataclass

from tasks.errors import InvalidInput
from tasks.mismatch import DEFAULT_EPS, check_eps

from .. import config


@dataclass(frozen=True)
class FinalizeSettings:
    """What a finalizer needs per step, fixed when it is built."""

    vocab_size: int  # token ids must lie in [0, vocab_size) (``policy.vocab-size``)
    num_experts: int | None  # routed expert ids must lie in [0, num_experts) (``policy.experts``)
    verify_token_budget: int  # tokens packed into one verify task (``finalize.verify-token-budget``)
    retries: int  # Dask retries of a step's tasks and its clear (``finalize.retries``)
    fetch_timeout_s: float  # bound on a fetch's and a clear's store call, s (``finalize.fetch-timeout-s``)
    gather_direct: bool  # collect groups straight from workers (``finalize.gather-direct``)
    clear_staged: bool  # delete a step's staged rows once result() delivered it (``finalize.clear-staged``)
    slots_per_worker: float  # the ``finalize`` resource a worker should advertise (error messages)
    # A step submitted with a trainer_version drops verified rollouts whose oldest
    # weight_version lags it by more than this many versions (``finalize.max-staleness``;
    # None: never).
    max_staleness: int | None = None
    # The ratio bounds 1 +- eps of StepResult.report_mismatch (``monitor.mismatch-eps``).
    mismatch_eps: tuple[float, ...] = DEFAULT_EPS
    # Clears a staged row whose delete fails is in (its step's, then later ones) before
    # the finalizer gives it up (``finalize.clear-attempts``; count).
    clear_attempts: int = 5

    def __post_init__(self) -> None:
        # Checked however the settings were made (from_config, Finalizer.with_settings).
        max_staleness_setting(self.max_staleness)
        object.__setattr__(self, "mismatch_eps", mismatch_eps_setting(self.mismatch_eps))

    @classmethod
    def from_config(cls, *, vocab_size: int | None = None, num_experts: int | None = None) -> FinalizeSettings:
        """The current ``dask.config`` values; ``vocab_size`` / ``num_experts`` override
        ``policy.vocab-size`` / ``policy.experts`` when given."""
        experts = config.get("policy.experts") if num_experts is None else num_experts
        return cls(
            vocab_size=int(config.get("policy.vocab-size") if vocab_size is None else vocab_size),
            num_experts=None if experts is None else int(experts),
            verify_token_budget=int(config.get("finalize.verify-token-budget")),
            retries=int(config.get("finalize.retries")),
            fetch_timeout_s=float(config.get("finalize.fetch-timeout-s")),
            gather_direct=bool(config.get("finalize.gather-direct")),
            clear_staged=bool(config.get("finalize.clear-staged")),
            slots_per_worker=float(config.get("finalize.slots-per-worker")),
            max_staleness=config.get("finalize.max-staleness"),  # checked by __post_init__
            mismatch_eps=config.get("monitor.mismatch-eps"),
            clear_attempts=clear_attempts_setting(config.get("finalize.clear-attempts")),
        )


def max_staleness_setting(value: object) -> int | None:
    """``finalize.max-staleness`` checked: None (off) or an int >= 0 (versions)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidInput(f"token-capture.finalize.max-staleness is {value!r}; set null (off) or an int >= 0 (weight versions)")
    return value


def clear_attempts_setting(value: object) -> int:
    """``finalize.clear-attempts`` checked: an int >= 1 (clears a failed row is in)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidInput(f"token-capture.finalize.clear-attempts is {value!r}; set an int >= 1 (clears a row whose delete "
                           "failed is in before it is given up)")
    return value


def mismatch_eps_setting(value: object) -> tuple[float, ...]:
    """``monitor.mismatch-eps`` checked: a non-empty list of finite numbers > 0."""
    return check_eps(value, "token-capture.monitor.mismatch-eps")
