"""The control plane's store against a real etcd: key-value, leases reaching watchers, watches that
survive an etcd restart, compare-and-swap, leader election failover, job isolation, event log,
TLS with client certificates and user/password auth."""

from __future__ import annotations

import json
import logging
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from megascale.controller.election import Election
from megascale.controller.events import EventLog, read_events
from megascale.etcd.keys import JobKeys
from megascale.etcd.server import EmbeddedEtcd, EtcdStartError
from megascale.etcd.store import (
    Get,
    LeaseNotFound,
    Put,
    Store,
    StoreConfig,
    StoreError,
    StoreUnavailable,
    missing,
    value_is,
)
from megascale.messages import Event

logger = logging.getLogger(__name__)


def drain(watch, n, timeout=5.0):
    """The next ``n`` events of ``watch`` (fails if they do not come within ``timeout``)."""
    events, deadline = [], time.monotonic() + timeout
    while len(events) < n:
        event = watch.get(timeout=max(deadline - time.monotonic(), 0.01))
        assert event is not None, f"got {len(events)} of {n} events: {events}"
        events.append(event)
    return events


def test_put_get_prefix_delete(store, job):
    rev = store.put(job.node("n0"), {"host": "h0", "nproc": 2})
    store.put(job.node("n1"), "plain text")
    store.put(job.node("n2"), b"\x00\xffbytes")
    kv = store.get(job.node("n0"))
    assert kv.json() == {"host": "h0", "nproc": 2} and kv.mod_revision == rev
    snap = store.snapshot(job.nodes_prefix)
    assert [job.name_of(k.key) for k in snap.items] == ["n0", "n1", "n2"]
    assert snap.items[1].text() == "plain text" and snap.items[2].value == b"\x00\xffbytes"
    assert snap.revision >= rev + 2
    newest = store.get_prefix(job.nodes_prefix, limit=1, descending=True)
    assert [k.key for k in newest] == [job.node("n2")]
    assert store.delete(job.node("n0")) and not store.delete(job.node("n0"))
    assert store.get(job.node("n0")) is None
    assert store.delete_prefix(job.prefix) == 2


def test_lease_expiry_reaches_a_watcher(store, job):
    # t0 before the grant: the TTL runs from the grant, so slow watch setup cannot eat into it
    t0 = time.monotonic()
    lease = store.grant(1)
    with store.watch_prefix(job.nodes_prefix) as watch:
        store.put(job.node("n0"), {"up": True}, lease=lease)
        put, gone = drain(watch, 2, timeout=6.0)
        latency = time.monotonic() - t0
    assert (put.kind, gone.kind, gone.key) == ("put", "delete", job.node("n0"))
    logger.info("TTL 1 s lease expiry reached the watcher %.2f s after the grant", latency)
    # not before the TTL; after it, etcd's 500 ms expiry scan plus slack for a loaded box
    assert 0.95 <= latency <= 3.5
    with pytest.raises(LeaseNotFound):
        store.refresh(lease)
    with pytest.raises(LeaseNotFound):
        store.put(job.node("n0"), "late", lease=lease)


def test_keepalive_holds_a_lease_and_reports_its_loss(store, job):
    lease = store.grant(3)
    store.put(job.heartbeat("n0"), {"step": 1}, lease=lease)
    keepalive = store.keep_alive(lease)
    time.sleep(4.0)  # past TTL + etcd's 500 ms expiry scan: only the keepalive holds the lease
    assert store.get(job.heartbeat("n0")) is not None and not keepalive.lost.is_set()
    keepalive.stop(revoke=True)
    assert store.get(job.heartbeat("n0")) is None and store.time_to_live(lease) == -1
    # a keepalive whose lease is revoked behind its back reports the loss
    lost = threading.Event()
    other = store.grant(5)
    keepalive = store.keep_alive(other, interval_s=0.05, on_lost=lambda _: lost.set())
    store.revoke(other)
    assert lost.wait(2.0) and keepalive.lost.is_set()
    keepalive.stop()


def test_watch_survives_an_etcd_restart(etcd, store, job):
    with store.watch_prefix(job.commands_prefix) as watch:
        store.put(job.command("n0"), {"generation": 1})
        assert drain(watch, 1)[0].json() == {"generation": 1}
        etcd.restart()
        # written at once, before the watch has reconnected: it must re-watch from revision + 1
        for g in (2, 3, 4):
            store.put(job.command("n0"), {"generation": g})
        events = drain(watch, 3)
        assert [e.json()["generation"] for e in events] == [2, 3, 4]
        assert watch.get(timeout=0.3) is None  # nothing twice
        assert watch.reconnects >= 1
        etcd.kill()  # a crash, not a clean stop; the store waits for etcd to come back
        threading.Timer(0.3, etcd.start).start()
        store.put(job.command("n0"), {"generation": 5})
        assert drain(watch, 1)[0].json() == {"generation": 5}


def test_compare_and_swap_and_transactions(store, job):
    key = job.generation
    assert store.create(key, {"generation": 1})
    assert not store.create(key, {"generation": 9})
    assert store.compare_and_swap(key, {"generation": 1}, {"generation": 2})
    assert not store.compare_and_swap(key, {"generation": 1}, {"generation": 3})
    assert store.get(key).json() == {"generation": 2}
    result = store.txn(
        [value_is(key, {"generation": 2}), missing(job.state)],
        [Put(job.state, "running"), Get(key)],
        [Get(job.state)],
    )
    assert result.succeeded and result.gets[0][0].json() == {"generation": 2}
    result = store.txn([missing(job.state)], [Put(job.state, "x")], [Get(job.state)])
    assert not result.succeeded and result.gets[0][0].text() == "running"


def test_election_failover_when_the_leader_stops_renewing(store, job):
    ttl = 1
    a = Election(store, job.controller_leader, "controller-a", ttl=ttl)
    b = Election(store, job.controller_leader, "controller-b", ttl=ttl)
    assert a.campaign(timeout_s=5)
    assert a.leader().id == "controller-a" and a.check()
    seen = []
    observer = b.observe(lambda leader: seen.append(leader.id if leader else None))
    won = threading.Event()
    threading.Thread(target=lambda: b.campaign(timeout_s=10) and won.set(), daemon=True).start()
    time.sleep(0.3)
    assert not won.is_set()  # a standby while a leads
    fence = a.guard()
    t0 = time.monotonic()
    a.abandon()  # a "dies": its lease is no longer renewed
    assert won.wait(ttl + 5.0)
    takeover = time.monotonic() - t0
    logger.info(
        "standby took over %.2f s after the leader stopped renewing (TTL %d s)", takeover, ttl
    )
    # the TTL, etcd's 500 ms expiry scan, and slack for a loaded box
    assert takeover <= ttl + 0.5 + 2.5
    assert b.is_leader() and b.leader().id == "controller-b"
    # the deposed leader's fenced writes fail
    assert not store.txn([fence], [Put(job.state, "from a")]).succeeded
    assert store.txn([b.guard()], [Put(job.state, "from b")]).succeeded
    # the observer's watch thread may lag b's own campaign: poll rather than sleep a fixed time
    deadline = time.monotonic() + 5.0
    while seen[-2:] != [None, "controller-b"] and time.monotonic() < deadline:
        time.sleep(0.02)
    observer.cancel()
    assert seen[-2:] == [None, "controller-b"]
    # resigning hands over at once
    c = Election(store, job.controller_leader, "controller-c", ttl=1)
    b.resign()
    assert not b.is_leader() and c.campaign(timeout_s=0.5)
    c.resign()


def test_jobs_are_isolated_by_prefix(store):
    a, ab = JobKeys("job-a"), JobKeys("job-ab")  # one job id a prefix of the other
    store.delete_prefix(a.prefix)
    with store.watch_prefix(a.prefix) as watch:
        store.put(ab.command("n0"), {"generation": 1})
        store.put(ab.node("n0"), "x")
        store.put(a.node("n0"), "y")
        (event,) = drain(watch, 1)
        assert event.key == a.node("n0")
        assert watch.get(timeout=0.2) is None
    assert [k.key for k in store.get_prefix(a.prefix)] == [a.node("n0")]
    with pytest.raises(ValueError, match="not under job prefix"):
        a.name_of(ab.node("n0"))


def test_event_log_writes_file_and_etcd_and_continues_after_takeover(store, job, tmp_path):
    log = EventLog(tmp_path, store, job)
    log.append("fault", generation=1, node="n1", rank=3, detail={"exit_code": -9})
    log.append("evict", generation=1, node="n1", detail={"reason": "self-check failed"})
    # a standby controller takes over and appends after its predecessor
    EventLog(tmp_path, store, job).append("generation_start", generation=2)
    events = read_events(tmp_path)
    assert [(e.seq, e.kind) for e in events] == [
        (0, "fault"),
        (1, "evict"),
        (2, "generation_start"),
    ]
    assert events[0].node == "n1" and events[0].rank == 3
    mirrored = [Event.decode(kv.json()) for kv in store.get_prefix(job.events_prefix)]
    assert mirrored == events
    # etcd unreachable: the file still gets the event
    offline = EventLog(tmp_path, Store(StoreConfig.parse("127.0.0.1:1", retry_s=0.1)), job)
    offline.append("fault", generation=2, node="n0")
    assert read_events(tmp_path)[-1].kind == "fault"


def test_a_fenced_event_log_of_a_deposed_leader_writes_nothing(store, job, tmp_path):
    a = Election(store, job.controller_leader, "controller-a", ttl=1)
    assert a.campaign(timeout_s=5)
    old = EventLog(tmp_path, store, job, buffered=True, fence=lambda: [a.guard()])
    old.term = a.term
    old.append("controller_start", generation=1)
    old.flush()
    fence = a.guard()
    a.abandon()  # stopped past its lease: b takes over
    b = Election(store, job.controller_leader, "controller-b", ttl=1)
    assert b.campaign(timeout_s=10) and b.term > fence.operand
    old.fence = lambda: [fence]  # it still believes it leads
    old.append("fault", generation=1, detail={"fault": "heartbeat_timeout"})
    old.flush()
    new = EventLog(tmp_path, store, job, buffered=True, fence=lambda: [b.guard()])
    new.term = b.term
    new.append("controller_takeover", generation=1)
    new.flush()
    events = read_events(tmp_path)
    assert [e.kind for e in events] == ["controller_start", "controller_takeover"]
    assert [Event.decode(kv.json()).kind for kv in store.get_prefix(job.events_prefix)] == [
        "controller_start",
        "controller_takeover",
    ]
    assert [e.term for e in events] == [fence.operand, b.term]
    b.resign()


def test_embedded_etcd_with_auth_refuses_anonymous_clients_across_restarts():
    with EmbeddedEtcd(unsafe_no_fsync=True, credentials=("root", "per-job-secret")) as server:
        user = Store(StoreConfig.parse(server.endpoint, username="root", password="per-job-secret"))
        anonymous = Store(StoreConfig.parse(server.endpoint, retry_s=0.5))
        user.put("/megascale/j/commands/node-0", "real")
        with pytest.raises(StoreError, match="user name is empty"):
            anonymous.put("/megascale/j/commands/node-0", "forged")
        server.restart()  # from its data directory: auth stays on
        with pytest.raises(StoreError, match="user name is empty"):
            anonymous.get("/megascale/j/commands/node-0")
        assert user.get("/megascale/j/commands/node-0").text() == "real"


def _race_to_add_a_user(port: int, stop: threading.Event, won: list[str]) -> None:
    """What a local process watching for the new etcd does: add its own user the moment the port
    accepts connections."""
    url = f"http://127.0.0.1:{port}/v3/auth/user/add"
    body = json.dumps({"name": "intruder", "password": "x"}).encode()
    while not stop.is_set():
        try:
            with urllib.request.urlopen(url, body, timeout=0.5) as r:
                won.append(r.read().decode())
                return
        except (OSError, urllib.error.URLError):
            time.sleep(0.0005)


def test_embedded_etcd_has_its_credentials_before_anything_can_connect():
    server = EmbeddedEtcd(unsafe_no_fsync=True, credentials=("root", "per-job-secret"))
    with socket.socket() as s:  # the port the racer watches (a real one finds it in /proc/net/tcp)
        s.bind(("127.0.0.1", 0))
        server.client_port = s.getsockname()[1]
    stop, won = threading.Event(), []
    racer = threading.Thread(target=_race_to_add_a_user, args=(server.client_port, stop, won))
    racer.start()
    try:
        server.start()
        time.sleep(0.2)  # the racer keeps trying while the server serves
    finally:
        stop.set()
        racer.join()
    try:
        assert won == []
        root = Store(StoreConfig.parse(server.endpoint, username="root", password="per-job-secret"))
        assert root._call("/v3/auth/user/list", {}).get("users") == ["root"]
        assert not (server.data_dir.parent / "boot:1").exists()  # the bootstrap socket is gone
    finally:
        server.stop()


def test_unreachable_etcd_raises_store_unavailable_naming_the_endpoint():
    store = Store(StoreConfig.parse("127.0.0.1:1", retry_s=0.3))
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match=r"127\.0\.0\.1:1 unavailable for 0\.3 s"):
        store.get("/x")
    assert time.monotonic() - t0 < 1.5


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="scheme must be http or https"):
        StoreConfig.parse("grpc://127.0.0.1:2379")
    with pytest.raises(ValueError, match="username/password"):
        StoreConfig.parse("127.0.0.1:2379", username="root")
    with pytest.raises(ValueError, match="lease ttl = 0"):
        Store("127.0.0.1:1").grant(0)


def test_start_failure_reports_the_server_log(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    server = EmbeddedEtcd(data_dir=not_a_dir / "data", startup_timeout_s=5)
    try:
        with pytest.raises(EtcdStartError, match="log ends with"):
            server.start()
    finally:
        server.stop()
    assert not server.log_path.parent.exists()


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _make_certificates(directory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, all signed by the CA.
    The client's has no Common Name: with etcd auth on, etcd's gateway refuses one that has."""
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    ca = ["-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
             "-subj", "/CN=megascale-test-ca", cwd=directory)  # fmt: skip
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name, subject in (("server", "/CN=megascale-server"), ("client", "/O=megascale-client")):
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject,
                 cwd=directory)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", *ca, "-out", f"{name}.pem",
                 "-extfile", "san.ext", cwd=directory)  # fmt: skip
    return {name: str(directory / name) for name in
            ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}  # fmt: skip


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_with_client_certificates_and_user_password(tmp_path):
    p = _make_certificates(tmp_path)
    server_tls = dict(cert_file=p["server.pem"], key_file=p["server.key"], ca_file=p["ca.pem"])
    with EmbeddedEtcd(unsafe_no_fsync=True, **server_tls) as server:
        assert server.client_url.startswith("https://127.0.0.1:")
        tls = dict(
            ca_file=p["ca.pem"], cert_file=p["client.pem"], key_file=p["client.key"], retry_s=0.5
        )
        admin = Store(StoreConfig.parse(server.client_url, **tls))
        admin.put("/megascale/t/x", "over tls")
        assert admin.get("/megascale/t/x").text() == "over tls"
        # without the client certificate the server refuses the handshake
        no_cert = Store(StoreConfig.parse(server.client_url, ca_file=p["ca.pem"], retry_s=0.3))
        with pytest.raises(StoreUnavailable):
            no_cert.get("/megascale/t/x")
        # enable etcd auth, then use user/password over TLS
        admin._call("/v3/auth/role/add", {"name": "root"})
        admin._call("/v3/auth/user/add", {"name": "root", "password": "s3cret"})
        admin._call("/v3/auth/user/grant", {"user": "root", "role": "root"})
        admin._call("/v3/auth/enable", {})
        user = Store(
            StoreConfig.parse(server.client_url, username="root", password="s3cret", **tls)
        )
        user.put("/megascale/t/y", "authenticated")
        with user.watch("/megascale/t/y") as watch:
            user.put("/megascale/t/y", "watched")
            assert drain(watch, 1)[0].text() == "watched"
        wrong = Store(StoreConfig.parse(server.client_url, username="root", password="no", **tls))
        with pytest.raises(StoreError, match="authentication failed"):
            wrong.get("/megascale/t/y")
        with pytest.raises(StoreError, match="permission denied"):
            admin.get("/megascale/t/y")  # a certificate alone is no etcd identity
