"""tasks.hashing: known-answer vectors, the documented byte layout, and tamper evidence,
for every digest version (1: SHA-256, 2: BLAKE3, 3: BLAKE3 over keyed field digests).

The hex strings below were computed once with tasks/hashing.py and are FIXED: a change
to any of them is a change of the on-disk/wire format and must come with a new
digest_version, not a new expected value. Version 1's are the values every row written
before BLAKE3 carries. Version 3's were also derived independently (here, from the
documented layout and key context, never through tasks.digests): see
test_version_3_known_answers_match_an_independent_derivation.
"""
from __future__ import annotations

import hashlib
import struct

import blake3
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tasks import hashing as H
from tasks.digests import UnsupportedDigest

IDS = np.array([1, 2, 3, 500, 0, 7], dtype=np.int64)
PARENT_CHAIN = bytes(range(32))

KAT_CHAIN_ROOT = "f6935098c6543683d83b89ccec4d3626d8c2f36bb22584da23ad95ad636b8422"
KAT_CHAIN_CHILD = "be1391828022919c9f6a8bc1a22ba6c2701ef51823de8bbebfb80aedef19f8b7"
KAT_CUMULATIVE = "3a4be169a19d3c125acc99cea5f1e198098eeee526a4895aa277991c0ebb1f1c"
KAT_CUMULATIVE_EMPTY = "267dab3a015334f8aff819c4f8cc07041d3023dad001233a1455f3ce8bbd629c"
KAT_DIGEST_ROUTES = "922bd6b46e8f0f1322a9db8a94db5706103e435ed1818dc3d2c6276ddfb8fd88"
KAT_DIGEST_ROOT_NO_ROUTES = "4f5dcf2e6ac44cfb9a2ba4f1d3a0891c122b77afa887fe66e6999f7aaab6c58a"
# digest_version -> the known answers above, in order (chain root, chain child, cumulative,
# cumulative of nothing, digest with routes, root digest without routes).
KATS = {
    1: (KAT_CHAIN_ROOT, KAT_CHAIN_CHILD, KAT_CUMULATIVE, KAT_CUMULATIVE_EMPTY, KAT_DIGEST_ROUTES, KAT_DIGEST_ROOT_NO_ROUTES),
    2: (
        "2783c52efe7b6fd5c718a409bb720a73b8257fa8f845c7e4ccae3024c81858ca",
        "71d9dc37b45e7b0b29a6f535d9159a2c434122632e45d7201d25683da039e970",
        "b6e98c74f179467436b9204b4a3f302bda9feb2971f00d1b11496e4a52d98441",
        "68aa7ae1dfe34adb1b7b30c07ce3c02e2497162bb00dabadeeb6a5e1693e3cf6",
        "88d7d695c9fc8fb5897ff7c419f7ddb1a62b69c4b529d2d34c83f2f049c69bee",
        "688dd83b13d4dbf8751257bb8ce06c0aa95c2e43038ad21fd3f87efbec873e0a",
    ),
    3: (
        "a4e38d7870c191453142fa989007e8ee7482369edf1b155ffb2aa25ca08a6596",
        "fc6465644b276970e6398cdfef9399f225534a361db26407a3451ec9f57682d9",
        "de86fcc384e9654eda9904c5efa40d25644d89cc26c1317c3da47d4a92323557",
        "7e8e35c3330b7b6ab1c002fd3541fbd56a84933dd8d35e7e8f8df800717b49bb",
        "e39fe001ec7a4f19e288f2978ccd6dca2391f6ded189b18f8ebc3cc4151383ef",
        "ee2705a45d45c0a4619b2376570c6e7c0d134b3d92ec7aaa19f68414761d7a89",
    ),
}
VERSIONS = sorted(KATS)
# The documented hash function of each version, called directly (not through tasks.digests).
HASH_OF = {1: hashlib.sha256, 2: blake3.blake3, 3: blake3.blake3}
# Version 3's field-digest key, derived here from the documented context string and key
# material (BLAKE3's key derivation mode), not read from tasks.digests.
FIELD_KEY_CONTEXT = "token-capture 2026-12 field digest"
FIELD_KEY = blake3.blake3(b"field digest v3", derive_key_context=FIELD_KEY_CONTEXT).digest()


def field_digest(b: bytes) -> bytes:
    """F(b) of version 3: keyed BLAKE3 of the field's raw bytes, nothing before them."""
    return blake3.blake3(b, key=FIELD_KEY).digest()


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


@pytest.mark.parametrize("v", VERSIONS)
def test_known_answers(v):
    chain_root, chain_child, cumulative, cumulative_empty, digest_routes, digest_root = KATS[v]
    assert H.chain_hash(None, IDS, v).hex() == chain_root
    assert H.chain_hash(PARENT_CHAIN, IDS, v).hex() == chain_child
    assert H.cumulative_hash(IDS, v).hex() == cumulative
    assert H.cumulative_hash(np.zeros(0, np.int64), v).hex() == cumulative_empty
    assert H.digest(**call_kwargs(), digest_version=v).hex() == digest_routes
    assert H.digest(**root_kwargs(), digest_version=v).hex() == digest_root


def test_default_version_is_blake3_fields_and_versions_never_collide():
    assert H.DIGEST_VERSION == 3
    assert H.chain_hash(None, IDS).hex() == KATS[3][0] and H.digest(**call_kwargs()).hex() == KATS[3][4]
    assert len({kat for v in VERSIONS for kat in KATS[v]}) == 6 * len(VERSIONS)


@pytest.mark.parametrize("v", VERSIONS)
def test_known_answers_are_layout_independent_of_input_dtype_and_order(v):
    # Big-endian, int32 and non-contiguous inputs hash as their canonical <i8 / <f4 bytes.
    _, chain_child, cumulative, _, digest_routes, _ = KATS[v]
    ids_be = IDS.astype(">i8")
    ids_strided = np.repeat(IDS, 2)[::2]
    assert not ids_strided.flags.c_contiguous
    for ids in (ids_be, IDS.astype(np.int32), ids_strided):
        assert H.chain_hash(PARENT_CHAIN, ids, v).hex() == chain_child
        assert H.cumulative_hash(ids, v).hex() == cumulative
    kw = call_kwargs(token_mask=call_kwargs()["token_mask"].astype(">f4"))
    assert H.digest(**kw, digest_version=v).hex() == digest_routes


# ---- the documented layout, written out independently ------------------------------------------


def reference_digest(kw, v: int = 1) -> bytes:
    """The digest of version ``v`` exactly as the tasks/hashing.py docstring describes it
    (version 3: each token field's bytes replaced by their field digest F)."""

    def framed(s: str) -> bytes:
        b = s.encode("utf-8")
        return struct.pack("<I", len(b)) + b

    tag = f"token-capture/call/v{v}\x00".encode()
    parts = [tag, struct.pack("<HH", 1, v), framed(kw["rollout_id"]), framed(kw["model_call_id"])]
    parts.append(b"\x00" if kw["parent_call_id"] is None else b"\x01" + framed(kw["parent_call_id"]))
    parts.append(
        struct.pack("<qqqqb", kw["prev_len"], kw["delta_len"], kw["cum_len"], kw["weight_version"], kw["routes_encoding"])
    )
    field = field_digest if v == 3 else (lambda b: b)
    for name, dt in (("token_ids", "<i8"), ("token_mask", "<f4"), ("logprobs", "<f4")):
        b = np.asarray(kw[name], dtype=dt).tobytes()
        parts += [struct.pack("<Q", len(b)), field(b)]
    if kw["routes_encoding"] in (1, 2):
        r = np.asarray(kw["routed_experts"], dtype="<i2" if kw["routes_encoding"] == 1 else "u1")
        parts += [struct.pack("<IIQ", r.shape[1], r.shape[2], r.nbytes), field(r.tobytes())]
    parts += [kw["chain_hash"], kw["cumulative_hash"]]
    return HASH_OF[v](b"".join(parts)).digest()


@pytest.mark.parametrize("v", VERSIONS)
def test_digest_matches_documented_layout(v):
    assert H.digest(**call_kwargs(), digest_version=v) == reference_digest(call_kwargs(), v)
    assert H.digest(**root_kwargs(), digest_version=v) == reference_digest(root_kwargs(), v)


@pytest.mark.parametrize("v", VERSIONS)
def test_chain_and_cumulative_match_documented_layout(v):
    h = HASH_OF[v]
    chain_tag, prefix_tag = f"token-capture/chain/v{v}\x00".encode(), f"token-capture/prefix/v{v}\x00".encode()
    assert H.chain_hash(None, IDS, v) == h(chain_tag + b"\x00" + IDS.tobytes()).digest()
    assert H.chain_hash(PARENT_CHAIN, IDS, v) == h(chain_tag + b"\x01" + PARENT_CHAIN + IDS.tobytes()).digest()
    assert H.cumulative_hash(IDS, v) == h(prefix_tag + IDS.tobytes()).digest()


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
    v=st.sampled_from(VERSIONS),
)
def test_digest_property_matches_reference(rid, n, lk, parent, prev_len, weight_version, routed, seed, v):
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
    assert H.digest(**kw, digest_version=v) == reference_digest(kw, v)


# ---- running prefix state ---------------------------------------------------------------------


@pytest.mark.parametrize("v", VERSIONS)
def test_running_prefix_equals_one_pass_and_parent_state_is_untouched(v):
    chunks = [IDS[:2], IDS[2:5], IDS[5:]]
    state = H.prefix_state(None, v)
    hashes = []
    for c in chunks:
        child = H.prefix_state(state)  # a copy: branching must not disturb the parent
        hashes.append(H.extend_prefix(child, c))
        state = child
    assert hashes[-1] == H.cumulative_hash(IDS, v)
    assert hashes[0] == H.cumulative_hash(IDS[:2], v)
    # Branch from the first chunk's state twice: both branches agree, parent unchanged.
    s0 = H.prefix_state(None, v)
    H.extend_prefix(s0, chunks[0])
    a = H.extend_prefix(H.prefix_state(s0), chunks[1])
    b = H.extend_prefix(H.prefix_state(s0), chunks[1])
    assert a == b == H.cumulative_hash(IDS[:5], v)
    assert s0.digest() == H.cumulative_hash(IDS[:2], v)
    # The running chain state, fed in pieces, equals the one-pass chain hash.
    c = H.chain_state(PARENT_CHAIN, v)
    for piece in chunks:
        c.update(piece.tobytes())
    assert c.digest() == H.chain_hash(PARENT_CHAIN, IDS, v)


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


@pytest.mark.parametrize("v", VERSIONS)
@pytest.mark.parametrize("make", [call_kwargs, root_kwargs], ids=["child_with_routes", "root_without_routes"])
def test_any_single_byte_flip_changes_digest(make, v):
    base = make()
    d0 = H.digest(**base, digest_version=v)
    seen = {d0: "original"}
    n = 0
    for label, kw in variants(base):
        d = H.digest(**kw, digest_version=v)
        assert d != d0, f"flipping {label} left the digest unchanged"
        assert d not in seen, f"{label} collides with {seen[d]}"
        seen[d] = label
        n += 1
    # Every byte of every field was covered (48+24+24(+48 routes) token bytes, ids, 4x8, 2x32, 2).
    routes = 48 if base["routed_experts"] is not None else 0
    parent = len(base["parent_call_id"] or "")
    assert n == 48 + 24 + 24 + routes + 4 + 6 + parent + 32 + 64 + 2


@pytest.mark.parametrize("v", VERSIONS)
def test_structural_changes_change_digest(v):
    base = call_kwargs()
    d0 = H.digest(**base, digest_version=v)
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
    digests = {H.digest(**kw, digest_version=v) for kw in changed.values()}
    assert d0 not in digests and len(digests) == len(changed)


@pytest.mark.parametrize("v", VERSIONS)
def test_any_single_byte_flip_changes_chain_and_cumulative(v):
    c0, p0 = H.chain_hash(PARENT_CHAIN, IDS, v), H.cumulative_hash(IDS, v)
    chains = {H.chain_hash(PARENT_CHAIN, ids, v) for ids in flipped_copies(IDS)}
    chains |= {H.chain_hash(p, IDS, v) for p in flipped_bytes(PARENT_CHAIN)}
    chains.add(H.chain_hash(None, IDS, v))
    assert c0 not in chains and len(chains) == IDS.nbytes + 32 + 1
    cums = {H.cumulative_hash(ids, v) for ids in flipped_copies(IDS)}
    assert p0 not in cums and len(cums) == IDS.nbytes
    # Domain tags: the same bytes never hash alike across kinds.
    assert H.chain_hash(None, IDS, v) != H.cumulative_hash(IDS, v)


@pytest.mark.parametrize("make", [call_kwargs, root_kwargs], ids=["child_with_routes", "root_without_routes"])
def test_the_digest_version_is_hashed(make):
    # A row relabelled from one version to another fails its digest under either: every
    # pair of versions differs, and each agrees with the documented layout of its own.
    d = {v: H.digest(**make(), digest_version=v) for v in VERSIONS}
    assert VERSIONS == [1, 2, 3]
    for a in VERSIONS:
        assert reference_digest(make(), a) == d[a]
        for b in VERSIONS:
            if a != b:
                assert d[a] != d[b], (a, b)
                assert reference_digest(make(), b) != d[a], (a, b)


def test_version_3_known_answers_match_an_independent_derivation():
    # Every version-3 known answer, derived from the documented layout with the key made
    # here (not the FIXED hex above re-read through tasks.hashing).
    chain_root, chain_child, cumulative, cumulative_empty, digest_routes, digest_root = KATS[3]
    b = blake3.blake3
    assert b(b"token-capture/chain/v3\x00" + b"\x00" + IDS.tobytes()).hexdigest() == chain_root
    assert b(b"token-capture/chain/v3\x00" + b"\x01" + PARENT_CHAIN + IDS.tobytes()).hexdigest() == chain_child
    assert b(b"token-capture/prefix/v3\x00" + IDS.tobytes()).hexdigest() == cumulative
    assert b(b"token-capture/prefix/v3\x00").hexdigest() == cumulative_empty
    assert reference_digest(call_kwargs(), 3).hex() == digest_routes
    assert reference_digest(root_kwargs(), 3).hex() == digest_root
    # The field key is the keyed mode's: unkeyed BLAKE3 (version 2's hash) of a field differs.
    assert field_digest(IDS.tobytes()) != b(IDS.tobytes()).digest()
    assert len(FIELD_KEY) == 32


@pytest.mark.parametrize("routes_encoding", [0, 1, 2])
@pytest.mark.parametrize("sizes", [[1], [3, 1, 2], [0, 5, 0, 1], [2, 2, 2]])
def test_v3_digest_raw_equals_digest_of_fields_fed_in_uneven_updates(routes_encoding, sizes):
    rng = np.random.default_rng(sum(sizes) * 3 + routes_encoding)
    n = sum(sizes)
    ids = rng.integers(0, 2**40, n).astype("<i8")
    mask = (rng.random(n) < 0.5).astype("<f4")
    lps = (-rng.random(n)).astype("<f4")
    routes = None
    if routes_encoding:
        routes = rng.integers(0, 200, (n, 3, 2)).astype("<i2" if routes_encoding == 1 else "u1")
    header = H.digest_header(1, 3, b"roll", b"call", b"par", 4, n, 4 + n, 7, routes_encoding)
    chain, cum = rng.bytes(32), rng.bytes(32)
    raw_routes = None if routes is None else (3, 2, routes.tobytes())
    want = H.digest_raw(header, ids.tobytes(), mask.tobytes(), lps.tobytes(), raw_routes, chain, cum, 3)
    # Each field fed piece by piece, as a writer feeds tokens as they arrive (uneven
    # pieces, empty ones included), routes as whole tokens' bytes.
    states = [H.field_state(3) for _ in range(3 if routes is None else 4)]
    edges = np.cumsum([0] + sizes)
    for a, b in zip(edges[:-1], edges[1:]):
        states[0].update(ids[a:b].tobytes())
        states[1].update(memoryview(mask[a:b]).cast("B"))
        states[2].update(lps[a:b].tobytes())
        if routes is not None:
            states[3].update(routes[a:b].tobytes())
    fds = [s.digest() for s in states]
    for f, arr in zip(fds, (ids, mask, lps, routes)):
        assert f == field_digest(arr.tobytes())  # the independent F
    got = H.digest_of_fields(header, (8 * n, fds[0]), (4 * n, fds[1]), (4 * n, fds[2]),
                             None if routes is None else (3, 2, routes.nbytes, fds[3]), chain, cum, 3)
    assert got == want
    # And equal to the documented layout, written out independently.
    kw = dict(rollout_id="roll", model_call_id="call", parent_call_id="par", prev_len=4, delta_len=n, cum_len=4 + n,
              weight_version=7, token_ids=ids, token_mask=mask, logprobs=lps, routes_encoding=routes_encoding,
              routed_experts=routes, chain_hash=chain, cumulative_hash=cum)
    assert reference_digest(kw, 3) == got == H.digest(**kw, digest_version=3)


@pytest.mark.parametrize("v", [1, 2])
def test_inline_versions_have_no_field_digests(v):
    with pytest.raises(ValueError, match="no field digests"):
        H.field_state(v)


@pytest.mark.parametrize("bad", [0, 4, 0xFFFF, -1, None, "2"])
def test_unknown_digest_version_is_a_typed_rejection(bad):
    for call in (
        lambda: H.digest(**call_kwargs(), digest_version=bad),
        lambda: H.chain_hash(None, IDS, bad),
        lambda: H.cumulative_hash(IDS, bad),
        lambda: H.prefix_state(None, bad),
    ):
        with pytest.raises(UnsupportedDigest, match="digest_version"):
            call()


def test_digest_rejects_bad_routes():
    with pytest.raises(ValueError, match="routed_experts"):
        H.digest(**call_kwargs(routed_experts=None))
    with pytest.raises(ValueError, match="routed_experts"):
        H.digest(**call_kwargs(routed_experts=np.zeros((6, 4), np.int16)))


@pytest.mark.parametrize("v", VERSIONS)
def test_row_digest_equals_digest_of_fields(v):
    from tasks.schema import StagedRow

    kw = call_kwargs()
    row = StagedRow(digest=b"", digest_version=v, **kw)
    assert H.row_digest(row) == H.digest(**kw, digest_version=v)
    assert H.row_digest(row).hex() == KATS[v][4]
