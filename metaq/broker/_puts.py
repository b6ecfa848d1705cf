"""Storing puts: one step from a read's parsed puts to appended messages and
their replies, in request order.

The request parser hands the broker puts in two forms: the tuples of its put
loop, ``(target, length, flag, checksum, opaque_token, payload)`` (valid puts to
served partitions, the broker's hot path; targets, ``PutTarget`` and
``PickTarget``, are described in ``_topics``),
and :class:`~metaq.protocol.PutRequest` for any other put.  A run of puts, of
either form or both, goes through the same steps:

1. gives each put its target: a tuple's is in it; a PutRequest's is looked up
   (400 for a partition below -1, 404 for one not served, the topic created when
   ``auto_create_topics`` says so); a put to partition -1 gets the next partition
   of its topic's round robin, in request order; a PutRequest the broker refuses
   whatever its payload (over ``max_message_size``) gets a target that says why
   (its ``refused``, see ``_topics.PutTarget``);
2. groups the puts by target: one group when all go to one partition, one per
   run when they come in runs (batches), else one per partition;
3. stores each group (:func:`put_group`): every checksum checked (400; a checksum
   -1, "not computed", as Java's clients send it or none given, in either form,
   becomes the payload's: its CRC32 is computed once, here, as for a check), then the
   partition's state (403 when closed) and the target's refusal (400), the
   messages packed and appended with one write, the replies formatted together
   (:func:`~metaq.broker._replies.put_results`).

:func:`store` is steps 2 and 3 (a run of tuples only, the usual read, goes straight
to it); :func:`store_requests` is step 1 before it, for a run holding PutRequests.
A run of puts costs whole-list operations per group, not Python work per put,
wherever it can (:func:`put_group`'s columnar path).

:func:`store_idempotent` is the put step of a run of puts after an ``idem`` mark
(metaq-py's idempotent producer): the puts already stored for that producer and
sequence are answered with their original msgId and offset, a sequence that jumps
ahead is refused (409), the rest is stored by :func:`put_group` with its producer
record journaled first (``_producers``).  Plain puts never come here.
"""

from __future__ import annotations

import itertools
import logging
import operator
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from metaq._errors import StorageError
from metaq.broker._replies import checksum_mismatch, put_results, result
from metaq.protocol import (
    CHECKSUM_MASK,
    GAP_CODE,
    HEADER,
    HEADER_SIZE,
    TOO_OLD_CODE,
    IdemMark,
    ProducerRecord,
    PutRequest,
    crc32,
)

if TYPE_CHECKING:
    from metaq.broker._producers import Producers
    from metaq.broker._storage import PartitionLog
    from metaq.broker._topics import PickTarget, PutTarget, Topics

__all__ = ["store", "store_requests", "store_idempotent", "idem_marks", "idem_group",
           "put_group", "runs", "target_of", "opaque_of"]

log = logging.getLogger(__name__)

#: A put tuple's target and opaque token (see the module docstring).
target_of = operator.itemgetter(0)
opaque_of = operator.itemgetter(4)
#: ``put_group(target, puts, msg_ids) -> (replies, how many failed, whether it wrote)``
PutGroup = Callable[["PutTarget", list, list[int]], tuple[list[bytes], int, bool]]

_pack = HEADER.pack
_PLUS_HEADER = HEADER_SIZE.__add__  # a message's bytes in the log: header + payload
#: Smallest group worth the columnar path (each whole-list step costs about a microsecond).
_COLUMNAR_MIN = 8


def store(puts: list, targets: list[PutTarget | PickTarget], ids: list[int],
          put_group: PutGroup, topics: Topics) -> tuple[list[bytes], int, list[PartitionLog]]:
    """The put step for put tuples (``targets``: theirs), msgIds ``ids``: ``(replies in
    request order, how many failed, the logs written)`` (steps 2 and 3 above)."""
    n = len(puts)
    first = targets[0]
    bad = 0
    written: list[PartitionLog] = []
    if first.log is not None and targets.count(first) == n:
        replies, bad, wrote = put_group(first, puts, ids)
        if wrote:
            written.append(first.log)
    elif (found := runs(targets)) is not None:  # a few runs (batches): one group each
        replies = []
        start = 0
        for target, count in found:
            stop = start + count
            group, group_bad, wrote = put_group(target, puts[start:stop], ids[start:stop])
            replies += group
            bad += group_bad
            if wrote and target.log not in written:
                written.append(target.log)
            start = stop
    else:
        replies = [None] * n
        buckets: dict[PutTarget, list[int]] = {}
        for k, t in enumerate(targets):
            if t.log is None:  # partition -1: the broker picks
                topic = t.topic
                t = topics.pick(topic)
                if t is None:
                    replies[k] = result(404, f"topic {topic} not found", int(puts[k][4]))
                    bad += 1
                    continue
            b = buckets.get(t)
            if b is None:
                buckets[t] = [k]
            else:
                b.append(k)
        for target, idxs in buckets.items():
            group, group_bad, wrote = put_group(
                target, [puts[k] for k in idxs], [ids[k] for k in idxs])
            for k, reply in zip(idxs, group, strict=True):
                replies[k] = reply
            bad += group_bad
            if wrote:
                written.append(target.log)
    return replies, bad, written


def store_requests(puts: list, ids: list[int], put_group: PutGroup, topics: Topics,
                   max_size: int) -> tuple[list[bytes], int, list[PartitionLog]]:
    """:func:`store` for a run of puts holding PutRequests: each given its target
    first (step 1 above), in request order."""
    replies: list = [None] * len(puts)
    todo, targets, where = _targets(puts, topics, max_size, replies)
    failed = len(puts) - len(where)
    if not todo:
        return replies, failed, []
    got, bad, written = store(todo, targets, [ids[k] for k in where], put_group, topics)
    for k, reply in zip(where, got, strict=True):
        replies[k] = reply
    return replies, failed + bad, written


def _targets(puts: list, topics: Topics, max_size: int,
             replies: list) -> tuple[list[tuple], list[PutTarget], list[int]]:
    """Step 1, for a run that holds PutRequests: every put as a tuple with its target
    resolved (partition -1 included), in request order; the replies of those that
    have none are set in ``replies``.  Returns ``(tuples, targets, their indexes)``."""
    todo: list[tuple] = []
    targets: list[PutTarget] = []
    where: list[int] = []
    for k, put in enumerate(puts):
        if type(put) is tuple:
            target = put[0]
            if target.log is None:  # partition -1
                topic = target.topic
                target = topics.pick(topic)
                if target is None:
                    replies[k] = result(404, f"topic {topic} not found", int(put[4]))
                    continue
        else:
            topic, partition, length, flag, check, _tx_key, opaque, payload = put
            if partition >= 0:
                target = topics.target(topic, partition)
                if target is None:
                    replies[k] = result(404, f"topic {topic} partition {partition} not found",
                                        opaque)
                    continue
            elif partition == -1:
                target = topics.pick(topic)
                if target is None:
                    replies[k] = result(404, f"topic {topic} not found", opaque)
                    continue
            else:
                replies[k] = result(400, f"bad partition {partition}", opaque)
                continue
            if length > max_size:
                target = target._replace(
                    refused=f"message of {length} bytes is over the limit {max_size}")
            put = (target, length, flag, check, b"%d" % opaque, payload)
        todo.append(put)
        targets.append(target)
        where.append(k)
    return todo, targets, where


def runs(targets: list[PutTarget | PickTarget]) -> list[tuple[PutTarget, int]] | None:
    """``[(target, count), ...]`` of the runs of equal targets, when there are few
    (at most one per 64 puts) and none is "partition -1"; else None."""
    found = [(t, len(list(g))) for t, g in itertools.groupby(targets)]
    if len(found) * 64 > len(targets) or any(t.log is None for t, _ in found):
        return None
    return found


def put_group(target: PutTarget, puts: list, ids: list[int]) -> tuple[list[bytes], int, bool]:
    """Store ``puts`` (tuples, all to ``target``) with msgIds ``ids``: ``(replies in
    order, how many failed, whether anything was written)``.

    Every put's checksum is checked first (400), then the partition (403 when
    closed) and the target's refusal (400); the rest is appended with one write.
    A group of at least ``_COLUMNAR_MIN`` puts is transposed into columns: every
    CRC32 verified in one pass (:func:`_put_group_checked`, one put at a time, when
    any is wrong), the 20-byte headers packed with one ``map``, the replies built
    together.
    """
    plog, partition, refused = target
    m = len(puts)
    if plog.closed or refused is not None:
        return _refused(target, puts), m, False
    if m < _COLUMNAR_MIN:  # a few puts: whole-list steps would cost more than a loop
        return _put_group_checked(plog, partition, puts, ids)
    _t, lengths, flags, checks, opaques, payloads = zip(*puts, strict=True)
    crcs = list(map(CHECKSUM_MASK.__and__, map(crc32, payloads)))  # once per put
    if crcs != list(checks):
        if checks.count(-1) != m:  # not all "not computed" (Java's clients): one at a time
            return _put_group_checked(plog, partition, puts, ids)
        checks = crcs
    base = plog.end
    parts: list = [None] * (2 * m)
    parts[0::2] = map(_pack, lengths, checks, ids, flags)
    parts[1::2] = payloads
    offsets = list(itertools.accumulate(map(_PLUS_HEADER, lengths), initial=base))
    offsets.pop()
    failed = _append(plog, parts, m, base)
    if failed is not None:
        return [result(500, failed, int(o)) for o in opaques], m, False
    return put_results(partition, opaques, ids, offsets), 0, True


def _refused(target: PutTarget, puts: list) -> list[bytes]:
    """The replies of a group that stores nothing: a closed partition's (403), or a
    refused put's (400, ``target.refused``), unless the checksum is wrong already (400)."""
    plog = target.log
    if plog.closed:
        code, why = 403, f"partition {plog.topic}-{plog.partition} is closed"
    else:
        code, why = 400, target.refused
    return [checksum_mismatch(opaque) if check != -1 and crc32(payload) & CHECKSUM_MASK != check
            else result(code, why, int(opaque))
            for _t, _l, _f, check, opaque, payload in puts]


def _put_group_checked(plog: PartitionLog, partition: bytes, puts: list,
                       ids: list[int]) -> tuple[list[bytes], int, bool]:
    """:func:`put_group` one put at a time: for a small group, or one with bad checksums."""
    parts: list = []
    add = parts.append
    offsets: list[int] = []
    offset = offsets.append
    opaques: list[bytes] = []
    opaque_add = opaques.append
    bad: list[int] | None = None  # the puts whose checksum is wrong
    base = plog.end
    size = 0
    for k, (_t, length, flag, check, opaque, payload) in enumerate(puts):
        actual = crc32(payload) & CHECKSUM_MASK
        if actual != check:
            if check == -1:  # not computed (Java's clients): the broker's own, this once
                check = actual
            elif bad is None:
                bad = [k]
                continue
            else:
                bad.append(k)
                continue
        add(_pack(length, check, ids[k], flag))
        add(payload)
        offset(base + size)
        opaque_add(opaque)
        size += HEADER_SIZE + length
    if bad is None:
        failed = _append(plog, parts, len(puts), base)
        if failed is not None:
            return [result(500, failed, int(o)) for o in opaques], len(puts), False
        return put_results(partition, opaques, ids, offsets), 0, True
    replies: list = [None] * len(puts)
    for k in bad:
        replies[k] = checksum_mismatch(puts[k][4])
    if not parts:
        return replies, len(bad), False
    skip = set(bad)
    good = [k for k in range(len(puts)) if k not in skip]
    failed = _append(plog, parts, len(good), base)
    wrote = failed is None
    if failed is not None:
        oks = [result(500, failed, int(o)) for o in opaques]
    else:
        oks = put_results(partition, opaques, [ids[k] for k in good], offsets)
    for k, reply in zip(good, oks, strict=True):
        replies[k] = reply
    return replies, len(bad) if wrote else len(puts), wrote


def _append(plog: PartitionLog, parts: list, count: int, base: int) -> str | None:
    """Append a group's messages with one write; the reply text when it failed."""
    try:
        start = plog.append(b"".join(parts), count)
        if start != base:  # cannot happen: offsets are only assigned here
            raise StorageError(f"append to {plog.dir} landed at {start}, expected {base}")
    except StorageError as e:
        log.error("put failed: %s", e)
        return f"write failed: {e}"
    return None


# --------------------------------------------------------------------------- idempotent

def idem_marks(mark: IdemMark, reqs: list, i: int
               ) -> tuple[list[tuple[int, int, int, int]], int, IdemMark | None]:
    """The puts an idem ``mark`` covers from ``reqs[i]`` on (up to its count, up to the
    first request that is not a put without transaction key), and those of the marks
    right after them (single sends come one mark per put): ``(marks, j, rest)`` with
    ``marks`` as :func:`store_idempotent` takes them (indexes into ``reqs``), ``j``
    where the requests after them begin, ``rest`` the part of the last mark whose puts
    had not arrived when ``reqs`` ends there (they come in the next read), else None."""
    n = len(reqs)
    marks: list[tuple[int, int, int, int]] = []
    j = i
    while True:
        start = j
        stop = min(n, start + mark.count)
        while j < stop:
            r = reqs[j]
            tj = type(r)
            if tj is not tuple and (tj is not PutRequest or r.tx_key is not None):
                break
            j += 1
        if j > start:
            marks.append((mark.pid, mark.seq, start, j))
        left = mark.count - (j - start)
        if left:
            rest = IdemMark(mark.pid, mark.seq + (j - start), left) if j == n else None
            return marks, j, rest
        if j < n and type(reqs[j]) is IdemMark:  # the next mark: the same batch
            mark = reqs[j]
            j += 1
            continue
        return marks, j, None


def store_idempotent(puts: list, marks: list[tuple[int, int, int, int]], ids: list[int],
                     topics: Topics, producers: Producers, max_size: int
                     ) -> tuple[list[bytes], int, list[PartitionLog]]:
    """The put step for ``puts`` (tuples or PutRequests without transaction key) that
    idem marks cover: ``marks`` are ``(pid, seq, start, stop)``, ``puts[start:stop]``
    carrying ``pid``'s seqs ``seq..``, in request order.  Returns ``(replies in request
    order, how many failed, the logs written or answered from)``.

    Every put of one mark names one partition (the mark's contract; else the mark's
    puts are refused, 400).  Marks of one producer to one partition whose seqs follow
    each other (single sends: one mark per put) are stored as one run, with one
    journal record and one append."""
    n = len(puts)
    replies: list = [None] * n
    if all(type(p) is tuple and p[0].log is not None for p in puts):  # the usual read
        tlist: list = list(map(target_of, puts))
        plist: list = puts
        failed = 0
    else:  # PutRequests among them, or partition -1: each given its target first
        todo, targets, where = _targets(puts, topics, max_size, replies)
        failed = n - len(where)
        tlist, plist = [None] * n, [None] * n
        for k, t, p in zip(where, targets, todo, strict=True):
            tlist[k] = t
            plist[k] = p
            orig = puts[k]
            if (orig[0].log is None if type(orig) is tuple else orig.partition < 0):
                tlist[k] = None  # a seq means a place in one partition's sequence
                failed += 1
                replies[k] = result(400, "a put after an idem mark must name its partition "
                                         "(not -1)", int(p[4]))
    # (target, pid) -> runs [first seq, next seq, [indexes]], in order of first appearance
    groups: dict[tuple[PutTarget, int], list[list]] = {}
    for pid, seq, start, stop in marks:
        target = tlist[start]
        if stop - start == 1:  # a single send's mark
            if target is None:
                continue
        else:
            mine = [t for t in tlist[start:stop] if t is not None]
            if not mine:
                continue
            target = mine[0]
            if mine.count(target) != len(mine):
                for k in range(start, stop):
                    if plist[k] is not None:
                        failed += 1
                        replies[k] = result(400, "the puts after an idem mark must all name "
                                                 "the same partition", int(plist[k][4]))
                continue
        key = (target, pid)
        runs = groups.get(key)
        if runs is None:
            runs = groups[key] = []
        for k in range(start, stop):
            if tlist[k] is None:  # no target (404): its seq went with it
                continue
            s = seq + k - start
            last = runs[-1] if runs else None
            if last is not None and last[1] == s:
                last[1] += 1
                last[2].append(k)
            else:
                runs.append([s, s + 1, [k]])
    written: list[PartitionLog] = []
    for (target, pid), runs in groups.items():
        for s, _next, idxs in runs:
            got, bad, touched = idem_group(target, [plist[k] for k in idxs],
                                           [ids[k] for k in idxs], pid, s, producers)
            for k, reply in zip(idxs, got, strict=True):
                replies[k] = reply
            failed += bad
            if touched and target.log not in written:
                written.append(target.log)
    return replies, failed, written


def idem_group(target: PutTarget, puts: list, ids: list[int], pid: int, seq: int,
               producers: Producers) -> tuple[list[bytes], int, bool]:
    """Store ``puts`` (tuples, all to ``target``) carrying ``pid``'s seqs ``seq..``:
    ``(replies in order, how many failed, whether the log was written or answered
    from)``."""
    plog, partition, refused = target
    m = len(puts)
    if plog.closed or refused is not None:
        return _refused(target, puts), m, False
    table = producers.table(plog)
    expected = table.expected(pid)
    if expected is not None and seq > expected:
        text = (f"idempotent put out of order: producer {pid}, partition "
                f"{plog.topic}-{plog.partition}: expected seq {expected}, got {seq} (a gap; "
                f"nothing stored)")
        return [result(GAP_CODE, text, int(p[4])) for p in puts], m, False
    dup = 0 if expected is None else min(m, expected - seq)
    replies: list[bytes] = []
    failed = 0
    if dup:
        for put, orig in zip(puts, table.originals(pid, seq, dup), strict=False):
            if orig is None:
                failed += 1
                replies.append(result(TOO_OLD_CODE, (
                    f"idempotent put already stored long ago: producer {pid}, partition "
                    f"{plog.topic}-{plog.partition}, seq {seq + len(replies)} is older than "
                    f"the oldest this broker remembers ({table.oldest(pid)})"), int(put[4])))
            else:
                replies += put_results(partition, [put[4]], [orig[0]], [orig[1]])
        if dup == m:
            return replies, failed, True
        puts, ids, seq = puts[dup:], ids[dup:], seq + dup
    base = plog.end
    n = len(puts)
    if n == 1:  # a single send's put: no list work
        last_start, end = base, base + HEADER_SIZE + puts[0][1]
    else:
        offsets = list(itertools.accumulate(map(_PLUS_HEADER, map(_length_of, puts)),
                                            initial=base))
        end = offsets.pop()
        last_start = offsets[-1]
    record = _new_tuple(ProducerRecord, (pid, seq, n, base, end, ids[0], last_start, ids[-1],
                                         int(_time() * 1000)))
    try:
        table.write(record)  # before the append: never behind the log
    except StorageError as e:
        log.error("put failed: %s", e)
        return replies + [result(500, f"write failed: {e}", int(p[4])) for p in puts], m, False
    got, bad, wrote = put_group(target, puts, ids)
    if wrote and not bad:
        table.stored(record)
    else:
        table.unwrite()
        if wrote:  # some stored, some refused (bad checksums): the seqs move on anyway
            log.warning("producer %d, partition %s-%d: %d puts of a run refused, the others "
                        "stored without a record (a resend of those is stored again)",
                        pid, plog.topic, plog.partition, bad)
            table.skip(pid, seq + len(puts))
    return replies + got, failed + bad, True


_length_of = operator.itemgetter(1)
_new_tuple = tuple.__new__
_time = time.time
