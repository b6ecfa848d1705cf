"""Broker registration in a real ZooKeeper, session expiry, and ``metaq broker start``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from helpers.raw_client import RawClient

import metaq
import zk_layout
from metaq.broker import Broker, BrokerConfig
from metaq.protocol import encode_version
from metaq.testing import expire_session, wait_until

pytestmark = pytest.mark.broker

LAYOUT = zk_layout.Layout()


def nodes_of(zk, broker_id: int, topics: dict[str, int]) -> dict[str, tuple[bytes, int]]:
    """path -> (data, ephemeralOwner) of every node a broker should have written."""
    paths = [LAYOUT.broker_id(broker_id), LAYOUT.broker_master(broker_id)]
    for t in topics:
        paths += [LAYOUT.topic_legacy(t, broker_id), LAYOUT.topic_pub(t, broker_id),
                  LAYOUT.topic_sub(t, broker_id)]
    out = {}
    for p in paths:
        st = zk.exists(p)
        if st is not None:
            out[p] = (zk.get(p)[0], st.ephemeralOwner)
    return out


def expected_data(broker_id: int, port: int, topics: dict[str, int]) -> dict[str, bytes]:
    uri = f"meta://127.0.0.1:{port}".encode()
    out = {LAYOUT.broker_id(broker_id): uri, LAYOUT.broker_master(broker_id): uri}
    for t, n in topics.items():
        out[LAYOUT.topic_legacy(t, broker_id)] = str(n).encode()
        js = json.dumps({"numParts": n, "broker": f"{broker_id}-m"},
                        separators=(",", ":")).encode()
        out[LAYOUT.topic_pub(t, broker_id)] = js
        out[LAYOUT.topic_sub(t, broker_id)] = js
    return out


def config(tmp_path, zk_connect, **kw) -> BrokerConfig:
    kw.setdefault("topics", {"orders": 4, "logs": 1})
    return BrokerConfig(broker_id=kw.pop("broker_id", 7), data_dir=tmp_path / "data", port=0,
                        zk_connect=zk_connect, zk_session_timeout=4.0, **kw)


def test_registration_nodes_and_data(tmp_path, zk_connect, zk_client):
    cfg = config(tmp_path, zk_connect)
    with Broker(cfg) as broker:
        found = nodes_of(zk_client, 7, cfg.topics)
        assert {p: d for p, (d, _o) in found.items()} == expected_data(7, broker.port, cfg.topics)
        session = broker.registry.client.client_id[0]
        for path, (_d, owner) in found.items():
            # ids/<id> is persistent, everything else ephemeral to the broker's session
            assert owner == (0 if path == LAYOUT.broker_id(7) else session), path
        assert zk_client.get(LAYOUT.topic_sub(
            "orders", 7))[0] == b'{"numParts":4,"broker":"7-m"}'
        # a topic added at run time is registered before add_topic returns
        broker.add_topic("late", 2)
        assert zk_client.get(LAYOUT.topic_pub("late", 7))[0] == b'{"numParts":2,"broker":"7-m"}'
        assert zk_client.get(LAYOUT.topic_legacy("late", 7))[0] == b"2"
        assert broker.registration_error is None
        assert "STAT zk_registered true\r\n" in broker.stats()
    # clean stop: every node of this broker is gone, parents stay
    assert nodes_of(zk_client, 7, {**cfg.topics, "late": 2}) == {}
    assert zk_client.exists(LAYOUT.topic_sub_dir("orders")) is not None


def test_reregisters_after_session_expiry(tmp_path, zk_connect, zk_client, zk_server):
    cfg = config(tmp_path, zk_connect)
    with Broker(cfg) as broker:
        reg = broker.registry
        old_session = reg.client.client_id[0]
        assert reg.registrations == 1
        hosts = zk_connect  # same server + chroot
        expire_session(reg.client, hosts)
        wait_until(lambda: reg.registrations >= 2, 20, what="re-registration")

        def all_back():
            found = nodes_of(zk_client, 7, cfg.topics)
            return (len(found) == 2 + 3 * len(cfg.topics)
                    and all(o != old_session for p, (_d, o) in found.items()
                            if p != LAYOUT.broker_id(7)))

        wait_until(all_back, 20, what="every node back under the new session")
        found = nodes_of(zk_client, 7, cfg.topics)
        assert {p: d for p, (d, _o) in found.items()} == expected_data(7, broker.port, cfg.topics)
        assert broker.registration_error is None
        # the broker kept serving throughout
        c = RawClient(broker.port)
        assert c.call(encode_version(5)).code == 200
        c.close()
    assert nodes_of(zk_client, 7, cfg.topics) == {}


def test_duplicate_broker_id_is_refused(tmp_path, zk_connect, zk_client):
    with Broker(config(tmp_path / "a", zk_connect)) as first:
        with pytest.raises(metaq.CoordinationError, match="another broker running with id 7"):
            # waits out one session timeout for a dead predecessor, then refuses
            Broker(config(tmp_path / "b", zk_connect, zk_connect_timeout=1.0)).start()
        # the first one is untouched
        found = nodes_of(zk_client, 7, first.config.topics)
        assert found[LAYOUT.broker_master(7)][0] == f"meta://127.0.0.1:{first.port}".encode()


def test_advertised_host_in_uri(tmp_path, zk_connect, zk_client):
    cfg = config(tmp_path, zk_connect, host="127.0.0.1", advertised_host="::1", topics={})
    with Broker(cfg) as broker:
        assert zk_client.get(LAYOUT.broker_master(7))[0] == f"meta://[::1]:{broker.port}".encode()


def test_unreachable_zookeeper_fails_start(tmp_path):
    cfg = BrokerConfig(broker_id=1, data_dir=tmp_path, port=0, zk_connect="127.0.0.1:1",
                       zk_connect_timeout=1.0)
    with pytest.raises(metaq.CoordinationError, match="cannot connect to ZooKeeper"):
        Broker(cfg).start()
    # nothing left behind: the data dir lock is free again
    Broker(cfg.replace(zk_connect=None)).start().stop()


def test_cli_start_sigterm_unregisters_and_exits_0(tmp_path, zk_connect, zk_client):
    cmd = [sys.executable, "-m", "metaq", "broker", "start", "--zk", zk_connect, "--id", "9",
           "--port", "0", "--data-dir", str(tmp_path / "d"), "--topic", "a:3", "--topic", "b",
           "--group-commit"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert line.startswith("metaq broker 9 serving on 127.0.0.1:"), (
            line, proc.stderr.read() if proc.poll() is not None else "")
        port = int(line.rsplit(":", 1)[1])
        topics = {"a": 3, "b": 1}
        found = nodes_of(zk_client, 9, topics)
        assert {p: d for p, (d, _o) in found.items()} == expected_data(9, port, topics)
        c = RawClient(port)
        assert c.put("a", 2, b"hello").code == 200
        c.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert nodes_of(zk_client, 9, topics) == {}
    assert (tmp_path / "d" / "a-2" / "00000000000000000000.meta").stat().st_size == 25


def test_cli_port_in_use_exits_1(tmp_path):
    with Broker(BrokerConfig(broker_id=1, data_dir=tmp_path / "a", port=0)) as taken:
        r = subprocess.run([sys.executable, "-m", "metaq", "broker", "start", "--id", "2",
                            "--port", str(taken.port), "--data-dir", str(tmp_path / "b")],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and f"cannot serve on 127.0.0.1:{taken.port}" in r.stderr
    assert "Traceback" not in r.stderr


def test_cli_bad_flags_exit_2(tmp_path):
    base = [sys.executable, "-m", "metaq", "broker", "start", "--data-dir", str(tmp_path)]
    r = subprocess.run(base + ["--id", "5000"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "broker_id must be 0..1023" in r.stderr
    r = subprocess.run(base + ["--id", "1", "--topic", "x:many"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "NAME:PARTITIONS" in r.stderr
    r = subprocess.run([sys.executable, "-m", "metaq", "broker", "start", "--id", "1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "data_dir is required" in r.stderr


def test_cli_config_file_merged_with_flags(tmp_path, zk_connect, zk_client):
    conf = tmp_path / "broker.toml"
    conf.write_text(f'broker_id = 11\ndata_dir = "{tmp_path / "d"}"\nport = 0\n'
                    f'zk_connect = "{zk_connect}"\n[topics]\nfromfile = 2\n')
    proc = subprocess.Popen([sys.executable, "-m", "metaq", "broker", "start", "--config",
                             str(conf), "--topic", "fromflag:1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "metaq broker 11 serving" in line, line if line else proc.stderr.read()
        wait_until(lambda: zk_client.exists(LAYOUT.topic_sub("fromflag", 11)), 10,
                   what="fromflag registered")
        assert zk_client.get(LAYOUT.topic_sub("fromfile", 11))[0] == \
            b'{"numParts":2,"broker":"11-m"}'
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    bad = tmp_path / "bad.toml"
    bad.write_text("broker_id = 1\nbogus = 2\n")
    r = subprocess.run([sys.executable, "-m", "metaq", "broker", "start", "--config", str(bad)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "unknown keys bogus" in r.stderr


def test_restart_right_after_kill_9_waits_for_the_old_session(tmp_path, zk_connect, zk_client):
    import signal
    import subprocess
    import sys

    from metaq.testing import free_port, wait_until

    port = free_port()
    args = [sys.executable, "-m", "metaq", "broker", "start", "--zk", zk_connect, "--id", "9",
            "--port", str(port), "--data-dir", str(tmp_path / "d"), "--topic", "t:1"]
    log1, log2 = tmp_path / "first.log", tmp_path / "second.log"
    with open(log1, "wb") as out:
        first = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    second = None
    try:
        wait_until(lambda: zk_client.exists(LAYOUT.broker_master(9)), timeout=30,
                   what="first broker registered")
        first.send_signal(signal.SIGKILL)
        first.wait(10)
        assert zk_client.exists(LAYOUT.broker_master(9))  # the dead session still holds it
        old_owner = zk_client.exists(LAYOUT.broker_master(9)).ephemeralOwner
        with open(log2, "wb") as out:
            second = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        wait_until(lambda: b"serving on" in log2.read_bytes() or second.poll() is not None,
                   timeout=60, what="the restarted broker to serve or exit")
        assert second.poll() is None, log2.read_text()
        stat = zk_client.exists(LAYOUT.broker_master(9))
        assert stat is not None and stat.ephemeralOwner != old_owner
        assert b"waiting for the old session to expire" in log2.read_bytes()
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(30)
    assert second.returncode == 0


def test_a_test_broker_whose_picked_port_was_taken_moves_to_another(zk_connect, tmp_path,
                                                                      monkeypatch):
    """The test helper picks a free port, releases it, and the broker binds it: another
    process can take it in between (parallel runs).  A first start then moves to a new
    port instead of failing the test; the port stays fixed across restarts."""
    import socket

    from helpers import procs

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = procs.free_port
    monkeypatch.setattr(procs, "free_port", lambda: next(ports, None) or real())
    with taken, procs.BrokerProc(zk_connect, 7, tmp_path / "b7", {"t": 1}) as broker:
        broker.start()
        assert broker.port != taken.getsockname()[1]
        assert b"address already in use" in broker.log_path.read_bytes()
        with broker.connection() as conn:
            assert procs.read_partition(conn, "t", 0) == []  # it serves on the new port
        moved_to = broker.port
        broker.restart()
        assert broker.port == moved_to
