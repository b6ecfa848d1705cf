"""Random bytes at a live broker: it answers or closes that connection, nothing else."""

from __future__ import annotations

import logging
import socket

import pytest
from helpers.raw_client import RawClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_broker import assert_logs_clean, make_config

from metaq.broker import Broker
from metaq.protocol import (
    QUIT,
    ReplyParser,
    checksum,
    encode_get,
    encode_offset,
    encode_put,
    encode_stats,
    encode_version,
    iter_messages,
)

pytestmark = pytest.mark.broker

topics = st.sampled_from(["t", "other", "nope"])
ints = st.one_of(st.integers(-3, 3), st.integers(-(2 ** 31), 2 ** 31 - 1))


@st.composite
def valid_request(draw) -> bytes:
    kind = draw(st.sampled_from(["put", "badput", "get", "offset", "stats", "version", "quit"]))
    topic = draw(topics)
    if kind in ("put", "badput"):
        payload = draw(st.binary(max_size=200))
        check = checksum(payload) ^ (1 if kind == "badput" else 0)
        return encode_put(topic, draw(st.integers(-2, 2)), payload, draw(ints), check,
                          draw(ints))
    if kind == "get":
        return encode_get(topic, "g", draw(st.integers(-1, 2)), draw(ints), draw(ints),
                          draw(ints))
    if kind == "offset":
        return encode_offset(topic, "g", draw(st.integers(-1, 2)), draw(ints), draw(ints))
    if kind == "stats":
        return encode_stats(draw(st.sampled_from([None, "topics", "offsets", "x"])), draw(ints))
    if kind == "version":
        return encode_version(draw(ints))
    return QUIT


@st.composite
def mutated(draw) -> bytes:
    data = bytearray(draw(valid_request()))
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        i = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[i] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[i:]
        else:
            data[i:i] = draw(st.sampled_from([b" ", b"\r\n", b"-", b"9" * 12, b"\xff", b"\x00"]))
    return bytes(data)


streams = st.lists(st.one_of(valid_request(), mutated(), st.binary(max_size=64)),
                   min_size=1, max_size=12)


def test_random_streams_never_hurt_the_broker(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    cfg = make_config(tmp_path, max_message_size=100_000, max_line=512)
    with Broker(cfg) as broker:
        witness = RawClient(broker.port)

        @settings(max_examples=400, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(streams, st.integers(1, 64))
        def one_connection(parts, chunk):
            data = b"".join(parts)
            s = socket.create_connection(("127.0.0.1", broker.port), timeout=10)
            parser = ReplyParser()
            try:
                try:
                    for i in range(0, len(data), chunk * 7):
                        s.sendall(data[i:i + chunk * 7])
                    s.shutdown(socket.SHUT_WR)
                except OSError:
                    pass  # the broker closed on us while we were still sending: allowed
                while True:
                    got = s.recv(65536)
                    if not got:
                        break
                    parser.feed(got)  # raises if the broker ever sent a malformed reply
            except ConnectionResetError:
                pass  # closed with our bytes unread: the kernel resets; allowed
            else:
                assert parser.buffered == 0, "reply cut short"
            finally:
                s.close()
            # every other connection keeps being served
            assert witness.call(encode_version(77)).opaque == 77

        one_connection()
        # a well-formed client is still served, and the logs are whole
        c = RawClient(broker.port)
        assert c.put("t", 0, b"after the storm", opaque=5).code == 200
        end = broker.offsets("t", 0)[1]
        v = c.call(encode_get("t", "g", 0, 0, 1 << 20, 6))
        msgs = list(iter_messages(v.body, 0))
        assert msgs[-1].next_offset == end
        c.close()
        witness.close()
    assert_logs_clean(cfg.data_dir)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors
