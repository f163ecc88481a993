"""Every error the project raises, in one hierarchy whose bases say what went wrong.

- :class:`InvalidInput` (a ``ValueError``): the caller passed something unusable; the
  message names what and why. Fix the input and retry.
- :class:`StoreUnavailable` (not a ``ValueError``): a store or unit is closed or lost. A
  caller's ``except ValueError`` must not swallow it.
- :class:`CheckpointError` (an ``OSError``): a checkpoint cannot be written or read.
- :class:`ClusterUnavailable` (a ``ConnectionError``): no scheduler answered, or it has no
  workers. The command line prints it, and :class:`InvalidSchedulerAddress` and
  :class:`MissingFinalizeResource`, as one line ``error: <problem>; <fix>``.

Per-row and per-rollout problems are not raised: they travel as reason words
(:mod:`tasks.reasons`, the store's per-key results) so one bad row never fails its batch.
Pure classes only (no Dask import): ``pipeline`` raises them too.
"""
from __future__ import annotations


class TokenCaptureError(Exception):
    """Root of every error raised by this project."""


# ---- bad input ---------------------------------------------------------------------------


class InvalidInput(TokenCaptureError, ValueError):
    """Bad input, named precisely enough to fix it."""


class InvalidRecord(InvalidInput):
    """A staged record failed validation; ``reason`` is a verification vocabulary word."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class InvalidKey(InvalidInput):
    """An id or key that cannot be used to derive a staging or cut key."""


class InvalidCall(InvalidInput):
    """A model call could not be started, appended to, advanced or resumed.

    ``reason`` says why: ``invalid_token``, ``invalid_prefix`` (shapes, dtypes, mask order,
    logprobs, routes of a saved prefix), ``short_history`` (fewer history tokens than the
    policy needs), ``prefix_mismatch`` (the prefix is not what this policy generates, or
    not the one cut), ``policy_mismatch``, ``invalid_argument``, ``not_active`` (the call
    is completed or failed).
    """

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


class UnknownCall(InvalidInput):
    """A generation worker holds no call with this (rollout_id, model_call_id)."""


class DuplicateCall(InvalidInput):
    """A call with this (rollout_id, model_call_id) is already held by the worker."""


class InvalidChunk(InvalidInput):
    """A cut prefix chunk whose pieces do not fit its row (names the chunk and piece)."""


class BatchLimitError(InvalidInput):
    """A batch limit that is not a positive integer."""


class InvalidInventory(InvalidInput):
    """A cut inventory entry that names no call: not ``(rollout_id, model_call_id)``."""


class UnsupportedDigest(InvalidInput):
    """A digest version or algorithm name this build cannot compute (``tasks.digests``)."""


class UsageError(InvalidInput):
    """Command-line flags each valid alone that cannot work together; the message names
    them and the fix. The command line prints it as one line (exit 2, as argparse)."""


class UnknownProfileError(InvalidInput):
    """A MoE profile name that is not one of ``tasks.profiles.PROFILES``."""


class InvalidPolicyConfig(InvalidInput):
    """A policy configuration value is missing, unknown or out of range."""


class InvalidEvent(InvalidInput):
    """A token-capture event that does not follow ``pipeline.events``.

    ``topic`` and ``field`` name what was wrong; the message says how.
    """

    def __init__(self, topic: str, field: str, detail: str) -> None:
        super().__init__(f"{topic}: field {field!r}: {detail}")
        self.topic = topic
        self.field = field
        self.detail = detail

    def __reduce__(self):
        return (type(self), (self.topic, self.field, self.detail))


class FinalizeError(InvalidInput):
    """A step that cannot be submitted (empty group, no finalize slots, bad arguments)."""


class MissingFinalizeResource(FinalizeError):
    """No worker of the cluster advertises the ``finalize`` resource verify tasks need;
    the message names the fix (``dask worker ADDR --resources "finalize=N"``)."""


class DriverError(InvalidInput):
    """Misuse of the rollout driver (no actors, unknown rollout, duplicate ids...)."""


class RuleFailed(TokenCaptureError):
    """A verification rule failed: ``reason`` (a :mod:`tasks.reasons` word) and ``detail``.

    Control flow inside the verifier only: it becomes the rollout's rejection verdict and
    never escapes ``verify_rollout``/``verify_many``.
    """

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail


# ---- the store ---------------------------------------------------------------------------


class StoreError(TokenCaptureError):
    """Base of store failures that concern a whole call (per-key ones are results)."""


class InvalidStoreRequest(StoreError, InvalidInput):
    """A whole store call was unusable (wrong argument type, unknown partition, ...)."""


class StoreUnavailable(StoreError, RuntimeError):
    """A store or storage unit is closed, lost or unreachable."""


class SlowRead(StoreError, TimeoutError):
    """A read not answered within ``store.read-failover-s`` by a unit whose keys have
    another copy: given up (its late answer ignored) so the other copy is read; a slow
    unit, not a lost one (nothing remembers it as down)."""


class UnitSkipped(StoreError, OSError):
    """A store call not sent: its unit was found unreachable moments ago (its keys fail
    ``unit_unavailable``, like a call that waited out the connect timeout)."""


class StoreBusy(StoreError, RuntimeError):
    """The store is in the middle of a change that excludes this one (a move of keys and
    a store checkpoint never overlap); retry once the other has ended."""


# ---- the cluster -------------------------------------------------------------------------


class ClusterUnavailable(TokenCaptureError, ConnectionError):
    """No Dask scheduler answered at the address within the connect timeout, or it has no
    workers to run on. The message names the address and how to start what is missing."""


class ActorUnresponsive(ClusterUnavailable, TimeoutError):
    """An actor call not answered within its bound while the actor's worker may still be
    registered: its process is hung or stalled (stopped, swapping, deadlocked). The
    message names the actor's worker, the call and the setting that bounds it."""


class HostStartFailed(ClusterUnavailable):
    """A cluster of hosts could not start: the scheduler's port is in use, a worker process
    exited before it registered, or a worker did not register within the start timeout.
    The message names the host (or the scheduler), its log file and the fix."""


class PartitionUnavailable(TokenCaptureError, RuntimeError):
    """A network partition (``pipeline.testing.partition``) cannot be made on this machine:
    no ``iptables``, no privilege to change the firewall or mount a cgroup, or no net_cls
    controller. The message names what is missing and the fix."""


class ClusterMisconfigured(InvalidInput):
    """Workers of the cluster lack what the pipeline needs of them: the worker preload
    (``pipeline.deploy.worker_preload``), a role resource (``generation``, ``storage``,
    ``finalize``) or this process's package version. The message names the workers, what
    each lacks and the ``dask worker`` flags that fix it."""


class InvalidSchedulerAddress(InvalidInput):
    """A scheduler address that does not parse (expected ``tcp://HOST:PORT``), or one the
    Dask security settings cannot reach: ``tls://`` without ``distributed.comm.tls.ca-file``
    and ``distributed.comm.tls.client.cert`` (+ ``.client.key``), or ``tcp://`` while
    ``distributed.comm.require-encryption`` is on. The message names the keys to set."""


# ---- checkpoints -------------------------------------------------------------------------


class CheckpointError(TokenCaptureError, OSError):
    """A checkpoint cannot be written or read (missing, unreadable, wrong format)."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint's manifest or data files fail their digests or do not parse."""


class ManifestReplaced(CheckpointError):
    """A conditional manifest write found another save's manifest in its place (the save
    outlived its lease); the newer checkpoint is kept."""


class CheckpointReplayed(CheckpointCorrupt):
    """A signed checkpoint older than one already saved or restored for its store name.

    Its manifest's sequence is below the highest this controller recorded for that store
    name (``checkpoint``/``recorded``): an old save put back in place of a newer one.
    Restore the newest checkpoint, or pass ``allow_older=True`` to take this one on purpose.
    """

    def __init__(self, message: str, checkpoint: int = 0, recorded: int = 0):
        super().__init__(message)
        self.checkpoint = int(checkpoint)
        self.recorded = int(recorded)

    def __reduce__(self):  # keep both sequences across a pickle, not only the message
        return (type(self), (str(self), self.checkpoint, self.recorded))


# ---- restore reads -----------------------------------------------------------------------


class KeyReadFailure(TokenCaptureError):
    """One key's failure on a read several requests share (``reason`` word, ``detail``),
    carried on the key's shared future inside the restore coalescer; callers see it only
    inside :class:`PrefixReadError`'s ``failed``."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail


class PrefixReadError(TokenCaptureError):
    """Some keys of a read could not be served; ``failed`` maps key -> (reason, detail).

    Reasons are the store's (``missing_key``, ...) or the coalescer's own:
    ``read_failed`` (the key's solo get raised), ``read_timeout`` (it ran past
    ``get-timeout-s``), ``incomplete_get`` (the store answered neither row nor failure),
    ``closed`` (the coalescer was closed while the key was pending).
    """

    def __init__(self, failed: dict[str, tuple[str, str]]):
        self.failed = dict(failed)
        first = next(iter(self.failed.items()), ("?", ("?", "")))
        more = f" (+{len(self.failed) - 1} more)" if len(self.failed) > 1 else ""
        super().__init__(f"{len(self.failed)} key(s) unreadable: {first[0]!r}: {first[1][0]}: {first[1][1]}{more}")

    def __reduce__(self):  # crosses actor boundaries: rebuild from ``failed``, not the message
        return (type(self), (self.failed,))


class RestoreIncomplete(CheckpointError):
    """A checkpoint restore that could not place every row; nothing of it was kept.

    ``failed`` maps key -> (reason, detail), the store's per-key reasons (``store_full``,
    ``key_conflict``, ``unit_unavailable``, ...). The rows the restore had added were
    removed again (``removed`` of them); rows the store held before were never changed.
    ``rollback_failed`` lists removals that failed too (key -> (reason, detail)): those
    rows are still in the store.
    """

    def __init__(self, failed: dict, removed: int = 0, rollback_failed: dict | None = None, path: str | None = None):
        self.failed = dict(failed)
        self.removed = int(removed)
        self.rollback_failed = dict(rollback_failed or {})
        self.path = path
        reasons: dict[str, int] = {}
        for reason, _ in self.failed.values():
            reasons[reason] = reasons.get(reason, 0) + 1
        shown = "; ".join(f"{k!r}: {r}: {d}" for k, (r, d) in list(self.failed.items())[:3])
        more = f" (+{len(self.failed) - 3} more)" if len(self.failed) > 3 else ""
        where = f" of {path!r}" if path else ""
        left = (
            f"; {len(self.rollback_failed)} added row(s) could not be removed and are still in the store"
            if self.rollback_failed else ""
        )
        super().__init__(
            f"restore{where} incomplete: {len(self.failed)} key(s) failed "
            f"({', '.join(f'{r} x{c}' for r, c in sorted(reasons.items()))}): {shown}{more}; "
            f"the {self.removed} row(s) it had added were removed{left}"
        )

    def __reduce__(self):  # crosses process boundaries: rebuild from the fields, not the message
        return (type(self), (self.failed, self.removed, self.rollback_failed, self.path))
