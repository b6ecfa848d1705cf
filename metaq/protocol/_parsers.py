"""Metaq 1.4 text protocol (reference section 6).

Requests (client → broker), space separated, lines end in CRLF::

    put <topic> <part> <len> <flag> <checksum> [<txKey>] <opaque>\\r\\n<payload>
    get <topic> <group> <part> <offset> <maxSize> <opaque> [hold=<ms>]\\r\\n
    offset <topic> <group> <part> <offset> <opaque> [time=<ms>]\\r\\n
    stats [<item>] <opaque>\\r\\n
    version <opaque>\\r\\n
    quit\\r\\n
    idem <pid> <seq> <count>\\r\\n                    (metaq-py, before puts)
    producers <topic> <part> <fromOffset> <opaque>\\r\\n   (metaq-py)
    txlog <replica> <incarnation> <seq> <holdMs> <opaque>\\r\\n   (metaq-py)
    watermarks <replica> <version> <holdMs> <opaque>\\r\\n   (metaq-py)

and every other form Java's decoder (``MetamorphosisWireFormatType``, Metaq 1.4) reads,
as it reads them: the legacy puts ``put <topic> <part> <len> <flag> <opaque>`` (no
checksum) and ``put <topic> <part> <len> <flag> <txKey> <opaque>``; ``stats  <opaque>``
(an empty item), ``stats`` and ``version`` alone (opaque 2147483647); extra fields
after a ``get``'s or an ``offset``'s opaque (ignored); trailing spaces (a line is split
on single spaces and trailing empty fields are dropped, as ``Pattern.split`` does).
``sync <topic> <part> <len> <flag> <msgId> [<checksum>] <opaque>\\r\\n<payload>``
(master → slave replication, Java's ``decodeSync``: its 7-field form from masters
before 1.4.4 has no checksum) is a :class:`SyncRequest`.  Where Java's own reading
is a plain bug, ours differs and says so beside the parser
(:meth:`RequestParser._put_header`, :func:`_version_request`).

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
from collections.abc import Callable, Mapping
from typing import NamedTuple

from metaq._errors import ProtocolError
from metaq.protocol import _fast
from metaq.protocol._commands import (
    BadRequest,
    GetRequest,
    OffsetRequest,
    PutRequest,
    QuitRequest,
    Result,
    StatsRequest,
    SyncRequest,
    TxPut,
    Value,
    VersionRequest,
    group_cache,
    name_problem,
    parse_group,
    parse_int,
    parse_topic,
    show,
    token_text,
    topic_cache,
)
from metaq.protocol._constants import (
    DEFAULT_MAX_BODY,
    DEFAULT_MAX_PAYLOAD,
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INT64_MIN,
    MAX_LINE,
)
from metaq.protocol._idempotence import IdemMark, idem_request, producers_request
from metaq.protocol._transaction import MAX_TRANSACTION_KEY, transaction_request
from metaq.protocol._txlog import txlog_request
from metaq.protocol._watermark import watermarks_request

__all__ = ["RequestParser", "ReplyParser"]

#: What the numbers of a put line (and the spaces between them) are made of.
_NUMERIC = b"-0123456789 "
#: The opaque Java's decoder gives a ``stats`` or ``version`` without one
#: (``Integer.MAX_VALUE``), which its broker echoes.
_NO_OPAQUE = INT32_MAX
#: Which field holds a command's opaque, to answer a bad one with (else its last field).
#: (``idem`` has none: a bad one is answered with opaque 0, never a put's opaque.)
_OPAQUE_FIELD: dict[bytes, int | None] = {
    b"get": 6, b"offset": 5, b"version": 1, b"stats": 2, b"producers": 4, b"idem": None,
    b"txlog": 5, b"watermarks": 4}


def _opaque_of(tok: bytes) -> int | None:
    """The opaque of a bad request, to answer it with, when it can be read."""
    try:
        return parse_int(tok, "opaque", INT32_MIN, INT32_MAX)
    except ProtocolError:
        return None


def _fields(line: bytes) -> list:
    """A request line's fields as Java's decoder splits it (``Pattern.compile(" ")
    .split``): at every single space, the empty fields between two spaces kept, the
    trailing ones dropped (``get ... 7  `` is ``get ... 7``); a blank line is ``[b""]``."""
    parts = line.split(b" ")
    if not parts[-1]:
        while len(parts) > 1 and not parts[-1]:
            parts.pop()
    return parts


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

#: a well-formed get whose names were checked before, read at once (``_fast.get_line``)
get_line = _fast.get_line
_new_tuple = tuple.__new__  # a NamedTuple from a tuple, without its __new__'s argument handling
#: The well-formed ``idem <pid> <seq> <count>`` line, read at once (one per idempotent
#: single send); anything else starting with ``idem`` goes to ``_command``, which says
#: what is wrong with it.
_IDEM = re.compile(rb"idem ([1-9][0-9]{0,17}) (0|[1-9][0-9]{0,17}) ([1-9][0-9]{0,8})\r\n").match


class RequestParser(_Buffered):
    """Incremental parser of client requests (broker side).

    ``max_payload`` bounds a put's payload length; a larger one is answered
    as a bad request and its bytes are skipped without being buffered.

    ``fast_puts`` (broker hot path) maps ``b"<topic> <partition>"`` as it
    appears in a put line to a target object.  A valid put without a
    transaction key whose key is in the mapping comes back as a plain tuple
    ``(target, length, flag, checksum, opaque_token, payload)`` (opaque as its
    decimal bytes, ready to echo; checksum -1 when the put has none) instead of a
    :class:`PutRequest`; with ``tx_puts``, a valid put with a transaction key (printable
    ASCII) comes back as a :class:`TxPut`, the same tuple and the key as bytes.

    Parsing goes in steps, each taking what starts at the current position and
    returning where the next begins (or -1 once it has stopped the parsing and saved
    where, to wait for more bytes or because the stream cannot go on):

    - runs of such puts: ``fast_puts`` of :mod:`metaq.protocol._fast` (C or its
      Python twin, bound once; the broker's hot path), which stops at anything else;
    - line framing (:meth:`_parse` itself, :meth:`_unframed` for a line without CRLF);
    - a put line (:meth:`_put_line`, :meth:`_put_head`) and its payload (:meth:`_payload`);
    - any other command (:meth:`_command`, one parser per command in ``_COMMANDS``).
    """

    def __init__(self, *, max_line: int = MAX_LINE,
                 max_payload: int = DEFAULT_MAX_PAYLOAD,
                 fast_puts: Mapping[bytes, object] | None = None,
                 tx_puts: bool = False) -> None:
        super().__init__()
        self.max_line = max_line
        self.max_payload = max_payload
        self.fast_puts = fast_puts
        #: the put loop's class of puts with a transaction key (None: it stops at them)
        self._tx_cls = TxPut if tx_puts else None
        #: the put loop over ``fast_puts``, bound once in ``_fast`` (C when built); the
        #: Python twin for a mapping that is not a dict (the C loop reads dicts only)
        self._put_loop: Callable[[bytes, int, Mapping, int, list, type | None], int] | None = (
            None if fast_puts is None else
            _fast.fast_puts if type(fast_puts) is dict else _fast.py_fast_puts)
        self._skip = 0                       # payload bytes of a rejected put still to drop
        self._put: tuple | None = None       # header of a put waiting for its payload
        self._put_cls: type = PutRequest     # what it is (PutRequest or SyncRequest)

    @property
    def in_request(self) -> bool:
        """A request has begun arriving and is not whole yet: bytes of its line, a put's
        payload still to come, or a refused put's payload still to skip."""
        return self._put is not None or self._skip > 0 or self.buffered > 0

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
        try:
            self._parse(out, strict)
        finally:
            if self._need == 0:
                if self._broken is not None:
                    self._pos = len(self._buf)
                if self._pos >= len(self._buf):
                    self._buf = b""
                    self._pos = 0

    def _parse(self, out: list, strict: bool) -> None:
        """Every request from ``_pos`` on; saves where it stopped in ``_pos`` (each step
        saves it before it stops the parsing or reports a bad request)."""
        buf = self._buf
        pos = self._pos
        end = len(buf)
        max_line = self.max_line
        max_payload = self.max_payload
        put_loop = self._put_loop
        fast = self.fast_puts
        tx_cls = self._tx_cls
        while pos < end or self._put is not None:
            if self._put is not None:
                pos = self._payload(buf, pos, out)
            else:
                if put_loop is not None:
                    pos = put_loop(buf, pos, fast, max_payload, out, tx_cls)
                    if pos >= end:
                        break
                m = _IDEM(buf, pos)  # an idempotent put's mark (``_idempotence``)
                if m is not None:
                    pid, seq, count = m.groups()
                    out.append(_new_tuple(IdemMark, (int(pid), int(seq), int(count))))
                    pos = m.end()
                    continue
                eol = buf.find(b"\r\n", pos, pos + max_line + 2)
                if eol < 0:
                    self._unframed(buf, pos, out, strict)
                    return
                line = buf[pos:eol]
                if line[:4] == b"put ":
                    pos = self._put_line(line, buf, eol + 2, out, strict)
                elif line[:4] == b"get " and (
                        got := get_line(line, topic_cache, group_cache, GetRequest)) is not None:
                    out.append(got)  # the usual get, whole (a slave's, after every put)
                    pos = eol + 2
                else:
                    pos = self._command(line, buf, eol + 2, out, strict)
            if pos < 0:
                return
        self._pos = pos

    def _unframed(self, buf: bytes, pos: int, out: list, strict: bool) -> None:
        """No CRLF after ``pos``: wait for the rest of the line, or, once it is longer
        than ``max_line``, give up on the stream (nothing tells where a request starts)."""
        end = len(buf)
        max_line = self.max_line
        if end - pos >= max_line + 2:
            self._pos = end
            self._bad(out, strict, ProtocolError(
                f"line {show(buf[pos:pos + max_line])} has no CRLF within "
                f"{max_line} bytes"), None, True)
            return
        self._pos = pos
        self._wait_for(end - pos + 1)

    def _payload(self, buf: bytes, pos: int, out: list) -> int:
        """The payload of the put whose header :meth:`_put_head` kept: the
        :class:`PutRequest`, or -1 to wait for the rest of it."""
        head = self._put
        stop = pos + head[2]
        if stop > len(buf):
            self._pos = pos
            self._wait_for(head[2])
            return -1
        self._put = None
        out.append(_new_tuple(self._put_cls, (*head, buf[pos:stop])))
        return stop

    def _put_line(self, line: bytes, buf: bytes, pos: int, out: list, strict: bool) -> int:
        """A ``put`` line the put loop did not take (no ``fast_puts``, a partition
        not in it...): when it is the common valid put without transaction key, to a
        topic seen before, with its payload all there, the :class:`PutRequest` at once;
        else :meth:`_put_head`.  ``pos`` is where the payload starts."""
        if b"  " not in line and line[-1:] != b" ":
            sp = line.find(b" ", 4)
            topic = topic_cache.get(line[4:sp])
            tail = line[sp + 1:]
            if topic is not None and not tail.translate(None, _NUMERIC):
                try:
                    partition, length, flag, check, opaque = map(int, tail.split())
                except ValueError:
                    length = -1
                if (0 <= length <= self.max_payload and pos + length <= len(buf)
                        and INT32_MIN <= partition <= INT32_MAX
                        and INT32_MIN <= flag <= INT32_MAX
                        and INT32_MIN <= check <= INT32_MAX
                        and INT32_MIN <= opaque <= INT32_MAX):
                    stop = pos + length
                    out.append(_new_tuple(PutRequest, (
                        topic, partition, length, flag, check, None, opaque, buf[pos:stop])))
                    return stop
        return self._put_head(_fields(line), line, buf, pos, out, strict)

    def _put_head(self, parts: list, line: bytes, buf: bytes, pos: int, out: list,
                  strict: bool) -> int:
        """Any put line: its header kept for :meth:`_payload`; or, when it is bad,
        answered, and its payload skipped when its length can be read (else the
        stream cannot go on)."""
        try:
            head = self._put_header(parts, line)
        except ProtocolError as e:
            skip = self._put_skip(parts) if 6 <= len(parts) <= 8 else None
            return self._refuse(e, _opaque_of(parts[-1]), skip, buf, pos, out, strict)
        self._put = head
        self._put_cls = PutRequest
        return pos

    def _refuse(self, err: ProtocolError, opaque: int | None, skip: int | None, buf: bytes,
                pos: int, out: list, strict: bool) -> int:
        """A bad request whose line ends at ``pos``, followed by a payload of ``skip``
        bytes: answered, and its payload skipped (in later reads too, not buffered);
        ``skip`` None (the length cannot be read): the stream cannot go on."""
        end = len(buf)
        if skip is None:
            self._pos = end
            self._bad(out, strict, err, opaque, True)
            return -1
        take = min(skip, end - pos)
        pos += take
        self._skip = skip - take
        self._pos = pos
        self._bad(out, strict, err, opaque, False)
        if self._skip:
            self._pos = end
            return -1
        return pos

    # The put forms of Java's decoder (``decodePut``), told apart by their number of
    # fields, the way it does:
    #
    #   6  put <topic> <part> <len> <flag> <opaque>                   clients before 1.4.4
    #   7  put <topic> <part> <len> <flag> <checksum> <opaque>        slot starts with a
    #                                                                 digit or '-'
    #      put <topic> <part> <len> <flag> <txKey> <opaque>           else (transactional,
    #                                                                 before 1.4.4)
    #   8  put <topic> <part> <len> <flag> <checksum> <txKey> <opaque>
    #
    # A put without a checksum gets -1, as Java's PutCommand does: "not computed"; Java's
    # clients send -1 in every put, and the broker computes the stored message's CRC
    # (metaq.broker._puts), where Java's never checks one.
    #
    # Java's plain bugs are not copied: its encoders size a request's buffer with
    # String.length(), so a topic or transaction key that is not ASCII (more UTF-8 bytes
    # than chars) overflows it and the request is never sent; ours are read (and
    # written, by our encoders) as UTF-8, whatever their characters.  A slot that starts
    # with a non-ASCII digit (Java's Character.isDigit) is a transaction key here.
    def _put_header(self, parts: list, line: bytes) -> tuple:
        n = len(parts)
        if n == 8:
            tx_tok = parts[6]
        elif n == 7:
            slot = parts[5][:1]
            tx_tok = None if slot.isdigit() or slot == b"-" else parts[5]
        elif n == 6:
            tx_tok = None
        else:
            raise ProtocolError(
                f"bad put line {show(line)}: expected 'put <topic> <partition> <length> "
                f"<flag> [<checksum>] [<txKey>] <opaque>'")
        tx_key = None
        if tx_tok is not None:
            tx_key = token_text(tx_tok, "transaction key")
            # an XA key (two hex ids of up to 64 bytes each, a unique qualifier) may be
            # longer than a name: its own length limit (_transaction._MAX_KEY) applies
            if not tx_key or len(tx_key) > MAX_TRANSACTION_KEY or not tx_key.isprintable():
                raise ProtocolError(f"bad put line {show(line)}: bad transaction key")
        try:
            topic = parse_topic(parts[1])
            partition = parse_int(parts[2], "partition", INT32_MIN, INT32_MAX)
            length = parse_int(parts[3], "length", 0, INT32_MAX)
            flag = parse_int(parts[4], "flag", INT32_MIN, INT32_MAX)
            checksum = (parse_int(parts[5], "checksum", INT32_MIN, INT32_MAX)
                        if n == 8 or (n == 7 and tx_tok is None) else -1)
            opaque = parse_int(parts[-1], "opaque", INT32_MIN, INT32_MAX)
        except ProtocolError as e:
            raise ProtocolError(f"bad put line {show(line)}: {e}") from None
        if length > self.max_payload:
            raise ProtocolError(
                f"bad put line {show(line)}: payload length {length} is over the limit "
                f"{self.max_payload}")
        return (topic, partition, length, flag, checksum, tx_key, opaque)

    @staticmethod
    def _put_skip(parts: list) -> int | None:
        """Payload length to skip after a bad put (or sync) header, or None if it is
        unknown."""
        try:
            return parse_int(parts[3], "length", 0, INT32_MAX)
        except ProtocolError:
            return None

    def _sync(self, parts: list, line: bytes, buf: bytes, pos: int, out: list,
              strict: bool) -> int:
        """``sync <topic> <part> <len> <flag> <msgId> [<checksum>] <opaque>\\r\\n<payload>``
        (Java's ``decodeSync``: 8 fields, or 7 from a master before 1.4.4, without the
        checksum, which is then -1): its header kept for :meth:`_payload`, which makes
        it a :class:`SyncRequest`.  A bad one is answered and its payload skipped when
        its length can be read (the 7 or 8 fields, a length in range); else the stream
        cannot go on."""
        n = len(parts)
        try:
            if n not in (7, 8):
                raise ProtocolError("expected 'sync <topic> <partition> <length> <flag> "
                                    "<msgId> [<checksum>] <opaque>'")
            head = (parse_topic(parts[1]),
                    parse_int(parts[2], "partition", INT32_MIN, INT32_MAX),
                    parse_int(parts[3], "length", 0, INT32_MAX),
                    parse_int(parts[4], "flag", INT32_MIN, INT32_MAX),
                    parse_int(parts[5], "msgId", INT64_MIN, INT64_MAX),
                    parse_int(parts[6], "checksum", INT32_MIN, INT32_MAX) if n == 8 else -1,
                    parse_int(parts[-1], "opaque", INT32_MIN, INT32_MAX))
            if head[2] > self.max_payload:
                raise ProtocolError(f"payload length {head[2]} is over the limit "
                                    f"{self.max_payload}")
        except ProtocolError as e:
            skip = self._put_skip(parts) if n in (7, 8) else None
            err = ProtocolError(f"bad sync line {show(line)}: {e}")
            return self._refuse(err, _opaque_of(parts[-1]), skip, buf, pos, out, strict)
        self._put = head
        self._put_cls = SyncRequest
        return pos

    def _command(self, line: bytes, buf: bytes, pos: int, out: list, strict: bool) -> int:
        """A line that is not a put's: its request (parsed by ``_COMMANDS``), or a
        bad request answered (the stream goes on after it).  ``pos`` follows the line."""
        parts = _fields(line)
        cmd = parts[0]
        if cmd == b"put":  # "put" alone, or with a tab...: a bad put
            return self._put_head(parts, line, buf, pos, out, strict)
        if cmd == b"sync":
            return self._sync(parts, line, buf, pos, out, strict)
        parse = _COMMANDS.get(cmd)
        try:
            if parse is None:
                raise ProtocolError(f"unknown command {show(cmd)} in line {show(line)}")
            try:
                out.append(parse(parts))
            except ProtocolError as e:
                raise ProtocolError(
                    f"bad {token_text(cmd, 'command')} line {show(line)}: {e}") from None
        except ProtocolError as e:
            self._pos = pos
            n = len(parts)
            k = _OPAQUE_FIELD.get(cmd, -1)
            self._bad(out, strict, e, _opaque_of(parts[k if 0 < k < n else -1])
                      if n > 1 and k is not None else None, False)
        return pos


# The other commands, from their fields (:func:`_fields`, the command's first): each
# raises ProtocolError saying what is wrong, which :meth:`RequestParser._command` puts
# in context.  Like Java's decoder, each reads the fields it knows and ignores any
# after them; metaq-py's extensions (``hold=``, ``time=``) are read only as the one
# field right after the opaque.

def _get_request(parts: list) -> GetRequest:
    if len(parts) < 7:
        raise ProtocolError("expected 'get <topic> <group> <partition> <offset> "
                            "<maxSize> <opaque> [hold=<ms> [records=<opaque>]]'")
    hold = parts[7] if len(parts) > 7 else b""
    records = parts[8] if len(parts) > 8 and hold[:5] == b"hold=" else b""
    return GetRequest(
        parse_topic(parts[1]), parse_group(parts[2]),
        parse_int(parts[3], "partition", INT32_MIN, INT32_MAX),
        parse_int(parts[4], "offset", INT64_MIN, INT64_MAX),
        parse_int(parts[5], "maxSize", INT32_MIN, INT32_MAX),
        parse_int(parts[6], "opaque", INT32_MIN, INT32_MAX),
        parse_int(hold[5:], "hold", 0, INT32_MAX) if hold[:5] == b"hold=" else 0,
        parse_int(records[8:], "records", INT32_MIN, INT32_MAX)
        if records[:8] == b"records=" else None)


def _offset_request(parts: list) -> OffsetRequest:
    if len(parts) < 6:
        raise ProtocolError("expected 'offset <topic> <group> <partition> <offset> <opaque>"
                            " [time=<ms>]'")
    time = parts[6] if len(parts) > 6 else b""
    return OffsetRequest(
        parse_topic(parts[1]), parse_group(parts[2]),
        parse_int(parts[3], "partition", INT32_MIN, INT32_MAX),
        parse_int(parts[4], "offset", INT64_MIN, INT64_MAX),
        parse_int(parts[5], "opaque", INT32_MIN, INT32_MAX),
        parse_int(time[5:], "time", 0, INT64_MAX) if time[:5] == b"time=" else -1)


# ``version`` and ``stats`` without an opaque get Java's (_NO_OPAQUE).  Java's encoders
# write the text ``null`` for a missing opaque in places (its String concatenation of
# a null Integer); that is their bug, and stays a bad request here as there (Java's
# Integer.parseInt refuses it too).

def _version_request(parts: list) -> VersionRequest:
    return VersionRequest(parse_int(parts[1], "opaque", INT32_MIN, INT32_MAX)
                          if len(parts) > 1 else _NO_OPAQUE)


def _stats_request(parts: list) -> StatsRequest:
    """``stats <item> <opaque>``; ``stats  <opaque>`` (an empty item: Java's encoder
    writes that for none) and ``stats <opaque>`` (ours) mean no item; ``stats`` alone
    and ``stats <item>`` (an item that is not a number) have no opaque, as in Java."""
    n = len(parts)
    if n == 1:
        return StatsRequest(None, _NO_OPAQUE)
    tok = parts[1]
    if n == 2:
        if tok.isdigit() or (tok[:1] == b"-" and tok[1:].isdigit()):
            # metaq-py's encoder's form; Java's decoder would read the number as an item
            return StatsRequest(None, parse_int(tok, "opaque", INT32_MIN, INT32_MAX))
        opaque = _NO_OPAQUE
    else:
        opaque = parse_int(parts[2], "opaque", INT32_MIN, INT32_MAX)
    if not tok:
        return StatsRequest(None, opaque)
    item = token_text(tok, "stats item")
    problem = name_problem(item)
    if problem:
        raise ProtocolError(f"stats item {problem}")
    return StatsRequest(item, opaque)


def _quit_request(parts: list) -> QuitRequest:
    if len(parts) != 1:
        raise ProtocolError("expected 'quit'")
    return QuitRequest()


_COMMANDS: dict[bytes, Callable[[list], NamedTuple]] = {
    b"get": _get_request,
    b"offset": _offset_request,
    b"version": _version_request,
    b"stats": _stats_request,
    b"quit": _quit_request,
    b"transaction": transaction_request,
    # metaq-py's idempotent producer (``_idempotence``): the mark before a run of puts
    # (no opaque, no answer but a refusal's) and the read of a partition's producer table
    b"idem": idem_request,
    b"producers": producers_request,
    # metaq-py's transaction feed from a master to its slaves (``_txlog``)
    b"txlog": txlog_request,
    # metaq-py's high watermarks from a master to its slaves (``_watermark``)
    b"watermarks": watermarks_request,
}


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
                        self._fail(f"reply line {show(buf[pos:pos + max_line])} has no CRLF "
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
                            False, parse_int(parts[1], "code", 0, 999),
                            parse_int(parts[2], "body length", 0, self.max_body),
                            parse_int(parts[3], "opaque", INT32_MIN, INT32_MAX))
                    elif parts[0] == b"value" and len(parts) == 3:
                        self._head = (
                            True, 200, parse_int(parts[1], "value length", 0, self.max_body),
                            parse_int(parts[2], "opaque", INT32_MIN, INT32_MAX))
                    else:
                        raise ProtocolError("expected 'result <code> <length> <opaque>' or "
                                            "'value <length> <opaque>'")
                except ProtocolError as e:
                    self._fail(f"bad reply line {show(line)}: {e}")
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
