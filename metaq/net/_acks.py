"""A broker's replies to puts (client side of a put connection): who gets them
(:class:`Pending`, :class:`MultiPending`, :class:`PutFuture`) and parsing.

Two parsers over the same bytes:

- :func:`scan_results`: any ``result <code> <length> <opaque>\\r\\n<body>``,
  one regex match per reply; raises ProtocolError for anything else.
- :func:`scan_acks`: the common case, a buffer holding nothing but
  successful put replies ``result 200 <len> <opaque>\\r\\n<msgId> <part>
  <offset>``, checked and split into tokens with a handful of whole-buffer
  byte operations (``replace``, ``translate``, ``split``) instead of Python
  code per reply; about four times cheaper per reply.  It answers ``None``
  for anything it does not fully verify, and the caller falls back to
  :func:`scan_results`.
"""

from __future__ import annotations

import re
from typing import NamedTuple, Protocol

from metaq._errors import BrokerError, ProtocolError
from metaq.net._future import LightFuture
from metaq.protocol import MAX_LINE, OPAQUE_MASK

__all__ = ["MultiPending", "Pending", "PutAck", "PutFuture", "check_partial", "parse_put_ack",
           "scan_acks", "scan_results"]

#: Largest ``result`` body accepted on a put connection (bodies are short texts).
MAX_RESULT_BODY = 1024 * 1024
_HEAD = re.compile(rb"result ([0-9]{1,3}) ([0-9]{1,9}) (-?[0-9]{1,10})\r\n")
_OK = b"result 200 "
#: What is left of one ok reply once its marker became R, its CRLF N, and digits went.
_SHAPE = b"R N  "
_DIGITS = b"0123456789"
_TO_SPACES = bytes.maketrans(b"RN", b"  ")


class PutAck(NamedTuple):
    """A broker's answer to a successful put: ``<msgId> <partition> <offset>``."""

    msg_id: int
    partition: int
    offset: int


def parse_put_ack(body: bytes) -> PutAck:
    """Parse the body of a ``result 200`` put reply; ProtocolError when malformed."""
    parts = body.split(b" ")
    if len(parts) == 3:
        try:
            return PutAck(int(parts[0]), int(parts[1]), int(parts[2]))
        except ValueError:
            pass
    raise ProtocolError(f"put reply body {bytes(body[:120])!r} is not '<msgId> <partition> "
                        f"<offset>'")


# --------------------------------------------------------------------------- requests

class Pending(Protocol):
    """What the connection completes for one put: exactly one of these is
    called, once, from the reader thread (or from the thread that finds the
    connection dead).

    The connection stores ``_pipe_sent`` (monotonic time) and ``_pipe_size``
    on it (no tuple per request: fewer objects for the garbage collector).

    Optionally the class has ``on_acks(requests, msg_ids, partitions,
    offsets)`` (a static or class method; the last three are lists of
    decimal ``bytes``, each a valid non-negative integer): the reader then
    completes a run of successful replies to requests of that class in one
    call instead of calling ``on_reply(200, body)`` for each.
    """

    _pipe_sent: float
    _pipe_size: int

    def on_reply(self, code: int, body: bytes) -> None: ...

    def on_error(self, exc: BaseException) -> None: ...


class MultiPending(Protocol):
    """What the connection completes for the puts of one
    :meth:`PipelinedConnection.put_many` call, by their index in that call.

    Each index gets exactly one outcome: ``on_acks`` (a run of successes,
    indexes ``first .. first + len(msg_ids) - 1``, in order; the columns are
    lists of decimal ``bytes``, each a valid non-negative integer), ``on_reply_at``
    (any other reply, or a success that came alone) or ``on_error_at``.
    Called from the reader thread (or the thread that finds the connection dead).
    """

    def on_acks(self, first: int, msg_ids: list[bytes], partitions: list[bytes],
                offsets: list[bytes]) -> None: ...

    def on_reply_at(self, index: int, code: int, body: bytes) -> None: ...

    def on_error_at(self, index: int, exc: BaseException) -> None: ...


class PutFuture(LightFuture):
    """The default request: resolves to a :class:`PutAck` or raises BrokerError."""

    # Slots (see LightFuture): the putting thread stores ``_pipe_*`` while the
    # reader may already complete it and another thread wait on it.
    __slots__ = ("_broker", "_pipe_sent", "_pipe_size")

    def __init__(self, broker: str = "") -> None:
        super().__init__()
        self._broker = broker

    def on_reply(self, code: int, body: bytes) -> None:
        if code == 200:
            try:
                self.set_result(parse_put_ack(body))
            except ProtocolError as e:
                self.set_exception(e)
        else:
            self.set_exception(BrokerError(code, body.decode("utf-8", "replace"),
                                           broker=self._broker))

    @staticmethod
    def on_acks(requests: list, msg_ids: list[bytes], partitions: list[bytes],
                offsets: list[bytes]) -> None:
        for request, ack in zip(requests, map(PutAck, map(int, msg_ids), map(int, partitions),
                                              map(int, offsets)), strict=True):
            request.set_result(ack)

    def on_error(self, exc: BaseException) -> None:
        self.set_exception(exc)


# --------------------------------------------------------------------------- parsing

def scan_acks(buf: bytes) -> tuple[list[int], list[bytes], list[bytes], list[bytes], int] | None:
    """Split the complete replies at the start of ``buf`` when all are put acks.

    Returns ``(opaques, msg_ids, partitions, offsets, used)``, one entry per
    reply in order: the opaques as ints, the rest as their decimal bytes
    (``int()`` of each is a valid non-negative integer; converting is left
    to whoever reads them).  Every body length is checked; ``buf[used:]`` is
    the start of a reply still waiting for bytes.  Returns ``None`` for
    anything else (another code, a negative number, a malformed reply,
    bytes that cannot start a reply): :func:`scan_results` then parses the
    buffer, or names what is wrong with it.  Never raises.
    """
    end = len(buf)
    last = buf.rfind(b"result ")  # the last reply's start, if the rest is acks
    if last < 0:
        return None
    m = _HEAD.match(buf, last)
    if m is None:  # the last header is still coming
        stop = last
        if not _may_start_reply(buf, stop, end):
            return None
    else:
        stop = m.end() + int(m.group(2))
        if stop > end:  # the last reply's body is still coming
            if stop - m.end() > MAX_RESULT_BODY:
                return None
            stop = last
        elif stop < end and not _may_start_reply(buf, stop, end):
            return None  # what follows the last reply cannot start one
    if stop == 0:
        return [], [], [], [], 0
    s = buf[:stop] if stop < end else buf
    n = s.count(_OK)
    if s.count(b"\r\n") != n or b"-" in s:
        return None
    # Each reply becomes "R<len> <opaque>N<msgId> <part> <offset>"; with the digits gone
    # it must be "R N  ", and R / N can only be the marker / CRLF (n of each, counted; any
    # other "result" reply leaves letters behind).  So every token is digits or empty.
    u = s.replace(_OK, b"R").replace(b"\r\n", b"N")
    if u.translate(None, _DIGITS) != _SHAPE * n:
        return None
    tokens = u.translate(_TO_SPACES).split(b" ")
    if tokens.count(b"") != 1:  # the one before the first reply
        return None
    lens, ids, parts, offs = tokens[1::5], tokens[3::5], tokens[4::5], tokens[5::5]
    # Every body length must match its body: at once when each field has one width
    # (replies to one batch), else reply by reply.
    n_id, n_part, n_off = len(ids[0]), len(parts[0]), len(offs[0])
    if not (lens.count(lens[0]) == n and int(lens[0]) == n_id + n_part + n_off + 2
            and set(map(len, ids)) == {n_id} and set(map(len, parts)) == {n_part}
            and set(map(len, offs)) == {n_off}) and list(map(int, lens)) != list(map(
                len, map(b" ".join, zip(ids, parts, offs, strict=True)))):
        return None
    opaques = list(map(int, tokens[2::5]))
    if max(opaques) > OPAQUE_MASK:
        return None
    return opaques, ids, parts, offs, stop


def _may_start_reply(buf: bytes, pos: int, end: int) -> bool:
    try:
        check_partial(buf, pos, end)
    except ProtocolError:
        return False
    return True


def scan_results(buf: bytes) -> tuple[list[tuple[int, int, bytes]], int]:
    """Parse the complete ``result`` replies at the start of ``buf``.

    Returns ``([(code, opaque, body), ...], used)`` where ``buf[used:]`` is an
    incomplete reply still waiting for bytes.  Anything that cannot become a
    valid ``result <code> <length> <opaque>\\r\\n<body>`` (including a ``value``
    reply, which a put never gets) raises ProtocolError.
    """
    out: list[tuple[int, int, bytes]] = []
    append = out.append
    pos = 0
    end = len(buf)
    match = _HEAD.match
    while pos < end:
        m = match(buf, pos)
        if m is None:
            check_partial(buf, pos, end)
            break
        code_b, len_b, opaque_b = m.groups()
        opaque = int(opaque_b)
        if opaque > OPAQUE_MASK or opaque < -OPAQUE_MASK - 1:
            raise ProtocolError(f"reply opaque {opaque} is out of the int32 range")
        start = m.end()
        stop = start + int(len_b)
        if stop > end:
            if stop - start > MAX_RESULT_BODY:
                raise ProtocolError(f"result body of {stop - start} bytes is over the "
                                    f"limit of {MAX_RESULT_BODY}")
            break
        append((int(code_b), opaque, buf[start:stop]))
        pos = stop
    return out, pos


def check_partial(buf: bytes, pos: int, end: int) -> None:
    """Raise unless ``buf[pos:end]`` may be the start of a valid reply header."""
    eol = buf.find(b"\r\n", pos, pos + MAX_LINE + 2)
    if eol >= 0 or end - pos > MAX_LINE:
        line = buf[pos:eol if eol >= 0 else pos + 120]
        if line.startswith(b"value "):
            raise ProtocolError(f"unexpected 'value' reply {line[:120]!r} on a put connection")
        raise ProtocolError(f"bad reply line {line[:120]!r}: expected "
                            f"'result <code> <length> <opaque>'")
    if not b"result ".startswith(buf[pos:pos + 7]):
        raise ProtocolError(f"bad reply {buf[pos:pos + 20]!r}...: expected 'result ...'")
