"""Metaq 1.4's ``transaction`` command and transaction keys (Java's ``TransactionCommand``,
``TransactionInfo``, ``LocalTransactionId``, ``XATransactionId``)::

    transaction <key> <sessionId> <type> [<timeout>] [<uniqueQualifier>] <opaque>\\r\\n

``key`` is a local transaction's ``TX:<sessionId>:<n>``, an XA branch's
``XID:<formatId>:<gtrid hex>:<bqual hex>:<uniqueQualifier>``, or ``null`` (RECOVER
names no transaction).  ``type`` is one of :data:`TX_TYPES`.  With 6 fields the
5th is the timeout (seconds) when it is all digits, else the unique qualifier,
as Java's decoder reads it.  A put joins a transaction by carrying its key
(``put <topic> <part> <len> <flag> <checksum> <key> <opaque>``).

**Pipelined local transactions** (metaq-py, offered by a broker whose ``version``
answer lists :data:`TXPIPE_CAPABILITY`, ``+txpipe``): a producer may write BEGIN, the
puts and COMMIT_ONE_PHASE together without waiting for any answer; its COMMIT then
says how many puts it sent, as a ``puts=<n>`` token where a unique qualifier would
stand (``transaction TX:<session>:<n> <sessionId> COMMIT_ONE_PHASE puts=<n> <opaque>``;
local transactions have no unique qualifier).  Such a broker commits only when the
transaction holds exactly that many messages and none of its puts was refused;
otherwise it rolls the transaction back and refuses the COMMIT, so a pipelined
transaction with a missing message is never committed.  Java's broker has no such
rule: a producer sends ``puts=`` only to a ``+txpipe`` broker.

Answers (Java's ``TransactionProcessor``): ``result 200`` with no body for BEGIN,
COMMIT_*, ROLLBACK, FORGET; PREPARE answers ``result 200`` with ``0`` (XA_OK) or
``3`` (XA_RDONLY: nothing to commit); RECOVER answers ``result 200`` with the
prepared branches' keys separated by CRLF; END is not answered.  Failures are
``result 500 XAException:code=<XAException errorCode>,msg=<text>`` (or, for a
local transaction not started, ``result 500 Local transaction '<key>' has not
been started.``).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from metaq._errors import ProtocolError
from metaq.protocol._commands import name_problem, parse_int, show, token_text
from metaq.protocol._constants import INT32_MAX, INT32_MIN

__all__ = ["TransactionRequest", "TransactionKey", "TX_TYPES", "encode_transaction",
           "parse_transaction_key", "transaction_request", "local_key", "xa_key",
           "MAX_TRANSACTION_KEY", "TXPIPE_CAPABILITY",
           "XA_OK", "XA_RDONLY", "XAER_NOTA", "XAER_PROTO",
           "XAER_RMERR", "XAER_INVAL",
           "XA_RBOTHER", "XA_RBTIMEOUT"]

#: The transaction types, as Java's ``TransactionInfo.TransactionType`` names them.
TX_TYPES = ("BEGIN", "PREPARE", "COMMIT_ONE_PHASE", "COMMIT_TWO_PHASE", "ROLLBACK", "RECOVER",
            "FORGET", "END")

# javax.transaction.xa codes carried in "XAException:code=..." answers
XA_OK = 0
XA_RDONLY = 3
XA_RBOTHER = 100
XA_RBTIMEOUT = 106
XAER_RMERR = -3
XAER_NOTA = -4
XAER_INVAL = -5
XAER_PROTO = -6

#: The ``version`` extension of a broker that takes pipelined local transactions
#: (the module docstring).
TXPIPE_CAPABILITY = "+txpipe"
_PUTS = re.compile(r"puts=(0|[1-9][0-9]{0,9})")

_LOCAL = re.compile(r"TX:([^:\s]+):(-?\d{1,19})")
_XA = re.compile(r"XID:(-?\d{1,10}):([0-9a-fA-F]*):([0-9a-fA-F]*):([^:\s]+)")
#: Longest transaction key accepted (an XA key with 64-byte ids is about 290 characters).
MAX_TRANSACTION_KEY = 512


class TransactionKey(NamedTuple):
    """A parsed key: ``kind`` "local", "xa" or "null"; for XA its ``format_id``,
    ``gtrid``, ``bqual`` and ``unique_qualifier``; for local its ``session_id``."""

    kind: str
    text: str
    session_id: str | None = None
    format_id: int = 0
    gtrid: bytes = b""
    bqual: bytes = b""
    unique_qualifier: str | None = None

    @property
    def is_xa(self) -> bool:
        return self.kind == "xa"


def parse_transaction_key(text: str) -> TransactionKey:
    """``text`` as a transaction key, or ProtocolError naming what is wrong."""
    if text == "null":
        return TransactionKey("null", text)
    if len(text) > MAX_TRANSACTION_KEY:
        raise ProtocolError(f"transaction key of {len(text)} characters is too long")
    m = _LOCAL.fullmatch(text)
    if m is not None:
        return TransactionKey("local", text, session_id=m.group(1))
    m = _XA.fullmatch(text)
    if m is not None:
        gtrid, bqual = m.group(2), m.group(3)
        if len(gtrid) % 2 or len(bqual) % 2:
            raise ProtocolError(f"transaction key {show(text.encode())}: odd-length hex")
        fmt = int(m.group(1))
        if not INT32_MIN <= fmt <= INT32_MAX:
            raise ProtocolError(f"transaction key {show(text.encode())}: formatId out of range")
        return TransactionKey("xa", text, format_id=fmt, gtrid=bytes.fromhex(gtrid),
                              bqual=bytes.fromhex(bqual), unique_qualifier=m.group(4))
    raise ProtocolError(f"bad transaction key {show(text.encode())}: expected "
                        f"'TX:<session>:<n>', 'XID:<formatId>:<gtrid hex>:<bqual hex>:"
                        f"<uniqueQualifier>' or 'null'")


def local_key(session_id: str, n: int) -> str:
    return f"TX:{session_id}:{n}"


def xa_key(format_id: int, gtrid: bytes, bqual: bytes, unique_qualifier: str) -> str:
    # Java's HexSupport writes lowercase hex
    return f"XID:{format_id}:{gtrid.hex()}:{bqual.hex()}:{unique_qualifier}"


class TransactionRequest(NamedTuple):
    key: TransactionKey
    session_id: str
    type: str
    #: seconds (0: none), for BEGIN
    timeout: int
    unique_qualifier: str | None
    opaque: int
    #: a pipelined local COMMIT_ONE_PHASE: how many puts the producer sent (``puts=<n>``)
    puts: int | None = None


def encode_transaction(key: str, session_id: str, type: str, opaque: int, *,
                       timeout: int = 0, unique_qualifier: str | None = None,
                       puts: int | None = None) -> bytes:
    """A ``transaction`` line as Java's ``TransactionCommand.encode`` writes it; with
    ``puts`` (a local COMMIT_ONE_PHASE only), a pipelined commit's ``puts=<n>``."""
    parsed = parse_transaction_key(key)
    if puts is not None:
        if (type != "COMMIT_ONE_PHASE" or parsed.kind != "local" or unique_qualifier
                or isinstance(puts, bool) or not isinstance(puts, int)
                or not 0 <= puts <= INT32_MAX):
            raise ProtocolError(f"puts={puts!r} is for a local transaction's "
                                f"COMMIT_ONE_PHASE only, a count from 0 to {INT32_MAX}")
        unique_qualifier = f"puts={puts}"
    if type not in TX_TYPES:
        raise ProtocolError(f"transaction type must be one of {', '.join(TX_TYPES)}, "
                            f"not {type!r}")
    for what, value in (("session id", session_id), ("unique qualifier", unique_qualifier)):
        if value is not None and (not value or name_problem(value) or ":" in value):
            raise ProtocolError(f"bad {what} {value!r}")
    fields = [key, session_id, type]
    if timeout > 0:
        fields.append(str(timeout))
    if unique_qualifier:
        fields.append(unique_qualifier)
    fields.append(str(opaque))
    return ("transaction " + " ".join(fields) + "\r\n").encode()


def transaction_request(parts: list) -> TransactionRequest:
    """The fields of a ``transaction`` line (``parts``, split on spaces, the command
    first), read as Java's decoder reads them."""
    n = len(parts)
    if n not in (5, 6, 7):
        raise ProtocolError("expected 'transaction <key> <sessionId> <type> [<timeout>] "
                            "[<uniqueQualifier>] <opaque>'")
    key = parse_transaction_key(token_text(parts[1], "transaction key"))
    session = token_text(parts[2], "session id")
    if not session or name_problem(session):
        raise ProtocolError(f"bad session id {show(parts[2])}")
    ttype = token_text(parts[3], "transaction type")
    if ttype not in TX_TYPES:
        raise ProtocolError(f"unknown transaction type {show(parts[3])} (one of "
                            f"{', '.join(TX_TYPES)})")
    timeout, uq = 0, None
    if n == 7:
        timeout = parse_int(parts[4], "timeout", 0, INT32_MAX)
        uq = token_text(parts[5], "unique qualifier")
    elif n == 6:
        if parts[4].isdigit():
            timeout = parse_int(parts[4], "timeout", 0, INT32_MAX)
        else:
            uq = token_text(parts[4], "unique qualifier")
    if uq is not None and (not uq or name_problem(uq)):
        raise ProtocolError(f"bad unique qualifier {show(uq.encode())}")
    puts = None
    if uq is not None and ttype == "COMMIT_ONE_PHASE" and key.kind == "local":
        m = _PUTS.fullmatch(uq)
        if m is not None and int(m.group(1)) <= INT32_MAX:
            puts, uq = int(m.group(1)), None
    return TransactionRequest(key, session, ttype, timeout, uq,
                              parse_int(parts[-1], "opaque", INT32_MIN, INT32_MAX), puts)
