"""tasks.hashing: known-answer vectors, the documented byte layout, and tamper evidence.

The hex strings below were computed once with tasks/hashing.py (layout v1) and are
FIXED: a change to any of them is a change of the on-disk/wire format and must come with
a new digest_version, not a new expected value.
"""
from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks import hashing as H

IDS = np.array([1, 2, 3, 500, 0, 7], dtype=np.int64)
PARENT_CHAIN = bytes(range(32))

KAT_CHAIN_ROOT = "f6935098c6543683d83b89ccec4d3626d8c2f36bb22584da23ad95ad636b8422"
KAT_CHAIN_CHILD = "be1391828022919c9f6a8bc1a22ba6c2701ef51823de8bbebfb80aedef19f8b7"
KAT_CUMULATIVE = "3a4be169a19d3c125acc99cea5f1e198098eeee526a4895aa277991c0ebb1f1c"
KAT_CUMULATIVE_EMPTY = "267dab3a015334f8aff819c4f8cc07041d3023dad001233a1455f3ce8bbd629c"
KAT_DIGEST_ROUTES = "922bd6b46e8f0f1322a9db8a94db5706103e435ed1818dc3d2c6276ddfb8fd88"
KAT_DIGEST_ROOT_NO_ROUTES = "4f5dcf2e6ac44cfb9a2ba4f1d3a0891c122b77afa887fe66e6999f7aaab6c58a"


def call_kwargs(**over):
    kw = dict(
        rollout_id="g0-1",
        model_call_id="call-1",
        parent_call_id="call-0",
        prev_len=10,
        delta_len=6,
        cum_len=16,
        weight_version=3,
        token_ids=IDS.copy(),
        token_mask=np.array([0, 0, 1, 1, 1, 1], np.float32),
        logprobs=np.array([0, 0, -0.5, -1.25, -3.0, -0.125], np.float32),
        routes_encoding=1,
        routed_experts=np.arange(6 * 2 * 2, dtype=np.int16).reshape(6, 2, 2) % 8,
        chain_hash=bytes([0xAA]) * 32,
        cumulative_hash=bytes([0x55]) * 32,
    )
    kw.update(over)
    return kw


def root_kwargs(**over):
    kw = call_kwargs(parent_call_id=None, prev_len=0, cum_len=6, routes_encoding=0, routed_experts=None)
    kw.update(over)
    return kw


# ---- known answers ---------------------------------------------------------------------------


def test_known_answers():
    assert H.chain_hash(None, IDS).hex() == KAT_CHAIN_ROOT
    assert H.chain_hash(PARENT_CHAIN, IDS).hex() == KAT_CHAIN_CHILD
    assert H.cumulative_hash(IDS).hex() == KAT_CUMULATIVE
    assert H.cumulative_hash(np.zeros(0, np.int64)).hex() == KAT_CUMULATIVE_EMPTY
    assert H.digest(**call_kwargs()).hex() == KAT_DIGEST_ROUTES
    assert H.digest(**root_kwargs()).hex() == KAT_DIGEST_ROOT_NO_ROUTES


def test_known_answers_are_layout_independent_of_input_dtype_and_order():
    # Big-endian, int32 and non-contiguous inputs hash as their canonical <i8 / <f4 bytes.
    ids_be = IDS.astype(">i8")
    ids_strided = np.repeat(IDS, 2)[::2]
    assert not ids_strided.flags.c_contiguous
    for ids in (ids_be, IDS.astype(np.int32), ids_strided):
        assert H.chain_hash(PARENT_CHAIN, ids).hex() == KAT_CHAIN_CHILD
        assert H.cumulative_hash(ids).hex() == KAT_CUMULATIVE
    kw = call_kwargs(token_mask=call_kwargs()["token_mask"].astype(">f4"))
    assert H.digest(**kw).hex() == KAT_DIGEST_ROUTES


# ---- the documented layout, written out independently ------------------------------------------


def reference_digest(kw) -> bytes:
    """Digest v1 exactly as the tasks/hashing.py docstring describes it."""

    def framed(s: str) -> bytes:
        b = s.encode("utf-8")
        return struct.pack("<I", len(b)) + b

    parts = [b"token-capture/call/v1\x00", struct.pack("<HH", 1, 1), framed(kw["rollout_id"]), framed(kw["model_call_id"])]
    parts.append(b"\x00" if kw["parent_call_id"] is None else b"\x01" + framed(kw["parent_call_id"]))
    parts.append(
        struct.pack("<qqqqb", kw["prev_len"], kw["delta_len"], kw["cum_len"], kw["weight_version"], kw["routes_encoding"])
    )
    for name, dt in (("token_ids", "<i8"), ("token_mask", "<f4"), ("logprobs", "<f4")):
        b = np.asarray(kw[name], dtype=dt).tobytes()
        parts += [struct.pack("<Q", len(b)), b]
    if kw["routes_encoding"] == 1:
        r = np.asarray(kw["routed_experts"], dtype="<i2")
        parts += [struct.pack("<IIQ", r.shape[1], r.shape[2], r.nbytes), r.tobytes()]
    parts += [kw["chain_hash"], kw["cumulative_hash"]]
    return hashlib.sha256(b"".join(parts)).digest()


def test_digest_matches_documented_layout():
    assert H.digest(**call_kwargs()) == reference_digest(call_kwargs())
    assert H.digest(**root_kwargs()) == reference_digest(root_kwargs())


def test_chain_and_cumulative_match_documented_layout():
    assert H.chain_hash(None, IDS) == hashlib.sha256(b"token-capture/chain/v1\x00" + b"\x00" + IDS.tobytes()).digest()
    assert (
        H.chain_hash(PARENT_CHAIN, IDS)
        == hashlib.sha256(b"token-capture/chain/v1\x00" + b"\x01" + PARENT_CHAIN + IDS.tobytes()).digest()
    )
    assert H.cumulative_hash(IDS) == hashlib.sha256(b"token-capture/prefix/v1\x00" + IDS.tobytes()).digest()


@settings(max_examples=60, deadline=None)
@given(
    rid=st.text(alphabet=st.characters(blacklist_characters="/", blacklist_categories=("Cs",)), min_size=1, max_size=12),
    n=st.integers(1, 40),
    lk=st.tuples(st.integers(1, 4), st.integers(1, 3)),
    parent=st.one_of(st.none(), st.text(min_size=1, max_size=8)),
    prev_len=st.integers(0, 2**40),
    weight_version=st.integers(-(2**63), 2**63 - 1),
    routed=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_digest_property_matches_reference(rid, n, lk, parent, prev_len, weight_version, routed, seed):
    rng = np.random.default_rng(seed)
    kw = dict(
        rollout_id=rid,
        model_call_id="c",
        parent_call_id=parent,
        prev_len=prev_len,
        delta_len=n,
        cum_len=prev_len + n,
        weight_version=weight_version,
        token_ids=rng.integers(0, 2**40, n),
        token_mask=(rng.random(n) < 0.5).astype(np.float32),
        logprobs=-rng.random(n).astype(np.float32),
        routes_encoding=int(routed),
        routed_experts=rng.integers(0, 64, (n, *lk)).astype(np.int16) if routed else None,
        chain_hash=rng.bytes(32),
        cumulative_hash=rng.bytes(32),
    )
    assert H.digest(**kw) == reference_digest(kw)


# ---- running prefix state ---------------------------------------------------------------------


def test_running_prefix_equals_one_pass_and_parent_state_is_untouched():
    chunks = [IDS[:2], IDS[2:5], IDS[5:]]
    state = H.prefix_state()
    hashes = []
    for c in chunks:
        child = H.prefix_state(state)  # a copy: branching must not disturb the parent
        hashes.append(H.extend_prefix(child, c))
        state = child
    assert hashes[-1] == H.cumulative_hash(IDS)
    assert hashes[0] == H.cumulative_hash(IDS[:2])
    # Branch from the first chunk's state twice: both branches agree, parent unchanged.
    s0 = H.prefix_state()
    H.extend_prefix(s0, chunks[0])
    a = H.extend_prefix(H.prefix_state(s0), chunks[1])
    b = H.extend_prefix(H.prefix_state(s0), chunks[1])
    assert a == b == H.cumulative_hash(IDS[:5])
    assert s0.digest() == H.cumulative_hash(IDS[:2])


# ---- tamper evidence: one flipped byte anywhere changes the hash --------------------------------


def flipped_copies(a: np.ndarray) -> np.ndarray:
    """[nbytes, *a.shape]: copy i has byte i xored with 0x01 (all copies built at once)."""
    raw = np.frombuffer(np.ascontiguousarray(a).tobytes(), dtype=np.uint8)
    m = np.tile(raw, (raw.size, 1))
    m[np.arange(raw.size), np.arange(raw.size)] ^= 0x01
    return m.view(a.dtype).reshape(raw.size, *a.shape)


def flipped_bytes(b: bytes) -> list[bytes]:
    return [bytes(x) for x in flipped_copies(np.frombuffer(b, dtype=np.uint8))]


def flipped_int(v: int) -> list[int]:
    return [int(x) for x in flipped_copies(np.array(v, dtype="<i8")).ravel()]


def variants(base: dict):
    """(label, kwargs) for every single-byte flip of every hashed input of a digest."""
    for name in ("token_ids", "token_mask", "logprobs", "routed_experts"):
        if base[name] is None:
            continue
        for i, arr in enumerate(flipped_copies(base[name])):
            yield f"{name}[byte {i}]", dict(base, **{name: arr})
    for name in ("rollout_id", "model_call_id", "parent_call_id"):
        if base[name] is None:
            continue
        for i, b in enumerate(flipped_bytes(base[name].encode("utf-8"))):
            yield f"{name}[byte {i}]", dict(base, **{name: b.decode("utf-8")})
    for name in ("prev_len", "delta_len", "cum_len", "weight_version"):
        for i, v in enumerate(flipped_int(base[name])):
            yield f"{name}[byte {i}]", dict(base, **{name: v})
    for name in ("chain_hash", "cumulative_hash"):
        for i, b in enumerate(flipped_bytes(base[name])):
            yield f"{name}[byte {i}]", dict(base, **{name: b})
    # schema_version is hashed as <H: its two low bytes.
    for i in range(2):
        yield f"schema_version[byte {i}]", dict(base, schema_version=1 ^ (1 << (8 * i)))


@pytest.mark.parametrize("make", [call_kwargs, root_kwargs], ids=["child_with_routes", "root_without_routes"])
def test_any_single_byte_flip_changes_digest(make):
    base = make()
    d0 = H.digest(**base)
    seen = {d0: "original"}
    n = 0
    for label, kw in variants(base):
        d = H.digest(**kw)
        assert d != d0, f"flipping {label} left the digest unchanged"
        assert d not in seen, f"{label} collides with {seen[d]}"
        seen[d] = label
        n += 1
    # Every byte of every field was covered (48+24+24(+48 routes) token bytes, ids, 4x8, 2x32, 2).
    routes = 48 if base["routed_experts"] is not None else 0
    parent = len(base["parent_call_id"] or "")
    assert n == 48 + 24 + 24 + routes + 4 + 6 + parent + 32 + 64 + 2


def test_structural_changes_change_digest():
    base = call_kwargs()
    d0 = H.digest(**base)
    changed = {
        "root marker": dict(base, parent_call_id=None),
        "empty parent id": dict(base, parent_call_id=""),
        "id boundary": dict(base, rollout_id="g0-1c", model_call_id="all-1"),
        "routes dropped": dict(base, routes_encoding=0, routed_experts=None),
        "routes reshaped": dict(base, routed_experts=base["routed_experts"].reshape(6, 4, 1)),
        "token moved between buffers": dict(
            base, token_mask=base["token_mask"][:5], logprobs=np.concatenate([base["logprobs"], [0]]).astype(np.float32)
        ),
        "hashes swapped": dict(base, chain_hash=base["cumulative_hash"], cumulative_hash=base["chain_hash"]),
    }
    digests = {H.digest(**kw) for kw in changed.values()}
    assert d0 not in digests and len(digests) == len(changed)


def test_any_single_byte_flip_changes_chain_and_cumulative():
    c0, p0 = H.chain_hash(PARENT_CHAIN, IDS), H.cumulative_hash(IDS)
    chains = {H.chain_hash(PARENT_CHAIN, ids) for ids in flipped_copies(IDS)}
    chains |= {H.chain_hash(p, IDS) for p in flipped_bytes(PARENT_CHAIN)}
    chains.add(H.chain_hash(None, IDS))
    assert c0 not in chains and len(chains) == IDS.nbytes + 32 + 1
    cums = {H.cumulative_hash(ids) for ids in flipped_copies(IDS)}
    assert p0 not in cums and len(cums) == IDS.nbytes
    # Domain tags: the same bytes never hash alike across kinds.
    assert H.chain_hash(None, IDS) != H.cumulative_hash(IDS)


def test_digest_rejects_unknown_version_and_bad_routes():
    with pytest.raises(ValueError, match="digest_version"):
        H.digest(**call_kwargs(), digest_version=2)
    with pytest.raises(ValueError, match="routed_experts"):
        H.digest(**call_kwargs(routed_experts=None))
    with pytest.raises(ValueError, match="routed_experts"):
        H.digest(**call_kwargs(routed_experts=np.zeros((6, 4), np.int16)))


def test_row_digest_equals_digest_of_fields():
    from tasks.schema import StagedRow

    kw = call_kwargs()
    row = StagedRow(digest=b"", **kw)
    assert H.row_digest(row) == H.digest(**kw)
    assert H.row_digest(row).hex() == KAT_DIGEST_ROUTES
