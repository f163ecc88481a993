"""Content rules for one call's delta, vectorized.

Shared by the capture gate (refuse before staging) and the verifier (reject after
fetching): one implementation, so a row the gate accepts is a row the verifier accepts.
Each check returns ``None`` or ``(reason, detail)``; none loops over tokens in Python.
"""
from __future__ import annotations


import numpy as np

from .schema import ROUTES_ENCODINGS, ROUTES_NONE, TOKEN_FIELDS

Problem = tuple[str, str] | None

# The digest's fixed-width header fields (tasks.hashing, digest v1).
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_U32_MAX = 2**32 - 1


def check_token_arrays(
    token_ids: np.ndarray,
    token_mask: np.ndarray,
    logprobs: np.ndarray,
    delta_len: int,
) -> Problem:
    """Dtypes, shapes and lengths of the three token fields."""
    for name, arr in (("token_ids", token_ids), ("token_mask", token_mask), ("logprobs", logprobs)):
        if not isinstance(arr, np.ndarray):
            return "invalid_staging_row", f"{name} is {type(arr).__name__}, not an ndarray"
        want = TOKEN_FIELDS[name]
        if arr.dtype != want:
            return "invalid_staging_row", f"{name} dtype {arr.dtype}, expected {want}"
        if arr.ndim != 1 or arr.shape[0] != delta_len:
            return "invalid_staging_row", f"{name} shape {arr.shape}, expected ({delta_len},)"
    return None


def check_lengths(prev_len: int, delta_len: int, cum_len: int) -> Problem:
    if delta_len <= 0:
        return "invalid_staging_row", f"delta_len {delta_len} must be > 0"
    if prev_len < 0:
        return "invalid_staging_row", f"prev_len {prev_len} must be >= 0"
    if cum_len != prev_len + delta_len:
        return "invalid_staging_row", f"cum_len {cum_len} != prev_len {prev_len} + delta_len {delta_len}"
    return None


def check_weight_version(weight_version: object) -> Problem:
    """An integer (not a bool) that fits the digest's ``<q weight_version>`` field."""
    if isinstance(weight_version, bool) or not isinstance(weight_version, (int, np.integer)):
        return "invalid_staging_row", f"weight_version {weight_version!r} is {type(weight_version).__name__}; pass an int"
    if not _I64_MIN <= int(weight_version) <= _I64_MAX:
        return (
            "invalid_staging_row",
            f"weight_version {int(weight_version)} is outside int64; pass an int in [-2**63, 2**63 - 1]",
        )
    return None


def check_mask(token_mask: np.ndarray) -> Problem:
    """Zeros first (carried context), then ones (generated), at least one 1."""
    is_one = token_mask == 1.0
    if not np.all(is_one | (token_mask == 0.0)):
        return "invalid_mask_order", "token_mask holds values other than 0.0 and 1.0"
    n_ones = int(np.count_nonzero(is_one))
    if n_ones == 0:
        return "empty_generation", "no generated token (token_mask has no 1.0)"
    # Ones must be a suffix: the last n_ones entries are exactly the ones.
    if not is_one[len(is_one) - n_ones :].all():
        return "invalid_mask_order", "token_mask is not zeros-then-ones"
    return None


def check_tokens(token_ids: np.ndarray, vocab_size: int) -> Problem:
    if token_ids.size and (int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab_size):
        bad = int(token_ids[(token_ids < 0) | (token_ids >= vocab_size)][0])
        return "invalid_token", f"token id {bad} outside [0, {vocab_size})"
    return None


def check_logprobs(logprobs: np.ndarray, token_mask: np.ndarray) -> Problem:
    if not np.isfinite(logprobs).all():
        return "invalid_logprob", "logprobs contain NaN or inf"
    if (logprobs > 0.0).any():
        return "invalid_logprob", "logprobs contain values > 0"
    if (logprobs[token_mask == 0.0] != 0.0).any():
        return "invalid_logprob", "logprobs are not 0.0 where token_mask is 0"
    return None


def check_routes(
    routes_encoding: int,
    routed_experts: np.ndarray | None,
    delta_len: int,
    num_experts: int | None,
    routes_shape: tuple[int, int] | None = None,
) -> Problem:
    """Routes present iff encoding says so; the encoding's dtype (int16 for 1, uint8 for
    2, :data:`tasks.schema.ROUTES_ENCODINGS`); shape ``[delta_len, L, K]``; ids in
    ``[0, num_experts)`` (an int16 id below 0 or either past the last expert; ``>= 0``
    when ``num_experts`` is None: :func:`check_expert_range`, the one range rule)."""
    if routes_encoding == ROUTES_NONE:
        if routed_experts is not None:
            return "invalid_routes", "routed_experts present but routes_encoding is 0"
        return None
    spec = ROUTES_ENCODINGS.get(routes_encoding)
    if spec is None:
        return "invalid_routes", f"unknown routes_encoding {routes_encoding}"
    dtype = spec[1]
    if routed_experts is None:
        return "missing_routes", f"routes_encoding is {routes_encoding} but routed_experts are absent"
    if not isinstance(routed_experts, np.ndarray) or routed_experts.dtype != dtype:
        return "invalid_routes", f"routed_experts dtype {getattr(routed_experts, 'dtype', None)}, routes_encoding {routes_encoding} expects {dtype.name}"
    problem = check_routes_shape(routed_experts, delta_len, routes_shape)
    if problem is None:
        return check_expert_range(routed_experts, num_experts, routes_encoding)
    return problem


def check_routes_shape(routed_experts: np.ndarray, delta_len: int, routes_shape: tuple[int, int] | None = None) -> Problem:
    """``[delta_len, L, K]`` with ``L`` and ``K`` within the digest's 32-bit fields (and
    equal to ``routes_shape`` when given)."""
    if routed_experts.ndim != 3 or routed_experts.shape[0] != delta_len:
        return "invalid_routes", f"routed_experts shape {routed_experts.shape}, expected ({delta_len}, L, K)"
    if max(routed_experts.shape[1:]) > _U32_MAX:
        return "invalid_routes", f"routed_experts [L, K] {routed_experts.shape[1:]} exceed the 32-bit fields of the digest (at most {_U32_MAX} each)"
    if routes_shape is not None and tuple(routed_experts.shape[1:]) != tuple(routes_shape):
        return "invalid_routes", f"routed_experts [L, K] {routed_experts.shape[1:]}, expected {tuple(routes_shape)}"
    return None


def encode_routes(
    routed_experts: object,
    routes_encoding: int,
    delta_len: int,
    num_experts: int | None,
    routes_shape: tuple[int, int] | None = None,
) -> tuple[Problem, np.ndarray | None]:
    """A writer's routed expert ids (any integer array) in the dtype of ``routes_encoding``:
    ``(None, ids)`` (``ids`` is the given array when it already has that dtype, else a
    new one), or ``(problem, None)``: not an integer array, a shape :func:`check_routes_shape`
    refuses, an id outside ``[0, num_experts)`` (below 0 when experts are unknown), or an
    id the encoding cannot hold. The range is checked on the given values, before any
    cast, so a cast never wraps an id into range."""
    dtype = ROUTES_ENCODINGS[routes_encoding][1]
    if not isinstance(routed_experts, np.ndarray) or routed_experts.dtype.kind not in "iu":
        got = getattr(routed_experts, "dtype", type(routed_experts).__name__)
        return ("invalid_routes", f"routed_experts dtype {got}, expected integer expert ids"), None
    problem = check_routes_shape(routed_experts, delta_len, routes_shape)
    if problem is None:
        problem = check_expert_range(routed_experts, num_experts, routes_encoding)
    if problem is None and routed_experts.dtype != dtype and routed_experts.size:
        info = np.iinfo(dtype)
        lo, hi = int(routed_experts.min()), int(routed_experts.max())
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            problem = "invalid_routes", f"expert id {bad} does not fit routes_encoding {routes_encoding} ({dtype.name})"
    if problem:
        return problem, None
    return None, routed_experts if routed_experts.dtype == dtype else routed_experts.astype(dtype)


def check_expert_range(routed_experts: np.ndarray, num_experts: int | None, routes_encoding: int | None = None) -> Problem:
    """Every id of the integer array ``routed_experts`` in ``[0, num_experts)`` (``>= 0``
    when ``num_experts`` is None: no expert is numbered below 0); the problem names the
    first id outside (and the encoding, when given)."""
    if not routed_experts.size:
        return None
    lo, hi = int(routed_experts.min()), int(routed_experts.max())
    if lo >= 0 and (num_experts is None or hi < num_experts):
        return None
    bad = lo if lo < 0 else hi
    how = "" if routes_encoding is None else f" (routes_encoding {routes_encoding}, {routed_experts.dtype.name} ids)"
    span = "[0, ...) (expert ids start at 0)" if num_experts is None else f"[0, {num_experts})"
    return "invalid_routes", f"expert id {bad} outside {span}{how}"


def check_delta(
    *,
    prev_len: int,
    delta_len: int,
    cum_len: int,
    token_ids: np.ndarray,
    token_mask: np.ndarray,
    logprobs: np.ndarray,
    routes_encoding: int,
    routed_experts: np.ndarray | None,
    vocab_size: int,
    num_experts: int | None = None,
) -> Problem:
    """All content rules for one delta, first failure wins (shape before content)."""
    return (
        check_lengths(prev_len, delta_len, cum_len)
        or check_token_arrays(token_ids, token_mask, logprobs, delta_len)
        or check_mask(token_mask)
        or check_tokens(token_ids, vocab_size)
        or check_logprobs(logprobs, token_mask)
        or check_routes(routes_encoding, routed_experts, delta_len, num_experts)
    )
