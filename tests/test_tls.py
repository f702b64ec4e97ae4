"""Mutual TLS on peer links and https to etcd ([cluster] tls_cert, tls_key, tls_ca): the config rules, links in
one process on both event loops (frames and payloads intact, another CA refused, TLS and plain refuse each
other), and real node servers: a job over TLS links with etcd over https and client certificates gives the
batches of one plain node; nodes with a foreign certificate or without TLS get no link, and the logs say why."""

from __future__ import annotations

import asyncio
import logging
import shutil
import ssl
from pathlib import Path

import pytest

from msdata_server.cluster.net.etcd import Etcd, EtcdError
from msdata_server.cluster.net.peers import AuthError, PeerLink, PeerServer
from msdata_server.cluster.net.tls import etcd_context, peer_tls
from msdata_server.config import parse_config
from msdata_server.errors import ConfigError, PeerLostError

from .cluster_util import run_spread, spread
from .e2e_util import run_ranks, small_job
from .etcd_fixture import EtcdServer
from .pki import CA, Cert, need_openssl
from .polling import wait_for

TOKEN = "t" * 32


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, Cert]:
    """The cluster's CA and a certificate per node (and for etcd); ``foreign``: from another CA."""
    need_openssl()
    base = tmp_path_factory.mktemp("pki")
    ca, other = CA(base / "ca"), CA(base / "other", name="someone-else")
    certs = {name: ca.issue(name) for name in ("node-0", "node-1", "node-2", "node-3", "etcd")}
    certs["foreign"] = other.issue("foreign")
    return certs


def contexts(c: Cert):
    return peer_tls(str(c.cert), str(c.key), str(c.ca))


# ---- configuration -----------------------------------------------------------------------------------------
def _doc(**tls: str) -> dict:
    return {"cluster": {"etcd": ["http://127.0.0.1:2379"], "token_file": "token", **tls}}


def test_tls_keys_are_set_together_and_resolve_against_the_config_dir(tmp_path):
    with pytest.raises(ConfigError, match=r"tls_cert set without tls_key, tls_ca: mutual TLS needs"):
        parse_config(_doc(tls_cert="n.pem"))
    with pytest.raises(ConfigError, match=r"tls_cert, tls_ca set without tls_key"):
        parse_config(_doc(tls_cert="n.pem", tls_ca="ca.pem"))
    with pytest.raises(ConfigError, match=r"tls_key = 3 must be a path"):
        parse_config(_doc(tls_key=3))  # type: ignore[arg-type]
    cc = parse_config(_doc(tls_cert="n.pem", tls_key="/k/n.key", tls_ca="ca.pem"), base_dir=str(tmp_path)).cluster
    assert cc is not None
    assert cc.tls
    assert (cc.tls_cert, cc.tls_key, cc.tls_ca) == (str(tmp_path / "n.pem"), "/k/n.key", str(tmp_path / "ca.pem"))
    plain = parse_config(_doc()).cluster
    assert plain is not None
    assert not plain.tls


def test_tls_files_must_exist_load_and_keep_the_key_private(pki, tmp_path):
    c = pki["node-0"]
    with pytest.raises(ConfigError, match=r"cannot read \[cluster\] tls_ca '/nonexistent/ca.pem': No such file"):
        peer_tls(str(c.cert), str(c.key), "/nonexistent/ca.pem")
    key = tmp_path / "open.key"
    shutil.copy(c.key, key)
    key.chmod(0o640)
    with pytest.raises(ConfigError, match=r"tls_key .* has mode 0640: group or others may read it; run `chmod 600"):
        peer_tls(str(c.cert), str(key), str(c.ca))
    with pytest.raises(ConfigError, match=r"tls_key .* has mode 0640"):
        etcd_context(str(c.cert), str(key), str(c.ca))
    with pytest.raises(ConfigError, match=r"do not load: .*a PEM certificate"):
        peer_tls(str(c.ca), str(c.key), str(c.ca))  # the CA's certificate is not the key's
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=r"tls_ca .* does not load"):
        peer_tls(str(c.cert), str(c.key), str(bad))


# ---- links in one process ----------------------------------------------------------------------------------
async def _server(tls: ssl.SSLContext | None, got: list) -> tuple[PeerServer, int]:
    async def handler(peer: str, frame: dict, payload: memoryview | None) -> None:
        got.append((peer, frame, None if payload is None else bytes(payload)))

    srv = PeerServer(token=TOKEN, node_id="srv", handler=handler, tls=tls)
    return srv, await srv.start()


def test_tls_link_carries_frames_and_payloads_intact(pki, arun):
    a, b = contexts(pki["node-0"]), contexts(pki["node-1"])
    blob = bytes(range(256)) * (12 << 10) + b"tail"  # 3 MiB and a bit: several CHUNKs, not a multiple of one

    async def main():
        got: list = []
        srv, port = await _server(a.server, got)
        link = await PeerLink.connect("127.0.0.1", port, token=TOKEN, node_id="cli", tls=b.client)
        assert link.authenticated
        assert link.peer_id == "srv"
        assert link.tls_version == "TLSv1.3"
        await link.send({"t": "hi", "n": 1})
        await link.send_payload({"t": "blob"}, blob)
        await link.send({"t": "bye"})
        await asyncio.wait_for(_until(lambda: len(got) == 3), 10)
        assert got == [("cli", {"t": "hi", "n": 1}, None), ("cli", {"t": "blob", "nbytes": len(blob)}, blob),
                       ("cli", {"t": "bye"}, None)]  # fmt: skip
        assert srv.links["cli"].tls_version == "TLSv1.3"
        assert link.traffic.bytes_out > len(blob)  # counted in plaintext, as on a plain link
        await link.aclose()
        await srv.aclose()

    arun(main())


async def _until(cond) -> None:
    while not cond():  # noqa: ASYNC110  (polls another process's state)
        await asyncio.sleep(0.01)


def test_a_certificate_of_another_ca_is_refused_both_ways(pki, arun, caplog):
    a, foreign = contexts(pki["node-0"]), contexts(pki["foreign"])
    c = pki["foreign"]
    # trusts our CA but presents its own CA's certificate: TLS 1.3 lets it finish its half; our server refuses
    trusting = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    trusting.check_hostname = False
    trusting.load_cert_chain(c.cert, c.key)
    trusting.load_verify_locations(pki["node-0"].ca)

    async def main():
        srv, port = await _server(a.server, [])
        with pytest.raises(AuthError, match=r"the TLS handshake failed: .*CERTIFICATE_VERIFY_FAILED.*tls_ca"):
            await PeerLink.connect("127.0.0.1", port, token=TOKEN, node_id="cli", tls=foreign.client)
        with pytest.raises(PeerLostError, match=r"after TLS was up: .* refuses our certificate"):
            await PeerLink.connect("127.0.0.1", port, token=TOKEN, node_id="cli", tls=trusting)
        await asyncio.wait_for(_until(lambda: "unable to get local issuer" in caplog.text), 10)
        assert not srv.links
        await srv.aclose()

    with caplog.at_level(logging.WARNING, logger="msdata_server.cluster.net.peers"):
        arun(main())
    refused = [r.getMessage() for r in caplog.records if "srv<->unauthenticated" in r.getMessage()]
    assert any("127.0.0.1:" in m and "the TLS handshake failed" in m for m in refused), refused


def test_tls_and_plain_sides_refuse_each_other(pki, arun, caplog):
    a = contexts(pki["node-0"])

    async def main():
        tls_srv, tls_port = await _server(a.server, [])
        plain_srv, plain_port = await _server(None, [])
        with pytest.raises(AuthError, match=r"refused us: this node requires TLS on peer links: set \[cluster\] tls_"):
            await PeerLink.connect("127.0.0.1", tls_port, token=TOKEN, node_id="plain-one")
        with pytest.raises(AuthError, match=r"refused us: this node has no TLS on peer links"):
            await PeerLink.connect("127.0.0.1", plain_port, token=TOKEN, node_id="tls-one", tls=a.client)
        assert not tls_srv.links
        assert not plain_srv.links
        await tls_srv.aclose()
        await plain_srv.aclose()

    with caplog.at_level(logging.WARNING, logger="msdata_server.cluster.net.peers"):
        arun(main())
    text = caplog.text
    assert "(node 'plain-one') speaks without TLS ('hello'), but this node requires TLS" in text
    assert "asks for TLS, but this node has no [cluster] tls_cert, tls_key and tls_ca" in text


# ---- node servers ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def etcd_https(pki, tmp_path_factory):
    """etcd serving https only and requiring a client certificate of the cluster's CA."""
    srv = EtcdServer(tmp_path_factory.mktemp("etcd-https"), tls=pki["etcd"]).start()
    yield srv
    srv.stop()


def _with_tls(c, certs: dict[str, Cert | None]):
    """Give each node of a Cluster its certificate (None: plain links) by appending to its [cluster] table."""
    for nid, cert in certs.items():
        if cert is not None:
            cfg = Path(c.nodes[nid].config)
            cfg.write_text(cfg.read_text() + cert.toml())
    return c


def test_etcd_over_https_needs_our_client_certificate(pki, etcd_https, arun):
    c = pki["node-0"]

    async def main():
        async with Etcd([etcd_https.url], ssl=etcd_context(str(c.cert), str(c.key), str(c.ca))) as etcd:
            await etcd.put("/tls-probe", "ok")
            assert [kv.value for kv in await etcd.get("/tls-probe")] == [b"ok"]
        no_cert = ssl.create_default_context(cafile=str(c.ca))  # trusts etcd, presents nothing
        async with Etcd([etcd_https.url], ssl=no_cert, timeout=2) as etcd:
            with pytest.raises(EtcdError, match=r"(?i)certificate"):
                await etcd.put("/tls-probe", "no")

    arun(main())


def test_job_over_tls_links_and_https_etcd_gives_the_batches_of_one_plain_node(
    pki, etcd_https, cluster_factory, server_factory
):
    spec = small_job("tls", dp=3, tp=2, samples=300, seed=11)
    n = 3 * spec.micro_batches
    want = run_ranks(spec, server_factory().start().socket, n)

    c = _with_tls(cluster_factory(etcd_https.url), {f"node-{i}": pki[f"node-{i}"] for i in range(3)}).start()
    wait_for(lambda: c.settled(set(c.nodes)), 60, "one leader, every node linked to every other over TLS")
    got = run_spread(c, spec, n, spread(spec.mesh.world_size))
    for r in range(spec.mesh.world_size):
        assert got[r] == want[r], f"rank {r} got other batches over TLS links than on one node"
    sts = c.statuses()
    assert all(st["cluster"]["tls"] for st in sts.values())
    assert sum(st["cluster"]["traffic"]["bytes_in"] for st in sts.values()) > 0
    assert "plain http although tls_* are set" not in c.nodes["node-0"].log()


def test_nodes_with_a_foreign_certificate_or_without_tls_get_no_link(pki, etcd_server, cluster_factory):
    certs = {"node-0": pki["node-0"], "node-1": pki["node-1"], "node-2": pki["foreign"], "node-3": None}
    c = _with_tls(cluster_factory(etcd_server.url, n=4), certs).start()
    every = set(c.nodes)

    def refused() -> bool:
        logs = {nid: srv.log() for nid, srv in c.nodes.items()}
        return (
            "cannot link to peer node-2 at" in logs["node-0"]
            and "CERTIFICATE_VERIFY_FAILED" in logs["node-0"]
            and "cannot link to peer node-3 at" in logs["node-0"]
            and "this node has no TLS on peer links" in logs["node-0"]
            and "cannot link to peer node-0 at" in logs["node-3"]
            and "this node requires TLS on peer links" in logs["node-3"]
            and "(node 'node-3') speaks without TLS" in logs["node-1"]
        )

    wait_for(lambda: all(set(st["cluster"]["members"]) == every for st in c.statuses().values()), 60, "4 members")
    wait_for(refused, 60, "log lines naming the refused peers")
    wait_for(lambda: {nid: st["cluster"]["links"] for nid, st in c.statuses().items()}.get("node-0") == ["node-1"],
             30, "the two good nodes linked")  # fmt: skip
    sts = c.statuses()
    assert sts["node-1"]["cluster"]["links"] == ["node-0"]
    assert sts["node-2"]["cluster"]["links"] == []
    assert sts["node-3"]["cluster"]["links"] == []
    assert sts["node-2"]["cluster"]["incoming"] == []
    assert sts["node-3"]["cluster"]["incoming"] == []
    assert "plain http although tls_* are set" in c.nodes["node-0"].log()
    assert TOKEN not in c.nodes["node-0"].log()
    assert c.token_file.read_text() not in c.nodes["node-0"].log()
