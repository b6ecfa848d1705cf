"""The optional C speedups (metaq/protocol/_speedups.c) against their Python twins.

Every function of the C module is fuzzed here against its Python twin in
metaq/protocol/_fast.py (``py_<name>``), on valid logs, logs cut anywhere, and
logs with any byte flipped (lengths, checksums, ids, flags, bodies), and checked
for reference leaks and for argument errors (the twins raise the same).  Which
of the two each name of metaq.protocol is bound to is checked too.
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import metaq
import metaq.protocol
import metaq.protocol._message as message_module
from metaq import MessageError
from metaq.consumer._message import message_classes
from metaq.protocol import _fast, build_payload, encode_message, get_codec, iter_messages

s = _fast.speedups
needs_c = pytest.mark.skipif(s is None, reason=f"C speedups: {_fast.SPEEDUPS_STATUS}")
#: each test that takes ``impl`` runs on the C functions (when built) and on the twins
both = pytest.mark.parametrize("impl", [pytest.param("c", marks=needs_c), "python"])


def _fn(impl, name):
    """The C function ``name``, or its Python twin."""
    return getattr(s, name) if impl == "c" else getattr(_fast, f"py_{name}")


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
    assert s is not None, _fast.SPEEDUPS_STATUS
    assert s.VERSION == _fast.EXPECTED_VERSION


_BOUND_TO_TWINS = (
    "import metaq.protocol as p; from metaq.protocol import _fast as f;"
    "twins = {n: getattr(f, 'py_' + n) for n in"
    "         ('crc32', 'scan', 'take', 'deliver', 'prepare', 'encode_puts')};"
    "wrong = [n for n, t in twins.items() if getattr(f, n) is not t or getattr(p, n) is not t];"
    "assert f.speedups is None and not f.SPEEDUPS_IN_USE and not wrong, wrong;")


def test_the_switch_binds_the_twins_and_pure_python_still_consumes():
    code = (_BOUND_TO_TWINS
            + "from metaq.consumer._processor import process_batch;"
            "from metaq.consumer._subscription import PartitionState;"
            "from metaq.spark import _arrow;"
            "assert _arrow._walk is _arrow._walk_leaping;"
            "log = b''.join(p.encode_message(i, 0, b'x' * i) for i in range(5));"
            "got = [];"
            "pf = PartitionState(topic='t', partition='0-0', broker_id=0, index=0,"
            "    broker_address=None, offset=0, msg_id=-1, max_size=1024, listener=got.append,"
            "    batch_listener=None, codec=p.get_codec('bytes'), verify=True, max_retries=0);"
            "assert process_batch(pf, memoryview(log)).consumed == 5;"
            "assert [m.body for m in got] == [b'x' * i for i in range(5)];"
            "print(f.SPEEDUPS_STATUS)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ,
                         "METAQ_NO_SPEEDUPS": "1"}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "METAQ_NO_SPEEDUPS" in out.stdout


@needs_c
def test_with_them_the_names_are_bound_to_c():
    bound = {"scan": s.scan, "take": s.take, "deliver": s.deliver, "prepare": _fast.c_prepare,
             "encode_puts": _fast.c_encode_puts}
    assert {n: getattr(metaq.protocol, n) for n in bound} == bound
    assert all(getattr(_fast, n) is f for n, f in bound.items())
    assert _fast.SPEEDUPS_IN_USE
    # ISA-L's crc32 is cheaper to call than the extension's; else the extension's
    assert _fast.crc32 is (_fast.py_crc32 if _fast.CRC32_IMPL == "isal" else s.crc32)


@needs_c
def test_the_statuses_are_the_c_ones():
    assert (s.END, s.LIMIT, s.BAD, s.LATER, s.ERROR) == (
        _fast.ST_END, _fast.ST_LIMIT, _fast.ST_BAD, _fast.ST_LATER, _fast.ST_ERROR)


def test_metaq_version_says_whether_they_are_in_use(capsys):
    from metaq._cli import main

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps long lines
    assert out.startswith("metaq-py ") and f"C speedups: {_fast.SPEEDUPS_STATUS}" in out


def test_a_stale_build_is_ignored(monkeypatch):
    fake = type(sys)("metaq.protocol._speedups")
    fake.VERSION = _fast.EXPECTED_VERSION + 1
    monkeypatch.setitem(sys.modules, "metaq.protocol._speedups", fake)
    monkeypatch.setattr(metaq.protocol, "_speedups", fake, raising=False)
    monkeypatch.delenv("METAQ_NO_SPEEDUPS", raising=False)
    module, status = _fast._load()
    assert module is None and "stale build" in status


# -- crc32 ------------------------------------------------------------------------------------

@both
@given(data=st.binary(max_size=3000), value=st.integers(0, 2**32 - 1))
def test_crc32_equals_zlib(impl, data, value):
    crc32 = _fn(impl, "crc32")
    assert crc32(data, value) == zlib.crc32(data, value)
    assert crc32(data) == zlib.crc32(data) == _fast.crc32(data)


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


@both
def test_crc32_refuses_what_is_not_bytes(impl):
    with pytest.raises(TypeError):
        _fn(impl, "crc32")("text")
    with pytest.raises(TypeError):
        _fn(impl, "crc32")(None)


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
    saved, message_module.scan = message_module.scan, _fast.py_scan
    try:
        return message_module.scan_messages(buf, max_payload=max_payload)
    finally:
        message_module.scan = saved


# -- scan -------------------------------------------------------------------------------------

@needs_c
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(logs(), st.sampled_from([_MAX, 100, 0, -1, 2**40]), st.booleans(), st.booleans())
def test_scan_equals_its_twin(buf, max_payload, verify, bounds):
    got = s.scan(buf, verify, max_payload, bounds)
    assert got == _fast.py_scan(buf, verify, max_payload, bounds)
    assert got == _fast.py_scan(memoryview(bytearray(buf)), verify, max_payload, bounds)


@both
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(buf=logs(), max_payload=st.sampled_from([_MAX, 100, 0]))
def test_scan_finds_what_the_reference_finds(impl, buf, max_payload):
    bounds, count, stop, kind, a, b = _fn(impl, "scan")(buf, True, max_payload)
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
    assert _fn(impl, "scan")(buf, True, max_payload, False)[0] is None


@both
def test_scan_without_verify_passes_a_bad_checksum_but_not_a_bad_length(impl):
    scan = _fn(impl, "scan")
    good = _log([(b"abc", None)] * 3)
    flipped = good[:-1] + bytes([good[-1] ^ 1])
    assert scan(flipped, True)[1:4] == (2, len(_log([(b"abc", None)] * 2)), 2)
    assert scan(flipped, False)[1:4] == (3, len(good), 0)
    bad = good + (-1).to_bytes(4, "big", signed=True) + bytes(30)
    assert scan(bad, False)[1:5] == (3, len(good), 1, -1)


@both
def test_scan_refuses_what_is_not_bytes(impl):
    with pytest.raises(TypeError):
        _fn(impl, "scan")("text")


# -- take and deliver -------------------------------------------------------------------------

#: a message's fields that never raise (raw_body and body may, with an attribute)
_SAFE_FIELDS = ("topic", "partition", "offset", "next_offset", "msg_id", "flag", "payload")


def _fields(m):
    if m is None:
        return None
    try:
        split = (m.attribute, m.raw_body, m.body)
    except MessageError as e:  # a corrupt attribute section (only unverified)
        split = str(e)
    named = tuple(getattr(m, name) for name in _SAFE_FIELDS)
    assert named == (*m[:6], m[6])  # each name reads its item of the layout
    return (type(m), tuple(m), split, named)


def _reference(buf, base, verify=True):
    """What the processor must deliver: the whole, valid messages before the first bad
    or cut one, as the pure-Python parser reads them; and where they end."""
    out = []
    saved, message_module.scan = message_module.scan, _fast.py_scan
    try:
        for raw in iter_messages(buf, base, verify=verify, max_payload=_MAX):
            cls = _ATTR if raw.flag & 1 else _PLAIN
            out.append(cls(("t", "0-1", raw.offset, raw.next_offset, raw.msg_id, raw.flag,
                            raw.payload, _CODEC)))
    except MessageError:  # a bad length or checksum ends the walk
        pass
    finally:
        message_module.scan = saved
    return out, (out[-1].next_offset - base if out else 0)


def _take_all(take, buf, base, limit, verify=True, max_bytes=1 << 40):
    got, pos, statuses = [], 0, []
    while True:
        start = pos
        batch, pos, status = take(buf, pos, base, limit, max_bytes, verify, _MAX, "t", "0-1",
                                  _CODEC, _PLAIN, _ATTR)
        assert len(batch) <= limit
        if len(batch) > 1:  # a slice stops at the first message that reaches max_bytes
            assert batch[-2].next_offset - base - start < max_bytes
        got += batch
        statuses.append(status)
        if status != _fast.ST_LIMIT:
            return got, pos, statuses


@needs_c
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(logs(), st.integers(0, 2**40), st.integers(-1, 7), st.booleans(),
       st.sampled_from([0, 1, 50, 300, 1 << 40]), st.sampled_from([_MAX, 100, 0, 2**40]),
       st.integers(0, 500))
def test_take_equals_its_twin(buf, base, limit, verify, max_bytes, max_payload, pos):
    """From any position (a message's start or not), any limits."""
    args = (min(pos, len(buf)), base, limit, max_bytes, verify, max_payload, "t", "0-1",
            _CODEC, _PLAIN, _ATTR)
    for data in (buf, memoryview(bytearray(buf))):
        got, want = s.take(data, *args), _fast.py_take(data, *args)
        assert [_fields(m) for m in got[0]] == [_fields(m) for m in want[0]]
        assert got[1:] == want[1:]


@both
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(buf=logs(), base=st.integers(0, 2**40), limit=st.integers(1, 7), verify=st.booleans(),
       max_bytes=st.sampled_from([1, 50, 300, 1 << 40]))
def test_take_builds_exactly_the_reference_messages(impl, buf, base, limit, verify, max_bytes):
    want, end = _reference(buf, base, verify)
    got, pos, statuses = _take_all(_fn(impl, "take"), buf, base, limit, verify, max_bytes)
    assert [_fields(m) for m in got] == [_fields(m) for m in want]
    assert pos == end
    assert all(x == _fast.ST_LIMIT for x in statuses[:-1])
    assert statuses[-1] in (_fast.ST_END, _fast.ST_BAD)


def _stopping_listener(stop_at, how, later):
    """A listener that takes messages until the ``stop_at``-th, which it refuses."""
    seen = []

    def listener(m):
        seen.append(m)
        if len(seen) == stop_at:
            if how == "raise":
                raise ValueError(f"no {m.offset}")
            return later
        return None

    return listener, seen


@needs_c
@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(logs(), st.integers(0, 2**40), st.booleans(), st.sampled_from([_MAX, 100, 0]),
       st.integers(0, 500), st.integers(1, 45), st.sampled_from(["raise", "later"]))
def test_deliver_equals_its_twin(buf, base, verify, max_payload, pos, stop_at, how):
    later = object()
    results = []
    for deliver in (s.deliver, _fast.py_deliver):
        listener, seen = _stopping_listener(stop_at, how, later)
        status, end, count, last, failed, exc = deliver(
            buf, min(pos, len(buf)), base, verify, max_payload, "t", "0-1", _CODEC, _PLAIN,
            _ATTR, listener, later)
        results.append(([_fields(m) for m in seen], status, end, count, _fields(last),
                        _fields(failed), type(exc), str(exc)))
        assert exc is None or exc.__traceback__ is not None
    assert results[0] == results[1]


@both
@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(buf=logs(), base=st.integers(0, 2**40), data=st.data())
def test_deliver_calls_the_listener_on_the_reference_messages(impl, buf, base, data):
    want, end = _reference(buf, base)
    stop_at = data.draw(st.integers(1, len(want) + 1))  # past the end: never stops
    how = data.draw(st.sampled_from(["raise", "later"]))
    later = object()
    listener, seen = _stopping_listener(stop_at, how, later)
    status, pos, count, last, failed, exc = _fn(impl, "deliver")(
        buf, 0, base, True, _MAX, "t", "0-1", _CODEC, _PLAIN, _ATTR, listener, later)
    assert [_fields(m) for m in seen] == [_fields(m) for m in want[:len(seen)]]
    if stop_at <= len(want):
        if how == "raise":
            assert status == _fast.ST_ERROR and isinstance(exc, ValueError)
            assert exc.__traceback__ is not None
        else:
            assert status == _fast.ST_LATER and exc is None
        assert count == stop_at - 1 and failed is seen[-1] and pos == failed.offset - base
    else:
        assert status in (_fast.ST_END, _fast.ST_BAD) and exc is None and failed is None
        assert count == len(want) and pos == end
    assert last is (seen[count - 1] if count else None)


@both
def test_deliver_stops_at_later_and_lets_base_exceptions_through(impl):
    deliver = _fn(impl, "deliver")
    buf = _log([(b"a", None), (b"b", None), (b"c", None)])
    later = object()
    args = ("t", "0-1", _CODEC, _PLAIN, _ATTR)
    calls = []

    def wants_later(m):
        calls.append(m)
        return later if m.raw_body == b"b" else None

    status, pos, count, last, failed, exc = deliver(buf, 0, 0, True, _MAX, *args,
                                                    wants_later, later)
    assert (status, count, last.raw_body, failed.raw_body, exc) == (_fast.ST_LATER, 1, b"a",
                                                                     b"b", None)
    assert pos == failed.offset

    class Stop(BaseException):
        pass

    def stops(m):
        raise Stop()

    with pytest.raises(Stop):
        deliver(buf, 0, 0, True, _MAX, *args, stops, later)


def _private_kind():
    """(topic, partition, codec, plain, attr) that no other code holds: their reference
    counts move only with what the C functions do with them.  (The bytes codec is every
    consumer's: a thread another test left running, taking messages, moves its count.)
    Each live message holds a reference to its class, so the classes count messages."""

    class Plain(_PLAIN):
        __slots__ = ()

    class Attr(_ATTR):
        __slots__ = ()

    return "-".join(["leak", "check", "topic"]), "-".join(["9", "9"]), object(), Plain, Attr


def _refcounts(objs):
    gc.collect()  # garbage cycles (tracebacks of frames) are not leaks; a lost decref is not
    return [sys.getrefcount(o) for o in objs]  # collectable, so this hides none of them


class _Stop(BaseException):
    pass


def _every_path(data, kind, ret, later):
    """take and deliver along each of their paths once, with ``data``."""
    topic, partition, codec, plain, attr = kind
    for limit, verify in ((1000, True), (7, True), (1000, False), (0, True)):
        s.take(data, 0, 0, limit, 1 << 40, verify, _MAX, *kind)
    s.take(data, 0, 0, 1000, 30, True, _MAX, *kind)  # max_bytes
    seen = iter(range(1 << 30))

    def listeners():
        yield lambda m: ret  # END or BAD
        yield lambda m: later  # LATER at the first message
        yield lambda m: later if next(seen) % 17 == 16 else ret  # LATER further on
        yield lambda m: 1 / 0  # ERROR at the first
        yield lambda m: ret if next(seen) % 13 else [][m.offset]  # ERROR further on
        yield lambda m: ret if next(seen) % 11 else _raise(_Stop())  # a BaseException

    for listener in listeners():
        try:
            s.deliver(data, 0, 0, True, _MAX, *kind, listener, later)
        except _Stop:
            pass
    with pytest.raises(ValueError):
        s.take(data, len(data) + 1, 0, 10, 99, True, _MAX, *kind)
    with pytest.raises(TypeError):
        s.deliver(data, 0, 0, True, _MAX, topic, partition, codec, dict, attr, print, later)


def _raise(e):
    raise e


@needs_c
def test_no_reference_is_leaked_per_message():
    """Every path of take and deliver (END, LIMIT, BAD, LATER, ERROR, a BaseException, bad
    arguments), on bytes, a bytearray and a memoryview, leaves the reference counts of all
    they were given as they were, and no buffer exported."""
    kind = _private_kind()
    ret, later = object(), object()
    good = _log([(b"x" * 10, None), (b"y", "attr")] * 50)
    bad = good[:-1] + bytes([good[-1] ^ 1])  # the last checksum does not match
    for log in (good, bad, good[:-5]):
        for form in (bytes, bytearray, lambda b: memoryview(bytearray(b))):
            data = form(log)
            _every_path(data, kind, ret, later)  # anything cached on a first call
            before = _refcounts((*kind, ret, later, data))
            for _ in range(10):
                _every_path(data, kind, ret, later)
            assert _refcounts((*kind, ret, later, data)) == before
            if isinstance(data, bytearray):
                data += b"."  # refused while a buffer of it is still exported
            elif isinstance(data, memoryview):
                data.release()


@needs_c
def test_threads_calling_them_at_once_leave_every_count_as_it_was():
    """take and deliver along every path, scan and crc32 (those two without the GIL on
    long data) from four threads at once for a second, collections running: the
    reference counts of everything they were given are the same after."""
    kinds = [_private_kind() for _ in range(2)]
    ret, later = object(), object()
    good = _log([(b"x" * 10, None), (b"y", "attr"), (b"z" * 3000, None)] * 40)
    logs = [good, bytearray(good), memoryview(good)[:-7], good[:-1] + bytes([good[-1] ^ 1])]
    big = bytearray(good * 3)
    counted = (*kinds[0], *kinds[1], ret, later, big, *logs)
    before = _refcounts(counted)
    deadline = time.monotonic() + 1.0
    errors = []

    def work(i):
        try:
            n = 0
            while time.monotonic() < deadline or n < 3:
                n += 1
                _every_path(logs[(i + n) % len(logs)], kinds[n % 2], ret, later)
                assert s.scan(big, True, _MAX, n % 2 == 0)[1] == 360
                assert s.crc32(big) == zlib.crc32(big)
                if n % 5 == 0:
                    gc.collect()
        except BaseException as e:  # noqa: BLE001 - reported by the test below
            errors.append(e)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        sys.setswitchinterval(switch)
    assert not errors and not any(t.is_alive() for t in threads)
    del threads
    assert _refcounts(counted) == before
    big += b"."  # no buffer of it left exported


@both
def test_bad_arguments_are_named(impl):
    take, deliver = _fn(impl, "take"), _fn(impl, "deliver")
    buf = _log([(b"a", None)])
    args = (True, _MAX, "t", "0-1", _CODEC)
    with pytest.raises(TypeError, match="plain must be a tuple subclass"):
        take(buf, 0, 0, 10, 99, *args, dict, _ATTR)

    class WithDict(tuple):
        pass

    with pytest.raises(TypeError, match="attr must be a tuple subclass"):
        take(buf, 0, 0, 10, 99, *args, _PLAIN, WithDict)
    with pytest.raises(TypeError, match="plain must be a tuple subclass"):
        deliver(buf, 0, 0, *args, 5, _ATTR, print, None)
    with pytest.raises(ValueError, match="take: pos outside the data"):
        take(buf, len(buf) + 1, 0, 10, 99, *args, _PLAIN, _ATTR)
    with pytest.raises(ValueError, match="deliver: pos outside the data"):
        deliver(buf, -1, 0, *args, _PLAIN, _ATTR, print, None)
    with pytest.raises(TypeError):
        take("not bytes", 0, 0, 10, 99, *args, _PLAIN, _ATTR)
    with pytest.raises(TypeError):
        deliver(7, 0, 0, *args, _PLAIN, _ATTR, print, None)


# -- what a consumer reads a batch with ------------------------------------------------------

@both
def test_prepare_verifies_big_replies_first_in_c_and_makes_bytes_in_python(impl):
    prepare = _fast.c_prepare if impl == "c" else _fast.py_prepare
    good = _log([(b"x" * 50, None)] * 4)
    bad = good + bytes([0, 0, 0, 9]) + bytes(29)  # a checksum mismatch after 4 messages
    for data in (good, bad, memoryview(bytearray(bad))):
        view, verify = prepare(data, True, _MAX, 1 << 20)  # small: read as it comes
        assert bytes(view) == bytes(data) and verify is True
        assert prepare(data, False, _MAX, 0)[1] is False
        view, verify = prepare(data, True, _MAX, 0)
        if impl == "c":  # the verified prefix, not to be verified again
            assert (bytes(view), verify) == (good, False)
        else:  # bytes: slicing them is the cheapest way to the bodies
            assert (type(view), bytes(view), verify) == (bytes, bytes(data), True)
    assert prepare(bad[len(good):], True, _MAX, 0)[1] is True  # nothing valid: as it comes


@both
def test_a_partition_reader_calls_the_bound_functions_with_its_arguments(impl, monkeypatch):
    for name in ("take", "deliver"):
        monkeypatch.setattr(_fast, name, _fn(impl, name))
    reader = metaq.protocol.PartitionReader("t", "0-1", _CODEC, _PLAIN, _ATTR, _MAX)
    buf = _log([(b"a", None), (b"b", "x")], first_id=1)
    batch, pos, status = reader.take(buf, 0, 100, 10, 1 << 40, True)
    assert [_fields(m) for m in batch] == [_fields(m) for m in _reference(buf, 100)[0]]
    assert (pos, status) == (len(buf), _fast.ST_END)
    seen = []
    assert reader.deliver(buf, 0, 100, True, seen.append, object())[:3] == (
        _fast.ST_END, len(buf), 2)
    assert seen == batch


@needs_c
def test_take_of_more_messages_than_it_holds_before_making_its_list_equals_its_twin():
    """take holds its first 512 messages and makes the list at their count; past that it
    appends: the same messages either side of the boundary, and nothing leaked there."""
    log = _log([(bytes([i % 251]) * (i % 7), "a" if i % 97 == 0 else None)
                for i in range(1500)])
    kind = ("t", "0-1", _CODEC, _PLAIN, _ATTR)
    for limit in (0, 1, 511, 512, 513, 1024, 1499, 1500, 1501):
        for max_bytes in (1 << 40, 5000, 20000):
            args = (0, 10, limit, max_bytes, True, _MAX, *kind)
            got, want = s.take(log, *args), _fast.py_take(log, *args)
            assert [_fields(m) for m in got[0]] == [_fields(m) for m in want[0]]
            assert got[1:] == want[1:]
    s.take(log, 0, 10, 1500, 1 << 40, True, _MAX, *kind)
    gc.collect()
    before = sys.getallocatedblocks()
    for _ in range(20):
        s.take(log, 0, 10, 1500, 1 << 40, True, _MAX, *kind)
    gc.collect()
    assert sys.getallocatedblocks() - before < 20


# -- a message's fields (slot_fields) --------------------------------------------------------

def _fields_class():
    class Fields(tuple):
        __slots__ = ()

    return Fields


_DEFS = tuple((name, i, f"item {i} of the layout") for i, name in enumerate("abcdefgh")) + (
    ("again", 6, "item 6 under another name"),)
#: one class made by each slot_fields (the C one's definitions live as long as the process)
_C_FIELDS, _PY_FIELDS = _fields_class(), _fields_class()
if s is not None:
    _fast.c_slot_fields(_C_FIELDS, 8, _DEFS)
_fast.py_slot_fields(_PY_FIELDS, 8, _DEFS)
_item = st.one_of(st.integers(), st.binary(max_size=20), st.text(max_size=5), st.none())


@needs_c
@given(st.lists(_item, min_size=8, max_size=8))
def test_slot_fields_read_what_their_twin_reads(items):
    c, py = _C_FIELDS(items), _PY_FIELDS(items)
    for name, index, doc in _DEFS:
        assert getattr(c, name) is getattr(py, name) is items[index]
        assert getattr(_C_FIELDS, name).__doc__ == getattr(_PY_FIELDS, name).__doc__ == doc


@both
def test_slot_fields_are_read_only_and_refuse_bad_definitions(impl):
    slot_fields = _fast.c_slot_fields if impl == "c" else _fast.py_slot_fields
    cls = _C_FIELDS if impl == "c" else _PY_FIELDS
    with pytest.raises(AttributeError):
        cls(range(8)).a = 1
    fresh = _fields_class()
    with pytest.raises(ValueError, match=r"index 8 of 'x' outside 0..7"):
        slot_fields(fresh, 8, (("x", 8, ""),))
    with pytest.raises(ValueError, match=r"index -1 of 'x' outside 0..7"):
        slot_fields(fresh, 8, (("x", -1, ""),))
    for bad in ([("x", 0, "")], (("x", 0),), ((b"x", 0, ""),), (("x", "0", ""),)):
        with pytest.raises(TypeError, match="fields must be"):
            slot_fields(fresh, 8, bad)

    class WithDict(tuple):
        pass

    for bad_cls in (WithDict, dict, 5):
        with pytest.raises(TypeError, match="cls must be a tuple subclass"):
            slot_fields(bad_cls, 8, _DEFS)
    assert not hasattr(fresh, "x")  # nothing made when refused


@needs_c
def test_the_c_slot_fields_check_as_the_twin_does():
    """Called directly (not through c_slot_fields), the C function refuses the same."""
    with pytest.raises(ValueError, match="outside 0..7"):
        s.slot_fields(_fields_class(), 8, (("x", 8, ""),))
    with pytest.raises(TypeError, match="fields must be"):
        s.slot_fields(_fields_class(), 8, (("x", "0", ""),))
    with pytest.raises(TypeError, match="cls must be a tuple subclass"):
        s.slot_fields(dict, 8, _DEFS)


def test_messages_read_their_fields_by_name_and_always_have_all_of_them():
    from metaq.consumer._message import Message

    m = Message.create("t", "0-1", 5, 30, 77, 0, b"body", _CODEC)
    assert (m.topic, m.partition, m.offset, m.next_offset, m.msg_id, m.flag) == (
        "t", "0-1", 5, 30, 77, 0)
    assert m.body is m.raw_body is m.payload == b"body"
    assert type(Message.body).__name__ == ("member_descriptor" if s is not None
                                           else "property")
    import pickle

    assert pickle.loads(pickle.dumps(m)) == m
    if s is not None:  # the C fields read items unchecked: no message lacks one
        for short in ((), ("t", "0-1"), tuple(range(9))):
            with pytest.raises(TypeError, match="a Message has 8 fields"):
                Message(short)


@needs_c
def test_no_int_is_leaked_per_message():
    """take and deliver give each message's next_offset to the next message as its
    offset; every path leaves no int (or anything else) allocated behind."""
    kind = _private_kind()
    ret, later = object(), object()
    good = _log([(b"x" * 10, None), (b"y", "attr")] * 50)
    bad = good[:-1] + bytes([good[-1] ^ 1])
    for log in (good, bad, good[:-5]):
        _every_path(log, kind, ret, later)
        gc.collect()
        before = sys.getallocatedblocks()
        for _ in range(100):
            _every_path(log, kind, ret, later)
        gc.collect()
        assert sys.getallocatedblocks() - before < 50  # one a call would be 100s


# -- the producer's put lines and the broker's put parser ----------------------------------

@needs_c
@given(st.lists(st.tuples(st.binary(max_size=300), st.integers(0, 2**31 - 1),
                          st.integers(0, 2**31 - 1)), max_size=20),
       st.integers(-(2**31), 2**31 - 1), st.sampled_from([b"put t 0 ", "put ü%d 12 ".encode()]))
def test_encode_puts_equals_its_twin(items, flag, head):
    payloads = [p for p, _, _ in items]
    checks = [c for _, c, _ in items]
    opaques = [o for _, _, o in items]
    want = _fast.py_encode_puts(head, flag, payloads, checks, opaques)
    assert s.encode_puts(head, flag, payloads, checks, opaques) == want
    assert _fast.encode_puts(head, flag, payloads, checks, opaques) == want


@needs_c
def test_encode_puts_refuses_what_it_cannot_encode_and_the_binding_falls_back():
    with pytest.raises(TypeError, match="payload 1 is not bytes"):
        s.encode_puts(b"put t 0 ", 0, [b"a", bytearray(b"b")], [1, 2], [3, 4])
    with pytest.raises(TypeError):
        s.encode_puts(b"put t 0 ", 0, (b"a", b"b"), [1, 2], [3, 4])
    with pytest.raises(ValueError, match="different lengths"):
        s.encode_puts(b"put t 0 ", 0, [b"a"], [1, 2], [3])
    for payloads in ([b"a", bytearray(b"b")], (b"a", b"b")):
        data, sizes = _fast.encode_puts(b"put t 0 ", 0, payloads, [1, 2], [3, 4])
        assert data == b"put t 0 1 0 1 3\r\naput t 0 1 0 2 4\r\nb" and sizes == [18, 18]
    with pytest.raises(ValueError, match="different lengths"):
        _fast.encode_puts(b"put t 0 ", 0, [b"a"], [1, 2], [3])


def test_the_encode_puts_twin_takes_any_bytes_and_refuses_lists_of_different_lengths():
    data, sizes = _fast.py_encode_puts(b"put %t 0 ", -1, [b"a", bytearray(b"bc")], (1, 2),
                                       [3, 4])
    assert data == b"put %t 0 1 -1 1 3\r\naput %t 0 2 -1 2 4\r\nbc" and sizes == [20, 21]
    with pytest.raises(ValueError, match="encode_puts: lists of different lengths"):
        _fast.py_encode_puts(b"put t 0 ", 0, [b"a"], [1, 2], [3])


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


class _Collecting:
    """Within ``with``: a collection starts on every other allocation of a GC object
    and runs ``callback`` first, Python code run inside whatever C function allocated
    (as a finalizer or a gc callback may, letting other threads run meanwhile).  The
    free lists of tuples and lists are emptied first, so their allocations count."""

    def __init__(self, callback):
        self.callback = callback

    def _cb(self, phase, info):
        if phase == "start":
            self.callback()

    def __enter__(self):
        gc.collect()  # first: the lists and tuples it frees go to the free lists
        self.drained = [tuple(range(i, i + n)) for n in range(1, 21) for i in range(2100)]
        self.drained.extend([] for _ in range(100))  # (a list freed here would be reused)
        self.threshold = gc.get_threshold()
        gc.callbacks.append(self._cb)
        gc.set_threshold(1)
        return self

    def __exit__(self, *exc):
        gc.set_threshold(*self.threshold)
        gc.callbacks.remove(self._cb)
        del self.drained


@needs_c
def test_fast_puts_holds_the_value_it_looked_up_while_a_collection_replaces_it():
    """Each put's tuple holds the value its key had when looked up, by a reference
    fast_puts owns: building the tuple may start a collection, whose Python code may
    replace the dict's values (the broker's _index_topics does, from another thread),
    and a borrowed value would then be freed before it is put in the tuple.  A value
    whose last reference goes here is resurrected by its __del__ (so this test reads no
    freed memory) and recorded: none of them may be in a put."""
    dead = []

    class Target:
        def __del__(self):
            dead.append(self)

    keys = (b"a 0", b"b 0")
    fast = {k: Target() for k in keys}
    # the key changes at every put: each one looks its value up again
    req = b"".join(b"put %b 0 1 0 7 %d\r\nx" % (b"ab"[i % 2:i % 2 + 1], i) for i in range(400))

    def replace():
        for k in keys:
            fast[k] = Target()

    for _ in range(10):
        out = []
        with _Collecting(replace):
            assert s.fast_puts(req, 0, fast, 10, out) == len(req)
        assert len(out) == 400
        ids = {id(t) for t in dead}
        assert not [put for put in out if id(put[0]) in ids]
        del out
        dead.clear()


@needs_c
def test_encode_puts_writes_the_lists_it_measured_while_a_collection_changes_them():
    """encode_puts measures every put, then writes them into bytes of that size: the
    lists must not change in between.  A collection that shortens the payloads (Python
    code, which may let other threads run) can only start in the one allocation that
    may start one, which comes before the lists are read: what is written is all of
    the lists before or all of them after, never what was measured of one and copied
    of the other (that wrote past the bytes when the payloads grew)."""
    payloads = []
    collections = []

    def shorten_once(when):
        collections.append(None)
        if len(collections) == when:
            for i in range(len(payloads)):  # freeing no list: their free list stays empty
                payloads[i] = b""

    checks, opaques = [1] * 20, [2] * 20
    before = _fast.py_encode_puts(b"put t 0 ", 0, [b"xx"] * 20, checks, opaques)
    after = _fast.py_encode_puts(b"put t 0 ", 0, [b""] * 20, checks, opaques)
    for k, when in enumerate((1, 2, 3) * 4):  # the first, second or third collection
        payloads[:] = [b"xx"] * 20
        collections.clear()
        with _Collecting(lambda when=when: shorten_once(when)):
            # a GC object more or less (a collection comes every other one), so that
            # one comes inside encode_puts, not only on its arguments and its result
            spare = tuple(range(30)) if k % 2 else None
            got = s.encode_puts(b"put t 0 ", 0, payloads, checks, opaques)
            del spare
        assert got in (before, after)  # (the call's result is a tuple: a collection too)


@needs_c
def test_encode_puts_hands_numbers_that_are_not_ints_to_the_twin():
    """Only ints are read in C (another object's __index__ is Python code, run between
    measuring and writing); anything else is a TypeError the binding falls back on."""

    class Index:
        def __index__(self):
            return 5

    with pytest.raises(TypeError, match="checksum or opaque 1 is not an int"):
        s.encode_puts(b"put t 0 ", 0, [b"a", b"b"], [1, Index()], [3, 4])
    with pytest.raises(TypeError, match="checksum or opaque 0 is not an int"):
        s.encode_puts(b"put t 0 ", 0, [b"a"], [1], [Index()])
    assert _fast.encode_puts(b"put t 0 ", 0, [b"a", b"b"], [1, Index()], [3, True]) == (
        b"put t 0 1 0 1 3\r\naput t 0 1 0 5 1\r\nb", [18, 18])


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
    # a checksum: ours, Java's -1 ("not computed"), or none (6 fields, Java's legacy form)
    _token(["0", "5", "2147483647", "-1", "<none>"],
           ["2147483648", "-2", "-2147483648", "-2147483649", "9999999999", "00", "-0"]),
    _token(["1", "-7", "2147483647"], ["2147483648", "-2147483648", "-2147483649",
                                       "0000000001", "-000000001", "12345678901", "", "-"]),
    _token([" "], ["  ", "\t"]),
    _token(["\r\n"], ["\n", " \r\n", "\r"]),
    st.binary(max_size=12))


def _put_bytes(fields: tuple) -> bytes:
    topic, part, length, flag, check, opaque, sep, eol, payload = fields
    length = length.replace("len", str(len(payload)))
    fields = ["put", topic, part, length, flag, check, opaque]
    if check == "<none>":
        del fields[5]
    return (sep.join(fields) + eol).encode() + payload


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
    stop_py = _fast.py_fast_puts(data, pos, _PUT_KEYS, max_payload, got_py)
    assert (stop_c, got_c) == (stop_py, got_py)
    assert all(type(v) is bytes for t in got_py for v in (t[4], t[5]))


def test_fast_puts_python_contract():
    out: list = []
    assert _fast.py_fast_puts(b"put t 0 1 0 5 7\r\nxput t 0 1 0 5 7\r\n", 0,
                                    {b"t 0": "T"}, 10, out) == 18
    assert out == [("T", 1, 0, 5, b"7", b"x")]
    with pytest.raises(ValueError, match="pos outside the data"):
        _fast.py_fast_puts(b"put", 4, {}, 10, [])
    # the binding: C when built, else the twin
    assert _fast.fast_puts is (_fast.py_fast_puts if s is None else s.fast_puts)


class _TxPut(tuple):
    """A class for the put loop's puts with a transaction key (as metaq.protocol.TxPut)."""

    __slots__ = ()


_tx_fields = st.tuples(
    _token(["t", "ü"], ["x", "t\t"]),
    _token(["0", "12", "-1"], ["5", "-0"]),
    _token(["len"], ["0len", "99999999999"]),
    _token(["0", "-1"], ["2147483648", "-2147483649"]),
    # the checksum: a number (8 fields) or none (7 fields, the key in its place)
    _token(["0", "-1", "<none>"], ["2147483648", "-2147483649", "x", "-", "12a"]),
    _token(["TX:s:1", "XID:1:0a:0b:q", "12", "-k", "k" * 512],
           ["", "k" * 513, "é", "a\tb", "a\x7fb", "9" * 11]),
    _token(["1", "-7"], ["2147483648", "", "x"]),
    _token(["\r\n"], [" \r\n", "\n"]),
    st.binary(max_size=12))


def _tx_bytes(fields: tuple) -> bytes:
    topic, part, length, flag, check, key, opaque, eol, payload = fields
    length = length.replace("len", str(len(payload)))
    out = ["put", topic, part, length, flag, check, key, opaque]
    if check == "<none>":
        del out[5]
    return (" ".join(out) + eol).encode() + payload


@needs_c
@settings(max_examples=500)
@given(st.lists(st.one_of(_tx_fields.map(_tx_bytes), _put_fields.map(_put_bytes)),
                max_size=10), st.binary(max_size=20), st.integers(0, 100), st.integers(0, 2000))
def test_fast_puts_with_transaction_keys_equals_its_python_twin(items, junk, max_payload, cut):
    """The put loop with ``tx_cls``: puts with a transaction key (8 fields, and 7 with the
    key in the checksum's place) taken alike by C and by its Python twin."""
    data = b"".join(items) + junk
    data = data[:cut % (len(data) + 1)]
    got_c: list = []
    got_py: list = []
    stop_c = s.fast_puts(data, 0, _PUT_KEYS, max_payload, got_c, _TxPut)
    stop_py = _fast.py_fast_puts(data, 0, _PUT_KEYS, max_payload, got_py, _TxPut)
    assert (stop_c, got_c) == (stop_py, got_py)
    assert [type(t) for t in got_c] == [type(t) for t in got_py]


@needs_c
def test_fast_puts_tx_cls_must_be_a_plain_tuple_subclass():
    with pytest.raises(TypeError, match="tx_cls must be a tuple subclass"):
        s.fast_puts(b"", 0, {}, 10, [], list)
    out: list = []
    assert s.fast_puts(b"put t 0 1 0 TX:a:1 7\r\nx", 0, {b"t 0": "T"}, 10, out, _TxPut) == 23
    assert out == [("T", 1, 0, -1, b"7", b"x", b"TX:a:1")] and type(out[0]) is _TxPut
