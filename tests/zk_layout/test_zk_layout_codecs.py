"""zk_layout codecs: every node's data both ways, every kind of garbage, and fuzzing.

The expected bytes are Metaq 1.4's (reference section 1), written out literally.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zk_layout import (
    MAX_STATIC_GRACE_MS,
    BrokerUri,
    InvalidNameError,
    Layout,
    NodeDataError,
    NodeRef,
    StaticMember,
    StoredOffset,
    TopicBroker,
    build_consumer_id,
    check_consumer_id,
    check_group,
    check_topic,
    decode_broker_uri,
    decode_node,
    decode_num_parts,
    decode_offset,
    decode_owner,
    decode_static_member,
    decode_topic_broker,
    decode_topic_list,
    encode_broker_uri,
    encode_num_parts,
    encode_offset,
    encode_owner,
    encode_static_member,
    encode_topic_broker,
    encode_topic_list,
)

PATH = "/meta/some/node"
DECODERS = [decode_broker_uri, decode_num_parts, decode_offset, decode_owner,
            decode_static_member, decode_topic_broker, decode_topic_list]


def _garbage(decoder, data, *, reason_part: str | None = None) -> NodeDataError:  # noqa: ANN001
    """``decoder(data, PATH)`` must raise NodeDataError naming the path and the data."""
    with pytest.raises(NodeDataError) as info:
        decoder(data, PATH)
    err = info.value
    assert err.path == PATH and err.data == data
    assert PATH in str(err) and repr(data) in str(err)
    if reason_part is not None:
        assert reason_part in err.reason
    return err


# -- NodeDataError ---------------------------------------------------------------------------


def test_node_data_error_is_value_error_and_picklable() -> None:
    err = NodeDataError(PATH, b"x", "why")
    assert isinstance(err, ValueError)
    back = pickle.loads(pickle.dumps(err))
    assert (back.path, back.data, back.reason, str(back)) == (PATH, b"x", "why", str(err))
    assert str(NodeDataError("", b"x", "why")) == "bad node data: why (data=b'x')"
    name_err = pickle.loads(pickle.dumps(InvalidNameError("topic", "a/b", "no slash")))
    assert isinstance(name_err, ValueError) and str(name_err) == "invalid topic 'a/b': no slash"


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("data, reason", [
    (None, "no data"),
    (b"", "empty"),
    (b"\xff\xfe", "UTF-8"),
    (b"abc\x80", "UTF-8"),
    (12, "expected bytes"),
])
def test_every_decoder_rejects_missing_empty_and_non_utf8(decoder, data, reason) -> None:  # noqa: ANN001
    _garbage(decoder, data, reason_part=reason)


def test_decoders_accept_str_and_bytearray() -> None:
    assert decode_offset("1-2") == decode_offset(bytearray(b"1-2")) == StoredOffset(
        msg_id=1, offset=2)
    assert decode_offset(memoryview(b"7")) == StoredOffset(offset=7, msg_id=None)


def test_error_without_path() -> None:
    with pytest.raises(NodeDataError) as info:
        decode_offset(b"x")
    assert info.value.path == "" and str(info.value).startswith("bad node data: ")


# -- broker URI ------------------------------------------------------------------------------


@pytest.mark.parametrize("uri, data", [
    (BrokerUri("10.0.0.1", 8123), b"meta://10.0.0.1:8123"),
    (BrokerUri("broker-1.example.com", 80), b"meta://broker-1.example.com:80"),
    (BrokerUri("::1", 8123), b"meta://[::1]:8123"),
    (BrokerUri("fe80::1:2", 65535), b"meta://[fe80::1:2]:65535"),
    (BrokerUri("h", 1, slave_id=0), b"meta://h:1?slaveId=0"),
    (BrokerUri("::1", 8123, slave_id=12), b"meta://[::1]:8123?slaveId=12"),
])
def test_broker_uri_both_ways(uri: BrokerUri, data: bytes) -> None:
    assert encode_broker_uri(uri) == data
    assert str(uri) == data.decode()
    assert decode_broker_uri(data) == uri
    assert decode_broker_uri(data.decode()) == uri


@pytest.mark.parametrize("data, uri", [
    # "meta://" + the host as Java's InetAddress.getHostAddress writes an IPv6 address
    # (expanded, no brackets): the port is after the last colon
    (b"meta://0:0:0:0:0:0:0:1:8123", BrokerUri("0:0:0:0:0:0:0:1", 8123)),
    (b"meta://[0:0:0:0:0:0:0:1]:8123", BrokerUri("0:0:0:0:0:0:0:1", 8123)),
    (b"meta://fe80:0:0:0:a00:27ff:fe4e:66a1:8123?slaveId=1",
     BrokerUri("fe80:0:0:0:a00:27ff:fe4e:66a1", 8123, 1)),
    (b"meta://fe80:0:0:0:a00:27ff:fe4e:66a1%eth0:8123",
     BrokerUri("fe80:0:0:0:a00:27ff:fe4e:66a1%eth0", 8123)),
    (b"meta://::1:8123", BrokerUri("::1", 8123)),
    (b"meta://::ffff:10.0.0.1:8123", BrokerUri("::ffff:10.0.0.1", 8123)),
])
def test_broker_uri_ipv6_as_java_writes_it(data: bytes, uri: BrokerUri) -> None:
    assert decode_broker_uri(data) == uri
    assert decode_broker_uri(encode_broker_uri(uri)) == uri  # written back with brackets
    assert encode_broker_uri(uri).startswith(b"meta://[")


def test_broker_uri_helpers() -> None:
    uri = BrokerUri("::1", 8123)
    assert uri.address == ("::1", 8123)
    assert uri.with_slave_id(3) == BrokerUri("::1", 8123, 3)
    assert uri.with_slave_id(3).with_slave_id(None) == uri
    with pytest.raises(TypeError):
        encode_broker_uri("meta://h:1")  # type: ignore[arg-type]


@pytest.mark.parametrize("data", [
    b"http://h:8123", b"meta://h", b"meta://h:", b"meta://:8123", b"meta://h:0",
    b"meta://h:65536", b"meta://h:01", b"meta://h:-1", b"meta://h:80x", b"meta://::1",
    b"meta://1:2:3:4:5:6:7:8", b"meta://0:0:0:0:0:0:0:1", b"meta://zz::1:8123",
    b"meta://1.2.3.4:5:8123", b"meta://::1:8123:", b"meta://::1::8123",
    b"meta://[zz::1]:8123", b"meta://[::1:8123", b"meta://[10.0.0.1]:8123",
    # (Java's query forms, "?slaveId=-1", "?foo=1", "?slaveId=", a path "/", are read as
    # Java reads them: tests/zk_layout/test_zk_layout_slave_forms.py)
    b"meta://h:1?slaveId=x", b"meta://h:1?slaveId=99999999999", b" meta://h:1",
    b"meta://h:1\n", b"meta://h h:1", b"meta://h/x:1", b"meta://user@h:1", b"meta://-h:1",
    b"META://h:1",
])
def test_broker_uri_garbage(data: bytes) -> None:
    _garbage(decode_broker_uri, data)


@pytest.mark.parametrize("host, port, slave", [
    ("", 1, None), ("a b", 1, None), ("zz::1", 1, None), ("h", 0, None), ("h", 65536, None),
    ("h", True, None), ("h", 1, -1), (None, 1, None), ("h", 1, 2**31),
])
def test_broker_uri_rejects_bad_fields(host, port, slave) -> None:  # noqa: ANN001
    with pytest.raises(ValueError):
        BrokerUri(host, port, slave)


# -- topic JSON (topics-pub / topics-sub) ------------------------------------------------------


def test_topic_broker_encodes_exactly_as_metaq() -> None:
    assert encode_topic_broker(TopicBroker(4, 0)) == b'{"numParts":4,"broker":"0-m"}'
    assert encode_topic_broker(TopicBroker(12, 3, 1)) == b'{"numParts":12,"broker":"3-s1"}'
    assert encode_topic_broker(TopicBroker(0, 7)) == b'{"numParts":0,"broker":"7-m"}'
    tb = TopicBroker(1, 2, 0)
    assert (tb.broker, tb.is_master) == ("2-s0", False)
    with pytest.raises(TypeError):
        encode_topic_broker({"numParts": 1})  # type: ignore[arg-type]


@pytest.mark.parametrize("data, expected", [
    (b'{"numParts":4,"broker":"0-m"}', TopicBroker(4, 0)),
    (b'{"broker":"0-m","numParts":4}', TopicBroker(4, 0)),
    (b' {\n  "numParts" : 4 ,\t"broker": "5-s2" }\n', TopicBroker(4, 5, 2)),
    (b'{"numParts":4,"broker":"0-m","extra":[1,{"x":null}]}', TopicBroker(4, 0)),
    (b'{"numParts":2147483647,"broker":"2147483647-m"}', TopicBroker(2**31 - 1, 2**31 - 1)),
])
def test_topic_broker_decode_tolerant_of_layout(data: bytes, expected: TopicBroker) -> None:
    assert decode_topic_broker(data, PATH) == expected


@pytest.mark.parametrize("data, reason", [
    (b"{", "not valid JSON"),
    (b"4", "JSON object"),
    (b'["numParts",4]', "JSON object"),
    (b"null", "JSON object"),
    (b'{"broker":"0-m"}', "numParts"),
    (b'{"numParts":4}', "broker"),
    (b'{"numParts":"4","broker":"0-m"}', "integer"),
    (b'{"numParts":4.0,"broker":"0-m"}', "integer"),
    (b'{"numParts":true,"broker":"0-m"}', "integer"),
    (b'{"numParts":null,"broker":"0-m"}', "integer"),
    (b'{"numParts":-1,"broker":"0-m"}', "between"),
    (b'{"numParts":2147483648,"broker":"0-m"}', "between"),
    (b'{"numParts":NaN,"broker":"0-m"}', "JSON"),
    (b'{"numParts":Infinity,"broker":"0-m"}', "JSON"),
    (b'{"numParts":4,"broker":0}', "string"),
    (b'{"numParts":4,"broker":"0"}', "broker field"),
    (b'{"numParts":4,"broker":"x-m"}', "broker field"),
    (b'{"numParts":4,"broker":"0-s"}', "broker field"),
    (b'{"numParts":4,"broker":"00-m"}', "broker field"),
    (b'{"numParts":4,"numParts":5,"broker":"0-m"}', "duplicate"),
    (b'{"numParts":4,"broker":"0-m"} x', "JSON"),
    (b"[" * 100_000, "JSON"),
])
def test_topic_broker_garbage(data: bytes, reason: str) -> None:
    _garbage(decode_topic_broker, data, reason_part=reason)


@pytest.mark.parametrize("args", [(-1, 0), (2**31, 0), (True, 0), (1, -1), (1, 0, -1),
                                  ("4", 0), (1, 2**31)])
def test_topic_broker_rejects_bad_fields(args: tuple) -> None:
    with pytest.raises(ValueError):
        TopicBroker(*args)


# -- legacy numParts ---------------------------------------------------------------------------


def test_num_parts_both_ways() -> None:
    assert encode_num_parts(4) == b"4"
    assert encode_num_parts(0) == b"0"
    assert decode_num_parts(b"12") == 12
    assert decode_num_parts(b"2147483647") == 2**31 - 1
    for bad in (-1, 2**31, True, "4", 4.0):
        with pytest.raises(ValueError):
            encode_num_parts(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("data", [b"-1", b"4.0", b" 4", b"4\n", b"+4", b"abc", b"2147483648",
                                  b"99999999999", b"04", b"\xd9\xa4", b"{\"numParts\":4}"])
def test_num_parts_garbage(data: bytes) -> None:
    _garbage(decode_num_parts, data)


# -- offsets -----------------------------------------------------------------------------------


@pytest.mark.parametrize("value, data", [
    (StoredOffset(msg_id=123, offset=4096), b"123-4096"),
    (StoredOffset(offset=0), b"-1-0"),
    (StoredOffset(msg_id=-1, offset=0), b"-1-0"),
    (StoredOffset(msg_id=-5, offset=7), b"-5-7"),
    (StoredOffset(msg_id=2**63 - 1, offset=2**63 - 1),
     b"9223372036854775807-9223372036854775807"),
    (StoredOffset(msg_id=-(2**63), offset=0), b"-9223372036854775808-0"),
])
def test_offset_both_ways(value: StoredOffset, data: bytes) -> None:
    assert encode_offset(value) == data
    assert decode_offset(data) == value


def test_offset_parsed_at_last_dash_and_legacy_bare_offset() -> None:
    assert decode_offset(b"-1-0") == StoredOffset(msg_id=-1, offset=0)
    assert decode_offset(b"4096") == StoredOffset(msg_id=None, offset=4096)
    assert decode_offset(b"0") == StoredOffset(msg_id=None, offset=0)
    # a legacy offset without msgId is written back the way Metaq does: msgId -1
    assert encode_offset(StoredOffset(msg_id=None, offset=4096)) == b"-1-4096"
    with pytest.raises(TypeError):
        encode_offset(4096)  # type: ignore[arg-type]


@pytest.mark.parametrize("data", [
    b"abc", b"1-", b"-5", b"-", b"--1-0", b"1--2", b"1-2-3", b"+1-2", b"1-+2", b" 1-2",
    b"1-2 ", b"1-2\n", b"1.5-2", b"1-2.0", b"x-1", b"1-x", b"1-99999999999999999999",
    b"9223372036854775808-0", b"-9223372036854775809-0", b"1-9223372036854775808",
    b"9223372036854775808", b"1_000-2", b"\xd9\xa1-2", b"0x10-2",
])
def test_offset_garbage(data: bytes) -> None:
    _garbage(decode_offset, data)


@pytest.mark.parametrize("kwargs", [{"offset": -1}, {"offset": 2**63}, {"offset": True},
                                    {"offset": 0, "msg_id": 2**63}, {"offset": 0, "msg_id": "1"},
                                    {"offset": 1.0}])
def test_stored_offset_rejects_bad_fields(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        StoredOffset(**kwargs)


# -- consumer ids, topic lists, owners ----------------------------------------------------------


def test_topic_list_both_ways() -> None:
    assert encode_topic_list(["t1", "t2"]) == b"t1,t2"
    assert encode_topic_list(("only",)) == b"only"
    assert encode_topic_list("single") == b"single"
    assert decode_topic_list(b"t1,t2") == ("t1", "t2")
    assert decode_topic_list(b"t2,t1") == ("t2", "t1")  # order kept as written
    assert decode_topic_list("中文,t".encode()) == ("中文", "t")
    with pytest.raises(ValueError):
        encode_topic_list([])
    with pytest.raises(InvalidNameError):
        encode_topic_list(["a,b"])
    with pytest.raises(InvalidNameError):
        encode_topic_list(["t", ""])


@pytest.mark.parametrize("data", [b",", b"t1,", b",t1", b"t1,,t2", b"a/b", b"t 1", b"t1, t2",
                                  b"t1\n", b"t\x00", b"."])
def test_topic_list_garbage(data: bytes) -> None:
    _garbage(decode_topic_list, data, reason_part="bad topic in list")


def test_consumer_id_building() -> None:
    assert build_consumer_id("g", "c1") == "g_c1"
    assert build_consumer_id("grp", ip="10.1.2.3", pid=42, uuid="u-u") == "grp_10.1.2.3-42-u-u"
    auto = build_consumer_id("grp")
    m = re.fullmatch(r"grp_(\d+\.\d+\.\d+\.\d+)-(\d+)-([0-9a-f-]{36})", auto)
    assert m is not None, auto
    import os
    assert int(m.group(2)) == os.getpid()
    assert build_consumer_id("grp") != auto  # a fresh uuid each time
    for bad in (("", "c"), ("a/b", "c"), ("g", "c/d"), ("g", "c d"), (None, "c")):
        with pytest.raises(InvalidNameError):
            build_consumer_id(*bad)


def test_owner_both_ways() -> None:
    cid = build_consumer_id("g", "c1")
    assert encode_owner(cid) == b"g_c1"
    assert decode_owner(b"g_c1") == "g_c1"
    with pytest.raises(InvalidNameError):
        encode_owner("a/b")


@pytest.mark.parametrize("data", [b"a/b", b"a b", b"..", b"x\ty", b"\xef\xbf\xbf"])
def test_owner_garbage(data: bytes) -> None:
    _garbage(decode_owner, data, reason_part="not a consumer id")


# -- static member record (metaq-py's own node) -----------------------------------------------

POD1 = StaticMember(instance_id="pod-1", consumer_id="g_pod-1", topics=("t1", "t2"),
                    grace_ms=30000, session_timeout_ms=10000, host="10.0.0.5")
POD1_BYTES = (b'{"instanceId":"pod-1","consumerId":"g_pod-1","topics":["t1","t2"],'
              b'"graceMs":30000,"sessionTimeoutMs":10000,"awaySinceMs":null,'
              b'"host":"10.0.0.5"}')


def test_static_member_both_ways() -> None:
    assert encode_static_member(POD1) == POD1_BYTES
    assert decode_static_member(POD1_BYTES) == POD1
    away = dataclasses.replace(POD1, away_since_ms=1_795_000_000_000)
    assert decode_static_member(encode_static_member(away)) == away
    assert away.held_until_ms == 1_795_000_030_000 and POD1.held_until_ms is None
    assert away.held(1_795_000_029_999) and not away.held(1_795_000_030_000)
    # key order and spacing are free; host and awaySinceMs may be left out
    obj = json.loads(POD1_BYTES)
    del obj["host"], obj["awaySinceMs"]
    assert decode_static_member(json.dumps(dict(reversed(obj.items())), indent=2)) == (
        dataclasses.replace(POD1, host=""))


@pytest.mark.parametrize("change, reason", [
    ({"instanceId": None}, "missing 'instanceId'"),
    ({"graceMs": None}, "missing 'graceMs'"),
    ({"topics": "t1"}, "topics must be a list"),
    ({"topics": [1]}, "topics must be a list"),
    ({"topics": []}, "at least one topic"),
    ({"topics": ["a,b"]}, "must not contain ','"),
    ({"instanceId": 7}, "instanceId must be a string"),
    ({"instanceId": "a/b"}, "must not contain '/'"),
    ({"consumerId": ""}, "must not be empty"),
    ({"host": 1}, "host must be a string"),
    ({"graceMs": -1}, "grace_ms"),
    ({"graceMs": MAX_STATIC_GRACE_MS + 1}, "grace_ms"),
    ({"graceMs": True}, "grace_ms"),
    ({"graceMs": 1.5}, "grace_ms"),
    ({"sessionTimeoutMs": 2**31}, "session_timeout_ms"),
    ({"awaySinceMs": -5}, "away_since_ms"),
    ({"awaySinceMs": "soon"}, "away_since_ms"),
])
def test_static_member_garbage(change: dict, reason: str) -> None:
    obj = json.loads(POD1_BYTES)
    for key, value in change.items():
        if value is None:
            del obj[key]
        else:
            obj[key] = value
    _garbage(decode_static_member, json.dumps(obj).encode(), reason_part=reason)


@pytest.mark.parametrize("data, reason", [
    (b"pod-1", "not valid JSON"),
    (b"[1,2]", "JSON object"),
    (b'{"graceMs":NaN}', "not valid JSON"),
    (POD1_BYTES[:-1] + b',"host":"h"}', "duplicate key"),
    (b"[" * 100_000, "not valid JSON"),
])
def test_static_member_not_a_record(data: bytes, reason: str) -> None:
    _garbage(decode_static_member, data, reason_part=reason)


def test_encode_static_member_refuses_bad_values() -> None:
    with pytest.raises(TypeError):
        encode_static_member({"instanceId": "x"})  # type: ignore[arg-type]
    for bad in (dataclasses.replace(POD1, topics=()), dataclasses.replace(POD1, grace_ms=-1),
                dataclasses.replace(POD1, instance_id="a/b")):
        with pytest.raises(ValueError):
            encode_static_member(bad)


# -- decode_node ---------------------------------------------------------------------------------

L = Layout()


def _ref(path: str) -> NodeRef:
    ref = L.classify(path)
    assert ref is not None, path
    return ref


def test_decode_node_by_kind() -> None:
    assert decode_node(_ref("/meta/brokers/ids/0"), b"meta://h:1") == BrokerUri("h", 1)
    # an id node a slave created (no data) or the master emptied on shutdown
    assert decode_node(_ref("/meta/brokers/ids/0"), None) is None
    assert decode_node(_ref("/meta/brokers/ids/0"), b"") is None
    assert decode_node(_ref("/meta/brokers/ids/0/master"), b"meta://h:1") == BrokerUri("h", 1)
    # clients see a slave with ?slaveId=N from the node name
    assert decode_node(_ref("/meta/brokers/ids/0/slave2"), b"meta://h:1") == BrokerUri("h", 1, 2)
    assert decode_node(_ref("/meta/brokers/ids/0/slave2"), b"meta://h:1?slaveId=2") == BrokerUri(
        "h", 1, 2)
    assert decode_node(_ref("/meta/brokers/ids/0/master_config_checksum"), b"123") == "123"
    assert decode_node(_ref("/meta/brokers/topics/t/0-m"), b"4") == 4
    assert decode_node(_ref("/meta/brokers/topics/t/0"), b"4") == 4
    assert decode_node(_ref("/meta/brokers/topics-pub/t/0-m"),
                       b'{"numParts":4,"broker":"0-m"}') == TopicBroker(4, 0)
    assert decode_node(_ref("/meta/brokers/topics-sub/t/0-s1"),
                       b'{"numParts":4,"broker":"0-s1"}') == TopicBroker(4, 0, 1)
    assert decode_node(_ref("/meta/consumers/g/ids/g_c"), b"a,b") == ("a", "b")
    assert decode_node(_ref("/meta/consumers/g/owners/t/0-1"), b"g_c") == "g_c"
    assert decode_node(_ref("/meta/consumers/g/offsets/t/0-1"), b"-1-0") == StoredOffset(offset=0)
    assert decode_node(_ref("/meta/consumers/g/static/g_pod-1"), POD1_BYTES) == POD1
    for directory in ("/meta", "/meta/brokers/ids", "/meta/brokers/topics-sub/t",
                      "/meta/consumers/g", "/meta/consumers/g/owners/t"):
        assert decode_node(_ref(directory), b"\xffanything") is None


@pytest.mark.parametrize("path, data, reason", [
    ("/meta/brokers/topics-sub/t/0-m", b'{"numParts":4,"broker":"1-m"}', "does not match"),
    ("/meta/brokers/topics-sub/t/0-m", b'{"numParts":4,"broker":"0-s0"}', "does not match"),
    ("/meta/brokers/topics-pub/t/0-s1", b'{"numParts":4,"broker":"0-s2"}', "does not match"),
    ("/meta/brokers/ids/0/master", b"meta://h:1?slaveId=0", "slaveId"),
    ("/meta/brokers/ids/0/slave1", b"meta://h:1?slaveId=2", "slaveId"),
    ("/meta/brokers/ids/0/master", b"", "empty"),
    ("/meta/brokers/ids/0/master", None, "no data"),
    ("/meta/brokers/ids/0", b"junk", "broker URI"),
    ("/meta/brokers/ids/0/master_config_checksum", b"\xff", "UTF-8"),
    ("/meta/consumers/g/offsets/t/0-1", b"x", "offset"),
])
def test_decode_node_garbage(path: str, data: bytes | None, reason: str) -> None:
    with pytest.raises(NodeDataError) as info:
        decode_node(_ref(path), data)
    assert info.value.path == path and reason in info.value.reason


# -- hypothesis: round trips -----------------------------------------------------------------

_NAME_CHARS = st.characters(blacklist_categories=("Cs", "Cc", "Zs", "Zl", "Zp", "Co"),
                            max_codepoint=0xFFEF)


def _valid(check):  # noqa: ANN001, ANN202
    def ok(name: str) -> bool:
        try:
            check(name)
        except InvalidNameError:
            return False
        return True
    return ok


topics = st.text(_NAME_CHARS, min_size=1, max_size=12).filter(_valid(check_topic))
consumer_ids = st.text(_NAME_CHARS, min_size=1, max_size=30).filter(_valid(check_consumer_id))
hostnames = st.from_regex(r"[A-Za-z0-9_]([A-Za-z0-9_.-]{0,20}[A-Za-z0-9_])?", fullmatch=True)
hosts = st.one_of(hostnames, st.ip_addresses(v=4).map(str), st.ip_addresses(v=6).map(str))
int32 = st.integers(0, 2**31 - 1)


@given(hosts, st.integers(1, 65535), st.none() | int32)
def test_broker_uri_round_trip(host: str, port: int, slave: int | None) -> None:
    uri = BrokerUri(host, port, slave)
    assert decode_broker_uri(encode_broker_uri(uri)) == uri


@given(int32, int32, st.none() | int32)
def test_topic_broker_round_trip(num_parts: int, broker_id: int, slave: int | None) -> None:
    tb = TopicBroker(num_parts, broker_id, slave)
    data = encode_topic_broker(tb)
    assert decode_topic_broker(data) == tb
    # byte-for-byte what a JSON writer with Metaq's field order and no spaces gives
    assert data == json.dumps({"numParts": num_parts, "broker": tb.broker},
                              separators=(",", ":")).encode()


@given(int32, int32, st.none() | int32, st.booleans(), st.sampled_from([None, 0, 2, "\n "]))
def test_topic_broker_decodes_any_key_order_and_spacing(
        num_parts: int, broker_id: int, slave: int | None, reverse: bool, indent) -> None:  # noqa: ANN001
    tb = TopicBroker(num_parts, broker_id, slave)
    obj = {"numParts": num_parts, "broker": tb.broker}
    if reverse:
        obj = dict(reversed(obj.items()))
    assert decode_topic_broker(json.dumps(obj, indent=indent).encode()) == tb


@given(st.integers(0, 2**63 - 1), st.integers(-(2**63), 2**63 - 1))
def test_offset_round_trip(offset: int, msg_id: int) -> None:
    value = StoredOffset(offset=offset, msg_id=msg_id)
    data = encode_offset(value)
    assert data == f"{msg_id}-{offset}".encode()
    assert decode_offset(data) == value


@given(st.integers(0, 2**63 - 1))
def test_legacy_offset_decodes(offset: int) -> None:
    assert decode_offset(str(offset).encode()) == StoredOffset(offset=offset, msg_id=None)


@given(st.lists(topics, min_size=1, max_size=5))
def test_topic_list_round_trip(names: list[str]) -> None:
    assert decode_topic_list(encode_topic_list(names)) == tuple(names)


@given(consumer_ids)
def test_owner_round_trip(cid: str) -> None:
    assert decode_owner(encode_owner(cid)) == cid


@given(int32)
def test_num_parts_round_trip(n: int) -> None:
    assert decode_num_parts(encode_num_parts(n)) == n


instance_ids = st.text(_NAME_CHARS, min_size=1, max_size=20).filter(_valid(check_group))
static_members = st.builds(
    StaticMember, instance_id=instance_ids, consumer_id=consumer_ids,
    topics=st.lists(topics, min_size=1, max_size=4).map(tuple),
    grace_ms=st.integers(0, MAX_STATIC_GRACE_MS), session_timeout_ms=int32,
    away_since_ms=st.none() | st.integers(0, 2**63 - 1), host=st.text(max_size=30))


@given(static_members)
def test_static_member_round_trip(value: StaticMember) -> None:
    data = encode_static_member(value)
    assert decode_static_member(data) == value
    assert decode_static_member(data.decode()) == value


# -- hypothesis: fuzzing, nothing but NodeDataError ---------------------------------------------

_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["numParts", "broker", "x"]) | st.text(max_size=4), inner, max_size=3),
    max_leaves=8)

fuzz_data = st.one_of(
    st.binary(max_size=64),
    st.text(max_size=40).map(lambda s: s.encode("utf-8", "surrogatepass")),
    st.text(max_size=40),
    _json_values.map(lambda v: json.dumps(v).encode()),
    st.from_regex(r"-{0,2}[0-9]{0,22}(-[0-9+ ]{0,22})?", fullmatch=True).map(str.encode),
    st.from_regex(r"meta://\[?[0-9a-z:.]{0,12}\]?(:[0-9]{0,6})?(\?slaveId=[0-9x-]{0,12})?",
                  fullmatch=True).map(str.encode),
    st.from_regex(r"meta://h:1/?(\?[a-zA-Z0-9=&%+ #/?-]{0,24})?", fullmatch=True).map(str.encode),
    st.none(),
)


_STATIC_KEYS = ["instanceId", "consumerId", "topics", "graceMs", "sessionTimeoutMs",
                "awaySinceMs", "host"]
#: near-records: the record's keys (some missing, some extra) with any JSON values,
#: or a valid record's encoding cut short or with one byte changed
static_fuzz_data = st.one_of(
    st.dictionaries(st.sampled_from(_STATIC_KEYS + ["x"]), _json_values | st.lists(
        st.text(max_size=6), max_size=3) | st.integers(-(2**70), 2**70),
        max_size=8).map(lambda d: json.dumps(d).encode()),
    st.tuples(static_members.map(encode_static_member), st.integers(0, 400), st.integers(0, 255))
    .map(lambda t: t[0][:t[1]] + bytes([t[2]]) + t[0][t[1] + 1:]),
    st.tuples(static_members.map(encode_static_member), st.integers(0, 400))
    .map(lambda t: t[0][:t[1]]),
)


def _only_node_data_errors(decoder, data) -> None:  # noqa: ANN001
    try:
        decoder(data, PATH)
    except NodeDataError as e:
        assert e.path == PATH and e.data == data
        assert isinstance(e.reason, str) and e.reason


@given(fuzz_data)
def test_fuzz_decoders_raise_only_node_data_error(data) -> None:  # noqa: ANN001
    for decoder in DECODERS:
        _only_node_data_errors(decoder, data)


@given(fuzz_data | static_fuzz_data)
def test_fuzz_decode_static_member_returns_a_record_or_node_data_error(data) -> None:  # noqa: ANN001
    try:
        value = decode_static_member(data, PATH)
    except NodeDataError as e:
        assert e.path == PATH and e.data == (bytes(data) if isinstance(data, bytes) else data)
        assert isinstance(e.reason, str) and e.reason
        return
    assert isinstance(value, StaticMember)
    assert decode_static_member(encode_static_member(value)) == value


_all_refs = [L.classify(p) for p in (
    "/meta/brokers/ids/0", "/meta/brokers/ids/0/master", "/meta/brokers/ids/0/slave1",
    "/meta/brokers/ids/0/master_config_checksum", "/meta/brokers/topics/t/0-m",
    "/meta/brokers/topics-pub/t/0-m", "/meta/brokers/topics-sub/t/0-s1",
    "/meta/consumers/g/ids/g_c", "/meta/consumers/g/owners/t/0-1",
    "/meta/consumers/g/offsets/t/0-1", "/meta/consumers/g/owners/t",
    "/meta/consumers/g/static/g_pod-1", "/meta/consumers/g/static", "/meta")]


@given(fuzz_data)
def test_fuzz_decode_node_raises_only_node_data_error(data) -> None:  # noqa: ANN001
    for ref in _all_refs:
        try:
            decode_node(ref, data)
        except NodeDataError as e:
            assert e.path == ref.path


@given(st.binary(max_size=64))
def test_fuzz_valid_decodes_re_encode_to_a_decodable_value(data: bytes) -> None:
    """Whatever decodes, encodes back to bytes that decode to the same value."""
    pairs = [(decode_broker_uri, encode_broker_uri), (decode_num_parts, encode_num_parts),
             (decode_offset, encode_offset), (decode_owner, encode_owner),
             (decode_topic_broker, encode_topic_broker), (decode_topic_list, encode_topic_list),
             (decode_static_member, encode_static_member)]
    for decode, encode in pairs:
        try:
            value = decode(data)
        except NodeDataError:
            continue
        again = decode(encode(value))
        if decode is decode_offset and value.msg_id is None:
            # a legacy bare offset is written back as Metaq does: with msgId -1
            value = StoredOffset(offset=value.offset, msg_id=-1)
        assert again == value
