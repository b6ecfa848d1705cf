"""zk_layout paths, names, partitions and Metaq's string order."""

from __future__ import annotations

import dataclasses
import pathlib
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

import zk_layout
from zk_layout import (
    BrokerChild,
    InvalidNameError,
    Layout,
    NodeDataError,
    NodeKind,
    Partition,
    TopicBroker,
    check_consumer_id,
    check_group,
    check_topic,
    metaq_sort_key,
    parse_broker_child,
    parse_broker_id,
    parse_broker_role,
    parse_partition,
    partitions_for_topic,
    sort_consumer_ids,
    sort_partitions,
)

L = Layout()


def test_every_path_under_default_root() -> None:
    assert L.root == "/meta"
    expected = {
        L.brokers(): "/meta/brokers",
        L.broker_ids(): "/meta/brokers/ids",
        L.broker_id(0): "/meta/brokers/ids/0",
        L.broker_master(3): "/meta/brokers/ids/3/master",
        L.broker_slave(3, 2): "/meta/brokers/ids/3/slave2",
        L.broker_config_checksum(3): "/meta/brokers/ids/3/master_config_checksum",
        L.topics_legacy(): "/meta/brokers/topics",
        L.topic_legacy_dir("t"): "/meta/brokers/topics/t",
        L.topic_legacy("t", 1): "/meta/brokers/topics/t/1-m",
        L.topic_legacy("t", 1, 0): "/meta/brokers/topics/t/1-s0",
        L.topics_pub(): "/meta/brokers/topics-pub",
        L.topic_pub_dir("t"): "/meta/brokers/topics-pub/t",
        L.topic_pub("t", 1): "/meta/brokers/topics-pub/t/1-m",
        L.topic_pub("t", 1, 4): "/meta/brokers/topics-pub/t/1-s4",
        L.topics_sub(): "/meta/brokers/topics-sub",
        L.topic_sub_dir("t"): "/meta/brokers/topics-sub/t",
        L.topic_sub("t", 1): "/meta/brokers/topics-sub/t/1-m",
        L.topic_sub("t", 1, slave=2): "/meta/brokers/topics-sub/t/1-s2",
        L.consumer_groups(): "/meta/consumers",
        L.group("g"): "/meta/consumers/g",
        L.consumer_ids("g"): "/meta/consumers/g/ids",
        L.consumer_id("g", "g_c1"): "/meta/consumers/g/ids/g_c1",
        L.owners("g"): "/meta/consumers/g/owners",
        L.owners_dir("g", "t"): "/meta/consumers/g/owners/t",
        L.owner("g", "t", Partition(0, 10)): "/meta/consumers/g/owners/t/0-10",
        L.owner("g", "t", "2-3"): "/meta/consumers/g/owners/t/2-3",
        L.offsets("g"): "/meta/consumers/g/offsets",
        L.offsets_dir("g", "t"): "/meta/consumers/g/offsets/t",
        L.offset("g", "t", Partition(broker_id=1, index=0)): "/meta/consumers/g/offsets/t/1-0",
        L.static_members("g"): "/meta/consumers/g/static",
        L.static_member("g", "g_pod-1"): "/meta/consumers/g/static/g_pod-1",
    }
    for built, path in expected.items():
        assert built == path


@pytest.mark.parametrize("root, expected", [
    ("/meta", "/meta"), ("/meta/", "/meta"), ("/a/b", "/a/b"), ("/a/b//", "/a/b"), ("/", "/"),
    # without the leading slash, as Java's MetaZookeeper.normalize reads a zkRoot
    ("meta", "/meta"), ("meta/", "/meta"), ("a/b", "/a/b"),
])
def test_custom_roots(root: str, expected: str) -> None:
    layout = Layout(root)
    assert layout.root == expected
    prefix = "" if expected == "/" else expected
    assert layout.broker_master(1) == prefix + "/brokers/ids/1/master"
    assert layout.offset("g", "t", "0-1") == prefix + "/consumers/g/offsets/t/0-1"
    assert layout.classify(layout.owner("g", "t", "0-1")).kind is NodeKind.OWNER
    assert layout.classify(expected).kind is NodeKind.ROOT


@pytest.mark.parametrize("root", ["", "/a//b", "a//b", "/a/./b", "/a/../b", "/a b", "a b", None,
                                  3])
def test_bad_roots(root: object) -> None:
    with pytest.raises(InvalidNameError) as info:
        Layout(root)  # type: ignore[arg-type]
    assert info.value.kind == "root"


def test_layout_is_frozen_value() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        L.root = "/x"  # type: ignore[misc]
    assert Layout("/meta/") == Layout() and hash(Layout("/meta/")) == hash(Layout())


@pytest.mark.parametrize("check, value, reason", [
    (check_topic, "", "empty"),
    (check_topic, "a/b", "'/'"),
    (check_topic, "a,b", "','"),
    (check_topic, "a b", "whitespace"),
    (check_topic, "a\tb", "whitespace"),
    (check_topic, "a\x00b", "control"),
    (check_topic, "a\x7fb", "control"),
    (check_topic, ".", "'.'"),
    (check_topic, "..", "'.'"),
    (check_topic, "a\ud800", "control"),
    (check_topic, "emoji\U0001f600", "control"),
    (check_topic, None, "str"),
    (check_topic, b"t", "str"),
    (check_group, "", "empty"),
    (check_group, "g/h", "'/'"),
    (check_group, " g", "whitespace"),
    (check_consumer_id, "", "empty"),
    (check_consumer_id, "c/d", "'/'"),
    (check_consumer_id, "c\nd", "whitespace"),
])
def test_bad_names_raise_clear_value_errors(check, value, reason) -> None:  # noqa: ANN001
    with pytest.raises(ValueError) as info:
        check(value)
    assert isinstance(info.value, InvalidNameError)
    assert reason in str(info.value) and repr(value) in str(info.value)


def test_good_names() -> None:
    for name in ("t", "meta-test_1.x", "中文", "a:b", "A" * 200):
        assert check_topic(name) == name
    assert check_group("g,h") == "g,h"  # commas only matter in topic lists


def test_builders_validate_names() -> None:
    bad_calls = [
        lambda: L.topic_sub_dir(""), lambda: L.topic_sub("a/b", 0), lambda: L.group("a/b"),
        lambda: L.owner("g", "", "0-1"), lambda: L.offset("g", "t", "0_1"),
        lambda: L.offset("g", "t", "x"), lambda: L.consumer_id("g", "a/b"),
        lambda: L.broker_id(-1), lambda: L.broker_id(True), lambda: L.broker_id("0"),
        lambda: L.broker_id(2**31), lambda: L.broker_slave(0, -1), lambda: L.topic_sub("t", 0, -1),
        lambda: L.broker_id(1.0), lambda: L.owner("g", "t", 5),
        lambda: L.static_member("g", "a/b"), lambda: L.static_member("g", ".."),
        lambda: L.static_members("a/b"),
    ]
    for call in bad_calls:
        with pytest.raises(InvalidNameError):
            call()


# -- parsing child names and paths ----------------------------------------------------------


def test_parse_children() -> None:
    assert parse_broker_child("0-m") == BrokerChild(0, True, None) == (0, True, None)
    assert parse_broker_child("12-s3") == (12, False, 3)
    assert parse_partition("0-10") == Partition(broker_id=0, index=10)
    assert Partition.parse("3-0") == Partition(3, 0)
    assert parse_broker_id("17") == 17
    assert parse_broker_role("master") is None
    assert parse_broker_role("slave0") == 0
    assert parse_broker_role("slave12") == 12


@pytest.mark.parametrize("parser, name", [
    (parse_broker_child, "0"), (parse_broker_child, "0-x"), (parse_broker_child, "0-s"),
    (parse_broker_child, "00-m"), (parse_broker_child, "-1-m"), (parse_broker_child, "0-m "),
    (parse_broker_child, "0-s01"), (parse_broker_child, "2147483648-m"), (parse_broker_child, ""),
    (parse_partition, "0"), (parse_partition, "0-"), (parse_partition, "a-1"),
    (parse_partition, "0-01"), (parse_partition, "0-1-2"), (parse_partition, "-1-0"),
    (parse_partition, "0-2147483648"), (parse_partition, "٠-١"), (parse_partition, None),
    (parse_partition, "0--1"), (parse_partition, "-1--2"), (parse_partition, "-2--2"),
    (parse_partition, "-1--1 "), (parse_partition, "-1--01"),
    (parse_broker_id, "x"), (parse_broker_id, "-1"), (parse_broker_id, "01"),
    (parse_broker_id, ""), (parse_broker_id, "2147483648"), (parse_broker_id, "1 "),
    (parse_broker_role, "slave"), (parse_broker_role, "slave-1"), (parse_broker_role, "Master"),
    (parse_broker_role, "slave01"), (parse_broker_role, "master_config_checksum"),
])
def test_parse_rejects(parser, name) -> None:  # noqa: ANN001
    with pytest.raises(InvalidNameError):
        parser(name)


@pytest.mark.parametrize("path, kind, fields", [
    ("/meta", NodeKind.ROOT, {}),
    ("/meta/brokers", NodeKind.BROKERS, {}),
    ("/meta/brokers/ids", NodeKind.BROKER_IDS, {}),
    ("/meta/brokers/ids/4", NodeKind.BROKER_ID, {"broker_id": 4}),
    ("/meta/brokers/ids/4/master", NodeKind.BROKER_MASTER, {"broker_id": 4, "slave_no": None}),
    ("/meta/brokers/ids/4/slave1", NodeKind.BROKER_SLAVE, {"broker_id": 4, "slave_no": 1}),
    ("/meta/brokers/ids/4/master_config_checksum", NodeKind.BROKER_CONFIG_CHECKSUM,
     {"broker_id": 4}),
    ("/meta/brokers/topics", NodeKind.TOPICS_LEGACY, {}),
    ("/meta/brokers/topics/t", NodeKind.TOPIC_LEGACY_DIR, {"topic": "t"}),
    ("/meta/brokers/topics/t/2-m", NodeKind.TOPIC_LEGACY, {"topic": "t", "broker_id": 2}),
    ("/meta/brokers/topics/t/2", NodeKind.TOPIC_LEGACY, {"topic": "t", "broker_id": 2}),
    ("/meta/brokers/topics-pub/t/2-m", NodeKind.TOPIC_PUB, {"topic": "t", "slave_no": None}),
    ("/meta/brokers/topics-pub/t/2-s0", NodeKind.TOPIC_PUB, {"topic": "t", "slave_no": 0}),
    ("/meta/brokers/topics-sub", NodeKind.TOPICS_SUB, {}),
    ("/meta/brokers/topics-sub/t", NodeKind.TOPIC_SUB_DIR, {"topic": "t"}),
    ("/meta/brokers/topics-sub/t/2-s5", NodeKind.TOPIC_SUB,
     {"topic": "t", "broker_id": 2, "slave_no": 5}),
    ("/meta/consumers", NodeKind.CONSUMERS, {}),
    ("/meta/consumers/g", NodeKind.GROUP, {"group": "g"}),
    ("/meta/consumers/g/ids", NodeKind.CONSUMER_IDS, {"group": "g"}),
    ("/meta/consumers/g/ids/g_c", NodeKind.CONSUMER_ID, {"group": "g", "consumer_id": "g_c"}),
    ("/meta/consumers/g/owners", NodeKind.OWNERS, {"group": "g"}),
    ("/meta/consumers/g/owners/t", NodeKind.OWNERS_DIR, {"group": "g", "topic": "t"}),
    ("/meta/consumers/g/owners/t/1-10", NodeKind.OWNER,
     {"group": "g", "topic": "t", "partition": Partition(1, 10), "broker_id": 1}),
    ("/meta/consumers/g/offsets", NodeKind.OFFSETS, {"group": "g"}),
    ("/meta/consumers/g/offsets/t", NodeKind.OFFSETS_DIR, {"topic": "t"}),
    ("/meta/consumers/g/offsets/t/0-0", NodeKind.OFFSET, {"partition": Partition(0, 0)}),
    ("/meta/consumers/g/static", NodeKind.STATIC_MEMBERS, {"group": "g", "consumer_id": None}),
    ("/meta/consumers/g/static/g_pod-1", NodeKind.STATIC_MEMBER,
     {"group": "g", "consumer_id": "g_pod-1", "topic": None}),
])
def test_classify(path: str, kind: NodeKind, fields: dict) -> None:
    ref = L.classify(path)
    assert ref is not None and ref.kind is kind and ref.path == path
    for name, value in fields.items():
        assert getattr(ref, name) == value, name


@pytest.mark.parametrize("path", [
    "/", "/metax", "/other/brokers", "meta", "/meta/", "/meta//brokers", "/meta/x",
    "/meta/brokers/x", "/meta/brokers/ids/abc", "/meta/brokers/ids/0/foo",
    "/meta/brokers/ids/0/master/x", "/meta/brokers/topics-sub/t/x",
    "/meta/brokers/topics-sub/t/0-m/x", "/meta/brokers/topics-pub/t/0",
    "/meta/consumers/g/x", "/meta/consumers/g/ids/c/x", "/meta/consumers/g/owners/t/abc",
    "/meta/consumers/g/offsets/t/0-1/x", "/meta/consumers/g/offsets/a,b",
    "/meta/consumers/g/static/g_c/x", "/meta/consumers/g/static/..", "/meta/consumers/g/statics",
    "/meta/consumers/a b", None,
])
def test_classify_unknown(path: str) -> None:
    assert L.classify(path) is None  # type: ignore[arg-type]


names = st.text(st.characters(blacklist_categories=("Cs", "Cc", "Zs", "Zl", "Zp", "Co"),
                              max_codepoint=0xFFEF), min_size=1, max_size=10)
topics = names.filter(lambda n: n not in (".", "..") and not set(n) & set("/,"))
groups = names.filter(lambda n: n not in (".", "..") and "/" not in n)
ids = st.integers(0, 2**31 - 1)


@given(topics, groups, ids, ids, st.none() | ids)
def test_classify_inverts_builders(topic: str, group: str, broker: int, index: int,
                                   slave: int | None) -> None:
    ref = L.classify(L.topic_sub(topic, broker, slave))
    assert (ref.kind, ref.topic, ref.broker_id, ref.slave_no) == (
        NodeKind.TOPIC_SUB, topic, broker, slave)
    part = Partition(broker, index)
    ref = L.classify(L.offset(group, topic, part))
    assert (ref.kind, ref.group, ref.topic, ref.partition) == (NodeKind.OFFSET, group, topic, part)
    ref = L.classify(L.consumer_id(group, group + "_x"))
    assert (ref.kind, ref.consumer_id) == (NodeKind.CONSUMER_ID, group + "_x")
    ref = L.classify(L.static_member(group, group + "_x"))
    assert (ref.kind, ref.group, ref.consumer_id) == (NodeKind.STATIC_MEMBER, group, group + "_x")


# -- partitions and Metaq's string order ----------------------------------------------------


def test_partition_value_type() -> None:
    p = Partition(broker_id=0, index=10)
    assert str(p) == "0-10" and parse_partition(str(p)) == p
    assert p == Partition(0, 10) and len({p, Partition(0, 10)}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.index = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        _ = p < Partition(0, 2)  # no numeric order: Metaq orders by name
    for bad in ((-1, 0), (0, -1), (-1, -2), (True, 0), (0, 2**31), ("0", 1), (-1.0, -1.0)):
        with pytest.raises(InvalidNameError):
            Partition(*bad)


def test_random_partition_parses() -> None:
    """``"-1--1"``, Java's Partition.RandomPartiton: the only negative partition."""
    p = parse_partition("-1--1")
    assert p == zk_layout.RANDOM_PARTITION == Partition(-1, -1) == Partition.parse("-1--1")
    assert str(p) == "-1--1" and p.is_random and not Partition(0, 0).is_random
    assert (p.broker_id, p.index) == (-1, -1)
    assert L.owner("g", "t", "-1--1") == "/meta/consumers/g/owners/t/-1--1"
    ref = L.classify("/meta/consumers/g/offsets/t/-1--1")
    assert ref is not None and ref.kind is NodeKind.OFFSET and ref.partition == p
    assert [str(x) for x in sort_partitions(["0-1", "-1--1"])] == ["-1--1", "0-1"]


def test_metaq_string_order() -> None:
    names = ["0-2", "0-10", "1-0", "10-0", "2-0", "0-1", "0-0"]
    assert [str(p) for p in sort_partitions(names)] == [
        "0-0", "0-1", "0-10", "0-2", "1-0", "10-0", "2-0"]
    assert sorted(names, key=metaq_sort_key) == ["0-0", "0-1", "0-10", "0-2", "1-0", "10-0", "2-0"]
    assert sort_partitions([Partition(0, 1), "0-1"]) == [Partition(0, 1)]  # de-duplicated
    assert sort_consumer_ids(["g_b", "g_a10", "g_a2", "g_A"]) == ["g_A", "g_a10", "g_a2", "g_b"]


def _pb(n: int, broker: str) -> bytes:
    return b'{"numParts":%d,"broker":"%s"}' % (n, broker.encode())


def test_partitions_for_topic_like_metaq() -> None:
    # the reference's example: 12 parts on broker 0 -> 0-0, 0-1, 0-10, 0-11, 0-2, ...
    parts = partitions_for_topic({"0-m": _pb(12, "0-m")})
    assert [str(p) for p in parts][:5] == ["0-0", "0-1", "0-10", "0-11", "0-2"]
    assert len(parts) == 12
    # master and slave of one broker give the same partitions once; other brokers add theirs
    parts = partitions_for_topic([("0-m", _pb(3, "0-m")), ("0-s1", _pb(3, "0-s1")),
                                  ("1-s0", _pb(2, "1-s0")), ("10-m", TopicBroker(1, 10))])
    assert [str(p) for p in parts] == ["0-0", "0-1", "0-2", "1-0", "1-1", "10-0"]
    # a slave with more partitions than its master contributes them too (as Metaq does)
    assert len(partitions_for_topic({"0-m": _pb(2, "0-m"), "0-s1": _pb(4, "0-s1")})) == 4
    assert partitions_for_topic({}) == []
    assert partitions_for_topic({"0-m": _pb(0, "0-m")}) == []


def test_partitions_for_topic_skips_unknown_names() -> None:
    parts = partitions_for_topic({"junk": b"x", "0": _pb(1, "0-m"), "1-m": _pb(1, "1-m")})
    assert parts == [Partition(1, 0)]


def test_partitions_for_topic_garbage() -> None:
    children = {"0-m": _pb(2, "0-m"), "1-m": b"{bad", "2-m": _pb(3, "9-m"), "3-m": None}
    with pytest.raises(NodeDataError) as info:
        partitions_for_topic(children, dir_path="/meta/brokers/topics-sub/t")
    assert info.value.path == "/meta/brokers/topics-sub/t/1-m"
    seen: list[NodeDataError] = []
    parts = partitions_for_topic(children, dir_path="/d", on_damaged=seen.append)
    assert parts == [Partition(0, 0), Partition(0, 1)]
    assert [e.path for e in seen] == ["/d/1-m", "/d/2-m", "/d/3-m"]
    assert "does not match" in seen[1].reason
    with pytest.raises(NodeDataError) as info:
        partitions_for_topic({"0-m": _pb(2**31 - 1, "0-m")})
    assert "over the limit" in info.value.reason
    assert len(partitions_for_topic({"0-m": _pb(7, "0-m")}, max_parts_per_broker=7)) == 7


@given(st.dictionaries(st.tuples(st.integers(0, 30), st.none() | st.integers(0, 3)),
                       st.integers(0, 15), max_size=8))
def test_partitions_for_topic_matches_the_reference_rule(brokers: dict) -> None:
    """<id>-0 .. <id>-(n-1) for every child, de-duplicated, sorted as strings."""
    children = {}
    for (broker, slave), n in brokers.items():
        name = f"{broker}-m" if slave is None else f"{broker}-s{slave}"
        children[name] = _pb(n, name)
    expected = sorted({f"{name.split('-')[0]}-{i}" for name, data in children.items()
                       for i in range(int(data.split(b":")[1].split(b",")[0]))})
    assert [str(p) for p in partitions_for_topic(children)] == expected


# -- package hygiene ---------------------------------------------------------------------------


def test_public_api_is_curated() -> None:
    assert len(set(zk_layout.__all__)) == len(zk_layout.__all__)
    for name in zk_layout.__all__:
        assert getattr(zk_layout, name) is not None


def test_zk_layout_is_the_real_package_not_this_room() -> None:
    # This room is a directory named zk_layout with no __init__.py, and tests/ is on sys.path:
    # without the repository root on sys.path too (pythonpath in pyproject.toml) it would be
    # imported as an empty namespace package wherever the real one is found only through an
    # editable install's finder.
    assert zk_layout.__file__ is not None, f"namespace package {list(zk_layout.__path__)}"
    pkg = pathlib.Path(zk_layout.__file__).resolve().parent
    room = pathlib.Path(__file__).resolve().parent
    assert pkg != room and room.parent not in pkg.parents, pkg
    assert pathlib.Path(zk_layout.__file__).name == "__init__.py" and zk_layout.Layout


def test_zk_layout_never_imports_metaq() -> None:
    pkg = pathlib.Path(zk_layout.__file__).parent
    for source in pkg.glob("*.py"):
        text = source.read_text()
        assert "import metaq" not in text and "from metaq" not in text, source
    code = ("import sys, zk_layout, zk_layout.__main__; "
            "bad = [m for m in sys.modules if m == 'metaq' or m.startswith('metaq.')]; "
            "assert not bad, bad")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_module_sizes() -> None:
    pkg = pathlib.Path(zk_layout.__file__).parent
    for source in pkg.glob("_*.py"):
        if source.name in ("__init__.py", "_errors.py"):
            continue
        lines = len(source.read_text().splitlines())
        assert lines <= 500, (source.name, lines)
