"""The optional C speedups (metaq/protocol/_speedups.c) against the pure-Python code they replace.

Every function of the C module is fuzzed here against its Python twin, on valid
logs, logs cut anywhere, and logs with any byte flipped (lengths, checksums,
ids, flags, bodies), and checked for reference leaks and for argument errors.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import metaq
import metaq.protocol
import metaq.protocol._message as message_module
from metaq import MessageError
from metaq.consumer._message import message_classes
from metaq.protocol import _fast as _native
from metaq.protocol import build_payload, encode_message, get_codec, iter_messages

s = _native.speedups
needs_c = pytest.mark.skipif(s is None, reason=f"C speedups: {_native.SPEEDUPS_STATUS}")

_MAX = 0x7FFFFFFF - 20
_CODEC = get_codec("bytes")
_PLAIN, _ATTR = message_classes(_CODEC)


def _compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "").split()
    return shutil.which(cc[0]) if cc else None


def test_speedups_are_built_wherever_a_compiler_is():
    """pip install builds metaq.protocol._speedups when it can; a silent fallback would hide a
    broken build (and halve the consumer's speed)."""
    if os.environ.get("METAQ_NO_SPEEDUPS"):
        pytest.skip("METAQ_NO_SPEEDUPS is set")
    if _compiler() is None:
        assert s is None  # nothing to check: the pure-Python paths are in use
        return
    assert s is not None, _native.SPEEDUPS_STATUS
    assert s.VERSION == _native.EXPECTED_VERSION


def test_the_switch_turns_them_off_and_pure_python_still_consumes():
    code = ("from metaq.protocol import _fast as _native; from metaq.consumer import _processor;"
            "import metaq.protocol._message as m;"
            "assert _native.speedups is None and _processor._NATIVE is None;"
            "assert m._native is None; print(_native.SPEEDUPS_STATUS)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ,
                         "METAQ_NO_SPEEDUPS": "1"}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "METAQ_NO_SPEEDUPS" in out.stdout


def test_metaq_version_says_whether_they_are_in_use(capsys):
    from metaq._cli import main

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps long lines
    assert out.startswith("metaq-py ") and f"C speedups: {_native.SPEEDUPS_STATUS}" in out


def test_a_stale_build_is_ignored(monkeypatch):
    fake = type(sys)("metaq.protocol._speedups")
    fake.VERSION = _native.EXPECTED_VERSION + 1
    monkeypatch.setitem(sys.modules, "metaq.protocol._speedups", fake)
    monkeypatch.setattr(metaq.protocol, "_speedups", fake, raising=False)
    monkeypatch.delenv("METAQ_NO_SPEEDUPS", raising=False)
    module, status = _native._load()
    assert module is None and "stale build" in status


# -- crc32 ------------------------------------------------------------------------------------

@needs_c
@given(st.binary(max_size=3000), st.integers(0, 2**32 - 1))
def test_crc32_equals_zlib(data, value):
    assert s.crc32(data, value) == zlib.crc32(data, value)
    assert s.crc32(data) == zlib.crc32(data)


@needs_c
def test_crc32_at_every_length_around_the_simd_blocks():
    block = bytes((i * 7 + 3) & 0xFF for i in range(1 << 17))
    for n in list(range(0, 260)) + [1023, 1024, 1025, 65535, 65536, 65537, 1 << 17]:
        assert s.crc32(block[:n]) == zlib.crc32(block[:n]), n
        assert s.crc32(memoryview(block)[1:n + 1]) == zlib.crc32(block[1:n + 1]), n


@needs_c
@pytest.mark.parametrize(("switch", "want"), [("METAQ_NO_AVX512", "sse"),
                                               ("METAQ_NO_CLMUL", "tables")])
def test_crc32_agrees_on_every_code_path(switch, want):
    """CPUs without VPCLMULQDQ fold 128 bits at a time, others (and non-x86) use
    slicing-by-8 tables; the switches force those paths here."""
    code = ("import os, zlib; from metaq.protocol import _speedups as s;"
            "print('avx512' if s.VCLMUL else 'sse' if s.CLMUL else 'tables');"
            "b = os.urandom(70000);"
            "bad = [n for n in list(range(300)) + [1023, 1024, 4097, 70000]"
            "       if s.crc32(b[:n]) != zlib.crc32(b[:n])"
            "       or s.crc32(b[1:n]) != zlib.crc32(b[1:n])];"
            "assert not bad, bad")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, switch: "1"}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ((want,) if want == "tables" else ("sse", "tables"))


@needs_c
def test_crc32_refuses_what_is_not_bytes():
    with pytest.raises(TypeError):
        s.crc32("text")
    with pytest.raises(TypeError):
        s.crc32(None)


# -- logs for the walkers ---------------------------------------------------------------------

_message = st.tuples(st.binary(max_size=150), st.one_of(st.none(), st.text(max_size=6)))


def _log(items, first_id=7):
    out = bytearray()
    for i, (body, attribute) in enumerate(items):
        payload, flag = build_payload(body, attribute)
        out += encode_message(first_id + i, flag, payload)
    return bytes(out)


@st.composite
def logs(draw):
    """A log, maybe cut short, maybe with one byte changed, maybe with garbage after it."""
    buf = bytearray(_log(draw(st.lists(_message, max_size=40))))
    buf = buf[:draw(st.integers(0, len(buf)))]
    if buf and draw(st.booleans()):
        buf[draw(st.integers(0, len(buf) - 1))] ^= draw(st.integers(1, 255))
    if draw(st.booleans()):
        buf += draw(st.binary(max_size=40))
    return bytes(buf)


def _python_scan(buf, max_payload=_MAX):
    saved, message_module._native = message_module._native, None
    try:
        return message_module.scan_messages(buf, max_payload=max_payload)
    finally:
        message_module._native = saved


# -- scan -------------------------------------------------------------------------------------

@needs_c
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(logs(), st.sampled_from([_MAX, 100, 0]))
def test_scan_equals_the_python_scan(buf, max_payload):
    bounds, count, stop, kind, a, b = s.scan(buf, True, max_payload)
    assert (stop, count, message_module.scan_problem(kind, a, b)) == _python_scan(
        buf, max_payload)
    starts = memoryview(bounds).cast("i").tolist()
    assert starts[-1] == stop and len(starts) == count + 1
    ref = []
    try:
        for raw in iter_messages(buf, max_payload=max_payload):
            ref.append(raw.offset)
    except Exception:  # noqa: BLE001 - the reference stops at the bad message too
        pass
    assert starts[:-1] == ref[:count]
    assert s.scan(buf, True, max_payload, False)[0] is None


@needs_c
def test_scan_without_verify_passes_a_bad_checksum_but_not_a_bad_length():
    good = _log([(b"abc", None)] * 3)
    flipped = good[:-1] + bytes([good[-1] ^ 1])
    assert s.scan(flipped, True)[1:4] == (2, len(_log([(b"abc", None)] * 2)), 2)
    assert s.scan(flipped, False)[1:4] == (3, len(good), 0)
    bad = good + (-1).to_bytes(4, "big", signed=True) + bytes(30)
    assert s.scan(bad, False)[1:5] == (3, len(good), 1, -1)


# -- take and deliver -------------------------------------------------------------------------

def _fields(m):
    try:
        split = (m.attribute, m.raw_body)
    except MessageError as e:  # a corrupt attribute section (only unverified)
        split = str(e)
    return (type(m), tuple(m), split)


def _reference(buf, base, verify=True):
    """What the processor must deliver: the whole, valid messages before the first bad
    or cut one, as the pure-Python parser reads them; and where they end."""
    out = []
    try:
        for raw in iter_messages(buf, base, verify=verify, max_payload=_MAX):
            cls = _ATTR if raw.flag & 1 else _PLAIN
            out.append(cls(("t", "0-1", raw.offset, raw.next_offset, raw.msg_id, raw.flag,
                            raw.payload, _CODEC)))
    except MessageError:  # a bad length or checksum ends the walk
        pass
    return out, (out[-1].next_offset - base if out else 0)


def _take_all(buf, base, limit, verify=True, max_bytes=1 << 40):
    got, pos, statuses = [], 0, []
    while True:
        start = pos
        batch, pos, status = s.take(buf, pos, base, limit, max_bytes, verify, _MAX, "t", "0-1",
                                    _CODEC, _PLAIN, _ATTR)
        assert len(batch) <= limit
        if len(batch) > 1:  # a slice stops at the first message that reaches max_bytes
            assert batch[-2].next_offset - base - start < max_bytes
        got += batch
        statuses.append(status)
        if status != s.LIMIT:
            return got, pos, statuses


@needs_c
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(logs(), st.integers(0, 2**40), st.integers(1, 7), st.booleans(),
       st.sampled_from([1, 50, 300, 1 << 40]))
def test_take_builds_exactly_the_reference_messages(buf, base, limit, verify, max_bytes):
    want, end = _reference(buf, base, verify)
    got, pos, statuses = _take_all(buf, base, limit, verify, max_bytes)
    assert [_fields(m) for m in got] == [_fields(m) for m in want]
    assert pos == end
    assert all(x == s.LIMIT for x in statuses[:-1])
    assert statuses[-1] in (s.END, s.BAD)


@needs_c
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(logs(), st.integers(0, 2**40), st.data())
def test_deliver_calls_the_listener_on_the_reference_messages(buf, base, data):
    want, end = _reference(buf, base)
    stop_at = data.draw(st.integers(1, len(want) + 1))  # past the end: never stops
    how = data.draw(st.sampled_from(["raise", "later"]))
    later = object()
    seen = []

    def listener(m):
        seen.append(m)
        if len(seen) == stop_at:
            if how == "raise":
                raise ValueError(f"no {m.offset}")
            return later
        return None

    status, pos, count, last, failed, exc = s.deliver(
        buf, 0, base, True, _MAX, "t", "0-1", _CODEC, _PLAIN, _ATTR, listener, later)
    assert [_fields(m) for m in seen] == [_fields(m) for m in want[:len(seen)]]
    if stop_at <= len(want):
        if how == "raise":
            assert status == s.ERROR and isinstance(exc, ValueError)
            assert exc.__traceback__ is not None
        else:
            assert status == s.LATER and exc is None
        assert count == stop_at - 1 and failed is seen[-1] and pos == failed.offset - base
    else:
        assert status in (s.END, s.BAD) and exc is None and failed is None
        assert count == len(want) and pos == end
    assert last is (seen[count - 1] if count else None)


@needs_c
def test_deliver_stops_at_later_and_lets_base_exceptions_through():
    buf = _log([(b"a", None), (b"b", None), (b"c", None)])
    later = object()
    args = ("t", "0-1", _CODEC, _PLAIN, _ATTR)
    calls = []

    def wants_later(m):
        calls.append(m)
        return later if m.raw_body == b"b" else None

    status, pos, count, last, failed, exc = s.deliver(buf, 0, 0, True, _MAX, *args,
                                                      wants_later, later)
    assert (status, count, last.raw_body, failed.raw_body, exc) == (s.LATER, 1, b"a", b"b",
                                                                     None)
    assert pos == failed.offset

    class Stop(BaseException):
        pass

    def stops(m):
        raise Stop()

    with pytest.raises(Stop):
        s.deliver(buf, 0, 0, True, _MAX, *args, stops, later)


@needs_c
def test_no_reference_is_leaked_per_message():
    buf = _log([(b"x" * 10, None), (b"y", "attr")] * 50)
    topic, partition, ret = "leak-check-topic", "9-9", object()
    before = [sys.getrefcount(o) for o in (topic, partition, _CODEC, ret)]
    for _ in range(20):
        s.take(buf, 0, 0, 1000, 1 << 40, True, _MAX, topic, partition, _CODEC, _PLAIN, _ATTR)
        s.deliver(buf, 0, 0, True, _MAX, topic, partition, _CODEC, _PLAIN, _ATTR,
                  lambda m: ret, None)
        s.deliver(buf, 0, 0, True, _MAX, topic, partition, _CODEC, _PLAIN, _ATTR,
                  lambda m: 1 / 0, None)
    assert [sys.getrefcount(o) for o in (topic, partition, _CODEC, ret)] == before


@needs_c
def test_bad_arguments_are_named():
    buf = _log([(b"a", None)])
    args = (True, _MAX, "t", "0-1", _CODEC)
    with pytest.raises(TypeError, match="plain must be a tuple subclass"):
        s.take(buf, 0, 0, 10, 99, *args, dict, _ATTR)

    class WithDict(tuple):
        pass

    with pytest.raises(TypeError, match="attr must be a tuple subclass"):
        s.take(buf, 0, 0, 10, 99, *args, _PLAIN, WithDict)
    with pytest.raises(ValueError, match="pos outside the data"):
        s.take(buf, len(buf) + 1, 0, 10, 99, *args, _PLAIN, _ATTR)
    with pytest.raises(ValueError, match="pos outside the data"):
        s.deliver(buf, -1, 0, *args, _PLAIN, _ATTR, print, None)
    with pytest.raises(TypeError):
        s.take("not bytes", 0, 0, 10, 99, *args, _PLAIN, _ATTR)


# -- the producer's put lines and the broker's put parser ----------------------------------

@needs_c
@given(st.lists(st.tuples(st.binary(max_size=300), st.integers(0, 2**31 - 1),
                          st.integers(0, 2**31 - 1)), max_size=20),
       st.integers(-(2**31), 2**31 - 1), st.sampled_from([b"put t 0 ", "put ü%d 12 ".encode()]))
def test_encode_puts_equals_the_python_formatting(items, flag, head):
    from metaq.net import _pipeline

    payloads = [p for p, _, _ in items]
    checks = [c for _, c, _ in items]
    opaques = [o for _, _, o in items]
    saved, _pipeline._NATIVE = _pipeline._NATIVE, None
    try:
        want = _pipeline._encode_puts(head, flag, payloads, checks, opaques)
    finally:
        _pipeline._NATIVE = saved
    assert s.encode_puts(head, flag, payloads, checks, opaques) == want
    assert _pipeline._encode_puts(head, flag, payloads, checks, opaques) == want


@needs_c
def test_encode_puts_refuses_what_it_cannot_encode_and_the_caller_falls_back():
    from metaq.net import _pipeline

    with pytest.raises(TypeError, match="payload 1 is not bytes"):
        s.encode_puts(b"put t 0 ", 0, [b"a", bytearray(b"b")], [1, 2], [3, 4])
    with pytest.raises(ValueError, match="different lengths"):
        s.encode_puts(b"put t 0 ", 0, [b"a"], [1, 2], [3])
    data, sizes = _pipeline._encode_puts(b"put t 0 ", 0, [b"a", bytearray(b"b")], [1, 2],
                                         [3, 4])
    assert data == b"put t 0 1 0 1 3\r\naput t 0 1 0 2 4\r\nb" and sizes == [18, 18]


@needs_c
def test_fast_puts_refuses_bad_arguments():
    with pytest.raises(TypeError):
        s.fast_puts(b"", 0, [], 10, [])  # fast must be a dict
    with pytest.raises(ValueError, match="pos outside the data"):
        s.fast_puts(b"put", 4, {}, 10, [])
    out = []
    assert s.fast_puts(b"put t 0 1 0 5 7\r\nxput t 0 1 0 5 7\r\n", 0, {b"t 0": "T"}, 10,
                       out) == 18  # the second put's payload has not arrived
    assert out == [("T", 1, 0, 5, b"7", b"x")]


# -- the broker's put loop: C against its Python twin (metaq/protocol/_fast.py) -------------

_PUT_KEYS = {f"{t} {p}".encode(): f"{t[:3]}/{p}" for t in ("t", "ü", "a" * 255)
             for p in ("0", "12", "-1", "3")}
_PUT_KEYS.update({b"t 00": "T00", b"a" * 256 + b" 0": "A256", b"t 5": None})


def _token(common: list[str], edges: list[str]) -> st.SearchStrategy[str]:
    """Mostly a valid token (so that runs of puts are taken), else an edge case."""
    return st.sampled_from(common * 40 + edges)


_put_fields = st.tuples(
    _token(["t", "ü", "a" * 255], ["x", "a" * 256, "t\t", "", "t\r"]),
    _token(["0", "12", "-1", "3"], ["00", "5", "-0", "012", "99999999999", "1x"]),
    _token(["len"], ["0len", "-1", "99999999999", "+1"]),
    _token(["0", "1", "-1"], ["00", "-0", "2147483647", "2147483648", "-2147483648",
                              "-2147483649", "9999999999", "99999999999"]),
    _token(["0", "5", "2147483647"], ["2147483648", "-1", "9999999999", "00"]),
    _token(["1", "-7", "2147483647"], ["2147483648", "-2147483648", "-2147483649",
                                       "0000000001", "-000000001", "12345678901", "", "-"]),
    _token([" "], ["  ", "\t"]),
    _token(["\r\n"], ["\n", " \r\n", "\r"]),
    st.binary(max_size=12))


def _put_bytes(fields: tuple) -> bytes:
    topic, part, length, flag, check, opaque, sep, eol, payload = fields
    length = length.replace("len", str(len(payload)))
    return (sep.join(["put", topic, part, length, flag, check, opaque]) + eol).encode() + payload


@needs_c
@settings(max_examples=500)
@given(st.lists(_put_fields, max_size=10), st.binary(max_size=20), st.integers(0, 100),
       st.integers(0, 2000), st.integers(0, 2000))
def test_fast_puts_equals_its_python_twin(items, junk, max_payload, start, cut):
    data = b"".join(map(_put_bytes, items)) + junk
    data = data[:cut % (len(data) + 1)]
    pos = start % (len(data) + 1)
    got_c: list = []
    got_py: list = []
    stop_c = s.fast_puts(data, pos, _PUT_KEYS, max_payload, got_c)
    stop_py = _native.fast_puts_python(data, pos, _PUT_KEYS, max_payload, got_py)
    assert (stop_c, got_c) == (stop_py, got_py)
    assert all(type(v) is bytes for t in got_py for v in (t[4], t[5]))


def test_fast_puts_python_contract():
    out: list = []
    assert _native.fast_puts_python(b"put t 0 1 0 5 7\r\nxput t 0 1 0 5 7\r\n", 0,
                                    {b"t 0": "T"}, 10, out) == 18
    assert out == [("T", 1, 0, 5, b"7", b"x")]
    with pytest.raises(ValueError, match="pos outside the data"):
        _native.fast_puts_python(b"put", 4, {}, 10, [])
    # the binding: C when built, else the twin
    assert _native.fast_puts is (_native.fast_puts_python if s is None else s.fast_puts)
