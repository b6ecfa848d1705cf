"""encode_tx_puts (issue 29): a transaction's puts to one partition encoded together,
in C and by its Python twin, give exactly the bytes encode_put gives one by one."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metaq.protocol import _fast, encode_put, encode_tx_puts

INT32 = st.integers(-(2**31), 2**31 - 1)
puts = st.lists(st.tuples(st.binary(max_size=300), INT32, INT32), max_size=30)
keys = st.sampled_from(["TX:host-1-2:1", "TX:a%b:7", "XID:1:ab:cd:q%d"])


@settings(max_examples=300, deadline=None)
@given(puts, keys, st.sampled_from(["t", "t%p", "orders"]), st.integers(0, 999),
       st.sampled_from([0, 1, 2**31 - 1, -5]))
def test_encode_tx_puts_is_encode_put_of_each(items, key, topic, partition, flag):
    payloads = [p for p, _c, _o in items]
    checksums = [c for _p, c, _o in items]
    opaques = [o for _p, _c, o in items]
    want = b"".join(encode_put(topic, partition, p, flag, c, o, key) for p, c, o in items)
    assert encode_tx_puts(topic, partition, flag, payloads, checksums, key, opaques) == want
    head = b"put %b %d " % (topic.encode(), partition)
    assert _fast.py_encode_tx_puts(head, flag, payloads, checksums, key.encode(),
                                   opaques) == want
    if _fast._c_encode_tx_puts is not None:
        assert _fast._c_encode_tx_puts(head, flag, payloads, checksums, key.encode(),
                                       opaques) == want


def test_encode_tx_puts_refuses_what_encode_put_refuses():
    from metaq import ProtocolError

    with pytest.raises(ProtocolError, match="tx_key"):
        encode_tx_puts("t", 0, 0, [b"x"], [1], "has space", [1])
    with pytest.raises(ValueError, match="different lengths"):
        encode_tx_puts("t", 0, 0, [b"x"], [1, 2], "TX:a:1", [1])
    # not bytes and ints: the Python formatting takes them (C only takes those)
    assert encode_tx_puts("t", 0, 0, [bytearray(b"x")], [1], "TX:a:1", [2]) == \
        encode_put("t", 0, b"x", 0, 1, 2, "TX:a:1")
