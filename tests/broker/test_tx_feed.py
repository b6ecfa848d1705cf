"""A slave's copy of its master's transaction feed (``_txfeed.TxCopy``) against bad
answers: a damaged chunk, events that do not follow what it holds, an error answer:
each is reported (stats, ``problem``) and nothing of it reaches the journal; a good
chunk after it is stored, and a snapshot replaces the journal whole.  The journal is
a real file; the master link is a stand-in that answers what the test gives it."""

from __future__ import annotations

import asyncio
import collections

from metaq.broker._txfeed import TxCopy
from metaq.broker._txjournal import TxJournal, prepare_record, put_record
from metaq.protocol import RequestParser, Result, TxLogRequest, encode_txlog_body

KEY = "XID:7:6161:6262:node1"
OTHER = "XID:7:6363:6464:node1"


class Link:
    """Answers each ``txlog`` with the next of ``answers``; keeps the requests."""

    def __init__(self, answers: list) -> None:
        self.answers = list(answers)
        self.requests: list[TxLogRequest] = []

    def request(self, encode):  # noqa: ANN001, ANN201 - _MasterLink's signature
        (req,) = RequestParser().feed(encode(1))
        self.requests.append(req)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self.answers.pop(0))
        return fut

    async def ask(self, encode, limit, what, stats):  # noqa: ANN001, ANN201 - _MasterLink's
        return await self.request(encode)


def ok(body: bytes) -> Result:
    return Result(200, body, 1)


def prepared(key: str, body: bytes) -> bytes:
    return put_record(key, "t", 0, body) + prepare_record(key, [("t", 0, 0, len(body) + 20)])


def test_bad_answers_store_nothing_and_good_ones_continue(tmp_path):
    journal = TxJournal(tmp_path / "transactions")
    stats: collections.Counter = collections.Counter()
    copy = TxCopy(journal, replica=2, stats=stats)
    snap = prepared(KEY, b"first")
    good = prepared(OTHER, b"second")
    damaged = bytearray(good)
    damaged[-3] ^= 0xFF
    link = Link([
        ok(encode_txlog_body(77, 0, 4, True, snap)),            # the snapshot: events 1..4
        ok(encode_txlog_body(77, 4, 5, False, bytes(damaged))),  # CRC wrong
        ok(encode_txlog_body(77, 4, 5, False, good[:-1])),      # torn
        ok(encode_txlog_body(77, 9, 10, False, good)),          # not after what it holds
        Result(503, b"broker 0 replica 0 is not the master", 1),
        ok(encode_txlog_body(77, 0, 5, True, snap + good)),     # asked afresh: a snapshot
    ])

    async def run(n: int) -> list[bool]:
        return [await copy.step(link, 0) for _ in range(n)]

    assert asyncio.run(run(5)) == [True, False, False, False, False]
    assert (tmp_path / "transactions" / "journal").read_bytes() == snap  # nothing more
    assert copy.problem is not None and "503" in copy.problem
    assert asyncio.run(run(1)) == [True]
    assert copy.problem is None
    assert stats["replication_tx_damaged"] == 2
    # what it asked: from its last good event each time, acknowledging it
    assert [(r.replica, r.incarnation, r.seq) for r in link.requests] == [
        (2, 0, 0), (2, 77, 4), (2, 77, 4), (2, 77, 4), (2, 0, 0), (2, 0, 0)]
    journal.close()
    txs = {t.key: t for t in TxJournal(tmp_path / "transactions").replay()}
    assert set(txs) == {KEY, OTHER} and txs[OTHER].prepared and len(txs[OTHER].puts) == 1


def test_a_snapshot_replaces_what_the_journal_held(tmp_path):
    journal = TxJournal(tmp_path / "transactions")
    journal.append_records(prepared(KEY, b"stale"))  # from an older master
    copy = TxCopy(journal, replica=1, stats=collections.Counter())
    link = Link([ok(encode_txlog_body(5, 0, 2, True, prepared(OTHER, b"now")))])
    assert asyncio.run(copy.step(link, 0))
    journal.close()
    assert [t.key for t in TxJournal(tmp_path / "transactions").replay()] == [OTHER]
    assert (copy.incarnation, copy.seq) == (5, 2)
