"""Metaq 1.4 text protocol (reference section 6).

Requests (client → broker), space separated, lines end in CRLF::

    put <topic> <part> <len> <flag> <checksum> [<txKey>] <opaque>\\r\\n<payload>
    get <topic> <group> <part> <offset> <maxSize> <opaque> [hold=<ms>]\\r\\n
    offset <topic> <group> <part> <offset> <opaque>\\r\\n
    stats [<item>] <opaque>\\r\\n
    version <opaque>\\r\\n
    quit\\r\\n

Replies (broker → client)::

    result <code> <bodyLen> <opaque>\\r\\n<body>
    value <len> <opaque>\\r\\n<bytes>

Encoders for both sides, and incremental parsers (:class:`RequestParser` for
the broker, :class:`ReplyParser` for clients) that take bytes in any chunking
and return every complete request or reply.  Bad input raises
:class:`metaq.ProtocolError` naming the offending line and what is wrong.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

from metaq._errors import ProtocolError
from metaq.protocol._commands import (
    _INT32_MAX,
    _INT32_MIN,
    _INT64_MAX,
    _INT64_MIN,
    _NUMERIC,
    BadRequest,
    GetRequest,
    OffsetRequest,
    PutRequest,
    QuitRequest,
    Result,
    StatsRequest,
    Value,
    VersionRequest,
    _name_problem,
    _opaque_of,
    _parse_int,
    _parse_topic,
    _show,
    _token_text,
    _topic_cache,
    check_group,
)
from metaq.protocol._constants import DEFAULT_MAX_BODY, DEFAULT_MAX_PAYLOAD, MAX_LINE
from metaq.protocol._fast import speedups as _NATIVE

__all__ = ["RequestParser", "ReplyParser"]

# put <topic> <partition> <len> <flag> <checksum> <opaque>\r\n, the broker's hot path
_FAST_PUT_NUMBERS = rb" ([0-9]{1,10}) (-?[0-9]{1,10}) ([0-9]{1,10}) (-?[0-9]{1,10})\r\n"
_FAST_PUT = re.compile(rb"put ([^ \r\n]{1,255} -?[0-9]{1,10})" + _FAST_PUT_NUMBERS)
_KEYED_PUTS: dict[bytes, object] = {}


def _keyed_put_match(key: bytes):  # type: ignore[no-untyped-def]
    """``_FAST_PUT.match`` for puts to one ``b"<topic> <partition>"`` (as matched by
    it): the same groups, found faster (a literal prefix instead of a scan)."""
    match = _KEYED_PUTS.get(key)
    if match is None:
        if len(_KEYED_PUTS) >= 1024:
            _KEYED_PUTS.clear()
        match = _KEYED_PUTS[key] = re.compile(
            b"put (" + re.escape(key) + b")" + _FAST_PUT_NUMBERS).match
    return match


# --------------------------------------------------------------------------- buffering

class _Buffered:
    """Bytes buffer shared by both parsers: joins chunks only when enough arrived."""

    def __init__(self) -> None:
        self._buf = b""
        self._pos = 0
        self._need = 0          # total bytes (from _pos) needed before parsing again
        self._parts: list[bytes] = []
        self._have = 0
        self._broken: ProtocolError | None = None

    def _take(self, data: bytes) -> bool:
        """Add data; return True when parsing should run."""
        if self._broken is not None:
            raise ProtocolError(f"stream already broken: {self._broken}")
        if self._need:
            if data:
                self._parts.append(bytes(data))
                self._have += len(data)
            if self._have < self._need:
                return False
            self._buf = self._buf[self._pos:] + b"".join(self._parts)
            self._pos = 0
            self._parts = []
            self._need = 0
            return True
        if self._pos >= len(self._buf):
            self._buf = bytes(data)
        else:
            self._buf = self._buf[self._pos:] + data
        self._pos = 0
        return True

    def _wait_for(self, nbytes: int) -> None:
        """Parsing stopped at _pos and needs ``nbytes`` bytes from there."""
        self._need = nbytes
        self._have = len(self._buf) - self._pos

    @property
    def buffered(self) -> int:
        """Bytes received and not yet parsed."""
        return len(self._buf) - self._pos + (sum(map(len, self._parts)) if self._parts else 0)


# --------------------------------------------------------------------------- requests

class RequestParser(_Buffered):
    """Incremental parser of client requests (broker side).

    ``max_payload`` bounds a put's payload length; a larger one is answered
    as a bad request and its bytes are skipped without being buffered.

    ``fast_puts`` (broker hot path) maps ``b"<topic> <partition>"`` as it
    appears in a put line to a target object.  A valid put without a
    transaction key whose key is in the mapping comes back as a plain tuple
    ``(target, length, flag, checksum, opaque_token, payload)`` (opaque as its
    decimal bytes, ready to echo) instead of a :class:`PutRequest`.
    """

    def __init__(self, *, max_line: int = MAX_LINE,
                 max_payload: int = DEFAULT_MAX_PAYLOAD,
                 fast_puts: Mapping[bytes, object] | None = None) -> None:
        super().__init__()
        self.max_line = max_line
        self.max_payload = max_payload
        self.fast_puts = fast_puts
        self._skip = 0                       # payload bytes of a rejected put still to drop
        self._put: tuple | None = None       # header of a put waiting for its payload
        self._match = None                   # the fast pattern of the last partition put to

    def feed(self, data: bytes) -> list:
        """Add bytes; return the complete requests. Raises ProtocolError on bad input.

        After an error the bad request has been consumed: calling ``feed(b"")``
        continues with what follows, unless the stream cannot be resynchronised
        (then every later call raises).
        """
        out: list = []
        self._run(data, out, strict=True)
        return out

    def feed_lenient(self, data: bytes) -> list:
        """Like :meth:`feed` but bad requests come back as :class:`BadRequest` items.

        Parsing stops after a fatal :class:`BadRequest`.
        """
        out: list = []
        self._run(data, out, strict=False)
        return out

    def _bad(self, out: list, strict: bool, err: ProtocolError, opaque: int | None,
             fatal: bool) -> None:
        if fatal:
            self._broken = err
        if strict:
            raise err
        out.append(BadRequest(err, opaque, fatal))

    def _run(self, data: bytes, out: list, strict: bool) -> None:
        if self._skip:
            drop = min(self._skip, len(data))
            self._skip -= drop
            data = data[drop:]
            if self._skip:
                return
        if not self._take(data):
            return
        buf = self._buf
        pos = self._pos
        end = len(buf)
        max_line = self.max_line
        max_payload = self.max_payload
        topic_cache = _topic_cache
        new_tuple = tuple.__new__
        append = out.append
        fast = self.fast_puts
        fast_match = _FAST_PUT.match
        fast_get = None if fast is None else fast.get
        # the same loop in C (metaq/protocol/_speedups.c) when built: same tuples, same stops
        fast_c = _NATIVE.fast_puts if _NATIVE is not None and type(fast) is dict else None
        last_key = None
        try:
            while pos < end or self._put is not None:
                if fast_c is not None and self._put is None:
                    pos = fast_c(buf, pos, fast, max_payload, out)
                    if pos >= end:
                        break
                elif fast_get is not None and self._put is None:
                    # The hot loop: runs of valid puts to known partitions.  Numbers of
                    # fewer than 10 digits are in the int32 range without a check.  After
                    # two puts in a row to one partition, a pattern for that partition is
                    # tried first (the general one again when it fails).
                    match = self._match or fast_match
                    while True:
                        m = match(buf, pos)
                        if m is None:
                            if match is fast_match:
                                break
                            match = fast_match
                            continue
                        key, length, flag, check, opaque = m.groups()
                        target = fast_get(key)
                        if target is None:
                            break
                        start = m.end()
                        stop = start + int(length)
                        if stop > end or stop - start > max_payload:
                            break
                        if flag == b"0":
                            flag = 0
                        else:
                            flag = int(flag)
                            if not _INT32_MIN <= flag <= _INT32_MAX:
                                break
                        check = int(check)
                        if check > _INT32_MAX or (len(opaque) > 9 and not (
                                _INT32_MIN <= int(opaque) <= _INT32_MAX)):
                            break
                        append((target, stop - start, flag, check, opaque, buf[start:stop]))
                        pos = stop
                        if match is fast_match:
                            if key == last_key:
                                match = _keyed_put_match(key)
                            last_key = key
                    self._match = None if match is fast_match else match
                    if pos >= end:
                        break
                if self._put is not None:
                    head = self._put
                    stop = pos + head[2]
                    if stop > end:
                        self._pos = pos
                        self._wait_for(head[2])
                        return
                    self._put = None
                    append(new_tuple(PutRequest, (*head, buf[pos:stop])))
                    pos = stop
                    continue
                eol = buf.find(b"\r\n", pos, pos + max_line + 2)
                if eol < 0:
                    if end - pos >= max_line + 2:
                        self._pos = end
                        self._bad(out, strict, ProtocolError(
                            f"line {_show(buf[pos:pos + max_line])} has no CRLF within "
                            f"{max_line} bytes"), None, True)
                        return
                    self._pos = pos
                    self._wait_for(end - pos + 1)
                    return
                line = buf[pos:eol]
                pos = eol + 2
                if line[:4] == b"put " and b"  " not in line and line[-1:] != b" ":
                    # fast path: the common, valid put without transaction key
                    sp = line.find(b" ", 4)
                    topic = topic_cache.get(line[4:sp])
                    tail = line[sp + 1:]
                    if topic is not None and not tail.translate(None, _NUMERIC):
                        try:
                            partition, length, flag, check, opaque = map(int, tail.split())
                        except ValueError:
                            length = -1
                        if (0 <= length <= max_payload and pos + length <= end
                                and _INT32_MIN <= partition <= _INT32_MAX
                                and _INT32_MIN <= flag <= _INT32_MAX
                                and _INT32_MIN <= check <= _INT32_MAX
                                and _INT32_MIN <= opaque <= _INT32_MAX):
                            stop = pos + length
                            append(new_tuple(PutRequest, (
                                topic, partition, length, flag, check, None, opaque,
                                buf[pos:stop])))
                            pos = stop
                            continue
                parts = line.split(b" ")
                cmd = parts[0]
                if cmd == b"put":
                    try:
                        head = self._put_header(parts, line)
                    except ProtocolError as e:
                        skip = self._put_skip(parts)
                        if skip is None:
                            self._pos = end
                            self._bad(out, strict, e, _opaque_of(parts[-1]), True)
                            return
                        take = min(skip, end - pos)
                        pos += take
                        self._skip = skip - take
                        self._pos = pos
                        self._bad(out, strict, e, _opaque_of(parts[-1]), False)
                        if self._skip:
                            self._pos = end
                            return
                        continue
                    self._put = head
                    continue
                try:
                    append(self._other(cmd, parts, line))
                except ProtocolError as e:
                    self._pos = pos
                    self._bad(out, strict, e, _opaque_of(parts[-1]) if len(parts) > 1 else None,
                              False)
        finally:
            if self._need == 0:
                self._pos = pos if self._broken is None else end
                if self._pos >= len(self._buf):
                    self._buf = b""
                    self._pos = 0

    def _put_header(self, parts: list, line: bytes) -> tuple:
        n = len(parts)
        if n == 7:
            tx_key = None
        elif n == 8:
            tx_key = _token_text(parts[6], "transaction key")
            if _name_problem(tx_key):
                raise ProtocolError(f"bad put line {_show(line)}: bad transaction key")
        else:
            raise ProtocolError(
                f"bad put line {_show(line)}: expected 'put <topic> <partition> <length> "
                f"<flag> <checksum> [<txKey>] <opaque>'")
        try:
            topic = _parse_topic(parts[1])
            partition = _parse_int(parts[2], "partition", _INT32_MIN, _INT32_MAX)
            length = _parse_int(parts[3], "length", 0, _INT32_MAX)
            flag = _parse_int(parts[4], "flag", _INT32_MIN, _INT32_MAX)
            checksum = _parse_int(parts[5], "checksum", _INT32_MIN, _INT32_MAX)
            opaque = _parse_int(parts[-1], "opaque", _INT32_MIN, _INT32_MAX)
        except ProtocolError as e:
            raise ProtocolError(f"bad put line {_show(line)}: {e}") from None
        if length > self.max_payload:
            raise ProtocolError(
                f"bad put line {_show(line)}: payload length {length} is over the limit "
                f"{self.max_payload}")
        return (topic, partition, length, flag, checksum, tx_key, opaque)

    @staticmethod
    def _put_skip(parts: list) -> int | None:
        """Payload length to skip after a bad put header, or None if it is unknown."""
        if len(parts) not in (7, 8):
            return None
        try:
            return _parse_int(parts[3], "length", 0, _INT32_MAX)
        except ProtocolError:
            return None

    def _other(self, cmd: bytes, parts: list, line: bytes) -> NamedTuple:
        n = len(parts)
        try:
            if cmd == b"get":
                if n != 7 and not (n == 8 and parts[7][:5] == b"hold="):
                    raise ProtocolError("expected 'get <topic> <group> <partition> <offset> "
                                        "<maxSize> <opaque> [hold=<ms>]'")
                return GetRequest(
                    _parse_topic(parts[1]), check_group(_token_text(parts[2], "group")),
                    _parse_int(parts[3], "partition", _INT32_MIN, _INT32_MAX),
                    _parse_int(parts[4], "offset", _INT64_MIN, _INT64_MAX),
                    _parse_int(parts[5], "maxSize", _INT32_MIN, _INT32_MAX),
                    _parse_int(parts[6], "opaque", _INT32_MIN, _INT32_MAX),
                    _parse_int(parts[7][5:], "hold", 0, _INT32_MAX) if n == 8 else 0)
            if cmd == b"offset":
                if n != 6:
                    raise ProtocolError("expected 'offset <topic> <group> <partition> <offset> "
                                        "<opaque>'")
                return OffsetRequest(
                    _parse_topic(parts[1]), check_group(_token_text(parts[2], "group")),
                    _parse_int(parts[3], "partition", _INT32_MIN, _INT32_MAX),
                    _parse_int(parts[4], "offset", _INT64_MIN, _INT64_MAX),
                    _parse_int(parts[5], "opaque", _INT32_MIN, _INT32_MAX))
            if cmd == b"version":
                if n != 2:
                    raise ProtocolError("expected 'version <opaque>'")
                return VersionRequest(_parse_int(parts[1], "opaque", _INT32_MIN, _INT32_MAX))
            if cmd == b"stats":
                if n == 2:
                    item = None
                elif n == 3:
                    item = _token_text(parts[1], "stats item")
                    problem = _name_problem(item)
                    if problem:
                        raise ProtocolError(f"stats item {problem}")
                else:
                    raise ProtocolError("expected 'stats [<item>] <opaque>'")
                return StatsRequest(item, _parse_int(parts[-1], "opaque", _INT32_MIN, _INT32_MAX))
            if cmd == b"quit":
                if n != 1:
                    raise ProtocolError("expected 'quit'")
                return QuitRequest()
        except ProtocolError as e:
            raise ProtocolError(f"bad {_token_text(cmd, 'command')} line {_show(line)}: {e}") \
                from None
        raise ProtocolError(f"unknown command {_show(cmd)} in line {_show(line)}")


# --------------------------------------------------------------------------- replies

class ReplyParser(_Buffered):
    """Incremental parser of broker replies (client side).

    Every error is fatal: the client should close the connection.
    """

    def __init__(self, *, max_line: int = MAX_LINE, max_body: int = DEFAULT_MAX_BODY) -> None:
        super().__init__()
        self.max_line = max_line
        self.max_body = max_body
        self._head: tuple | None = None   # (is_value, code, length, opaque) awaiting the body

    def feed(self, data: bytes) -> list:
        """Add bytes; return complete :class:`Result` / :class:`Value` replies."""
        if not self._take(data):
            return []
        out: list = []
        buf = self._buf
        pos = self._pos
        end = len(buf)
        max_line = self.max_line
        append = out.append
        try:
            while pos < end or self._head is not None:
                head = self._head
                if head is not None:
                    stop = pos + head[2]
                    if stop > end:
                        self._pos = pos
                        self._wait_for(head[2])
                        return out
                    self._head = None
                    if head[0]:
                        append(Value(buf[pos:stop], head[3]))
                    else:
                        append(Result(head[1], buf[pos:stop], head[3]))
                    pos = stop
                    continue
                eol = buf.find(b"\r\n", pos, pos + max_line + 2)
                if eol < 0:
                    if end - pos >= max_line + 2:
                        self._fail(f"reply line {_show(buf[pos:pos + max_line])} has no CRLF "
                                   f"within {max_line} bytes")
                    self._pos = pos
                    self._wait_for(end - pos + 1)
                    return out
                line = buf[pos:eol]
                pos = eol + 2
                parts = line.split(b" ")
                try:
                    if parts[0] == b"result" and len(parts) == 4:
                        self._head = (
                            False, _parse_int(parts[1], "code", 0, 999),
                            _parse_int(parts[2], "body length", 0, self.max_body),
                            _parse_int(parts[3], "opaque", _INT32_MIN, _INT32_MAX))
                    elif parts[0] == b"value" and len(parts) == 3:
                        self._head = (
                            True, 200, _parse_int(parts[1], "value length", 0, self.max_body),
                            _parse_int(parts[2], "opaque", _INT32_MIN, _INT32_MAX))
                    else:
                        raise ProtocolError("expected 'result <code> <length> <opaque>' or "
                                            "'value <length> <opaque>'")
                except ProtocolError as e:
                    self._fail(f"bad reply line {_show(line)}: {e}")
        finally:
            if self._need == 0:
                self._pos = pos
                if pos >= len(self._buf):
                    self._buf = b""
                    self._pos = 0
        return out

    def _fail(self, msg: str) -> None:
        err = ProtocolError(msg)
        self._broken = err
        raise err
