"""Java's slave forms: broker URIs with a query as Metaq 1.4 writes and reads them, and
the slave's read of one master's partitions (``getPartitionStringsForSubTopicsFromMaster``).

The accepted and refused URIs and what they mean are what Java 17 gave for Metaq's
``Broker(int, String)`` parse (``java.net.URI`` + ``URIUtils.parseParameters`` +
``Broker.slaveIdByUri``), written out literally.
"""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kazoo.client import KazooClient

from zk_layout import (
    BrokerUri,
    Layout,
    NodeDataError,
    decode_broker_uri,
    encode_broker_uri,
    read_master_partitions,
)

PATH = "/meta/brokers/ids/0/slave3"


# -- URIs Java accepts ---------------------------------------------------------------------


@pytest.mark.parametrize("data, slave_id", [
    ("meta://h:8123?slaveId=3", 3),
    ("meta://h:8123/?x=1&slaveId=3", 3),          # a path "/", several parameters
    ("meta://h:8123?slaveId=3&x=1", 3),           # in any order
    ("meta://h:8123?slaveId=", None),             # empty: Java's -1, a master
    ("meta://h:8123?slaveId", None),              # no '=' at all: the same
    ("meta://h:8123?slaveId=%20", None),          # blank after decoding
    ("meta://h:8123?slaveId=%E2%80%83", None),    # an em space is Java whitespace too
    ("meta://h:8123?slaveId=-1", None),           # negative: Broker.isSlave is false
    ("meta://h:8123?slaveId=-7", None),
    ("meta://h:8123?slaveId=-2147483648", None),
    ("meta://h:8123?slaveId=-0", 0),              # Integer.parseInt("-0") == 0
    ("meta://h:8123?slaveId=03", 3),
    ("meta://h:8123?slaveId=%2B3", 3),            # "+3" after decoding
    ("meta://h:8123?slaveId=%33", 3),
    ("meta://h:8123?slave%49d=2", 2),             # the name is decoded too
    ("meta://h:8123?slaveId=\u0663", 3),          # a Unicode digit (ARABIC-INDIC THREE)
    ("meta://h:8123?slaveId=2147483647", 2147483647),
    ("meta://h:8123?slaveId=3&slaveId=4", 4),     # the last one wins
    ("meta://h:8123?slaveId=1=", 1),              # String.split drops trailing empties
    ("meta://h:8123?&slaveId=3", 3),
    ("meta://h:8123?a&&slaveId=3&", 3),
    ("meta://h:8123?=3&slaveId=5", 5),            # a nameless parameter is ignored
    ("meta://h:8123?x=a+b&y=%FF&slaveId=1", 1),   # other values are not looked at
    ("meta://h:8123?a=[1]&b=\u00e9&slaveId=2", 2),
    ("meta://h:8123?slaveid=1", None),            # names are case-sensitive
    ("meta://h:8123?x=1", None),
    ("meta://h:8123?", None),
    ("meta://h:8123/", None),
    ("meta://h:8123/p/%41;q?slaveId=3", 3),
    ("meta://h:8123?slaveId=3#frag", 3),
    ("meta://h:8123#[x]", None),
])
def test_java_query_forms_are_read_as_java_reads_them(data: str, slave_id: int | None) -> None:
    uri = decode_broker_uri(data.encode(), PATH)
    assert uri == BrokerUri("h", 8123, slave_id)
    assert decode_broker_uri(encode_broker_uri(uri)) == uri


def test_ipv6_with_a_path_and_query() -> None:
    assert decode_broker_uri(b"meta://[::1]:8123/?x=1&slaveId=2") == BrokerUri("::1", 8123, 2)
    assert decode_broker_uri(b"meta://0:0:0:0:0:0:0:1:8123/?slaveId=") == BrokerUri(
        "0:0:0:0:0:0:0:1", 8123)


# -- URIs Java fails on ----------------------------------------------------------------------


@pytest.mark.parametrize("data, reason_part", [
    ("meta://h:8123?slaveId==3", "bad parameter 'slaveId==3'"),
    ("meta://h:8123?x=1&=", "bad parameter '='"),
    ("meta://h:8123?a=b=c&slaveId=1", "bad parameter 'a=b=c'"),
    ("meta://h:8123?slaveId=x", "slaveId 'x' is not a whole number"),
    ("meta://h:8123?slaveId=+3", "slaveId ' 3'"),         # '+' decodes to a space
    ("meta://h:8123?slaveId=1+", "slaveId '1 '"),
    ("meta://h:8123?slaveId=%2B", "slaveId '+'"),
    ("meta://h:8123?slaveId=-", "slaveId '-'"),
    ("meta://h:8123?slaveId=%FF", "not a whole number"),
    ("meta://h:8123?slaveId=%C2%A03", "not a whole number"),  # no-break space: not blank
    ("meta://h:8123?slaveId=2147483648", "out of Java's int range"),
    ("meta://h:8123?slaveId=-2147483649", "out of Java's int range"),
    ("meta://h:8123?slaveId=99999999999", "out of Java's int range"),
    ("meta://h:8123?x=%zz&slaveId=1", "malformed %-escape in the URI's query at index 16"),
    ("meta://h:8123?slaveId=3%", "malformed %-escape in the URI's query at index 23"),
    ("meta://h:8123?x y=1", "illegal character ' ' in the URI's query at index 15"),
    ("meta://h:8123?a=|", "illegal character '|' in the URI's query"),
    ("meta://h:8123?slaveId=\u3000", "illegal character '\\u3000' in the URI's query"),
    ("meta://h:8123?slaveId=1\n", "illegal character '\\n' in the URI's query"),
    ("meta://h:8123/[x]", "illegal character '[' in the URI's path at index 14"),
    ("meta://h:8123/a b", "illegal character ' ' in the URI's path"),
    ("meta://h:8123#a#b", "illegal character '#' in the URI's fragment at index 15"),
])
def test_what_java_fails_on_is_refused_naming_node_and_fault(data: str, reason_part: str) -> None:
    raw = data.encode()
    with pytest.raises(NodeDataError) as info:
        decode_broker_uri(raw, PATH)
    err = info.value
    assert err.path == PATH and err.data == raw
    assert PATH in str(err) and reason_part in err.reason


@pytest.mark.parametrize("data", [
    # Java's URI takes these as a registry authority: no host, port -1 -- no broker
    "meta://h:8123=", "meta://h:8123x?slaveId=1", "meta://h:8123\u00e9",
])
def test_garbage_after_the_port_is_refused(data: str) -> None:
    with pytest.raises(NodeDataError, match="expected a broker URI"):
        decode_broker_uri(data, PATH)


# -- hypothesis --------------------------------------------------------------------------------

_other_names = st.sampled_from(["x", "a", "slaveid", "slave", "topic", "%41", "b+c"])
_other_values = st.sampled_from(["", "1", "-1", "a+b", "%20", "%FF", "[0]", "x-y"])


@st.composite
def _slave_queries(draw: st.DrawFn) -> tuple[str, int | None]:
    """A query of other parameters in any order with 0-2 ``slaveId`` among them, and the
    slave number Java makes of it (by construction: the last slaveId written)."""
    pieces: list[str] = [
        f"{draw(_other_names)}={draw(_other_values)}"
        for _ in range(draw(st.integers(0, 4)))]
    expected: int | None = None
    for _ in range(draw(st.integers(0, 2))):
        kind = draw(st.sampled_from(["number", "zeros", "negative", "empty", "bare", "blank"]))
        n = draw(st.integers(0, 2**31 - 1))
        at = draw(st.integers(0, len(pieces)))
        text, value = {
            "number": (f"slaveId={n}", n), "zeros": (f"slaveId=00{n}", n),
            "negative": (f"slaveId=-{n + 1}", None), "empty": ("slaveId=", None),
            "bare": ("slaveId", None), "blank": ("slaveId=%20%09", None),
        }[kind]
        pieces.insert(at, text)
        if all(p.split("=")[0] != "slaveId" for p in pieces[at + 1:]):
            expected = value  # the last slaveId in the query is the one Java keeps
    sep = draw(st.sampled_from(["&", "&&"]))
    return sep.join(pieces), expected


_hosts = st.sampled_from([("h", "h"), ("10.0.0.1", "10.0.0.1"), ("[::1]", "::1"),
                          ("broker-1.example.com", "broker-1.example.com")])


@given(_hosts, st.integers(1, 65535), st.sampled_from(["", "/"]), _slave_queries(),
       st.sampled_from(["", "#f"]))
def test_fuzz_java_queries_give_the_slave_java_gives(host, port, path, query, frag) -> None:  # noqa: ANN001
    written, bare_host = host
    text, expected = query
    uri = decode_broker_uri(f"meta://{written}:{port}{path}?{text}{frag}", PATH)
    assert uri == BrokerUri(bare_host, port, expected)


_uri_text = st.one_of(
    st.from_regex(r"meta://(h|10\.0\.0\.1|\[::1\]):[0-9]{1,5}/?(\?[a-zA-Z0-9=&%+ #/?\[\]-]{0,30})?",
                  fullmatch=True),
    st.builds(lambda q: f"meta://h:8123?{q}", st.text(max_size=30)),
)


@given(_uri_text)
def test_fuzz_accepted_uris_round_trip_and_the_rest_raise_node_data_error(text: str) -> None:
    try:
        uri = decode_broker_uri(text, PATH)
    except NodeDataError as e:
        assert e.path == PATH and e.data == text and e.reason
        return
    back = decode_broker_uri(encode_broker_uri(uri), PATH)
    assert (back.host, back.port, back.slave_id) == (uri.host, uri.port, uri.slave_id)
    assert str(back) == str(uri)


# -- the slave's read of one master's partitions (live ZooKeeper) -----------------------------


def _java_broker_nodes(zk: KazooClient) -> None:
    """topics-sub as Java brokers write it: master 0 (t1: 12 parts, t2: 0 parts), its slave 1
    (t1 with more), master 1 (t1, t3); t4 has an empty master node."""
    for path, data in [
        ("/meta/brokers/topics-sub/t1/0-m", b'{"numParts":12,"broker":"0-m"}'),
        ("/meta/brokers/topics-sub/t1/0-s1", b'{"numParts":20,"broker":"0-s1"}'),
        ("/meta/brokers/topics-sub/t1/1-m", b'{"numParts":2,"broker":"1-m"}'),
        ("/meta/brokers/topics-sub/t2/0-m", b'{"numParts":0,"broker":"0-m"}'),
        ("/meta/brokers/topics-sub/t3/1-m", b'{"numParts":1,"broker":"1-m"}'),
        ("/meta/brokers/topics-sub/t4/0-m", b""),
    ]:
        zk.create(path, data, makepath=True)


def test_read_master_partitions_reads_only_that_master(zk_client: KazooClient) -> None:
    _java_broker_nodes(zk_client)
    layout = Layout()
    got = read_master_partitions(zk_client, layout, ["t1", "t2", "t3", "t4", "absent"], 0)
    # Metaq's string order (Collections.sort of "<id>-<n>"): 0-10, 0-11 before 0-2
    assert got == {"t1": ["0-0", "0-1", "0-10", "0-11", "0-2", "0-3", "0-4", "0-5", "0-6",
                          "0-7", "0-8", "0-9"]}
    assert read_master_partitions(zk_client, layout, ["t1", "t3", "t1"], 1) == {
        "t1": ["1-0", "1-1"], "t3": ["1-0"]}
    assert read_master_partitions(zk_client, layout, ["t1"], 7) == {}
    assert read_master_partitions(zk_client, layout, [], 0) == {}


def test_read_master_partitions_under_another_root(zk_client: KazooClient) -> None:
    zk_client.create("/mq/brokers/topics-sub/t/2-m", b'{"numParts":3,"broker":"2-m"}',
                     makepath=True)
    assert read_master_partitions(zk_client, Layout("/mq"), ["t"], 2) == {
        "t": ["2-0", "2-1", "2-2"]}


def test_read_master_partitions_raises_on_damaged_data(zk_client: KazooClient) -> None:
    zk_client.create("/meta/brokers/topics-sub/t/0-m", b'{"numParts":"x"}', makepath=True)
    with pytest.raises(NodeDataError) as info:
        read_master_partitions(zk_client, Layout(), ["t"], 0)
    assert info.value.path == "/meta/brokers/topics-sub/t/0-m"


def test_read_master_partitions_arms_the_watch_on_creation(zk_client: KazooClient) -> None:
    fired = threading.Event()
    assert read_master_partitions(zk_client, Layout(), ["t"], 0,
                                  watch=lambda event: fired.set()) == {}
    zk_client.create("/meta/brokers/topics-sub/t/0-m", b'{"numParts":1,"broker":"0-m"}',
                     makepath=True)
    assert fired.wait(10), "the watch on topics-sub/t/0-m did not fire on its creation"
    assert read_master_partitions(zk_client, Layout(), ["t"], 0) == {"t": ["0-0"]}
