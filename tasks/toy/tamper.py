"""Deliberate tampering of generated rollouts, for demos: each kind is one way a bad
writer or a bad store breaks the ledger, and the verifier must reject it with its reason.

Pure (numpy on :class:`~tasks.schema.StagedRow` / :class:`~tasks.receipts.Receipt`); the
inputs are never modified. Rollouts are chains (rows in chain order, as
:func:`tasks.toy.rollouts.generate_rollouts` makes them). Tampered rollout ids carry their
kind: ``tampered-<reason>-<i>`` (:func:`tampered_rollout_id`).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from .. import hashing
from .. import reasons as R
from ..gate import record_of
from ..receipts import Receipt
from ..schema import StagedRow

PREFIX = "tampered"

# kind (= the reason the verifier must give) -> what was done, for people.
TAMPER_KINDS: dict[str, str] = {
    R.CORRUPT_DIGEST: "a token byte flipped in a staged row, its digest left as it was",
    R.MISSING_STAGING_ROW: "a call listed in the receipt whose row was never staged",
    R.CHAIN_HASH_MISMATCH: "a token forged and the row re-signed (digest, cumulative hash) but its chain hash kept",
    R.wrong("delta_len"): "the receipt reports one token more for the last call than was staged",
    R.WRONG_GROUP: "a receipt that names another group, submitted in this one",
}


@dataclass(frozen=True)
class Tampered:
    """A tampered rollout: the rows to stage and the receipt to submit."""

    kind: str
    rows: list[StagedRow]
    receipt: Receipt


def tampered_rollout_id(kind: str, i: int = 0) -> str:
    """``tampered-<kind>-<i>``: the id a demo gives the ``i``-th rollout tampered with ``kind``."""
    if kind not in TAMPER_KINDS:
        raise ValueError(f"unknown tamper kind {kind!r}; known: {', '.join(TAMPER_KINDS)}")
    return f"{PREFIX}-{kind}-{i}"


def tamper_kind(rollout_id: str) -> str | None:
    """The kind a :func:`tampered_rollout_id` names, ``None`` for any other id."""
    head, sep, rest = rollout_id.partition("-")
    kind = rest.rpartition("-")[0]
    return kind if head == PREFIX and sep and kind in TAMPER_KINDS else None


def _copy(rows: Sequence[StagedRow]) -> list[StagedRow]:
    return [copy.deepcopy(r) for r in rows]


def _check(rows: Sequence[StagedRow], receipt: Receipt) -> None:
    if not rows or len(rows) != len(receipt.calls):
        raise ValueError(f"{receipt.rollout_id!r}: need a rollout with rows for every call, got {len(rows)} rows, {len(receipt.calls)} calls")


def flip_token_byte(rows: Sequence[StagedRow], receipt: Receipt, call: int = -1, byte: int = 0) -> Tampered:
    """XOR the low bit of byte ``byte`` of call ``call``'s token ids; hashes untouched
    (bit rot, or an edit without re-signing): ``corrupt_digest``."""
    _check(rows, receipt)
    out = _copy(rows)
    r = out[call]
    ids = np.ascontiguousarray(r.token_ids, dtype="<i8").copy()
    ids.view(np.uint8)[byte % ids.nbytes] ^= 0x01
    r.token_ids = ids
    return Tampered(R.CORRUPT_DIGEST, out, receipt)


def withhold_row(rows: Sequence[StagedRow], receipt: Receipt, call: int = -1) -> Tampered:
    """Stage every row but call ``call``'s; the receipt still lists it: ``missing_staging_row``."""
    _check(rows, receipt)
    out = _copy(rows)
    del out[call]
    return Tampered(R.MISSING_STAGING_ROW, out, receipt)


def forge_token(rows: Sequence[StagedRow], receipt: Receipt, call: int = -1, pos: int = -1) -> Tampered:
    """A forger changes token ``pos`` of call ``call`` (to a neighbouring id, still in the
    vocabulary), recomputes that row's digest and every cumulative hash from there on,
    and rebuilds the receipt from the rows, but cannot redo the chain hash without
    breaking the parent link: ``chain_hash_mismatch``."""
    _check(rows, receipt)
    out = _copy(rows)
    c = call % len(out)
    r = out[c]
    ids = np.ascontiguousarray(r.token_ids, dtype="<i8").copy()
    v = int(ids[pos])
    ids[pos] = v - 1 if v > 0 else v + 1
    r.token_ids = ids
    state = hashing.prefix_state(None, out[0].digest_version)
    for i, row in enumerate(out):  # chain order: this call's cumulative hash and its descendants'
        h = hashing.extend_prefix(state, row.token_ids)
        if i >= c:
            row.cumulative_hash = h
    r.digest = hashing.row_digest(r)
    return Tampered(R.CHAIN_HASH_MISMATCH, out, replace(receipt, calls=[record_of(x) for x in out]))


def misreport_length(rows: Sequence[StagedRow], receipt: Receipt, by: int = 1) -> Tampered:
    """The receipt says the last call's delta is ``by`` tokens longer than the staged row
    (``cum_len`` moved with it, so the receipt stays self-consistent): ``wrong_delta_len``."""
    _check(rows, receipt)
    calls = list(receipt.calls)
    last = calls[-1]
    calls[-1] = replace(last, delta_len=last.delta_len + by, cum_len=last.cum_len + by)
    return Tampered(R.wrong("delta_len"), _copy(rows), replace(receipt, calls=calls))


def claim_group(rows: Sequence[StagedRow], receipt: Receipt, group_id: str) -> Tampered:
    """The receipt names ``group_id``; submit it in another group: ``wrong_group``."""
    _check(rows, receipt)
    return Tampered(R.WRONG_GROUP, _copy(rows), replace(receipt, group_id=group_id))


def tamper(kind: str, rows: Sequence[StagedRow], receipt: Receipt, *, other_group: str) -> Tampered:
    """Tamper with one rollout in the way ``kind`` (a :data:`TAMPER_KINDS` key) names.
    ``other_group``: the group a ``wrong_group`` receipt claims (not the one it is
    submitted in)."""
    if kind == R.CORRUPT_DIGEST:
        return flip_token_byte(rows, receipt)
    if kind == R.MISSING_STAGING_ROW:
        return withhold_row(rows, receipt)
    if kind == R.CHAIN_HASH_MISMATCH:
        return forge_token(rows, receipt)
    if kind == R.wrong("delta_len"):
        return misreport_length(rows, receipt)
    if kind == R.WRONG_GROUP:
        return claim_group(rows, receipt, other_group)
    raise ValueError(f"unknown tamper kind {kind!r}; known: {', '.join(TAMPER_KINDS)}")
