"""zk_layout against a real ZooKeeper: snapshot of a Metaq-shaped tree and the inspector CLI.

The tree is written with literal bytes, exactly as a Java Metaq 1.4 cluster writes them
(see reference section 1), plus one garbage node and a few nodes Metaq does not define.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from kazoo.client import KazooClient

from zk_layout import (
    BrokerUri,
    Layout,
    NodeKind,
    Partition,
    StoredOffset,
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
    assert rows[0] == ["BROKER", "ROLE", "URI", "LEGACY", "URI", "CHECKSUM", "/", "ERROR"]
    assert ["0", "master", "meta://10.0.0.1:8123", "meta://10.0.0.1:8123", "3141592653"] in rows
    assert ["0", "slave1", "meta://10.0.0.2:8123?slaveId=1", "-", "-"] in rows
    assert ["1", "master", "meta://[::1]:8124", "meta://[::1]:8124", "-"] in rows
    header = r.stdout.splitlines()[0]
    for line in r.stdout.splitlines()[1:]:  # aligned: every URI starts under its header
        assert line[header.index("URI")] != " "
    doc = json.loads(_run_cli(zk_connect, "--json", "brokers").stdout)
    assert [b["broker_id"] for b in doc["brokers"]] == [0, 1]
    assert doc["brokers"][1]["slaves"] == [[0, "meta://10.0.0.3:8125?slaveId=0"]]
    assert doc["damaged"] == []


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
    assert ["g1", "g1_10.0.0.8-66-def", "t1,t2", "-"] in rows
    (damage_line,) = [ln for ln in r.stdout.splitlines() if GARBAGE_PATH + ":" in ln]
    assert damage_line.endswith('(data: "not-an-offset")')
    assert "1 damaged node(s):" in r.stdout

    r = _run_cli(zk_connect, "group", "g1")
    assert r.returncode == 0, r.stderr
    rows = _rows(r.stdout)
    assert ["t1", "0-0", "g1_10.0.0.8-66-def", "4096", "123", "-"] in rows
    assert ["t1", "0-1", "g1_10.0.0.8-66-def", "0", "-1", "-"] in rows
    assert ["t1", "0-2", "-", "4096", "(legacy)", "-"] in rows
    (bad,) = [row for row in rows if row[:2] == ["t1", "0-10"]]
    assert bad[2:5] == ["g1_10.0.0.8-66-def", "-", "-"] and bad[5] == "DAMAGED:"
    assert ["t2", "1-2", "-", "-", "-", "-"] in rows  # the run went on past the garbage
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
    (["--zk", "127.0.0.1:2181", "--root", "meta", "tree"], "absolute path"),
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
