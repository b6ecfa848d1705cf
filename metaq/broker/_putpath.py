"""The broker's put fast path: groups of valid puts to one partition, checked,
packed, appended and answered with whole-list operations.

A group is a list of the parser's fast-put tuples ``(target, length, flag,
checksum, opaque_token, payload)`` for one partition.  :func:`put_group`
transposes it into columns, verifies every CRC32 in one pass (falling back
to :func:`_put_group_checked`, one put at a time, when any is wrong), packs
the 20-byte headers with one ``map``, appends everything with one write, and
formats the ``result 200`` replies from one prebuilt format when the msgIds
and offsets keep their digit counts (see :func:`_ok_replies`).
"""

from __future__ import annotations

import itertools
import logging
import operator

from metaq._errors import StorageError
from metaq.broker._connection import result
from metaq.broker._storage import PartitionLog
from metaq.protocol import HEADER
from metaq.protocol import crc32 as _crc32  # ISA-L when installed (one selection point)

__all__ = ["put_group", "runs"]

log = logging.getLogger(__name__)

_MASK = 0x7FFFFFFF
_pack = HEADER.pack
_target_of = operator.itemgetter(0)  # fields of a fast-put tuple (see put_group)
_opaque_of_put = operator.itemgetter(4)
_PLUS_HEADER = HEADER.size.__add__  # a message's bytes in the log: header + payload
#: Smallest group worth the columnar path (each whole-list step costs about a microsecond).
_COLUMNAR_MIN = 8


def runs(targets: list[tuple]) -> list[tuple[tuple, int]] | None:
    """``[(target, count), ...]`` of the runs of equal targets, when there are few
    (at most one per 64 puts) and none is "partition -1"; else None."""
    runs = [(t, len(list(g))) for t, g in itertools.groupby(targets)]
    if len(runs) * 64 > len(targets) or any(t[0] is None for t, _ in runs):
        return None
    return runs


def _ok_replies(pbytes: bytes, opaques: tuple[bytes, ...], ids: list[int],
                offsets: list[int]) -> list[bytes]:
    """``result 200`` replies of stored puts (``<msgId> <partition> <offset>``).

    msgIds and offsets only grow, so their digit counts (and the body length)
    are the same for every reply when they are the same for the first and the
    last: then each reply is one ``%`` of a prebuilt format.
    """
    n_id = len(b"%d" % ids[0])
    n_off = len(b"%d" % offsets[0])
    if n_id == len(b"%d" % ids[-1]) and n_off == len(b"%d" % offsets[-1]):
        fmt = b"result 200 %d %%b\r\n%%d %b %%d" % (n_id + len(pbytes) + n_off + 2, pbytes)
        return list(map(fmt.__mod__, zip(opaques, ids, offsets, strict=True)))
    fixed = len(pbytes) + 2
    return [b"result 200 %d %b\r\n%d %b %d" % (len(b"%d" % i) + len(b"%d" % o) + fixed, op,
                                                 i, pbytes, o)
            for op, i, o in zip(opaques, ids, offsets, strict=True)]


def put_group(target: tuple, puts: list, ids: list[int]) -> tuple[list[bytes], int, bool]:
    """Store ``puts`` (fast-path tuples, all to ``target``) with msgIds ``ids``:
    ``(replies in order, how many failed, whether anything was written)``."""
    plog, pbytes = target
    m = len(puts)
    if plog.closed:
        return [b"result 400 17 %b\r\nchecksum mismatch" % opaque
                if _crc32(payload) & _MASK != check else
                result(403, f"partition {plog.topic}-{plog.partition} is closed", int(opaque))
                for _t, _l, _f, check, opaque, payload in puts], m, False
    if m < _COLUMNAR_MIN:  # a few puts: whole-list steps would cost more than a loop
        return _put_group_checked(plog, pbytes, puts, ids)
    _t, lengths, flags, checks, opaques, payloads = zip(*puts, strict=True)
    if list(map(_MASK.__and__, map(_crc32, payloads))) != list(checks):
        return _put_group_checked(plog, pbytes, puts, ids)
    base = plog.end
    parts: list = [None] * (2 * m)
    parts[0::2] = map(_pack, lengths, checks, ids, flags)
    parts[1::2] = payloads
    offsets = list(itertools.accumulate(map(_PLUS_HEADER, lengths), initial=base))
    offsets.pop()
    try:
        start = plog.append(b"".join(parts), m)
        if start != base:  # cannot happen: offsets are only assigned here
            raise StorageError(f"append to {plog.dir} landed at {start}, expected {base}")
    except StorageError as e:
        log.error("put failed: %s", e)
        return [result(500, f"write failed: {e}", int(o)) for o in opaques], m, False
    return _ok_replies(pbytes, opaques, ids, offsets), 0, True

def _put_group_checked(plog: PartitionLog, pbytes: bytes, puts: list,
                       ids: list[int]) -> tuple[list[bytes], int, bool]:
    """:func:`put_group` one put at a time: for a small group, or one with bad checksums."""
    replies: list = [None] * len(puts)
    parts: list = []
    add = parts.append
    base = plog.end
    size = bad = 0
    fixed = len(pbytes) + 2
    for k, (_t, length, flag, check, opaque, payload) in enumerate(puts):
        if _crc32(payload) & _MASK != check:
            replies[k] = b"result 400 17 %b\r\nchecksum mismatch" % opaque
            bad += 1
            continue
        msg_id = ids[k]
        add(_pack(length, check, msg_id, flag))
        add(payload)
        off = base + size
        size += 20 + length
        replies[k] = b"result 200 %d %b\r\n%d %b %d" % (
            len(b"%d" % msg_id) + len(b"%d" % off) + fixed, opaque, msg_id, pbytes, off)
    if not parts:
        return replies, bad, False
    try:
        start = plog.append(b"".join(parts), len(parts) >> 1)
        if start != base:  # cannot happen: offsets are only assigned here
            raise StorageError(f"append to {plog.dir} landed at {start}, expected {base}")
    except StorageError as e:
        log.error("put failed: %s", e)
        for k, reply in enumerate(replies):
            if reply.startswith(b"result 200 "):
                replies[k] = result(500, f"write failed: {e}", int(puts[k][4]))
                bad += 1
        return replies, bad, False
    return replies, bad, True
