"""The fixed rejection vocabulary as constants, and the one status outside it.

Every rejected rollout carries exactly one of these words as its ``status``; a good one
carries :data:`OK`. Code compares against the constants, never against string literals,
so a typo is an ``AttributeError`` rather than a silently unmatched reason. The rules
run in a fixed order (the vectorized verifier and the per-token reference agree), so the
first failing rule decides the reason.
"""
from __future__ import annotations

# Check order (first failing rule decides):
# receipt (tasks.finalize.plan), per receipt
#     invalid_receipt (top-level types; reward not a finite float32) -> wrong_group
#     (the receipt names a group other than the one it was submitted in) ->
#     capture_poisoned -> empty_manifest -> invalid_receipt (per record: an unknown
#     digest_version too; then calls of mixed digest versions) ->
#     duplicate_call_id -> duplicate_staging_key -> invalid_receipt (staging_key not
#     derived from the ids) -> missing_terminal -> missing_parent (any record) ->
#     lineage_cycle (any record) -> terminal_not_leaf (a call of the receipt names the
#     terminal as its parent);
#     then across the step: duplicate_staging_key for every receipt sharing a rollout_id.
# rows (tasks.finalize.chain / verify), call by call from the root to the terminal
#     missing_staging_row (lost_staging_row when the store says the row was lost) -> invalid_staging_row (fields present, dtypes, ids decode,
#     one value per scalar, 32-byte hashes, supported schema and digest versions) -> identity_mismatch ->
#     wrong_<field> in RECEIPT_COMPARED_FIELDS order -> invalid_staging_row (token arrays
#     not delta_len long) -> routes readiness (invalid_routes for a chain mixing routed
#     and unrouted calls, missing_routes, invalid_routes for dtype/shape) ->
#     corrupt_digest -> parent_length_mismatch -> chain_hash_mismatch -> content
#     (invalid_mask_order / empty_generation / invalid_token / invalid_logprob, as
#     tasks.validation.check_delta orders them) -> invalid_routes (expert id range);
#     then once per rollout: cumulative_hash_mismatch -> empty_training_row.
# assembly (tasks.finalize.assemble), per verified rollout: invalid_routes ([L, K] differs
#     from the group's) -> stale (its oldest weight_version lags the trainer's version by
#     more than finalize.max-staleness; only when both are set).
# step batch (tasks.finalize.batch_reject), per row of the step: invalid_routes ([L, K]
#     differs from the step's) -> stale (with a trainer_version, its lag leaves int64).

OK = "ok"

# receipt
INVALID_RECEIPT = "invalid_receipt"
CAPTURE_POISONED = "capture_poisoned"
EMPTY_MANIFEST = "empty_manifest"
DUPLICATE_CALL_ID = "duplicate_call_id"
DUPLICATE_STAGING_KEY = "duplicate_staging_key"
MISSING_TERMINAL = "missing_terminal"
# The receipt's group_id names a group other than the one it was submitted in. A receipt
# without a group (group_id None or "") claims none and fits any group.
WRONG_GROUP = "wrong_group"

# row
MISSING_STAGING_ROW = "missing_staging_row"
# A row of the rollout WAS staged, but the store lost both its copies (its ``lost_key``):
# decided from the store's answer, in place of missing_staging_row.
LOST_STAGING_ROW = "lost_staging_row"
INVALID_STAGING_ROW = "invalid_staging_row"
IDENTITY_MISMATCH = "identity_mismatch"
CORRUPT_DIGEST = "corrupt_digest"

# Row fields compared with the receipt's record, in check order; a difference in field
# ``f`` rejects with ``wrong_f``.
RECEIPT_COMPARED_FIELDS: tuple[str, ...] = (
    "parent_call_id",
    "prev_len",
    "delta_len",
    "cum_len",
    "weight_version",
    "routes_encoding",
    "digest_version",
    "digest",
    "chain_hash",
    "cumulative_hash",
)


def wrong(field: str) -> str:
    """``wrong_<field>``: the row's ``field`` differs from the receipt's record."""
    if field not in RECEIPT_COMPARED_FIELDS:
        raise ValueError(f"{field!r} is not a receipt-compared field")
    return f"wrong_{field}"


WRONG_FIELD_REASONS: tuple[str, ...] = tuple(f"wrong_{f}" for f in RECEIPT_COMPARED_FIELDS)

# lineage
MISSING_PARENT = "missing_parent"
PARENT_LENGTH_MISMATCH = "parent_length_mismatch"
LINEAGE_CYCLE = "lineage_cycle"
# The terminal call has a staged child in the same receipt: the chain would stop short of
# calls the rollout made after it (the training row would silently be truncated).
TERMINAL_NOT_LEAF = "terminal_not_leaf"
CHAIN_HASH_MISMATCH = "chain_hash_mismatch"
CUMULATIVE_HASH_MISMATCH = "cumulative_hash_mismatch"

# content
INVALID_MASK_ORDER = "invalid_mask_order"
EMPTY_GENERATION = "empty_generation"
INVALID_TOKEN = "invalid_token"
INVALID_LOGPROB = "invalid_logprob"
EMPTY_TRAINING_ROW = "empty_training_row"
MISSING_ROUTES = "missing_routes"
INVALID_ROUTES = "invalid_routes"

# policy
# A verified rollout whose oldest weight_version lags the trainer's version (given at
# submit time) by more than ``finalize.max-staleness``: kept out of the training batch
# like any rejection, its rows cleared with the step's (never earlier). Also, in the step
# batch only, an accepted row whose lag behind the batch's trainer_version leaves int64.
STALE = "stale"

RECEIPT_REASONS = frozenset(
    {
        INVALID_RECEIPT,
        WRONG_GROUP,
        CAPTURE_POISONED,
        EMPTY_MANIFEST,
        DUPLICATE_CALL_ID,
        DUPLICATE_STAGING_KEY,
        MISSING_TERMINAL,
    }
)
ROW_REASONS = frozenset({MISSING_STAGING_ROW, LOST_STAGING_ROW, INVALID_STAGING_ROW, IDENTITY_MISMATCH, CORRUPT_DIGEST, *WRONG_FIELD_REASONS})
LINEAGE_REASONS = frozenset(
    {
        MISSING_PARENT,
        PARENT_LENGTH_MISMATCH,
        LINEAGE_CYCLE,
        TERMINAL_NOT_LEAF,
        CHAIN_HASH_MISMATCH,
        CUMULATIVE_HASH_MISMATCH,
    }
)
CONTENT_REASONS = frozenset(
    {
        INVALID_MASK_ORDER,
        EMPTY_GENERATION,
        INVALID_TOKEN,
        INVALID_LOGPROB,
        EMPTY_TRAINING_ROW,
        MISSING_ROUTES,
        INVALID_ROUTES,
    }
)
POLICY_REASONS = frozenset({STALE})
ALL_REASONS = RECEIPT_REASONS | ROW_REASONS | LINEAGE_REASONS | CONTENT_REASONS | POLICY_REASONS


# Not a rejection: the verifier itself failed on the rollout (a bug, logged), so nothing
# is known about its data. Deliberately outside ALL_REASONS (metrics pre-create one label
# per reason there); finalization counts it apart as ``internal_errors``.
INTERNAL_ERROR = "internal_error"


def is_reason(status: str) -> bool:
    """True for a word of the rejection vocabulary (not for :data:`OK`)."""
    return status in ALL_REASONS
