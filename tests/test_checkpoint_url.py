"""Store checkpoints to any fsspec URL, against a real S3-compatible server.

One moto stand-alone server (a subprocess on 127.0.0.1, a free port, IAM authentication
on: only the test's access key signs requests) and one 2-worker process LocalCluster
per module. The credentials and the endpoint are set as ``AWS_*`` environment variables
BEFORE the cluster starts, so the worker processes (the storage units, who write their
own files) have them as the controller does. Backend-independent tests run on a local
directory and on ``s3://``; the finalizer's step journal on ``s3://`` too.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import dask
import fsspec
import numpy as np
import pytest
from distributed import Client

from pipeline.actors import workers_now
from pipeline.cluster import local_cluster
from pipeline.finalize.journal import JournalState, StepJournal
from pipeline.store import CheckpointCorrupt, CheckpointError, StagingStore
from pipeline.store import checkpoint as ck
from pipeline.store.location import Location, parse
from pipeline.store.location_lease import LEASE_NAME, Lease
from tasks.packed import pack_rows

from rollout_factory import make_group
from support import assert_rows_read_back, store_maker, wait_until
from test_store import make_rows  # noqa: E402  (tests/ is on sys.path under pytest)

pytestmark = pytest.mark.timeout(180)

BUCKET = "ckpt-bucket"
KEY_SETTING = "token-capture.store.checkpoint-key"
OPTIONS_SETTING = "token-capture.store.checkpoint-storage-options"
TIMEOUT_SETTING = "token-capture.store.checkpoint-lock-timeout-s"
PROBE_SETTING = "token-capture.store.checkpoint-probe-timeout-s"


# ---- the server, the environment, the cluster ------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: bytes) -> None:
    req = urllib.request.Request(url, data=body, method="POST", headers={"Content-Type": "text/plain"})
    urllib.request.urlopen(req, timeout=10).read()


@pytest.fixture(scope="module")
def moto_s3(tmp_path_factory):
    """A moto server on 127.0.0.1 with a bucket and one IAM user's key; authentication on."""
    import boto3

    port = _free_port()
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(endpoint), 60, "the moto server to answer")
        boot = dict(endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="boot", aws_secret_access_key="boot")
        iam = boto3.client("iam", **boot)
        iam.create_user(UserName="checkpointer")
        allow = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="checkpointer", PolicyName="all", PolicyDocument=json.dumps(allow))
        key = iam.create_access_key(UserName="checkpointer")["AccessKey"]
        iam.create_user(UserName="reader")  # may read the bucket, not write it
        read = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:GetObject", "s3:ListBucket"], "Resource": "*"}]}
        iam.put_user_policy(UserName="reader", PolicyName="read", PolicyDocument=json.dumps(read))
        reader = iam.create_access_key(UserName="reader")["AccessKey"]
        boto3.client("s3", **boot).create_bucket(Bucket=BUCKET)
        _post(f"{endpoint}/moto-api/reset-auth", b"0")  # from now on every request must be signed by a known key
        yield {"endpoint": endpoint, "key": key["AccessKeyId"], "secret": key["SecretAccessKey"],
               "reader": (reader["AccessKeyId"], reader["SecretAccessKey"])}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _answers(endpoint: str) -> bool:
    try:
        urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).read()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def s3_env(moto_s3, tmp_path_factory):
    """The test's credentials and endpoint as AWS_* variables (and no ~/.aws), restored after."""
    home = tmp_path_factory.mktemp("aws")
    env = {
        "AWS_ACCESS_KEY_ID": moto_s3["key"], "AWS_SECRET_ACCESS_KEY": moto_s3["secret"],
        "AWS_ENDPOINT_URL": moto_s3["endpoint"], "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(home / "config"), "AWS_SHARED_CREDENTIALS_FILE": str(home / "credentials"),
    }
    saved = {k: os.environ.get(k) for k in [*env, "AWS_SESSION_TOKEN", "AWS_PROFILE"]}
    for k in ("AWS_SESSION_TOKEN", "AWS_PROFILE"):
        os.environ.pop(k, None)
    os.environ.update(env)
    try:
        yield moto_s3
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def client(s3_env):
    """A 2-worker process LocalCluster started AFTER the AWS_* variables are set. Connects
    time out after 5 s (loopback answers at once): closing a store whose unit's worker was
    killed costs one connect to its old address."""
    with dask.config.set({"distributed.comm.timeouts.connect": "5s"}):
        with local_cluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
            with Client(cluster) as c:
                yield c


@pytest.fixture
def make(client, tmp_path):
    with store_maker(client, tmp_path / "spill") as maker:
        yield maker


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path, s3_env):
    """A fresh checkpoint location of each backend: a directory, or s3://bucket/<unique>."""
    if request.param == "local":
        return str(tmp_path / "ckpt")
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}/ckpt"


def raw(where: str) -> tuple:
    """(fsspec filesystem, root) to look at or damage a location behind the store's back."""
    if "://" not in where:
        return fsspec.filesystem("file"), where
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    return fs, where[len("s3://"):]


def listing(where: str) -> list[str]:
    """Every object under the location (relative names), sorted."""
    fs, root = raw(where)
    fs.invalidate_cache()
    found = fs.find(root) if fs.exists(root) else []
    return sorted(str(p)[len(root.rstrip("/")) + 1:] if "://" in where else os.path.relpath(p, root) for p in found)


def generations(where: str) -> set[str]:
    return {name.split("/")[0] for name in listing(where) if name.startswith("gen-")}


def edit_manifest(where: str, edit) -> None:
    """Edit the manifest and recompute its unkeyed digest: what anyone who can write there can do."""
    fs, root = raw(where)
    m = json.loads(fs.cat_file(f"{root}/{ck.MANIFEST}"))
    edit(m)
    m["manifest_sha256"] = ck._manifest_digest(m)
    fs.pipe_file(f"{root}/{ck.MANIFEST}", json.dumps(m).encode())


def total_rows(store) -> int:
    return sum(s["rows"] for s in store.stats())


def begun(store) -> int:
    """Checkpoints opened on the store's units so far (a save opens one before any write)."""
    return sum(s["checkpoints_begun"] for s in store.stats())


def saved(make, where, n=4, seed=0, prefix="r", chunk_bytes=4096):
    store = make(n_units=2)
    rows = make_rows(n, calls=2, tokens=48, seed=seed, prefix=prefix)
    assert not store.put_many(pack_rows(rows)).failed
    return store, store.checkpoint(where, chunk_bytes=chunk_bytes), rows


# ---- worker-side faults (run in each worker by client.run) -------------------------------


def _patch_writes(mode: str, after: int = 0) -> None:
    """Each unit's data-file writes through Location.write: ``fail`` raises after ``after``
    files (a crash mid-save), ``skip`` reports a file it never wrote, ``die`` ends the process."""
    real = getattr(Location, "_real_write", Location.write)
    count = {"n": 0}

    def write(self, name, buffers, *rest):
        count["n"] += 1
        if count["n"] > after:
            if mode == "fail":
                raise OSError(f"injected failure before writing {name}")
            if mode == "skip":
                return "0" * 64, 1
            if mode == "die":
                os._exit(1)
        return real(self, name, buffers, *rest)

    Location._real_write = real
    Location.write = write


def _heal_writes() -> None:
    Location.write = getattr(Location, "_real_write", Location.write)


# ---- save and restore, every backend -------------------------------------------------------


def test_save_and_restore_bit_for_bit(client, make, where, tmp_path):
    store, manifest, rows = saved(make, where, n=5)
    cut = make_rows(2, calls=1, tokens=40, routes=False, prefix="k", seed=9)
    assert not store.put_many(pack_rows(cut), partition="cut").failed
    manifest = store.checkpoint(where, chunk_bytes=4096)
    assert manifest["rows"] == len(rows) + 2 and len(manifest["files"]) > 2
    names = listing(where)
    assert ck.MANIFEST in names and all(f["file"] in names for f in manifest["files"])
    assert generations(where) == {manifest["generation"]}  # the first save's generation is gone
    fresh = StagingStore.from_checkpoint(client, where, n_units=1, spill_directory=str(tmp_path / "s2"))
    try:
        assert total_rows(fresh) == len(rows) + 2
        assert_rows_read_back(fresh, rows)
        got = fresh.get_many([r.staging_key for r in cut], partition="cut")
        assert not got.failed and [r.staging_key for r in cut] == got.batch.keys
    finally:
        fresh.close()


def test_a_save_failing_part_way_keeps_the_previous_checkpoint(client, make, where):
    store, first, rows = saved(make, where)
    later = make_rows(3, seed=2, prefix="late")
    assert not store.put_many(pack_rows(later)).failed
    client.run(_patch_writes, "fail", 1)  # each unit writes one file (one row each), then fails
    try:
        with pytest.raises(CheckpointError, match="previous checkpoint kept") as info:
            store.checkpoint(where, chunk_bytes=1)
    finally:
        client.run(_heal_writes)
    assert "injected failure" in str(info.value)
    assert ck.read_manifest(where)["generation"] == first["generation"]
    assert generations(where) == {first["generation"]}, "the failed save's files are removed"
    fresh = make(n_units=1)
    assert fresh.restore(where)["rows"] == len(rows) == total_rows(fresh)
    assert_rows_read_back(fresh, rows)


def test_no_manifest_names_a_file_the_controller_cannot_see(client, make, where):
    """A unit reports a file that is not at the location as the controller sees it (on
    several hosts: a local path each host has its own copy of): the save fails."""
    store, first, rows = saved(make, where)
    client.run(_patch_writes, "skip", 0)
    try:
        with pytest.raises(CheckpointError, match="as the controller sees it"):
            store.checkpoint(where, chunk_bytes=4096)
    finally:
        client.run(_heal_writes)
    manifest = ck.read_manifest(where)
    assert manifest["generation"] == first["generation"]
    assert set(f["file"] for f in manifest["files"]) <= set(listing(where))


def test_older_generations_go_only_after_the_manifest_reads_back(client, make, where, monkeypatch):
    store, first, rows = saved(make, where)
    real = Location.write

    def garbled(self, name, buffers, *rest):  # the manifest lands damaged (a broken put, a full disk)
        if name == ck.MANIFEST:
            data = bytearray(b"".join(bytes(b) for b in buffers))
            data[len(data) // 2] ^= 0x55
            buffers = [bytes(data)]
        return real(self, name, buffers, *rest)

    real_replace = Location.replace

    def garbled_replace(self, name, data, expected):  # the same on a conditional (S3) location
        return real_replace(self, name, garbled_bytes(data) if name == ck.MANIFEST else data, expected)

    def garbled_bytes(data: bytes) -> bytes:
        out = bytearray(data)
        out[len(out) // 2] ^= 0x55
        return bytes(out)

    monkeypatch.setattr(Location, "write", garbled)
    monkeypatch.setattr(Location, "replace", garbled_replace)
    with pytest.raises(CheckpointError, match="did not read back"):
        store.checkpoint(where, chunk_bytes=4096)
    monkeypatch.undo()
    assert first["generation"] in generations(where), "the older generation is kept"
    good = store.checkpoint(where, chunk_bytes=4096)  # the next save becomes current and cleans up
    assert generations(where) == {good["generation"]}
    fresh = make(n_units=1)
    assert fresh.restore(where)["rows"] == len(rows)


def test_one_corrupted_object_loads_nothing(make, where):
    store, manifest, rows = saved(make, where, n=4, chunk_bytes=1)  # one file per row
    fs, root = raw(where)
    victim = f"{root}/{manifest['files'][-1]['file']}"
    data = bytearray(fs.cat_file(victim))
    data[-7] ^= 0xFF
    fs.pipe_file(victim, bytes(data))
    fresh = make(n_units=2)
    with pytest.raises(CheckpointCorrupt, match=os.path.basename(victim)):
        fresh.restore(where)
    assert total_rows(fresh) == 0 and sum(s["puts"] for s in fresh.stats()) == 0


def test_signed_manifest_tampered_is_refused(make, where, tmp_path):
    key = tmp_path / "key.hex"
    key.write_text(bytes(range(32)).hex())
    with dask.config.set({KEY_SETTING: str(key)}):
        store, manifest, rows = saved(make, where)
        assert ck.read_manifest(where)[ck.HMAC_FIELD]
        edit_manifest(where, lambda m: m.update(rows=m["rows"] + 1))
        fresh = make(n_units=1)
        with pytest.raises(CheckpointCorrupt, match="signature does not match"):
            fresh.restore(where)
        assert total_rows(fresh) == 0


# ---- s3 only: names and sizes, the lease, the probe ---------------------------------------


def s3_where() -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}/ckpt"


BAD_NAMES = ["../outside.tcb", "{gen}/../outside.tcb", "gen-other/u000-staging-00000.tcb",
             "{gen}/sub/u000-staging-00000.tcb", "{gen}/%2e%2e.tcb", "/{gen}/u000-staging-00000.tcb"]


def test_s3_manifest_entry_with_a_bad_name_is_refused(make, s3_env):
    where = s3_where()
    saved(make, where)
    fs, root = raw(where)
    original = fs.cat_file(f"{root}/{ck.MANIFEST}")
    fresh = make(n_units=1)
    for name in BAD_NAMES:
        fs.pipe_file(f"{root}/{ck.MANIFEST}", original)
        edit_manifest(where, lambda m: m["files"][0].update(file=name.format(gen=m["generation"])))
        with pytest.raises(CheckpointCorrupt, match="file name"):
            fresh.restore(where)
        assert total_rows(fresh) == 0, name


def test_s3_object_larger_than_its_manifest_entry_is_refused_unread(make, s3_env):
    where = s3_where()
    store, manifest, rows = saved(make, where)
    edit_manifest(where, lambda m: m["files"][0].update(bytes=m["files"][0]["bytes"] - 1))
    fresh = make(n_units=1)
    with pytest.raises(CheckpointCorrupt, match="refused unread"):
        fresh.restore(where)
    assert total_rows(fresh) == 0


def test_s3_lease_is_a_conditional_create(s3_env):
    loc = parse(s3_where())
    first, second = Lease(loc, 600), Lease(loc, 600)
    first.acquire(0)
    with pytest.raises(CheckpointError, match=f"leased by {first.owner}"):
        second.acquire(0.2)
    first.check()
    first.release()
    second.acquire(0)
    with pytest.raises(CheckpointError, match="lost its lease"):
        first.check()
    second.release()
    assert not loc.exists(LEASE_NAME)


def test_s3_save_waits_for_a_held_lease_then_fails_naming_its_holder(make, s3_env):
    where = s3_where()
    store, first, rows = saved(make, where)
    fs, root = raw(where)
    holder = {"owner": "trainer-7:4242:abc", "acquired_unix_s": time.time(), "expires_unix_s": time.time() + 600}
    fs.pipe_file(f"{root}/{LEASE_NAME}", json.dumps(holder).encode())
    opened = begun(store)
    with dask.config.set({TIMEOUT_SETTING: 0.3}):
        with pytest.raises(CheckpointError, match="leased by trainer-7:4242:abc") as info:
            store.checkpoint(where)
    assert "\n" not in str(info.value)
    assert begun(store) == opened, "no unit opened the checkpoint"
    assert ck.read_manifest(where)["generation"] == first["generation"]
    # A lease past its expiry (its save died) is taken over.
    fs.pipe_file(f"{root}/{LEASE_NAME}", json.dumps(dict(holder, expires_unix_s=time.time() - 1)).encode())
    with dask.config.set({TIMEOUT_SETTING: 0.3}):
        newer = store.checkpoint(where)
    assert ck.read_manifest(where)["generation"] == newer["generation"]
    assert LEASE_NAME not in listing(where), "released after the save"


def test_s3_two_saves_to_one_location_run_one_at_a_time(make, s3_env):
    where = s3_where()
    store, first, rows = saved(make, where)
    results: list = []

    def one() -> None:
        try:
            results.append(store.checkpoint(where, chunk_bytes=4096))
        except Exception as e:  # noqa: BLE001 (reported below)
            results.append(e)

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(isinstance(r, dict) for r in results), results
    current = ck.read_manifest(where)
    assert current["generation"] in {r["generation"] for r in results}
    assert generations(where) == {current["generation"]}
    assert set(f["file"] for f in current["files"]) <= set(listing(where))


def _dead_endpoint() -> tuple[socket.socket, str]:
    """A port bound on 127.0.0.1 that listens to nobody: connections are refused."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s, f"http://127.0.0.1:{s.getsockname()[1]}"


def _hung_endpoint() -> tuple[socket.socket, str]:
    """A port that accepts connections (the kernel's backlog) and never answers."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    return s, f"http://127.0.0.1:{s.getsockname()[1]}"


BAD_URL_CASES = ["unknown-protocol", "backend-missing", "private-memory", "unreachable", "hung", "wrong-secret",
                 "unknown-key", "read-only", "no-bucket"]


def _bad_case(case: str, where: str, s3_env: dict) -> tuple:
    """(URL, settings, words its one-line error must hold, socket to close or None)."""
    settings: dict = {PROBE_SETTING: 30.0}
    if case == "unknown-protocol":
        return "nope://bucket/ckpt", settings, "unknown protocol 'nope'", None
    if case == "backend-missing":  # gcsfs is not installed here (checked by the test)
        return "gcs://bucket/ckpt", settings, "backend for gcs:// is not installed", None
    if case == "private-memory":
        return "memory://ckpt", settings, "private to each process", None
    if case == "no-bucket":
        return f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/ckpt", settings, "does not exist", None
    if case == "unreachable":
        sock, endpoint = _dead_endpoint()
        settings[OPTIONS_SETTING] = {"endpoint_url": endpoint, "config_kwargs": {"retries": {"max_attempts": 1}}}
        return where, settings, "cannot be reached", sock
    if case == "hung":
        sock, endpoint = _hung_endpoint()
        settings.update({OPTIONS_SETTING: {"endpoint_url": endpoint}, PROBE_SETTING: 1.0})
        return where, settings, "did not answer within 1 s", sock
    if case == "read-only":  # good credentials that may not write there
        settings[OPTIONS_SETTING] = dict(zip(("key", "secret"), s3_env["reader"]))
        return where, settings, "refused access", None
    key = s3_env["key"] if case == "wrong-secret" else "AKIAUNKNOWNUNKNOWN00"
    settings[OPTIONS_SETTING] = {"key": key, "secret": "not-the-secret"}
    return where, settings, "refused access", None


def test_bad_url_fails_in_one_line_before_any_unit_writes(make, s3_env):
    """Each bad location fails the save with one line naming the URL and the fix, before
    any unit opened the checkpoint; the previous checkpoint there stays current."""
    import importlib.util

    assert importlib.util.find_spec("gcsfs") is None, "the backend-missing case needs gcsfs absent"
    where = s3_where()
    store, first, rows = saved(make, where)
    before, opened = listing(where), begun(store)
    for case in BAD_URL_CASES:
        target, settings, words, sock = _bad_case(case, where, s3_env)
        try:
            with dask.config.set(settings):
                with pytest.raises(CheckpointError) as info:
                    store.checkpoint(target)
        finally:
            if sock is not None:
                sock.close()
        message = str(info.value)
        assert words in message and "\n" not in message, (case, message)
        assert repr(target) in message, (case, message)
        assert begun(store) == opened, f"{case}: no unit opened (or wrote) the checkpoint"
        assert listing(where) == before, case
    assert ck.read_manifest(where)["generation"] == first["generation"]
    fresh = make(n_units=1)
    with dask.config.set({OPTIONS_SETTING: {"key": s3_env["key"], "secret": "not-the-secret"}}):
        with pytest.raises(CheckpointError, match="refused access") as info:
            fresh.restore(where)  # a restore too: one line, before any task runs
    assert "\n" not in str(info.value) and repr(where) in str(info.value)
    assert fresh.restore(where)["rows"] == len(rows)


# ---- last: a storage worker dies mid-save (its nanny restarts it) ------------------------


def test_s3_unit_killed_mid_save_leaves_no_manifest_naming_missing_files(client, make, s3_env):
    where = s3_where()
    store, first, rows = saved(make, where)
    victim = store.placement.workers[0]
    client.run(_patch_writes, "die", 0, workers=[victim])  # its first file: the process exits
    try:
        with pytest.raises(CheckpointError, match="previous checkpoint kept"):
            store.checkpoint(where, chunk_bytes=1)
    finally:
        workers = lambda: workers_now(client)  # noqa: E731
        wait_until(lambda: victim not in workers() and len(workers()) == 2, 60, "the killed worker's restart")
        client.run(_heal_writes)
    manifest = ck.read_manifest(where)
    assert manifest["generation"] == first["generation"]
    fs, root = raw(where)
    for entry in manifest["files"]:
        assert fs.size(f"{root}/{entry['file']}") == entry["bytes"]
    store.close()  # its lost unit's old address answers nobody: one connect timeout (the module's 5 s)
    fresh = make(n_units=2)
    assert fresh.restore(where)["rows"] == len(rows)
    assert_rows_read_back(fresh, rows)


# ---- the location's own rules (no cluster) ---------------------------------------------------


def test_location_parsing_and_names(tmp_path):
    assert parse(str(tmp_path / "a")).local and parse(f"file://{tmp_path}/a").root == str(tmp_path / "a")
    assert parse(str(tmp_path / "odd://name")).local, "a path holding '://' further on stays a path"
    with pytest.raises(CheckpointError, match="chained"):
        parse("simplecache::s3://bucket/x")
    with pytest.raises(CheckpointError, match="needs a bucket"):
        parse("s3://", options={})
    loc = parse("s3://bucket/prefix/", options={})
    assert (loc.protocol, loc.root, loc.path("gen-1/u.tcb")) == ("s3", "bucket/prefix", "bucket/prefix/gen-1/u.tcb")
    for bad in ["../x.tcb", "gen-1/../../x.tcb", "a//b", "/abs", "gen-1/./x", "x\\y", "x\x00"]:
        with pytest.raises(CheckpointError, match="not a plain relative name"):
            loc.path(bad)


def test_s3_root_that_fsspec_would_glob_or_split_is_refused(s3_env):
    """fsspec globs ``*``, ``?`` and ``[`` in removes (``[1]`` matches only ``1``, ``*``
    anything), s3fs reads ``?`` as a version id, and an empty part lists empty: such a
    root would never release its lease, or release another location's, or write every
    object to one key. Each is refused in one line naming the URL; ``S3://`` is ``s3://``."""
    other = parse(f"s3://{BUCKET}/aXb/ckpt", options={})
    assert other.create(LEASE_NAME, json.dumps({"owner": "other-save", "expires_unix_s": None}).encode())
    for bad in [f"s3://{BUCKET}/a*b/ckpt", f"s3://{BUCKET}/run[1]/ckpt", f"s3://{BUCKET}/x?versionId=3",
                f"s3://{BUCKET}//ckpt", f"s3://{BUCKET}/a//ckpt"]:
        with pytest.raises(CheckpointError, match="refused") as info:
            Lease(parse(bad, options={}), 600).acquire(0)
        assert repr(bad) in str(info.value) and "\n" not in str(info.value), bad
    assert other.read(LEASE_NAME, 1 << 10, None, CheckpointError), "another location's lease is never touched"
    other.remove(LEASE_NAME)
    upper = parse(f"S3://{BUCKET}/up/ckpt", options={})
    assert (upper.protocol, upper.root) == ("s3", f"{BUCKET}/up/ckpt")


def test_storage_options_and_probe_timeout_settings_are_checked(tmp_path):
    from pipeline.store.location_probe import probe_timeout_s

    with dask.config.set({OPTIONS_SETTING: "key=abc"}):
        with pytest.raises(CheckpointError, match="checkpoint-storage-options must be null or a mapping"):
            parse("s3://bucket/x")
    with dask.config.set({OPTIONS_SETTING: {"endpoint_url": "http://127.0.0.1:1"}}):
        assert parse("s3://bucket/x").options == {"endpoint_url": "http://127.0.0.1:1"}
        assert "127.0.0.1:1" not in repr(parse("s3://bucket/x")), "options (credentials) never in the repr"
    for value in (0, -1, "soon", None):
        with dask.config.set({PROBE_SETTING: value}):
            with pytest.raises(CheckpointError, match="checkpoint-probe-timeout-s must be"):
                probe_timeout_s()


def test_s3_a_save_paused_past_its_lease_cannot_overwrite_the_next_saves_manifest(make, s3_env, monkeypatch):
    # Save A passes its lease check, then stalls until its lease expires; save B takes the
    # expired lease, saves and removes A's generation. A then resumes: its manifest write is
    # conditional on the manifest A saw when it took its lease, so it fails instead of
    # overwriting B's; B's checkpoint stays current and restorable.
    import threading
    import time as _time

    from pipeline.store import checkpoint as ck

    where = s3_where()
    with dask.config.set({"token-capture.store.checkpoint-lease-s": 3}):
        store, first, rows = saved(make, where)
        paused, resume = threading.Event(), threading.Event()
        real = ck._write_sequenced

        def slow(*args, **kwargs):
            if threading.current_thread().name == "A":  # A passed its lease check, then stalls
                paused.set()
                resume.wait(60)
            return real(*args, **kwargs)

        monkeypatch.setattr(ck, "_write_sequenced", slow)
        out = {}

        def a():
            try:
                out["a"] = store.checkpoint(where)
            except Exception as e:  # noqa: BLE001 - reported below
                out["a"] = e

        t = threading.Thread(target=a, name="A")
        t.start()
        assert paused.wait(60)
        _time.sleep(3.5)  # A's lease expires while it stalls
        out["b"] = store.checkpoint(where)  # B takes the expired lease, saves, removes A's generation
        resume.set()
        t.join(60)
    assert isinstance(out["a"], CheckpointError) and "another save" in str(out["a"]), out["a"]
    current = ck.read_manifest(where)
    assert current["generation"] == out["b"]["generation"]
    fs, root = raw(where)
    fs.invalidate_cache()
    assert all(fs.exists(f"{root}/{e['file']}") for e in current["files"])


def test_a_step_journal_on_s3_records_replaces_and_forgets(s3_env):
    """The finalizer's step journal at an ``s3://`` URL on the same server: a step's
    receipts, then the keys its clear owes, then nothing (pipeline/finalize/journal.py)."""
    where = f"s3://{BUCKET}/{uuid.uuid4().hex[:10]}/journal"
    receipts = {"g0": [b.receipt for b in make_group(np.random.default_rng(3), "jr0", 2, n_calls=2)]}
    journal = StepJournal(where)
    journal.submitted("s0", receipts, trainer_version=7)
    journal.submitted("s1", receipts, trainer_version=None)
    state = StepJournal(where).read()  # as a replacement controller reads it
    assert [s.step_id for s in state.steps] == ["s0", "s1"] and state.steps[0].trainer_version == 7
    assert state.steps[0].groups["g0"] == [r.to_dict() for r in receipts["g0"]]
    journal.delivered("s0", ["jr0-r0/c0", "jr0-r0/c1"])
    state = StepJournal(where).read()
    assert [s.step_id for s in state.steps] == ["s1"] and state.owed == {"s0": ["jr0-r0/c0", "jr0-r0/c1"]}
    journal.cleared(["s0"])
    journal.delivered("s1", [])
    assert StepJournal(where).read() == JournalState([], {}, [])
