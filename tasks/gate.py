"""The capture gate: turns one rollout's model calls into staged rows and a receipt.

The gate is the writer: it validates each delta before anything is staged (a bad
record is refused with :class:`~tasks.errors.InvalidRecord` and nothing of it is kept),
computes the chain hash, extends the running cumulative hash (one pass per call, no
re-hashing of the prefix) and the digest, and records the call for the receipt.
Staging the rows is the caller's job (``pipeline.capture`` puts them in the store).
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from . import digests, hashing
from .errors import InvalidRecord
from .finalize.plan import reward_value
from .keys import check_id, staging_key
from .receipts import CallRecord, Receipt
from .schema import ROUTES_ENCODINGS, ROUTES_NONE, ROUTES_UINT8, SCHEMA_VERSION, UINT8_MAX_EXPERTS, StagedRow, routes_encoding_for
from .reasons import INVALID_RECEIPT
from .validation import check_delta, check_weight_version, encode_routes


@dataclass
class _CallState:
    cum_len: int
    chain_hash: bytes
    prefix: "digests.Hasher"


class CaptureGate:
    """Stages the calls of ONE rollout; call :meth:`receipt` when the rollout ends."""

    def __init__(
        self,
        rollout_id: str,
        *,
        vocab_size: int,
        num_experts: int | None = None,
        group_id: str | None = None,
        routes_encoding: int | None = None,
        digest_version: int = hashing.DIGEST_VERSION,
    ):
        """``routes_encoding``: how routed experts are staged; None (default) picks it from
        ``num_experts`` (:func:`tasks.schema.routes_encoding_for`: uint8 ids up to 256
        experts, else int16). Routes may be given as any integer array: the gate checks
        their range, then converts them. ``digest_version``: the algorithm of every hash
        of the rollout (:mod:`tasks.digests`: 1 SHA-256, 2 BLAKE3, 3 BLAKE3 over field
        digests, the default); an unknown one raises :class:`~tasks.digests.UnsupportedDigest`."""
        self.rollout_id = check_id(rollout_id, "rollout_id")
        self.digest_version = digests.scheme(digest_version).version
        self.vocab_size = vocab_size
        self.num_experts = num_experts
        self.group_id = group_id
        if routes_encoding is None:
            routes_encoding = routes_encoding_for(num_experts)
        if routes_encoding not in ROUTES_ENCODINGS:
            raise ValueError(f"routes_encoding {routes_encoding!r}: expected one of {sorted(ROUTES_ENCODINGS)} or None")
        if routes_encoding == ROUTES_UINT8 and num_experts is not None and num_experts > UINT8_MAX_EXPERTS:
            raise ValueError(f"routes_encoding {ROUTES_UINT8} (uint8 ids) needs num_experts <= {UINT8_MAX_EXPERTS}, got {num_experts}")
        self.routes_encoding = routes_encoding  # of this rollout's routed calls
        self._calls: dict[str, _CallState] = {}
        self._records: list[CallRecord] = []
        self._poison: str | None = None
        self._routes_shape: tuple[int, int] | None = None  # [L, K], fixed by the first routed call

    def stage_call(
        self,
        model_call_id: str,
        parent_call_id: str | None,
        token_ids: np.ndarray,
        token_mask: np.ndarray,
        logprobs: np.ndarray,
        *,
        routed_experts: np.ndarray | None = None,
        weight_version: int = 0,
    ) -> StagedRow:
        """Validate and hash one call's delta; return the row to stage.

        Raises :class:`InvalidRecord` (reason + detail) and keeps no state on refusal.
        """
        parent = self._admit(model_call_id, parent_call_id, weight_version)
        token_ids = np.asarray(token_ids)
        delta_len = int(token_ids.shape[0]) if token_ids.ndim == 1 else -1
        prev_len = 0 if parent is None else parent.cum_len
        routes = self._check_delta(prev_len, delta_len, token_ids, token_mask, logprobs, routed_experts)
        # Copies: the row must not change if the caller reuses its buffers after staging
        # (routes converted to the encoding's dtype are a new array already).
        row, prefix = self._hashed_row(
            model_call_id,
            parent_call_id,
            parent,
            prev_len,
            delta_len,
            np.array(token_ids, copy=True),
            np.array(token_mask, copy=True),
            np.array(logprobs, copy=True),
            None if routes is None else np.array(routes, copy=True) if routes is routed_experts else routes,
            weight_version,
        )
        self._calls[model_call_id] = _CallState(row.cum_len, row.chain_hash, prefix)
        if row.routed_experts is not None:
            self._routes_shape = tuple(row.routed_experts.shape[1:])
        self._records.append(record_of(row))
        return row

    def _admit(self, model_call_id: str, parent_call_id: str | None, weight_version: int) -> _CallState | None:
        """The call's place in the rollout before its delta is read: invalid_staging_row
        (ids) -> the weight version's rule -> duplicate_call_id -> missing_parent. Returns
        the parent's state (None for a root call)."""
        try:
            check_id(model_call_id, "model_call_id")
            if parent_call_id is not None:
                check_id(parent_call_id, "parent_call_id")
        except ValueError as e:
            raise InvalidRecord("invalid_staging_row", str(e)) from None
        problem = check_weight_version(weight_version)
        if problem:
            raise InvalidRecord(*problem)
        if model_call_id in self._calls:
            raise InvalidRecord("duplicate_call_id", f"{model_call_id!r} already staged in {self.rollout_id!r}")
        if parent_call_id is None:
            return None
        parent = self._calls.get(parent_call_id)
        if parent is None:
            raise InvalidRecord("missing_parent", f"parent {parent_call_id!r} of {model_call_id!r} was not staged")
        return parent

    def _check_delta(
        self,
        prev_len: int,
        delta_len: int,
        token_ids: np.ndarray,
        token_mask: np.ndarray,
        logprobs: np.ndarray,
        routed_experts: np.ndarray | None,
    ) -> np.ndarray | None:
        """The delta's rules (:func:`check_delta`), then its routes against the rollout's
        ``[L, K]`` and ``num_experts``, then invalid_routes for a rollout mixing routed and
        unrouted calls. Returns the routes in the rollout's encoding (None: unrouted)."""
        problem = check_delta(
            prev_len=prev_len,
            delta_len=delta_len,
            cum_len=prev_len + delta_len,
            token_ids=token_ids,
            token_mask=np.asarray(token_mask),
            logprobs=np.asarray(logprobs),
            routes_encoding=ROUTES_NONE,
            routed_experts=None,
            vocab_size=self.vocab_size,
            num_experts=self.num_experts,
        )
        routes = None
        if not problem and routed_experts is not None:
            problem, routes = encode_routes(routed_experts, self.routes_encoding, delta_len, self.num_experts, self._routes_shape)
        routes_encoding = ROUTES_NONE if routed_experts is None else self.routes_encoding
        if not problem and self._records and (routes_encoding != self._records[0].routes_encoding):
            problem = ("invalid_routes", "a rollout's calls must all carry routed experts, or none")
        if problem:
            raise InvalidRecord(*problem)
        return routes

    def _hashed_row(
        self,
        model_call_id: str,
        parent_call_id: str | None,
        parent: _CallState | None,
        prev_len: int,
        delta_len: int,
        token_ids: np.ndarray,
        token_mask: np.ndarray,
        logprobs: np.ndarray,
        routed_experts: np.ndarray | None,
        weight_version: int,
    ) -> tuple[StagedRow, "digests.Hasher"]:
        """The row of a validated delta (the gate's own copies), its chain hash, cumulative
        hash and digest computed; and the prefix state its children extend."""
        version = self.digest_version
        chain = hashing.chain_hash(None if parent is None else parent.chain_hash, token_ids, version)
        prefix = hashing.prefix_state(None if parent is None else parent.prefix, version)
        cumulative = hashing.extend_prefix(prefix, token_ids)
        row = StagedRow(
            rollout_id=self.rollout_id,
            model_call_id=model_call_id,
            parent_call_id=parent_call_id,
            prev_len=prev_len,
            delta_len=delta_len,
            cum_len=prev_len + delta_len,
            weight_version=int(weight_version),
            token_ids=token_ids,
            token_mask=token_mask,
            logprobs=logprobs,
            routes_encoding=ROUTES_NONE if routed_experts is None else self.routes_encoding,
            routed_experts=routed_experts,
            digest=b"",
            chain_hash=chain,
            cumulative_hash=cumulative,
            schema_version=SCHEMA_VERSION,
            digest_version=version,
        )
        row.digest = hashing.row_digest(row)
        return row, prefix

    @classmethod
    def resume(
        cls,
        rollout_id: str,
        rows: Sequence[StagedRow],
        *,
        vocab_size: int,
        num_experts: int | None = None,
        group_id: str | None = None,
        records: Sequence[CallRecord] | None = None,
        digest_version: int = hashing.DIGEST_VERSION,
    ) -> "CaptureGate":
        """Rebuild a gate (after a crash) from the rows it already staged, in chain order.

        A hash state cannot be saved, so every row's delta is staged again through
        :meth:`stage_call`: chain, cumulative hash and digest are recomputed (one pass
        over the tokens), never taken from the row. Each recomputed record must equal
        the row's own hashes and, when given, ``records`` (the receipt the controller
        kept); otherwise :class:`InvalidRecord` (``missing_staging_row`` when the counts
        differ, ``identity_mismatch``, ``corrupt_digest``, or a content reason from
        :meth:`stage_call`) names the call and nothing is returned. The gate hashes with
        the rows' digest version (a rollout keeps its algorithm across a restart;
        ``digest_version`` only when there is no row); rows of mixed or unknown versions
        are ``invalid_staging_row``.
        """
        version = _rows_version(rollout_id, rows, digest_version)
        # The rows' own encoding (rows staged as int16 resume as int16, whatever the experts).
        enc = next((r.routes_encoding for r in rows if r.routes_encoding != ROUTES_NONE), None)
        if enc not in ROUTES_ENCODINGS or (enc == ROUTES_UINT8 and num_experts is not None and num_experts > UINT8_MAX_EXPERTS):
            enc = None  # an unknown encoding: the restaged digest then differs (corrupt_digest)
        gate = cls(rollout_id, vocab_size=vocab_size, num_experts=num_experts, group_id=group_id, routes_encoding=enc,
                   digest_version=version)
        if records is not None and len(records) != len(rows):
            raise InvalidRecord("missing_staging_row", f"{rollout_id!r}: {len(rows)} rows for {len(records)} receipt records")
        for i, row in enumerate(rows):
            if row.rollout_id != gate.rollout_id:
                raise InvalidRecord("identity_mismatch", f"row {i} belongs to {row.rollout_id!r}, not {rollout_id!r}")
            new = gate.stage_call(
                row.model_call_id,
                row.parent_call_id,
                row.token_ids,
                row.token_mask,
                row.logprobs,
                routed_experts=row.routed_experts if row.routes_encoding != ROUTES_NONE else None,
                weight_version=row.weight_version,
            )
            got = gate._records[-1]
            want = record_of(row) if records is None else records[i]
            if (new.digest, new.chain_hash, new.cumulative_hash) != (row.digest, row.chain_hash, row.cumulative_hash) or got != want:
                raise InvalidRecord("corrupt_digest", f"{got.staging_key!r}: recomputed hashes differ from the staged row or receipt")
        return gate

    def poison(self, reason: str) -> None:
        """Mark the capture as unusable (e.g. a call failed mid-way); the receipt says so."""
        self._poison = reason

    def check_receipt_args(self, reward: float, terminal_model_call_id: str | None = None) -> float:
        """``reward`` as a float, or :class:`InvalidRecord` (``invalid_receipt``) when the
        finalizer would reject the receipt for it: a reward that is not a number finite in
        float32 (NaN, +-inf, |reward| >= 3.4e38, ``10**400``, a bool), or a terminal that
        is neither ``None`` nor a str. Changes nothing."""
        value = _reward(reward)
        if value is None:
            raise InvalidRecord(
                INVALID_RECEIPT,
                f"reward {_short(reward)} of {self.rollout_id!r} is not a number finite in float32; "
                "pass a finite float with |reward| < 3.4e38 (training reads rewards as float32)",
            )
        if terminal_model_call_id is not None and not isinstance(terminal_model_call_id, str):
            raise InvalidRecord(
                INVALID_RECEIPT,
                f"terminal_model_call_id is {type(terminal_model_call_id).__name__}; pass a staged call's id (str) or None",
            )
        return value

    def receipt(self, reward: float, terminal_model_call_id: str | None = None) -> Receipt:
        """The token-free receipt; terminal defaults to the last staged call.

        Raises :class:`InvalidRecord` for a reward or terminal :meth:`check_receipt_args`
        refuses.
        """
        reward = self.check_receipt_args(reward, terminal_model_call_id)
        if terminal_model_call_id is None and self._records:
            terminal_model_call_id = self._records[-1].model_call_id
        return Receipt(
            rollout_id=self.rollout_id,
            reward=reward,
            terminal_model_call_id=terminal_model_call_id,
            calls=list(self._records),
            poisoned=self._poison is not None,
            failure_reason=self._poison,
            group_id=self.group_id,
        )


def _reward(reward: object) -> float | None:
    """``reward`` as a float when it is a real number (numpy scalars included, bools not)
    that stays finite in float32, the finalizer's rule (:func:`reward_value`); else None."""
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):
        return None
    try:
        value = float(reward)
    except (OverflowError, TypeError, ValueError):  # an int past float64, a hostile __float__
        return None
    return reward_value(value)


def _short(value: object, n: int = 60) -> str:
    """``repr(value)``, cut to ``n`` characters (a reward of 10**400 has 401 digits)."""
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def record_of(row: StagedRow) -> CallRecord:
    """The receipt's record of a staged row."""
    return CallRecord(
        model_call_id=row.model_call_id,
        parent_call_id=row.parent_call_id,
        prev_len=row.prev_len,
        delta_len=row.delta_len,
        cum_len=row.cum_len,
        weight_version=row.weight_version,
        digest=row.digest,
        chain_hash=row.chain_hash,
        cumulative_hash=row.cumulative_hash,
        routes_encoding=row.routes_encoding,
        staging_key=staging_key(row.rollout_id, row.model_call_id),
        digest_version=row.digest_version,
    )


def _rows_version(rollout_id: str, rows: Sequence[StagedRow], default: int) -> int:
    """The digest version every one of ``rows`` shares (``default`` for none), or
    :class:`InvalidRecord` (``invalid_staging_row``) naming the first row that differs."""
    if not rows:
        return default
    version = rows[0].digest_version
    if version not in digests.SUPPORTED_VERSIONS:
        raise InvalidRecord("invalid_staging_row", f"{rollout_id!r}: digest_version {version!r} unsupported ({digests.described()})")
    for i, row in enumerate(rows):
        if row.digest_version != version:
            raise InvalidRecord(
                "invalid_staging_row",
                f"{rollout_id!r}: row {i} has digest_version {row.digest_version}, row 0 {version}: one rollout, one algorithm",
            )
    return version
