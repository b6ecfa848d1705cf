"""zk_layout against a real ZooKeeper: snapshot of a Metaq-shaped tree and the inspector CLI.

The tree is written with literal bytes, exactly as a Java Metaq 1.4 cluster writes them
(see reference section 1), plus one garbage node and a few nodes Metaq does not define.
"""

from __future__ import annotations

import dataclasses
import json
import re
import socket
import subprocess
import sys
import time

import pytest
from kazoo.client import KazooClient

import zk_layout
from zk_layout import (
    BrokerUri,
    Layout,
    NodeKind,
    Partition,
    StaticMember,
    StaticMemberInfo,
    StoredOffset,
    encode_static_member,
    read_tree,
    take_snapshot,
)

L = Layout()

T1_PARTS = ["0-0", "0-1", "0-10", "0-11", "0-2", "0-3", "0-4", "0-5", "0-6", "0-7", "0-8",
            "0-9", "1-0", "1-1"]
GARBAGE_PATH = "/meta/consumers/g1/offsets/t1/0-10"


def _put(client: KazooClient, path: str, data: bytes, ephemeral: bool = False) -> None:
    client.create(path, data, makepath=True, ephemeral=ephemeral)


def build_metaq_tree(client: KazooClient) -> None:
    """Two brokers (master + slave each), topics t1 (12 + 2 parts) and t2, group g1."""
    # broker 0: legacy id node, master, slave1, Java's config checksum
    _put(client, "/meta/brokers/ids/0", b"meta://10.0.0.1:8123")
    _put(client, "/meta/brokers/ids/0/master", b"meta://10.0.0.1:8123", ephemeral=True)
    _put(client, "/meta/brokers/ids/0/slave1", b"meta://10.0.0.2:8123", ephemeral=True)
    _put(client, "/meta/brokers/ids/0/master_config_checksum", b"3141592653", ephemeral=True)
    # broker 1: IPv6 master, slave0
    _put(client, "/meta/brokers/ids/1", b"meta://[::1]:8124")
    _put(client, "/meta/brokers/ids/1/master", b"meta://[::1]:8124", ephemeral=True)
    _put(client, "/meta/brokers/ids/1/slave0", b"meta://10.0.0.3:8125", ephemeral=True)
    # topic t1: 12 parts on broker 0, 2 on broker 1; slaves register under topics-sub
    for broker, parts in ((0, 12), (1, 2)):
        _put(client, f"/meta/brokers/topics/t1/{broker}-m", str(parts).encode(), ephemeral=True)
        body = b'{"numParts":%d,"broker":"%d-m"}' % (parts, broker)
        _put(client, f"/meta/brokers/topics-pub/t1/{broker}-m", body, ephemeral=True)
        _put(client, f"/meta/brokers/topics-sub/t1/{broker}-m", body, ephemeral=True)
    _put(client, "/meta/brokers/topics-sub/t1/0-s1", b'{"numParts":12,"broker":"0-s1"}',
         ephemeral=True)
    _put(client, "/meta/brokers/topics-sub/t1/1-s0", b'{"numParts":2,"broker":"1-s0"}',
         ephemeral=True)
    _put(client, "/meta/brokers/topics-sub/t2/1-m", b'{"numParts":3,"broker":"1-m"}',
         ephemeral=True)
    # group g1: two members, owners, offsets (new format, -1 msgId, legacy bare, garbage)
    _put(client, "/meta/consumers/g1/ids/g1_10.0.0.9-77-abc", b"t1", ephemeral=True)
    _put(client, "/meta/consumers/g1/ids/g1_10.0.0.8-66-def", b"t1,t2", ephemeral=True)
    for part in ("0-0", "0-1", "0-10"):
        _put(client, f"/meta/consumers/g1/owners/t1/{part}", b"g1_10.0.0.8-66-def",
             ephemeral=True)
    _put(client, "/meta/consumers/g1/owners/t1/1-1", b"g1_10.0.0.9-77-abc", ephemeral=True)
    _put(client, "/meta/consumers/g1/offsets/t1/0-0", b"123-4096")
    _put(client, "/meta/consumers/g1/offsets/t1/0-1", b"-1-0")
    _put(client, "/meta/consumers/g1/offsets/t1/0-2", b"4096")
    _put(client, GARBAGE_PATH, b"not-an-offset")
    # nodes Metaq does not define (a Java tool's, an operator's)
    _put(client, "/meta/consumers/g1/notes", b"hello")
    _put(client, "/meta/extra", b"")


@pytest.fixture
def metaq_tree(zk_client: KazooClient) -> KazooClient:
    build_metaq_tree(zk_client)
    return zk_client


def _run_cli(zk_connect: str, *args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "zk_layout", "--zk", zk_connect, *args],
        capture_output=True, text=True, timeout=timeout_s,
    )


# -- snapshot --------------------------------------------------------------------------------


def test_snapshot_brokers(metaq_tree: KazooClient) -> None:
    snap = take_snapshot(metaq_tree, L)
    assert snap.exists
    assert [b.broker_id for b in snap.brokers] == [0, 1]
    b0, b1 = snap.broker(0), snap.broker(1)
    assert b0.master == BrokerUri("10.0.0.1", 8123)
    assert b0.legacy_uri == BrokerUri("10.0.0.1", 8123)
    assert b0.slaves == ((1, BrokerUri("10.0.0.2", 8123, slave_id=1)),)
    assert str(b0.slaves[0][1]) == "meta://10.0.0.2:8123?slaveId=1"
    assert b0.config_checksum == "3141592653"
    assert b1.master == BrokerUri("::1", 8124)
    assert b1.slaves == ((0, BrokerUri("10.0.0.3", 8125, slave_id=0)),)
    assert not b0.damaged and not b1.damaged


def test_snapshot_topics(metaq_tree: KazooClient) -> None:
    snap = take_snapshot(metaq_tree, L)
    assert [t.topic for t in snap.topics] == ["t1", "t2"]
    t1 = snap.topic("t1")
    assert [str(p) for p in t1.partitions] == T1_PARTS
    entries = {(e.broker_id, e.slave_no): e for e in t1.brokers}
    assert set(entries) == {(0, None), (0, 1), (1, None), (1, 0)}
    assert (entries[0, None].pub_parts, entries[0, None].sub_parts,
            entries[0, None].legacy_parts) == (12, 12, 12)
    assert (entries[0, 1].pub_parts, entries[0, 1].sub_parts) == (None, 12)
    assert [str(p) for p in snap.topic("t2").partitions] == ["1-0", "1-1", "1-2"]


def test_snapshot_group_with_damaged_offset(metaq_tree: KazooClient) -> None:
    snap = take_snapshot(metaq_tree, L)
    g1 = snap.group("g1")
    # members sorted as strings, as Metaq sorts consumer ids
    assert [m.consumer_id for m in g1.members] == ["g1_10.0.0.8-66-def", "g1_10.0.0.9-77-abc"]
    assert g1.members[0].topics == ("t1", "t2")
    assert [t.topic for t in g1.topics] == ["t1", "t2"]
    states = {str(p.partition): p for p in g1.topics[0].partitions}
    assert list(states) == T1_PARTS
    assert states["0-0"].owner == "g1_10.0.0.8-66-def"
    assert states["0-0"].offset == StoredOffset(msg_id=123, offset=4096)
    assert states["0-1"].offset == StoredOffset(msg_id=-1, offset=0)
    assert states["0-2"].offset == StoredOffset(msg_id=None, offset=4096)
    assert states["0-2"].owner is None
    assert states["1-1"].owner == "g1_10.0.0.9-77-abc"
    # the garbage node is reported, the rest of the group read on
    assert states["0-10"].owner == "g1_10.0.0.8-66-def"
    assert states["0-10"].offset is None
    assert [d.path for d in g1.damaged] == [GARBAGE_PATH]
    assert [d.path for d in snap.damaged] == [GARBAGE_PATH]
    assert snap.damaged[0].data == b"not-an-offset"
    assert "<msgId>-<offset>" in snap.damaged[0].error
    assert states["0-10"].errors == (snap.damaged[0].error,)
    assert [str(p.partition) for p in g1.topics[1].partitions] == ["1-0", "1-1", "1-2"]
    assert sorted(snap.unknown) == ["/meta/consumers/g1/notes", "/meta/extra"]


def test_snapshot_missing_root(zk_client: KazooClient) -> None:
    snap = take_snapshot(zk_client, L)
    assert not snap.exists and snap.brokers == () and snap.groups == ()
    assert read_tree(zk_client, L) == ()


def test_snapshot_custom_root_and_empty_dirs(zk_client: KazooClient) -> None:
    layout = Layout("/other/meta")
    zk_client.ensure_path(layout.topics_sub())
    zk_client.ensure_path(layout.consumer_ids("g"))
    # a slave registered first: brokers/ids/3 exists with empty data, no master
    _put(zk_client, layout.broker_slave(3, 0), b"meta://h3:8123", ephemeral=True)
    snap = take_snapshot(zk_client, layout)
    assert snap.exists and snap.topics == () and snap.damaged == ()
    (b3,) = snap.brokers
    assert b3.master is None and b3.legacy_uri is None
    assert b3.slaves == ((0, BrokerUri("h3", 8123, slave_id=0)),)
    assert snap.group("g").members == () and snap.group("g").topics == ()
    assert not take_snapshot(zk_client, L).exists


class _VanishingClient:
    """A real kazoo client that deletes ``victims`` for real just before reading them,
    as if their owner's session ended between our get_children and get."""

    def __init__(self, client: KazooClient, victims: set[str]) -> None:
        self._client = client
        self.victims = set(victims)
        self.deleted: list[str] = []

    def get(self, path: str):  # noqa: ANN201
        if path in self.victims:
            self.victims.discard(path)
            self._client.delete(path, recursive=True)
            self.deleted.append(path)
        return self._client.get(path)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self._client, name)


def test_snapshot_tolerates_nodes_vanishing(metaq_tree: KazooClient) -> None:
    victims = {"/meta/brokers/ids/1", "/meta/brokers/ids/0/slave1",
               "/meta/brokers/topics-sub/t2/1-m", "/meta/consumers/g1/ids/g1_10.0.0.9-77-abc",
               "/meta/consumers/g1/owners/t1/1-1", GARBAGE_PATH}
    client = _VanishingClient(metaq_tree, victims)
    snap = take_snapshot(client, L)
    assert sorted(client.deleted) == sorted(victims)
    assert [b.broker_id for b in snap.brokers] == [0]
    assert snap.broker(0).slaves == ()
    assert snap.topic("t2").partitions == ()
    g1 = snap.group("g1")
    assert [m.consumer_id for m in g1.members] == ["g1_10.0.0.8-66-def"]
    states = {str(p.partition): p for p in g1.topics[0].partitions}
    assert states["1-1"].owner is None
    assert snap.damaged == ()  # the garbage node vanished before it was read
    # the tree walk tolerates it too
    client = _VanishingClient(metaq_tree, {"/meta/brokers/ids/0/master",
                                            "/meta/consumers/g1"})
    paths = [n.path for n in read_tree(client, L)]
    assert "/meta/brokers/ids/0/master" not in paths
    assert not any(p.startswith("/meta/consumers/g1") for p in paths)
    assert "/meta/brokers/ids/0/master_config_checksum" in paths


def test_read_tree(metaq_tree: KazooClient) -> None:
    nodes = {n.path: n for n in read_tree(metaq_tree, L)}
    assert nodes["/meta"].depth == 0
    master = nodes["/meta/brokers/ids/0/master"]
    assert master.ephemeral and master.depth == 4
    assert master.ref.kind is NodeKind.BROKER_MASTER
    assert master.value == BrokerUri("10.0.0.1", 8123)
    assert not nodes["/meta/consumers/g1/offsets/t1/0-0"].ephemeral
    assert nodes["/meta/consumers/g1/offsets/t1/0-1"].value == StoredOffset(offset=0)
    assert nodes[GARBAGE_PATH].data == b"not-an-offset"
    assert "<msgId>-<offset>" in nodes[GARBAGE_PATH].error
    assert nodes["/meta/extra"].ref is None
    assert nodes["/meta/consumers/g1/owners/t1/0-10"].value == "g1_10.0.0.8-66-def"
    assert sum(1 for n in nodes.values() if n.error) == 1


# -- the inspector CLI, as a real subprocess ---------------------------------------------------


def test_cli_tree(metaq_tree: KazooClient, zk_connect: str) -> None:
    r = _run_cli(zk_connect, "tree")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "/meta"
    assert '        master = "meta://10.0.0.1:8123"  (ephemeral)' in lines
    garbage = [ln for ln in lines if ln.strip().startswith("0-10 = ") and "DAMAGED" in ln]
    assert len(garbage) == 1 and '"not-an-offset"' in garbage[0]
    assert any(ln.strip().startswith("extra") and "[not a Metaq node]" in ln for ln in lines)
    assert lines[-1] == f"{len(read_tree(metaq_tree, L))} node(s), 1 damaged"
    r = _run_cli(zk_connect, "tree", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    nodes = {n["path"]: n for n in doc["nodes"]}
    assert nodes["/meta/consumers/g1/offsets/t1/0-1"]["value"] == {"msg_id": -1, "offset": 0}
    assert nodes["/meta/brokers/ids/1/slave0"]["value"] == "meta://10.0.0.3:8125?slaveId=0"
    assert nodes[GARBAGE_PATH]["data"] == "not-an-offset" and nodes[GARBAGE_PATH]["error"]


def _rows(text: str) -> list[list[str]]:
    return [ln.split() for ln in text.splitlines() if ln.strip()]


def test_cli_brokers(metaq_tree: KazooClient, zk_connect: str) -> None:
    r = _run_cli(zk_connect, "brokers")
    assert r.returncode == 0, r.stderr
    rows = _rows(r.stdout)
    assert rows[0] == ["BROKER", "ROLE", "URI", "LEGACY", "URI", "REPLICATION", "CHECKSUM", "/",
                       "ERROR"]
    assert ["0", "master", "meta://10.0.0.1:8123", "meta://10.0.0.1:8123", "-",
            "3141592653"] in rows
    assert ["0", "slave1", "meta://10.0.0.2:8123?slaveId=1", "-", "-", "-"] in rows
    assert ["1", "master", "meta://[::1]:8124", "meta://[::1]:8124", "-", "-"] in rows
    header = r.stdout.splitlines()[0]
    for line in r.stdout.splitlines()[1:]:  # aligned: every URI starts under its header
        assert line[header.index("URI")] != " "
    doc = json.loads(_run_cli(zk_connect, "--json", "brokers").stdout)
    assert [b["broker_id"] for b in doc["brokers"]] == [0, 1]
    assert doc["brokers"][1]["slaves"] == [[0, "meta://10.0.0.3:8125?slaveId=0"]]
    assert doc["damaged"] == []
    # a metaq-py broker id's replication state: the epoch, who leads, who is in sync
    layout = zk_layout.Layout()
    metaq_tree.create(layout.replication(0), zk_layout.encode_replication_state(
        zk_layout.ReplicationState(epoch=2, master=0, in_sync=(1,), mode="sync")),
        makepath=True)
    try:
        out = _run_cli(zk_connect, "brokers").stdout
        assert "epoch 2, replica 0, sync, in sync: 1" in out
        assert any(line.split()[:2] == ["0", "slave1"] and "in sync" in line
                   for line in out.splitlines())
        metaq_tree.set(layout.replication(0), b"{garbage")
        out = _run_cli(zk_connect, "brokers").stdout
        assert "DAMAGED" in out and "/brokers/replication/0" in out
    finally:
        metaq_tree.delete(layout.replication_root(), recursive=True)


def test_cli_topics(metaq_tree: KazooClient, zk_connect: str) -> None:
    r = _run_cli(zk_connect, "topics")
    assert r.returncode == 0, r.stderr
    rows = _rows(r.stdout)
    assert ["t1", "0", "master", "12", "12", "12"] in rows
    assert ["t1", "0", "slave1", "-", "12", "-"] in rows
    assert ["t1", "14", *T1_PARTS] in rows
    assert ["t2", "3", "1-0", "1-1", "1-2"] in rows
    doc = json.loads(_run_cli(zk_connect, "topics", "--json").stdout)
    assert doc["topics"][0]["partitions"] == T1_PARTS


def test_cli_groups_and_group(metaq_tree: KazooClient, zk_connect: str) -> None:
    r = _run_cli(zk_connect, "groups")
    assert r.returncode == 0, r.stderr
    rows = _rows(r.stdout)
    assert ["g1", "2", "t1,t2", "17", "4", "3", "1"] in rows
    assert ["g1", "g1_10.0.0.8-66-def", "t1,t2", "-", "-", "-", "live"] in rows
    (damage_line,) = [ln for ln in r.stdout.splitlines() if GARBAGE_PATH + ":" in ln]
    assert damage_line.endswith('(data: "not-an-offset")')
    assert "1 damaged node(s):" in r.stdout

    r = _run_cli(zk_connect, "group", "g1")
    assert r.returncode == 0, r.stderr
    rows = _rows(r.stdout)
    # CONSUMED UP TO: the msgId time of the last committed message (msgId 123: 0 ms + epoch)
    assert ["t1", "0-0", "g1_10.0.0.8-66-def", "4096", "123", "2011-04-27T09:14:20.503Z",
            "-"] in rows
    assert ["t1", "0-1", "g1_10.0.0.8-66-def", "0", "-1", "-", "-"] in rows
    assert ["t1", "0-2", "-", "4096", "(legacy)", "-", "-"] in rows
    (bad,) = [row for row in rows if row[:2] == ["t1", "0-10"]]
    assert bad[2:6] == ["g1_10.0.0.8-66-def", "-", "-", "-"] and bad[6] == "DAMAGED:"
    assert ["t2", "1-2", "-", "-", "-", "-", "-"] in rows  # the run went on past the garbage
    # partition rows come in Metaq's (string) order
    assert [row[1] for row in rows if row[0] == "t1"] == T1_PARTS

    doc = json.loads(_run_cli(zk_connect, "group", "g1", "--json").stdout)
    parts = {p["partition"]: p for p in doc["topics"][0]["partitions"]}
    assert parts["0-0"]["offset"] == {"msg_id": 123, "offset": 4096}
    assert parts["0-2"]["offset"] == {"msg_id": None, "offset": 4096}
    assert parts["0-10"]["errors"] and parts["0-10"]["offset"] is None
    assert [d["path"] for d in doc["damaged"]] == [GARBAGE_PATH]
    assert doc["damaged"][0]["data"] == "not-an-offset"


def test_cli_missing_group_and_root(zk_client: KazooClient, zk_connect: str) -> None:
    r = _run_cli(zk_connect, "group", "nope")
    assert r.returncode == 1 and "no consumer group 'nope'" in r.stderr
    r = _run_cli(zk_connect, "brokers")
    assert r.returncode == 0 and "/meta does not exist" in r.stdout
    doc = json.loads(_run_cli(zk_connect, "groups", "--json").stdout)
    assert doc == {"root": "/meta", "exists": False, "groups": [], "damaged": []}
    r = _run_cli(zk_connect, "--root", "/elsewhere", "tree")
    assert r.returncode == 0 and "/elsewhere does not exist" in r.stdout


@pytest.mark.parametrize("args, message", [
    (["--zk", "nohostport", "tree"], "expected HOST:PORT"),
    (["--zk", "127.0.0.1:99999", "tree"], "port out of range"),
    (["--zk", "127.0.0.1:2181", "--root", "a//b", "tree"], "empty path segments"),
    (["--zk", "127.0.0.1:2181", "--timeout", "0", "tree"], "must be > 0"),
    (["--zk", "127.0.0.1:2181", "group", "a/b"], "must not contain '/'"),
    (["--zk", "127.0.0.1:2181", "group"], "NAME"),
    (["--zk", "127.0.0.1:2181", "nosuch"], "invalid choice"),
    (["tree"], "--zk"),
])
def test_cli_bad_args_exit_2(args: list[str], message: str) -> None:
    r = subprocess.run([sys.executable, "-m", "zk_layout", *args], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert message in r.stderr


def test_cli_unreachable_exit_1() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "zk_layout", "--zk", f"127.0.0.1:{port}",
                        "--timeout", "1", "brokers"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1
    assert f"cannot connect to ZooKeeper at 127.0.0.1:{port} within 1s" in r.stderr
    assert r.stdout == ""


def test_partition_type_in_snapshot_is_value_type(metaq_tree: KazooClient) -> None:
    snap = take_snapshot(metaq_tree, L)
    assert snap.topic("t1").partitions[2] == Partition(broker_id=0, index=10)


# -- static members (consumers/<group>/static/<consumerId>, metaq-py's own record) -------------

SG = "gs"  # a group with static members, on topic t2 (partitions 1-0, 1-1, 1-2)
GRACE_MS = 600_000
DAMAGED_STATIC = f"/meta/consumers/{SG}/static/{SG}_pod-5"
MISNAMED_STATIC = f"/meta/consumers/{SG}/static/{SG}_pod-6"


def _static(instance: str, *, away_since_ms: int | None = None, grace_ms: int = GRACE_MS,
            host: str = "10.0.0.5") -> StaticMember:
    return StaticMember(instance_id=instance, consumer_id=f"{SG}_{instance}", topics=("t2",),
                        grace_ms=grace_ms, session_timeout_ms=10_000,
                        away_since_ms=away_since_ms, host=host)


def build_static_group(client: KazooClient, now_ms: int) -> None:
    """pod-1 live and static; a plain live member; pod-2 away within its hold; pod-3 past
    it; pod-4 just gone (not yet marked away); pod-5 garbage; pod-6 another id's record."""
    live = _static("pod-1", away_since_ms=now_ms - 5000)  # stale mark: its id node wins
    _put(client, L.consumer_id(SG, live.consumer_id), b"t2", ephemeral=True)
    _put(client, L.consumer_id(SG, f"{SG}_10.0.0.7-1-x"), b"t2", ephemeral=True)
    _put(client, L.owner(SG, "t2", "1-0"), live.consumer_id.encode(), ephemeral=True)
    _put(client, L.owner(SG, "t2", "1-1"), f"{SG}_10.0.0.7-1-x".encode(), ephemeral=True)
    for rec in (live, _static("pod-2", away_since_ms=now_ms - 1000, host="10.0.0.6"),
                _static("pod-3", away_since_ms=now_ms - 3_600_000, grace_ms=1000),
                _static("pod-4")):
        _put(client, L.static_member(SG, rec.consumer_id), encode_static_member(rec))
    _put(client, DAMAGED_STATIC, b"\xff\x00garbage")
    other = dataclasses.replace(_static("pod-6"), consumer_id=f"{SG}_pod-7")
    _put(client, MISNAMED_STATIC, encode_static_member(other))


@pytest.fixture
def static_tree(metaq_tree: KazooClient) -> tuple[KazooClient, int]:
    now_ms = int(time.time() * 1000)
    build_static_group(metaq_tree, now_ms)
    return metaq_tree, now_ms


def test_snapshot_static_members(static_tree: tuple[KazooClient, int]) -> None:
    client, now_ms = static_tree
    snap = take_snapshot(client, L, now_ms=now_ms)
    gs = snap.group(SG)
    assert gs.read_at_ms == now_ms
    # live members: the static one flagged with its instance id
    assert [(m.consumer_id, m.static, m.instance_id, m.state_text) for m in gs.members] == [
        (f"{SG}_10.0.0.7-1-x", False, None, "live"),
        (f"{SG}_pod-1", True, "pod-1", "live, static (instance pod-1)"),
    ]
    states = {s.consumer_id: s for s in gs.static_members}
    assert list(states) == [f"{SG}_pod-{i}" for i in (1, 2, 3, 4)]
    pod1, pod2, pod3, pod4 = states.values()
    assert (pod1.state, pod1.held_until_ms) == ("live", None)
    assert pod2.state == "away" and pod2.held_until_ms == now_ms - 1000 + GRACE_MS
    assert pod2.held_until.endswith("Z") and pod2.host == "10.0.0.6"
    assert pod2.state_text(now_ms) == f"away, held until {pod2.held_until} (in 599 s)"
    assert pod3.state == "hold_expired" and pod3.held_until_ms == now_ms - 3_599_000
    assert pod3.state_text(now_ms) == (f"away, hold expired at {pod3.held_until} "
                                       "(awaiting cleanup)")
    assert (pod4.state, pod4.state_text(now_ms)) == ("hold_starting",
                                                     "away (just gone; hold starting)")
    assert [s.consumer_id for s in gs.away_members] == [f"{SG}_pod-{i}" for i in (2, 3, 4)]
    assert gs.held_topics == {"t2"}
    # the garbage and the misnamed record are damage naming their paths; nothing crashed
    assert [d.path for d in gs.damaged] == [DAMAGED_STATIC, MISNAMED_STATIC]
    assert gs.damaged[0].data == b"\xff\x00garbage" and "UTF-8" in gs.damaged[0].error
    assert f"'{SG}_pod-7' is not its node's name" in gs.damaged[1].error
    assert {d.path for d in snap.damaged} >= {DAMAGED_STATIC, MISNAMED_STATIC}
    # 'static' is one of the group's own children, not an unknown node
    assert sorted(snap.unknown) == ["/meta/consumers/g1/notes", "/meta/extra"]
    # the hold is judged at now_ms: past pod-2's hold it is expired too
    later = take_snapshot(client, L, now_ms=now_ms + GRACE_MS).group(SG)
    assert {s.consumer_id: s.state for s in later.static_members}[f"{SG}_pod-2"] == (
        "hold_expired")
    assert later.held_topics == {"t2"}  # pod-4's hold is still starting


def test_static_member_iso_time_is_utc_with_ms() -> None:
    info = StaticMemberInfo.of(_static("p", away_since_ms=1_795_641_230_120, grace_ms=13_000),
                               live=False, now_ms=1_795_641_231_120)
    assert info.held_until == "2026-11-25T21:14:03.120Z"
    assert info.state_text(1_795_641_231_120) == (
        "away, held until 2026-11-25T21:14:03.120Z (in 12 s)")
    huge = StaticMemberInfo.of(_static("p", away_since_ms=2**62), live=False, now_ms=0)
    assert huge.state == "away" and "ms after the epoch" in huge.held_until


def test_read_tree_decodes_static_records(static_tree: tuple[KazooClient, int]) -> None:
    client, _ = static_tree
    nodes = {n.path: n for n in read_tree(client, L)}
    pod4 = nodes[L.static_member(SG, f"{SG}_pod-4")]
    assert pod4.ref.kind is NodeKind.STATIC_MEMBER and pod4.value == _static("pod-4")
    assert nodes[L.static_members(SG)].ref.kind is NodeKind.STATIC_MEMBERS
    assert "UTF-8" in nodes[DAMAGED_STATIC].error


def _line(text: str, *first: str) -> str:
    """The one table row whose first cells are ``first``."""
    (line,) = [ln for ln in text.splitlines() if ln.split()[:len(first)] == list(first)]
    return line


def test_cli_group_static_members(static_tree: tuple[KazooClient, int], zk_connect: str) -> None:
    r = _run_cli(zk_connect, "group", SG)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.splitlines()[0] == f"group {SG}: 2 member(s), 3 away static member(s)"
    assert _line(out, f"{SG}_10.0.0.7-1-x").split()[-1] == "live"
    assert _line(out, f"{SG}_pod-1").rstrip().endswith("live, static (instance pod-1)")
    pod2 = _line(out, f"{SG}_pod-2")
    assert pod2.split()[1:4] == ["t2", "pod-2", "10.0.0.6"]
    assert re.search(r"away, held until 20\d\d-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z \(in 5\d\d s\)$",
                     pod2), pod2
    assert re.search(r"away, hold expired at \S+Z \(awaiting cleanup\)$",
                     _line(out, f"{SG}_pod-3"))
    assert _line(out, f"{SG}_pod-4").endswith("away (just gone; hold starting)")
    # partitions: owned ones as before, the unowned one possibly held
    assert _line(out, "t2", "1-0").split()[2] == f"{SG}_pod-1"
    assert _line(out, "t2", "1-2").endswith("unowned (may be held for an away static member)")
    assert f"{DAMAGED_STATIC}: " in out and f"{MISNAMED_STATIC}: " in out
    assert "2 damaged node(s):" in out

    doc = json.loads(_run_cli(zk_connect, "group", SG, "--json").stdout)
    assert [(m["consumer_id"], m["static"], m["instance_id"]) for m in doc["members"]] == [
        (f"{SG}_10.0.0.7-1-x", False, None), (f"{SG}_pod-1", True, "pod-1")]
    statics = {s["consumer_id"]: s for s in doc["static_members"]}
    assert [s["state"] for s in statics.values()] == ["live", "away", "hold_expired",
                                                      "hold_starting"]
    pod2 = statics[f"{SG}_pod-2"]
    assert pod2["instance_id"] == "pod-2" and pod2["host"] == "10.0.0.6"
    assert pod2["topics"] == ["t2"] and pod2["held_until"].endswith("Z")
    assert pod2["held_until_ms"] == pod2["away_since_ms"] + GRACE_MS
    assert [d["path"] for d in doc["damaged"]] == [DAMAGED_STATIC, MISNAMED_STATIC]

    r = _run_cli(zk_connect, "groups")
    assert r.returncode == 0, r.stderr
    assert "away, held until" in _line(r.stdout, SG, f"{SG}_pod-2")
    assert _line(r.stdout, SG, f"{SG}_pod-1").endswith("live, static (instance pod-1)")
    doc = json.loads(_run_cli(zk_connect, "groups", "--json").stdout)
    (gs,) = [g for g in doc["groups"] if g["group"] == SG]
    assert len(gs["static_members"]) == 4 and gs["read_at_ms"] > 0


def test_snapshot_tolerates_static_records_vanishing(static_tree: tuple[KazooClient, int]) -> None:
    client, now_ms = static_tree
    gone = L.static_member(SG, f"{SG}_pod-2")
    vanishing = _VanishingClient(client, {gone, DAMAGED_STATIC})
    gs = take_snapshot(vanishing, L, now_ms=now_ms).group(SG)
    assert sorted(vanishing.deleted) == sorted({gone, DAMAGED_STATIC})
    assert [s.consumer_id for s in gs.static_members] == [f"{SG}_pod-{i}" for i in (1, 3, 4)]
    assert [d.path for d in gs.damaged] == [MISNAMED_STATIC]
