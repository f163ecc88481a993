"""The pipeline on a TLS cluster.

Certificates are made here with the ``openssl`` CLI (a throwaway CA and one node
certificate for 127.0.0.1, used by scheduler, workers and client). On a
``LocalCluster(protocol="tls://", security=...)`` the store, a finalization step, a
checkpoint cut by a GenerationWorker, coalesced restores and a bit-identical resume all
run; clients without the certificate (none, CA only, another CA's, plain tcp) cannot
connect.
"""
from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess

import numpy as np
import pytest
from distributed import Client
from distributed.comm import connect
from distributed.security import Security
from rollout_factory import make_group
from support import resume_and_compare

from pipeline.actors import workers_now
from pipeline.cluster import local_cluster
from pipeline.finalize import Finalizer
from pipeline.generation.worker import GenerationWorker
from pipeline.restore.batcher import start_batchers
from pipeline.store import StagingStore
from tasks import reasons as R
from tasks.packed import pack_rows

pytestmark = [
    pytest.mark.usefixtures("keep_staged_rows"),
    pytest.mark.timeout(180),
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI to make certificates"),
]




VOCAB, L, K, E = 64, 2, 2, 8


def make_ca(d, name: str) -> tuple[str, str]:
    key, cert = str(d / f"{name}.key"), str(d / f"{name}.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", key, "-out", cert, "-days", "2", "-subj", f"/CN={name}",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        check=True, capture_output=True,
    )
    return key, cert


def make_node(d, ca_key: str, ca_cert: str, name: str) -> tuple[str, str]:
    key, csr, cert, ext = (str(d / f"{name}{s}") for s in (".key", ".csr", ".pem", ".ext"))
    subprocess.run(
        ["openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", key, "-out", csr, "-subj", "/CN=localhost"],
        check=True, capture_output=True,
    )
    with open(ext, "w") as fh:
        fh.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
                 "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n")
    subprocess.run(
        ["openssl", "x509", "-req", "-in", csr, "-CA", ca_cert, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "2", "-extfile", ext],
        check=True, capture_output=True,
    )
    return key, cert


def security(ca: str, key: str | None, cert: str | None) -> Security:
    kw = {}
    if cert is not None:
        kw = dict(tls_client_key=key, tls_client_cert=cert, tls_scheduler_key=key, tls_scheduler_cert=cert,
                  tls_worker_key=key, tls_worker_cert=cert)
    return Security(tls_ca_file=ca, require_encryption=True, **kw)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    ca_key, ca = make_ca(d, "tc-ca")
    key, cert = make_node(d, ca_key, ca, "node")
    rogue_ca_key, rogue_ca = make_ca(d, "rogue-ca")
    rogue_key, rogue_cert = make_node(d, rogue_ca_key, rogue_ca, "rogue")
    return {"ca": ca, "key": key, "cert": cert, "rogue_ca": rogue_ca, "rogue_key": rogue_key, "rogue_cert": rogue_cert}


@pytest.fixture(scope="module")
def tls_cluster(certs):
    sec = security(certs["ca"], certs["key"], certs["cert"])
    with local_cluster(
        n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0", protocol="tls://", security=sec
    ) as cluster, Client(cluster, security=sec) as client:
        yield cluster, client


def test_pipeline_runs_over_tls(tls_cluster, tmp_path):
    cluster, client = tls_cluster
    assert cluster.scheduler_address.startswith("tls://")
    workers = workers_now(client)
    assert len(workers) == 2 and all(a.startswith("tls://") for a in workers)

    store = StagingStore.start(client, n_units=2, memory_limit="16KiB", spill_directory=str(tmp_path / "spill"))
    try:
        assert all(a.startswith("tls://") for a in store.unit_workers)
        # Stage and finalize one step (union fetch + routes fetch + verify + assemble).
        rng = np.random.default_rng(0)
        groups = {f"g{g}": make_group(rng, f"g{g}", 4, rollout_prefix=f"tls{g}", n_calls=3, routes=(L, K, E), vocab_size=VOCAB) for g in range(2)}
        assert not store.put_many(pack_rows([r for bs in groups.values() for b in bs for r in b.rows])).failed
        fin = Finalizer(client, store, vocab_size=VOCAB, num_experts=E)
        step = fin.submit_step({g: [b.receipt for b in bs] for g, bs in groups.items()}).result(timeout=60)
        assert all(step.groups[g].status == [R.OK] * 4 for g in groups)
        assert sum(s["spilled_bytes"] for s in store.stats()) > 0

        # Store checkpoint and restore over TLS.
        manifest = store.checkpoint(str(tmp_path / "ckpt"))
        copy = StagingStore.from_checkpoint(client, str(tmp_path / "ckpt"), n_units=1, spill_directory=str(tmp_path / "spill2"))
        try:
            assert sum(s["rows"] for s in copy.stats()) == manifest["rows"] > 0
        finally:
            copy.close()

        # Cut mid-generation, restore through the coalescing batchers, resume bit-identically.
        batchers = start_batchers(client, store)
        addr = sorted(batchers)[0]
        policy = {"vocab-size": 64, "hidden": 16, "layers": 2, "experts": 4, "top-k": 2, "seed": 0, "window": 8}
        gen = client.submit(GenerationWorker, store, policy=policy, actor=True, workers=[addr]).result()
        specs = [{"rollout_id": f"tls-gen{i}", "model_call_id": "c0", "context": list(range(1 + i, 9 + i)), "max_new_tokens": 16} for i in range(2)]
        gen.start_calls(specs).result()
        gen.step(5).result()
        receipt = gen.checkpoint_cut("tls-ck").result()
        acks = {a.call: a for a in receipt.durable}
        assert len(acks) == 2
        verdicts = batchers[addr].restore_many(list(acks.values()), vocab_size=64, num_experts=4).result()
        resume_and_compare(client, store, gen, specs, verdicts, acks, policy=policy, worker=addr, max_new_tokens=16, rounds=20)
    finally:
        store.close()


@pytest.mark.parametrize("who", ["ca-only", "rogue-cert", "plain-tcp"])
def test_client_without_the_certificate_cannot_connect(tls_cluster, certs, who):
    cluster, client = tls_cluster
    addr = cluster.scheduler_address
    if who == "ca-only":
        # Trusts the cluster's CA but presents no certificate (distributed's own Security
        # will not even build such a context, so use the ssl module directly).
        ctx = ssl.create_default_context(cafile=certs["ca"])
        ctx.check_hostname = False
        with pytest.raises(OSError):
            asyncio.run(connect(addr, timeout=3, ssl_context=ctx))
        assert len(workers_now(client)) == 2
        return
    if who == "rogue-cert":  # a certificate from another CA
        kw = dict(address=addr, security=security(certs["rogue_ca"], certs["rogue_key"], certs["rogue_cert"]))
    else:  # no TLS at all, to the same port
        kw = dict(address="tcp://" + addr.split("://", 1)[1])
    with pytest.raises((OSError, TimeoutError)):
        with Client(timeout="3s", **kw) as c:
            c.scheduler_info()
    # The cluster is unaffected and still serves its own client.
    assert len(workers_now(client)) == 2
