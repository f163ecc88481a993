"""Receipt parsing: receipts -> staging keys and a per-rollout verification plan (no I/O).

Every key a step needs is known from the receipts alone, so the graph can fetch them in
one union read. A receipt that cannot be used is rejected here with a reason from
:mod:`tasks.reasons` (never an exception) and the rest of the step plans as usual; only
the root -> terminal chain of a usable receipt is fetched and verified.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence, TypedDict, cast

from .. import reasons as R
from ..digests import SUPPORTED_VERSIONS, described
from ..errors import InvalidKey
from ..keys import CUT_PREFIX, MAX_ID_BYTES, check_id, staging_key
from ..receipts import RECEIPT_VERSION, CallRecord, Receipt
from ..schema import HASH_BYTES, HASH_FIELDS, ROUTES_ENCODINGS, ROUTES_NONE

ReceiptLike = Receipt | Mapping[str, object]
Rejection = tuple[str, str]

_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_RECEIPT_REQUIRED = ("rollout_id", "reward", "terminal_model_call_id", "calls")
_RECEIPT_OPTIONAL = {"poisoned": False, "failure_reason": None, "group_id": None, "version": RECEIPT_VERSION}
_RECORD_FIELDS = tuple(CallRecord.__dataclass_fields__)
_INT_FIELDS = ("prev_len", "delta_len", "cum_len", "weight_version")
# A record field a mapping may leave out: a record without it was hashed with SHA-256.
_OPTIONAL_RECORD_FIELDS = {"digest_version": 1}
# Training reads rewards as float32 (``FinalizedGroup.rewards``): a float64 of this
# magnitude or more rounds to +-inf there (it is the midpoint between float32's largest
# finite value and 2**128, and that tie rounds to even: up).
_F32_OVERFLOW = 2.0**128 - 2.0**103


class _Header(TypedDict):
    """A receipt's top-level fields once :func:`_header` checked them (``calls`` not yet)."""

    rollout_id: str
    reward: float
    terminal_model_call_id: str | None
    calls: list[object] | tuple[object, ...]
    poisoned: bool
    failure_reason: str | None
    group_id: str | None
    version: int


class _Bad(Exception):
    """Internal: a receipt rejection (reason, detail) raised out of the parsing helpers."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason, self.detail = reason, detail


@dataclass
class RolloutPlan:
    """One usable receipt and what verifying it needs.

    ``chain`` runs root -> terminal; ``keys`` are the chain's staging keys (what to fetch,
    in chain order); ``routes_keys`` the subset whose ``routes_encoding != 0``.
    """

    receipt: Receipt
    chain: list[CallRecord]
    keys: list[str]
    routes_keys: list[str]
    all_keys: list[str]  # every staged call of the receipt, on the chain or not

    @property
    def rollout_id(self) -> str:
        return self.receipt.rollout_id

    @property
    def reward(self) -> float:
        return self.receipt.reward

    @property
    def group_id(self) -> str | None:
        return self.receipt.group_id

    @property
    def n_tokens(self) -> int:
        """Tokens of the linearized training row (the terminal's ``cum_len``)."""
        return self.chain[-1].cum_len


@dataclass
class StepPlan:
    """The plan of a step (many groups) or of one group.

    ``order``/``group_ids`` list every submitted receipt (placeholder ids
    ``"<receipt #i/>"`` for receipts whose rollout_id is unreadable: the ``/`` makes them
    no usable rollout id, so they never collide with a receipt's), so a group keeps its
    shape however many rollouts are rejected early. ``group_ids`` are the submitted
    groups' ids when :func:`plan_step` was given ``{group_id: receipts}``, else the
    receipts' own ``group_id``.
    """

    rollouts: list[RolloutPlan]
    rejected: dict[str, Rejection]
    order: list[str]
    group_ids: list[str | None]
    rewards: list[float]
    staging_keys: list[str]
    routes_keys: list[str]

    def groups(self) -> dict[str | None, list[int]]:
        """Submission indices per group id, in first-seen order."""
        out: dict[str | None, list[int]] = {}
        for i, g in enumerate(self.group_ids):
            out.setdefault(g, []).append(i)
        return out


# ---- parsing helpers ------------------------------------------------------------------


def _get(obj: object, name: str, default: object = ...) -> object:
    if isinstance(obj, Mapping):
        if name in obj:
            return obj[name]
    elif hasattr(obj, name):
        return getattr(obj, name)
    if default is ...:
        raise _Bad(R.INVALID_RECEIPT, f"missing field {name!r}")
    return default


def reward_value(v: object) -> float | None:
    """``v`` as the float a training row carries, or ``None`` when it is not a number that
    stays finite once cast to float32 (NaN, +-inf, beyond float32's range, or an int too
    large even for float64)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        x = float(v)
    except Exception:  # an int past float64 (OverflowError), or a hostile __float__
        return None
    return x if abs(x) < _F32_OVERFLOW else None


def _short(v: object, n: int = 60) -> str:
    try:
        r = repr(v)
    except Exception:  # a hostile __repr__
        r = f"<{type(v).__name__}>"
    return r if len(r) <= n else r[: n - 3] + "..."


def _is_int(v: object) -> bool:
    # bool is an int subclass but never a valid length or version.
    return isinstance(v, int) and not isinstance(v, bool)


def _id(v: object, what: str, *, optional: bool = False) -> str | None:
    if v is None and optional:
        return None
    try:
        return check_id(v, what)
    except InvalidKey as e:
        raise _Bad(R.INVALID_RECEIPT, str(e)) from None


def _hash(v: object, what: str) -> bytes:
    if not isinstance(v, (bytes, bytearray)):
        raise _Bad(R.INVALID_RECEIPT, f"{what} is {type(v).__name__}, expected {HASH_BYTES} bytes")
    if len(v) != HASH_BYTES:
        raise _Bad(R.INVALID_RECEIPT, f"{what} is {len(v)} bytes, expected {HASH_BYTES}")
    return bytes(v)


def _plain_id(v: object) -> bool:
    """``v`` is an exact ``str`` that :func:`tasks.keys.check_id` accepts (the fast path)."""
    if type(v) is not str or not v or "/" in v or v == CUT_PREFIX:
        return False
    try:
        return len(v.encode("utf-8")) <= MAX_ID_BYTES
    except UnicodeEncodeError:
        return False


def _plain_record(raw: CallRecord) -> CallRecord | None:
    """:func:`_record` of a CallRecord whose fields all have their exact types and pass
    every check (the common case, checked in one go), else None: the field-by-field path
    then finds the first failure. Equal to that path's result when not None."""
    r = raw
    p, d, c, w, e = r.prev_len, r.delta_len, r.cum_len, r.weight_version, r.routes_encoding
    par = r.parent_call_id
    if not (
        type(p) is int and type(d) is int and type(c) is int and type(w) is int and type(e) is int
        and 0 <= p <= _I64_MAX and 0 < d <= _I64_MAX and c == p + d and c <= _I64_MAX and _I64_MIN <= w <= _I64_MAX
        and (e == ROUTES_NONE or e in ROUTES_ENCODINGS)
        and type(r.digest) is bytes and len(r.digest) == HASH_BYTES
        and type(r.chain_hash) is bytes and len(r.chain_hash) == HASH_BYTES
        and type(r.cumulative_hash) is bytes and len(r.cumulative_hash) == HASH_BYTES
        and type(r.staging_key) is str
        and type(r.digest_version) is int and r.digest_version in SUPPORTED_VERSIONS
        and _plain_id(r.model_call_id) and (par is None or _plain_id(par))
    ):
        return None
    return raw  # frozen, and every field an exact immutable type: the record as given


def _record(raw: object, i: int) -> CallRecord:
    """One call record, type- and range-checked (lengths consistent, hashes 32 bytes)."""
    if type(raw) is CallRecord:
        plain = _plain_record(raw)
        if plain is not None:
            return plain
    if isinstance(raw, CallRecord):
        get = lambda n: getattr(raw, n)  # noqa: E731
    elif isinstance(raw, Mapping):
        unknown = set(raw) - set(_RECORD_FIELDS)
        missing = set(_RECORD_FIELDS) - set(raw) - set(_OPTIONAL_RECORD_FIELDS)
        if unknown or missing:
            raise _Bad(R.INVALID_RECEIPT, f"calls[{i}]: unknown fields {sorted(map(str, unknown))}, missing {sorted(missing)}")
        get = lambda n: raw[n] if n in raw else _OPTIONAL_RECORD_FIELDS[n]  # noqa: E731
    else:
        raise _Bad(R.INVALID_RECEIPT, f"calls[{i}] is {type(raw).__name__}, expected a call record")
    where = f"calls[{i}]"
    call_id = _id(get("model_call_id"), f"{where}.model_call_id")
    parent = _id(get("parent_call_id"), f"{where}.parent_call_id", optional=True)
    ints: dict[str, int] = {}
    for name in _INT_FIELDS:
        v = get(name)
        if not _is_int(v) or not (_I64_MIN <= v <= _I64_MAX):
            raise _Bad(R.INVALID_RECEIPT, f"{where}.{name} = {v!r} is not an int64")
        ints[name] = int(v)
    if ints["delta_len"] <= 0:
        raise _Bad(R.INVALID_RECEIPT, f"{where}.delta_len {ints['delta_len']} must be > 0")
    if ints["prev_len"] < 0:
        raise _Bad(R.INVALID_RECEIPT, f"{where}.prev_len {ints['prev_len']} must be >= 0")
    if ints["cum_len"] != ints["prev_len"] + ints["delta_len"]:
        raise _Bad(R.INVALID_RECEIPT, f"{where}.cum_len {ints['cum_len']} != prev_len + delta_len")
    enc = get("routes_encoding")
    if not _is_int(enc) or not (enc == ROUTES_NONE or enc in ROUTES_ENCODINGS):
        raise _Bad(R.INVALID_RECEIPT, f"{where}.routes_encoding = {enc!r}, expected one of {[ROUTES_NONE, *ROUTES_ENCODINGS]}")
    key = get("staging_key")
    if not isinstance(key, str):
        raise _Bad(R.INVALID_RECEIPT, f"{where}.staging_key is {type(key).__name__}, expected str")
    hashes = {name: _hash(get(name), f"{where}.{name}") for name in HASH_FIELDS}
    version = get("digest_version")
    if not _is_int(version) or version not in SUPPORTED_VERSIONS:
        raise _Bad(R.INVALID_RECEIPT, f"{where}.digest_version = {_short(version)}: this build verifies {described()}")
    return CallRecord(
        model_call_id=call_id,
        parent_call_id=parent,
        routes_encoding=int(enc),
        staging_key=key,
        digest_version=int(version),
        **ints,
        **hashes,
    )


def _header(raw: object) -> _Header:
    """Top-level receipt fields, type-checked."""
    if not isinstance(raw, (Receipt, Mapping)):
        raise _Bad(R.INVALID_RECEIPT, f"receipt is {type(raw).__name__}, expected Receipt or dict")
    if isinstance(raw, Mapping):
        unknown = set(raw) - set(_RECEIPT_REQUIRED) - set(_RECEIPT_OPTIONAL)
        if unknown:
            raise _Bad(R.INVALID_RECEIPT, f"unknown receipt fields {sorted(map(str, unknown))}")
    h = {name: _get(raw, name) for name in _RECEIPT_REQUIRED}
    h.update({name: _get(raw, name, d) for name, d in _RECEIPT_OPTIONAL.items()})
    h["rollout_id"] = _id(h["rollout_id"], "rollout_id")
    reward = reward_value(h["reward"])
    if reward is None:
        raise _Bad(
            R.INVALID_RECEIPT,
            f"reward {_short(h['reward'])} is not a number finite in float32 (training reads rewards as float32)",
        )
    h["reward"] = reward
    if h["terminal_model_call_id"] is not None and not isinstance(h["terminal_model_call_id"], str):
        raise _Bad(R.INVALID_RECEIPT, "terminal_model_call_id must be str or None")
    if not isinstance(h["calls"], (list, tuple)):
        raise _Bad(R.INVALID_RECEIPT, f"calls is {type(h['calls']).__name__}, expected a list")
    if not isinstance(h["poisoned"], bool):
        raise _Bad(R.INVALID_RECEIPT, f"poisoned is {type(h['poisoned']).__name__}, expected bool")
    for name in ("failure_reason", "group_id"):
        if h[name] is not None and not isinstance(h[name], str):
            raise _Bad(R.INVALID_RECEIPT, f"{name} must be str or None")
    if h["version"] != RECEIPT_VERSION or not _is_int(h["version"]):
        raise _Bad(R.INVALID_RECEIPT, f"receipt version {h['version']!r}, this build reads {RECEIPT_VERSION}")
    return cast(_Header, h)  # every field checked above


def _chain(records: Sequence[CallRecord], terminal: str) -> list[CallRecord]:
    """Lineage of the whole receipt checked (every parent listed, no cycle, the terminal
    a leaf); the root -> terminal chain returned."""
    by_id = {r.model_call_id: r for r in records}
    for r in records:
        if r.parent_call_id is not None and r.parent_call_id not in by_id:
            raise _Bad(R.MISSING_PARENT, f"parent {r.parent_call_id!r} of {r.model_call_id!r} is not in the receipt")
    # Every record must reach a root; `settled` memoizes records already known to.
    settled: set[str] = set()
    for r in records:
        path: list[str] = []
        on_path: set[str] = set()
        cur: CallRecord | None = r
        while cur is not None and cur.model_call_id not in settled:
            if cur.model_call_id in on_path:
                raise _Bad(R.LINEAGE_CYCLE, f"calls {' -> '.join(path)} -> {cur.model_call_id} form a cycle")
            on_path.add(cur.model_call_id)
            path.append(cur.model_call_id)
            cur = None if cur.parent_call_id is None else by_id[cur.parent_call_id]
        settled.update(path)
    # The terminal must be a leaf: a staged child of it is a call the rollout made after
    # its "last" call, and the training row would silently stop short of it.
    child = next((r.model_call_id for r in records if r.parent_call_id == terminal), None)
    if child is not None:
        raise _Bad(R.TERMINAL_NOT_LEAF, f"terminal call {terminal!r} is the parent of {child!r} in the same receipt")
    chain = [by_id[terminal]]
    while chain[-1].parent_call_id is not None:
        chain.append(by_id[chain[-1].parent_call_id])
    chain.reverse()
    return chain


def _plan_one(raw: object, submitted_group: str | None = None) -> RolloutPlan:
    h = _header(raw)
    rid = h["rollout_id"]
    claimed = h["group_id"]
    if submitted_group is not None and claimed and claimed != submitted_group:
        raise _Bad(R.WRONG_GROUP, f"receipt names group {claimed!r} but was submitted in group {submitted_group!r}")
    if h["poisoned"]:
        raise _Bad(R.CAPTURE_POISONED, f"capture poisoned: {h['failure_reason'] or 'no reason given'}")
    if not h["calls"]:
        raise _Bad(R.EMPTY_MANIFEST, "receipt lists no calls")
    records = [_record(c, i) for i, c in enumerate(h["calls"])]
    mixed = next((r for r in records if r.digest_version != records[0].digest_version), None)
    if mixed is not None:
        raise _Bad(
            R.INVALID_RECEIPT,
            f"calls mix digest versions {records[0].digest_version} and {mixed.digest_version} "
            f"({mixed.model_call_id!r}): one rollout's calls are hashed with one algorithm",
        )
    seen: set[str] = set()
    for r in records:
        if r.model_call_id in seen:
            raise _Bad(R.DUPLICATE_CALL_ID, f"model_call_id {r.model_call_id!r} listed twice")
        seen.add(r.model_call_id)
    seen.clear()
    for r in records:
        if r.staging_key in seen:
            raise _Bad(R.DUPLICATE_STAGING_KEY, f"staging_key {r.staging_key!r} listed twice")
        seen.add(r.staging_key)
    for r in records:
        want = staging_key(rid, r.model_call_id)
        if r.staging_key != want:
            raise _Bad(R.INVALID_RECEIPT, f"staging_key {r.staging_key!r} of {r.model_call_id!r}, expected {want!r}")
    terminal = h["terminal_model_call_id"]
    if terminal is None or terminal not in {r.model_call_id for r in records}:
        raise _Bad(R.MISSING_TERMINAL, f"terminal call {terminal!r} is not in the receipt")
    chain = _chain(records, terminal)
    receipt = Receipt(
        rollout_id=rid,
        reward=h["reward"],
        terminal_model_call_id=terminal,
        calls=records,
        poisoned=False,
        failure_reason=h["failure_reason"],
        group_id=h["group_id"],
        version=h["version"],
    )
    keys = [c.staging_key for c in chain]
    routes = [c.staging_key for c in chain if c.routes_encoding != ROUTES_NONE]
    return RolloutPlan(receipt, chain, keys, routes, [r.staging_key for r in records])


def _peek(raw: object, name: str) -> object:
    try:
        return _get(raw, name, None)
    except Exception:  # a hostile mapping; the id is unreadable
        return None


# ---- public ---------------------------------------------------------------------------


def plan_step(receipts: Sequence[ReceiptLike] | Mapping[str, Sequence[ReceiptLike]]) -> StepPlan:
    """Parse a step's receipts (Receipt objects or dicts) into a :class:`StepPlan`.

    ``receipts`` is a flat list, or the submitted groups ``{group_id: [receipts]}`` (in
    submission order, group ids compared as ``str``): then a receipt whose own
    ``group_id`` names another group is rejected ``wrong_group`` (a receipt without one,
    ``None`` or ``""``, claims no group and fits any) and ``group_ids`` are the submitted
    ids. A flat list names no group, so nothing is compared and ``group_ids`` are the
    receipts' own.

    Never raises on bad receipts: each is rejected on its own with a reason. Receipts
    sharing a rollout_id collide on every staging key, so all of them are rejected with
    ``duplicate_staging_key`` (no way to tell which one the store holds). A rejected
    receipt's reward is kept as given when it is finite in float32, else it reads 0.0.
    """
    if isinstance(receipts, Mapping):
        items: list[tuple[str | None, object]] = [(str(g), raw) for g, rs in receipts.items() for raw in rs]
    else:
        items = [(None, raw) for raw in receipts]
    plans: list[RolloutPlan | None] = []
    rejected: dict[str, Rejection] = {}
    order: list[str] = []
    group_ids: list[str | None] = []
    rewards: list[float] = []
    for i, (submitted, raw) in enumerate(items):
        rid = _peek(raw, "rollout_id")
        rid = rid if isinstance(rid, str) and rid else f"<receipt #{i}/>"
        gid = submitted if submitted is not None else _peek(raw, "group_id")
        order.append(rid)
        group_ids.append(gid if isinstance(gid, str) else None)
        reward = reward_value(_peek(raw, "reward"))
        rewards.append(0.0 if reward is None else reward)
        try:
            plans.append(_plan_one(raw, submitted))
        except _Bad as e:
            plans.append(None)
            rejected.setdefault(rid, (e.reason, e.detail))
        except Exception as e:  # hostile objects (e.g. __eq__ raising): still one rejection
            plans.append(None)
            rejected.setdefault(rid, (R.INVALID_RECEIPT, f"{type(e).__name__}: {e}"))
    counts: dict[str, int] = {}
    for rid in order:
        counts[rid] = counts.get(rid, 0) + 1
    for rid, n in counts.items():
        if n > 1:
            rejected[rid] = (R.DUPLICATE_STAGING_KEY, f"rollout_id {rid!r} submitted {n} times: its staging keys collide")
    rollouts = [p for p in plans if p is not None and p.rollout_id not in rejected]
    staging_keys = [k for p in rollouts for k in p.keys]
    routes_keys = [k for p in rollouts for k in p.routes_keys]
    return StepPlan(rollouts, rejected, order, group_ids, rewards, staging_keys, routes_keys)


def plan_group(receipts: Sequence[ReceiptLike], group_id: str | None = None) -> StepPlan:
    """:func:`plan_step` for the receipts of one group (same result type and rules); with
    ``group_id`` the receipts are checked against it (``wrong_group``)."""
    return plan_step(receipts if group_id is None else {group_id: receipts})


def pack_verify_tasks(plans: Sequence[RolloutPlan], token_budget: int) -> list[list[RolloutPlan]]:
    """Pack rollouts into verify tasks of at most ``token_budget`` tokens each.

    A rollout of ``token_budget`` tokens or more gets a task alone; shorter ones are
    packed greedily in submission order (a task of many short rollouts amortizes the
    ~1 ms per-task scheduling overhead). Every rollout is still verified on its own.
    Groups do not cut tasks: the controller assembles every group from all of them.
    """
    if token_budget <= 0:
        raise ValueError(f"token_budget must be positive, got {token_budget}")
    tasks: list[list[RolloutPlan]] = []
    current: list[RolloutPlan] = []
    used = 0
    for p in plans:
        n = p.n_tokens
        if n >= token_budget:
            if current:  # tasks stay in submission order: each a run of consecutive rollouts
                tasks.append(current)
                current, used = [], 0
            tasks.append([p])
            continue
        if current and used + n > token_budget:
            tasks.append(current)
            current, used = [], 0
        current.append(p)
        used += n
    if current:
        tasks.append(current)
    return tasks
