"""Transactions on the replicas: a master's feed of its prepared XA branches to
its slaves (:class:`TxFeed`), and a slave's copy of it (:class:`TxCopy`).

Only what outlives a master matters to a slave: a transaction that was not
prepared is rolled back when its master dies (as Java Metaq does), and a commit's
messages reach the slave through the partitions' copy.  So the feed carries the
transaction journal's records (``_txjournal``) of prepared branches only:

- PREPARE: the branch's ``P`` records and its ``R`` (with the partitions' ends
  then, the lower bounds of where a commit appends its messages);
- the commit of a prepared branch: its ``D`` (before its messages are appended)
  and its ``C`` (after);
- the rollback of a prepared branch: its ``X``.

Each event has a sequence number within the master's *incarnation* (a random
number drawn whenever this broker starts leading); a slave asks with ``txlog``
(``metaq.protocol``'s ``_txlog``) for what follows the last event it holds, and
that request acknowledges what it holds.  A slave that asks with another
incarnation, or from before the events the master still keeps
(:attr:`TxFeed.keep_bytes`), gets a snapshot: the records of every branch that is
prepared or committing now; it replaces its journal with them.

**Waiting (sync replication).**  A PREPARE, and the commit or rollback of a
prepared branch, is answered once every in-sync slave that copies the feed
acknowledged its event (:meth:`TxFeed.wait`); a slave that leaves the in-sync set
stops being waited for (``_replicas``), and one whose acknowledgement lags more
than ``replication_max_lag`` leaves it.  Which slaves copy the feed: those listed
in sync when this master started, and every slave that asked ``txlog``; a metaq-py
slave asks before its first ``get`` on each connection, so it never joins the
in-sync set unseen.  (A Java Metaq slave does not copy transactions, as Java's
own slaves do not.)

**Never committed twice.**  The ``D`` and the messages travel apart (the feed, the
partitions' copy), so a slave can hold a commit's messages and still see its
branch prepared when its master dies.  A promoted slave therefore looks, for each
prepared branch, for its first message from the ``R``'s lower bounds (its msgId
makes it unique): found, the branch was committed, and what is missing of it is
appended (``Transactions.recover``); a resent COMMIT then answers XAER_NOTA, as for
any finished branch.

On the slave :class:`TxCopy` runs in the broker's event loop beside the
partitions' copy (``_follower``): it appends the records to the slave's own
journal, fsynced before it asks again (the next request is the acknowledgement),
and on promotion ``Transactions.take_over`` replays that journal as after a
restart.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from metaq._errors import BrokerUnavailableError, ProtocolError, StorageError
from metaq.broker._hold import HeldRequests
from metaq.broker._replies import answer
from metaq.broker._txjournal import COMPACT_AT, read_records
from metaq.protocol import (
    Result,
    TxLogRequest,
    decode_txlog_body,
    encode_txlog,
    encode_txlog_body,
)

if TYPE_CHECKING:
    from metaq.broker._connection import Connection
    from metaq.broker._txjournal import TxJournal

__all__ = ["TxFeed", "TxCopy"]

log = logging.getLogger(__name__)

_INCARNATION_MAX = (1 << 63) - 1


def _incarnation() -> int:
    return 1 + secrets.randbelow(_INCARNATION_MAX)


class TxFeed:
    """A master's feed of prepared branches' records (event loop only)."""

    def __init__(self, *, max_hold: float, stats: collections.Counter,
                 snapshot: Callable[[], bytes], keep_bytes: int = 16 << 20) -> None:
        self.max_hold = max_hold
        self.stats = stats
        #: the records of every branch prepared or committing now (``Transactions``)
        self.snapshot = snapshot
        self.keep_bytes = keep_bytes
        self.incarnation = _incarnation()
        self.seq = 0
        #: ``(seq, monotonic time, records)`` of the latest events
        self._events: collections.deque[tuple[int, float, bytes]] = collections.deque()
        self._kept = 0
        self._held = HeldRequests(self._answer)
        #: replica -> the last event it acknowledged (this incarnation)
        self.acked: dict[int, int] = {}
        #: replicas whose acknowledgements count (see the module docstring)
        self.counted: set[int] = set()
        #: the in-sync set while this broker leads (``ReplicaSet.in_sync``), else None
        self.in_sync: Callable[[], Iterable[int]] | None = None
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()

    # -- leading -------------------------------------------------------------------------
    def lead(self, in_sync: Callable[[], Iterable[int]], listed: Iterable[int]) -> None:
        """This broker leads now: a new incarnation; ``listed`` (in sync in ZooKeeper)
        count at once."""
        self.restart()
        self.in_sync = in_sync
        self.counted = set(listed)

    def restart(self) -> None:
        """Forget the events and the acknowledgements (a new incarnation): the
        slaves get a snapshot next; waiting answers fail (not replicated)."""
        self.incarnation = _incarnation()
        self.seq = 0
        self._events.clear()
        self._kept = 0
        self.acked.clear()
        self.counted.clear()
        self.in_sync = None
        # a snapshot of the new incarnation
        self._held.answer_all(lambda conn, opaque, _since: self._answer(conn, opaque, 0, 0))
        self.fail("the broker stopped leading")

    def fail(self, why: str) -> None:
        from metaq.broker._replicas import NotReplicatedError
        waiters, self._waiters = self._waiters, collections.deque()
        for _seq, fut in waiters:
            if not fut.done():
                fut.set_exception(NotReplicatedError(why))
                fut.exception()

    # -- events --------------------------------------------------------------------------
    def emit(self, records: bytes) -> int:
        """One event (whole journal records); its sequence number."""
        self.seq += 1
        self._events.append((self.seq, time.monotonic(), records))
        self._kept += len(records)
        while self._kept > self.keep_bytes and len(self._events) > 1:
            self._kept -= len(self._events.popleft()[2])
        self.stats["replication_tx_events"] += 1
        if self._held:
            self._held.answer_all()
        return self.seq

    # -- the slaves' requests ------------------------------------------------------------
    def request(self, conn: Connection, r: TxLogRequest) -> None:
        """``txlog``: record the acknowledgement, answer (or hold) what follows it."""
        self.stats["cmd_txlog"] += 1
        self.counted.add(r.replica)
        if r.incarnation == self.incarnation and r.seq > self.acked.get(r.replica, 0) \
                and r.seq <= self.seq:
            self.acked[r.replica] = r.seq
            self._release()
        self._held.drop(conn)
        if (r.incarnation == self.incarnation and r.seq == self.seq and r.hold_ms > 0
                and self.max_hold > 0):
            self._held.hold(conn, r.opaque, r.seq, min(r.hold_ms / 1000.0, self.max_hold))
            return
        self._answer(conn, r.opaque, r.seq, r.incarnation)

    def _answer(self, conn: Connection, opaque: int, seq: int,
                incarnation: int | None = None) -> None:
        """What follows ``seq`` of ``incarnation`` (default: this one)."""
        if incarnation is None:
            incarnation = self.incarnation
        first = self._events[0][0] if self._events else self.seq + 1
        if incarnation != self.incarnation or seq > self.seq or seq < first - 1:
            body = encode_txlog_body(self.incarnation, 0, self.seq, True, self.snapshot())
            self.stats["replication_tx_snapshots"] += 1
        else:
            records = b"".join(rec for s, _t, rec in self._events if s > seq)
            body = encode_txlog_body(self.incarnation, seq, self.seq, False, records)
        conn.send(answer(body, opaque))

    def connection_closed(self, conn: Connection) -> None:
        self._held.drop(conn)

    # -- waiting (sync replication) ------------------------------------------------------
    def _needed(self) -> list[int]:
        if self.in_sync is None:
            return []
        return [r for r in self.in_sync() if r in self.counted]

    def wait(self, seq: int) -> asyncio.Future | None:
        """A future done when every in-sync slave that copies the feed holds event
        ``seq``; None when none needs waiting for."""
        if not self._needed():
            return None
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append((seq, fut))
        self._release()
        return fut

    def _release(self) -> None:
        """Answer the waits every in-sync copying slave has acknowledged (also called
        when the in-sync set shrinks)."""
        if not self._waiters:
            return
        needed = self._needed()
        low = min((self.acked.get(r, 0) for r in needed), default=None)
        while self._waiters and (low is None or self._waiters[0][0] <= low):
            _seq, fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)

    def in_sync_changed(self) -> None:
        self._release()

    def lagging(self, replica: int, now: float, max_lag: float) -> str | None:
        """Why ``replica`` is too far behind on the feed to stay in sync, or None."""
        if replica not in self.counted:
            return None
        acked = self.acked.get(replica, 0)
        if acked >= self.seq:
            return None
        since = next((t for s, t, _r in self._events if s > acked), None)
        if since is None or now - since <= max_lag:
            return None
        return (f"has not acknowledged transaction event {acked + 1} (of {self.seq}) "
                f"for {now - since:.1f} s")

    def status(self) -> dict:
        return {"incarnation": self.incarnation, "seq": self.seq,
                "acked": dict(sorted(self.acked.items()))}


class TxCopy:
    """A slave's copy of its master's feed, into its own journal (event loop only)."""

    def __init__(self, journal: TxJournal, *, replica: int, stats: collections.Counter,
                 executor: object = None, hold_ms: int = 5000,
                 retry_delay: float = 1.0, answer_timeout: float = 10.0) -> None:
        self.journal = journal
        self.replica = replica
        self.stats = stats
        self.executor = executor
        self.hold_ms = hold_ms
        self.retry_delay = retry_delay
        #: how long past its hold a request may wait for its answer before the
        #: connection is made again (a lost request would stop the feed for good)
        self.answer_timeout = answer_timeout
        #: what this slave holds of its master's feed: (incarnation, last event)
        self.incarnation = 0
        self.seq = 0
        self.problem: str | None = None

    def forget(self) -> None:
        """A new master: ask for a snapshot."""
        self.incarnation = self.seq = 0

    async def step(self, link: object, hold_ms: int) -> bool:
        """One ``txlog`` request on ``link`` (``_follower``'s master link) and its
        records stored; False when the answer could not be used (asked again)."""
        inc, seq = self.incarnation, self.seq
        reply = await link.ask(  # type: ignore[attr-defined]
            lambda o: encode_txlog(self.replica, inc, seq, hold_ms, o),
            hold_ms / 1000.0 + self.answer_timeout, "a txlog request", self.stats)
        if type(reply) is Result and reply.code != 200:
            self.problem = f"master answered {reply.code}: " \
                           f"{reply.body.decode('utf-8', 'replace')}"
            return False
        try:
            chunk = decode_txlog_body(reply.body)
            txs = read_records(chunk.records)
        except (ProtocolError, ValueError) as e:
            self.stats["replication_tx_damaged"] += 1
            self.problem = f"damaged transaction feed: {e}"
            log.error("replica %d: the master's transaction feed (events %s..) cannot be "
                      "used: %s; nothing of it stored, asked again", self.replica, seq, e)
            return False
        if not chunk.snapshot and (chunk.incarnation != inc or chunk.first != seq):
            self.problem = (f"the master answered events {chunk.first}..{chunk.last} of "
                            f"incarnation {chunk.incarnation} for a request after {seq} of "
                            f"{inc}")
            log.error("replica %d: %s; asked again", self.replica, self.problem)
            self.forget()
            return False
        try:
            if chunk.snapshot:
                self.journal.replace(chunk.records)
                self.stats["replication_tx_snapshots"] += 1
            elif chunk.records:
                self.journal.append_records(chunk.records)
                await asyncio.get_running_loop().run_in_executor(self.executor,
                                                                 self.journal.sync)
                if self.journal.size > COMPACT_AT:
                    self._compact()
        except (StorageError, OSError) as e:
            self.stats["replication_tx_failed"] += 1
            self.problem = f"storing the transaction feed failed: {e}"
            log.error("replica %d: %s", self.replica, self.problem)
            return False
        self.stats["replication_tx_applied"] += len(txs) if chunk.records else 0
        self.incarnation, self.seq = chunk.incarnation, chunk.last
        self.problem = None
        return True

    def _compact(self) -> None:
        """Keep the branches still prepared or committing (a commit's ``C`` follows
        its messages: with sync replication they were copied before it was answered)."""
        keep = [tx for tx in self.journal.replay()
                if not tx.rolled_back and (tx.prepared or tx.decided or tx.committed)
                and tx.committed is None]
        self.journal.rewrite(keep)

    async def run(self, link: object) -> None:
        """Copy the feed over ``link`` until it fails (the caller reconnects)."""
        while True:
            try:
                ok = await self.step(link, self.hold_ms)
            except BrokerUnavailableError:
                return
            except Exception as e:  # a bug: said, and the copy tried again
                self.problem = f"copying the transaction feed failed: {e!r}"
                log.exception("replica %d: %s", self.replica, self.problem)
                ok = False
            if not ok:
                await asyncio.sleep(self.retry_delay)

    def status(self) -> dict:
        return {"incarnation": self.incarnation, "seq": self.seq, "problem": self.problem}
