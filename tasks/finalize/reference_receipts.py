"""A deliberately simple reference of the receipt rules, one receipt dict at a time.

Written independently of ``tasks.finalize.plan`` / ``tasks.receipts``: every rule is a
plain Python check on the dict (what a msgpack round trip gives), in the order
documented in ``tasks/reasons.py``. It is the tests' oracle for the receipt reasons;
:mod:`tasks.finalize.reference` re-exports it beside the per-token row reference.
"""
from __future__ import annotations

import math
import struct
from typing import Any

RECORD_KEYS = ["model_call_id", "parent_call_id", "prev_len", "delta_len", "cum_len", "weight_version",
               "digest", "chain_hash", "cumulative_hash", "routes_encoding", "staging_key"]
# A record may also say which algorithm hashed it (1 SHA-256, 2 BLAKE3, 3 BLAKE3 over
# field digests); without it: 1.
DIGEST_VERSIONS = (1, 2, 3)


def _good_id(v: object) -> bool:
    return (isinstance(v, str) and v != "" and "/" not in v and v != "__cut__"
            and len(v.encode("utf-8", "surrogatepass")) <= 512 and _utf8(v))


def _utf8(v: str) -> bool:
    try:
        v.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63


def _f32_reward(v: object) -> bool:
    """A number that stays finite as a float32 (``struct`` refuses to pack a float that
    rounds past float32's range; NaN and inf pack, so they are tested apart)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return False
    try:
        x = float(v)
        struct.pack("<f", x)
    except OverflowError:
        return False
    return not math.isnan(x) and not math.isinf(x)


_RECEIPT_KEYS = {"rollout_id", "reward", "terminal_model_call_id", "calls", "poisoned", "failure_reason", "group_id", "version"}


def _top_level_reason(raw: dict[Any, Any]) -> str | None:
    """invalid_receipt for the receipt's own fields: known keys, the required ones present,
    a good rollout id, a reward finite in float32, typed optional fields."""
    for k in raw:
        if k not in _RECEIPT_KEYS:
            return "invalid_receipt"
    for k in ("rollout_id", "reward", "terminal_model_call_id", "calls"):
        if k not in raw:
            return "invalid_receipt"
    if not _good_id(raw["rollout_id"]):
        return "invalid_receipt"
    if not _f32_reward(raw["reward"]):
        return "invalid_receipt"
    term = raw["terminal_model_call_id"]
    if term is not None and not isinstance(term, str):
        return "invalid_receipt"
    if not isinstance(raw["calls"], (list, tuple)):
        return "invalid_receipt"
    if not isinstance(raw.get("poisoned", False), bool):
        return "invalid_receipt"
    for k in ("failure_reason", "group_id"):
        if raw.get(k) is not None and not isinstance(raw.get(k), str):
            return "invalid_receipt"
    if not _int(raw.get("version", 1)) or raw.get("version", 1) != 1:
        return "invalid_receipt"
    return None


def _record_ok(c: object) -> bool:
    """One call record is well formed (else invalid_receipt): its keys, good ids, int
    lengths that add up, a known routes encoding, a str staging key, 32-byte hashes."""
    if not isinstance(c, dict) or sorted(k for k in c if k != "digest_version") != sorted(RECORD_KEYS):
        return False
    version = c.get("digest_version", 1)
    if not _int(version) or version not in DIGEST_VERSIONS:
        return False
    if not _good_id(c["model_call_id"]):
        return False
    if c["parent_call_id"] is not None and not _good_id(c["parent_call_id"]):
        return False
    for k in ("prev_len", "delta_len", "cum_len", "weight_version"):
        if not _int(c[k]):
            return False
    if c["delta_len"] <= 0 or c["prev_len"] < 0 or c["cum_len"] != c["prev_len"] + c["delta_len"]:
        return False
    if not _int(c["routes_encoding"]) or c["routes_encoding"] not in (0, 1, 2):
        return False
    if not isinstance(c["staging_key"], str):
        return False
    for k in ("digest", "chain_hash", "cumulative_hash"):
        if not isinstance(c[k], (bytes, bytearray)) or len(c[k]) != 32:
            return False
    return True


def _keys_reason(rid: str, calls: list[dict[str, Any]], ids: list[str]) -> str | None:
    """duplicate_call_id -> duplicate_staging_key -> invalid_receipt (a staging key not
    ``rollout_id/model_call_id``)."""
    if len(set(ids)) != len(ids):
        return "duplicate_call_id"
    keys = [c["staging_key"] for c in calls]
    if len(set(keys)) != len(keys):
        return "duplicate_staging_key"
    for c in calls:
        if c["staging_key"] != rid + "/" + c["model_call_id"]:
            return "invalid_receipt"
    return None


def _lineage_reason(term: str | None, calls: list[dict[str, Any]], ids: list[str]) -> str | None:
    """missing_terminal -> missing_parent (any record) -> lineage_cycle (any record) ->
    terminal_not_leaf."""
    if term is None or term not in ids:
        return "missing_terminal"
    parent = {c["model_call_id"]: c["parent_call_id"] for c in calls}
    for c in calls:
        if c["parent_call_id"] is not None and c["parent_call_id"] not in parent:
            return "missing_parent"
    for start in ids:
        steps, cur = 0, start
        while cur is not None:
            cur = parent[cur]
            steps += 1
            if steps > len(ids):
                return "lineage_cycle"
    for c in calls:
        if c["parent_call_id"] == term:
            return "terminal_not_leaf"
    return None


def reference_receipt_reason(raw: object, submitted_group: str | None = None) -> str | None:
    """The rejection reason of one receipt dict by itself (``None``: usable), submitted
    in the group ``submitted_group`` (``None``: submitted in no named group)."""
    if not isinstance(raw, dict):
        return "invalid_receipt"
    reason = _top_level_reason(raw)
    if reason:
        return reason
    claimed = raw.get("group_id")
    if submitted_group is not None and claimed is not None and claimed != "" and claimed != submitted_group:
        return "wrong_group"
    if raw.get("poisoned", False):
        return "capture_poisoned"
    calls = raw["calls"]
    if len(calls) == 0:
        return "empty_manifest"
    for c in calls:
        if not _record_ok(c):
            return "invalid_receipt"
    if len({c.get("digest_version", 1) for c in calls}) > 1:
        return "invalid_receipt"  # one rollout's calls are hashed with one algorithm
    ids = [c["model_call_id"] for c in calls]
    return _keys_reason(raw["rollout_id"], calls, ids) or _lineage_reason(raw["terminal_model_call_id"], calls, ids)


def reference_chain(raw: dict) -> list[str]:
    """Root -> terminal call ids of a usable receipt dict."""
    parent = {c["model_call_id"]: c["parent_call_id"] for c in raw["calls"]}
    out = [raw["terminal_model_call_id"]]
    while parent[out[-1]] is not None:
        out.append(parent[out[-1]])
    return out[::-1]
