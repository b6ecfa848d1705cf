"""A master's slaves: how far each has copied each partition, which are in sync,
and the puts waiting for them (synchronous replication).

A slave copies by fetching (``_follower``) with the group
``meta-slave-group-<N>``; the offset of each of its gets says how much of the
partition it holds (everything below it; durably when the slave uses group
commit, because it asks again only after its fsync).  :meth:`ReplicaSet.fetched`
records that, from the server's ``get`` path.

**In sync.**  A slave is in sync while, on every partition, it has caught up
within the last ``replication_max_lag`` seconds and is never more than
``replication_max_lag_bytes`` behind.  It caught up when it asked from the log's
end, or from at least where the log could be read up to when it asked before (as
Kafka's ``lastCaughtUpTime``, then as of that earlier get): under a steady stream of
puts a slave that keeps up is almost never exactly at the end, and with group
commit it can read only up to the fsync.  A slave out of sync that has caught up on
every partition rejoins.  The set is written to ZooKeeper (the replication
state node, ``zk_layout.ReplicationState``) through ``write_in_sync``, one write
at a time, because it decides who may be promoted:

- a slave *joins* in memory first (from then on every acknowledgement waits for
  it), then in ZooKeeper: when ZooKeeper lists it, it holds every acknowledged
  message;
- a slave *leaves* in ZooKeeper first, and only once that write succeeded do the
  puts waiting for it stop waiting: a slave that may be promoted is never one that
  missed an acknowledged message.

**Waiting.**  With ``replication = "sync"`` a put is acknowledged once every
in-sync slave has fetched past it (:meth:`ReplicaSet.wait`).  With no slave in
sync, ``no_in_sync`` decides: ``continue`` acknowledges from the master's log
alone (counted in ``stats`` as ``replication_alone``), ``refuse`` refuses puts
(:attr:`ReplicaSet.refusal`).  Everything here runs in the broker's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from metaq._errors import MetaqError

if TYPE_CHECKING:
    from metaq.broker._storage import PartitionLog, Storage
    from metaq.broker._watermarks import WatermarkFeed

__all__ = ["ReplicaSet", "NotReplicatedError"]

log = logging.getLogger(__name__)


#: At most this many puts waiting for slaves make the loop poll for their answer.
FEW_WAITING = 1


class NotReplicatedError(MetaqError):
    """A put written on the master whose replication could not be confirmed (the
    master was fenced, or stopped): it is not acknowledged."""


class _Replica:
    __slots__ = ("number", "positions", "caught_up_at", "asked", "joined", "last_fetch")

    def __init__(self, number: int, now: float) -> None:
        self.number = number
        self.positions: dict[PartitionLog, int] = {}
        self.caught_up_at: dict[PartitionLog, float] = {}
        #: per log, this replica's last get: (when, the log's readable end then)
        self.asked: dict[PartitionLog, tuple[float, int]] = {}
        self.joined = now
        self.last_fetch = now

    def lag(self, plog: PartitionLog, now: float) -> tuple[int, float]:
        """``(bytes, seconds)`` this replica is behind on ``plog``."""
        pos = self.positions.get(plog)
        end = plog.end
        if pos is None:
            if end <= plog.min_offset:
                return 0, 0.0
            return end - plog.min_offset, now - self.joined
        if pos >= end:
            return 0, 0.0
        return end - pos, now - self.caught_up_at.get(plog, self.joined)


class ReplicaSet:
    """The slaves of one master (see the module docstring)."""

    def __init__(self, storage: Storage, *, mode: str, max_lag: float, max_lag_bytes: int,
                 no_in_sync: str, stats: collections.Counter,
                 write_in_sync: Callable[[tuple[int, ...]], Future] | None = None,
                 in_sync: tuple[int, ...] = (), watermarks: WatermarkFeed | None = None
                 ) -> None:
        #: tells the slaves each watermark as it moves (``_watermarks``)
        self.watermarks = watermarks
        self.storage = storage
        self.mode = mode
        self.max_lag = max_lag
        self.max_lag_bytes = max_lag_bytes
        self.no_in_sync = no_in_sync
        self.stats = stats
        self.write_in_sync = write_in_sync
        now = time.monotonic()
        self.replicas: dict[int, _Replica] = {}
        #: who every acknowledgement waits for (sync mode), and whose copies bound
        #: what consumers may read (the high watermark)
        self.in_sync: set[int] = set(in_sync)
        #: the in-sync set ZooKeeper holds (who may be promoted)
        self.written: tuple[int, ...] = tuple(sorted(in_sync))
        for r in in_sync:  # listed in ZooKeeper: they may be promoted, so they count
            self.replicas[r] = _Replica(r, now)  # until the lag check (ZooKeeper first)
        self._update_watermarks()               # moves them out
        self._writing: Future | None = None
        self._leaving: set[int] = set()   # leave memory once ZooKeeper no longer lists them
        #: per log, the puts waiting: (the end they wait for, future, on_done)
        self._waiters: dict[PartitionLog, collections.deque] = {}
        self.failed: BaseException | None = None
        #: the transactions' feed (``_txfeed.TxFeed``): its waits follow the in-sync
        #: set, and a slave that lags on it leaves the set
        self.feed = None

    # -- what slaves report ----------------------------------------------------------------
    def fetched(self, replica: int, plog: PartitionLog, offset: int) -> None:
        """Replica ``replica`` asked for ``plog`` from ``offset``: it holds what is below."""
        now = time.monotonic()
        rep = self.replicas.get(replica)
        if rep is None:
            rep = self.replicas[replica] = _Replica(replica, now)
            log.info("replica %d of this broker is copying", replica)
        rep.last_fetch = now
        old = rep.positions.get(plog)
        rep.positions[plog] = offset
        if offset >= plog.readable_end:  # with group commit: all it may read (and all
            rep.caught_up_at[plog] = now   # that can have been acknowledged)
            if replica not in self.in_sync and self._caught_up(rep):
                self._join(rep)
        else:  # caught up as of its previous get if it holds all that was readable then
            asked = rep.asked.get(plog)
            if asked is not None and offset >= asked[1] and \
                    asked[0] > rep.caught_up_at.get(plog, rep.joined):
                rep.caught_up_at[plog] = asked[0]
        rep.asked[plog] = (now, plog.readable_end)
        if replica in self.in_sync and (old is None or offset > old):
            self._release(plog)
            self._update_watermark(plog)

    def answered(self, replica: int, plog: PartitionLog, offset: int) -> None:
        """Replica ``replica``'s get from ``offset``, held at the end of ``plog``
        (:meth:`fetched` counted it then), is answered now, below a readable end that
        moved: what :meth:`fetched` would record for that get again, the short way (its
        position stays, it was caught up when it asked, so only: its next get shows it
        caught up with what is readable now); anything else, :meth:`fetched` itself."""
        rep = self.replicas.get(replica)
        if rep is None or rep.positions.get(plog) != offset or offset >= plog.readable_end:
            self.fetched(replica, plog, offset)
            return
        now = time.monotonic()
        rep.last_fetch = now
        rep.asked[plog] = (now, plog.readable_end)

    def _caught_up(self, rep: _Replica) -> bool:
        for plog in self.storage.logs():
            pos = rep.positions.get(plog)
            if pos is None:
                if plog.readable_end > plog.min_offset:
                    return False
            elif pos < plog.readable_end:
                return False
        return True

    def _join(self, rep: _Replica) -> None:
        self.in_sync.add(rep.number)
        self._update_watermarks()
        self.stats["replication_joins"] += 1
        log.info("replica %d caught up on every partition: in sync", rep.number)
        self._sync_written()

    # -- sync replication ------------------------------------------------------------------
    @property
    def refusal(self) -> str | None:
        """Why puts are refused now (sync, nobody in sync, ``no_in_sync = refuse``)."""
        if self.failed is not None:
            return f"replication stopped: {self.failed}"
        if self.mode == "sync" and not self.in_sync and self.no_in_sync == "refuse":
            return "no slave is in sync (no_in_sync = refuse)"
        return None

    def wait(self, plogs: list[PartitionLog], on_done: Callable[[], None] | None = None
             ) -> asyncio.Future | None:
        """A future done when every in-sync slave holds each log up to its current
        end; None when nothing needs waiting for (async mode, or nobody in sync).

        ``on_done`` (the waiting put's connection writing what it can) is called
        right where the future is resolved, for a wait on one log: in the call
        that records the slave's position, so the acknowledgement leaves in the
        same turn of the event loop as the slave's get (a future's own callbacks
        run a turn later).  For several logs it is the gathered future's callback."""
        if self.mode != "sync":
            return None
        if not self.in_sync:
            self.stats["replication_alone"] += 1
            return None
        loop = asyncio.get_running_loop()
        self.stats["replication_waits"] += 1
        if len(plogs) == 1:
            plog = plogs[0]
            fut = loop.create_future()
            q = self._waiters.get(plog)
            if q is None:
                q = self._waiters[plog] = collections.deque()
            q.append((plog.end, fut, on_done))
            self._release(plog)
            return fut
        futs = []
        for plog in plogs:
            fut = loop.create_future()
            q = self._waiters.get(plog)
            if q is None:
                q = self._waiters[plog] = collections.deque()
            q.append((plog.end, fut, None))
            futs.append(fut)
            self._release(plog)
        gathered = asyncio.gather(*futs)
        if on_done is not None:
            gathered.add_done_callback(lambda _f: on_done())
        return gathered

    def waiting(self) -> bool:
        """Whether a lone put (at most :data:`FEW_WAITING`) waits for slaves now: the
        event loop then polls a moment for their answer before it sleeps (``_spin``).
        Many waiting is a stream of batches, whose producer keeps the loop busy: no
        polling there, which would take a CPU from the slave and the producer."""
        n = 0
        for q in self._waiters.values():
            n += len(q)
        return 0 < n <= FEW_WAITING

    def _release(self, plog: PartitionLog) -> None:
        q = self._waiters.get(plog)
        if not q:
            return
        low = min((self.replicas[r].positions.get(plog, -1) for r in self.in_sync),
                  default=None)
        while q and (low is None or q[0][0] <= low):
            _end, fut, on_done = q.popleft()
            if not fut.done():
                fut.set_result(None)
            if on_done is not None:
                _notify(on_done)

    # -- the high watermark ----------------------------------------------------------------
    def _update_watermark(self, plog: PartitionLog) -> None:
        """Consumers read ``plog`` only below what every in-sync slave holds: a
        message a failover can lose (it was on the master alone) is never delivered,
        so no consumer's committed position can point past the new master's log."""
        if not self.in_sync:
            hw = None
        else:
            hw = min(self.replicas[r].positions.get(plog, plog.min_offset)
                     for r in self.in_sync)
        old = plog.high_watermark
        if hw == old:
            return
        plog.high_watermark = hw
        if self.watermarks is not None:
            self.watermarks.changed(plog)
        if plog.on_readable is not None and (hw is None or (old is not None and hw > old)):
            plog.on_readable(plog)  # held consumer gets may go on

    def _update_watermarks(self) -> None:
        for plog in self.storage.logs():
            self._update_watermark(plog)

    def _release_all(self) -> None:
        for plog in list(self._waiters):
            self._release(plog)

    def fail(self, err: BaseException) -> None:
        """Stop (fenced or closing): every waiting put fails, none is acknowledged."""
        self.failed = err
        if self.watermarks is not None:
            self.watermarks.close()
        for q in self._waiters.values():
            while q:
                _end, fut, on_done = q.popleft()
                if not fut.done():
                    fut.set_exception(NotReplicatedError(str(err)))
                    fut.exception()
                if on_done is not None:
                    _notify(on_done)
        self._waiters.clear()

    # -- the periodic check ----------------------------------------------------------------
    def check(self, now: float | None = None) -> None:
        """Move slaves that fell behind out of the in-sync set (ZooKeeper first)."""
        now = time.monotonic() if now is None else now
        behind = []
        for r in sorted(self.in_sync):
            rep = self.replicas[r]
            worst = self._worst(rep, now)
            if worst is not None:
                behind.append(r)
                log.warning("replica %d leaves the in-sync set: %s", r, worst)
        if behind:
            self._sync_written(without=set(behind))

    def _worst(self, rep: _Replica, now: float) -> str | None:
        for plog in self.storage.logs():
            nbytes, secs = rep.lag(plog, now)
            if nbytes >= self.max_lag_bytes:
                return f"{nbytes} bytes behind on {plog.topic}-{plog.partition}"
            if nbytes and secs > self.max_lag:
                return (f"not caught up with {plog.topic}-{plog.partition} for {secs:.1f} s "
                        f"({nbytes} bytes behind)")
        if self.feed is not None:
            return self.feed.lagging(rep.number, now, self.max_lag)
        return None

    def _sync_written(self, without: set[int] | None = None) -> None:
        """Bring ZooKeeper's in-sync set to the memory one (minus ``without``, which
        leave memory only once ZooKeeper no longer lists them)."""
        if without:
            self._leaving |= without
        if self._writing is not None:
            return
        want = tuple(sorted(self.in_sync - self._leaving))
        if want == self.written:
            self._apply_leaving()
            return
        if self.write_in_sync is None:
            self.written = want
            self._apply_leaving()
            return
        fut = self._writing = self.write_in_sync(want)
        loop = asyncio.get_running_loop()
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(self._written, f, want))

    def _written(self, fut: Future, want: tuple[int, ...]) -> None:
        self._writing = None
        err = fut.exception()
        if err is not None:
            log.error("writing the in-sync set %s to ZooKeeper failed: %s", list(want), err)
            return  # the next check or fetch tries again; nobody leaves meanwhile
        self.written = want
        self._apply_leaving()
        if tuple(sorted(self.in_sync - self._leaving)) != self.written:
            self._sync_written()

    def _apply_leaving(self) -> None:
        gone = self._leaving - set(self.written)
        if gone:
            self.in_sync -= gone
            self.stats["replication_leaves"] += len(gone)
            self._leaving -= gone
            self._release_all()
            self._update_watermarks()
            if self.feed is not None:
                self.feed.in_sync_changed()

    # -- reporting -------------------------------------------------------------------------
    def status(self, now: float | None = None) -> list[dict]:
        """Per replica: in sync or not, bytes and seconds behind (worst partition)."""
        now = time.monotonic() if now is None else now
        out = []
        for r in sorted(self.replicas):
            rep = self.replicas[r]
            worst_bytes, worst_secs = 0, 0.0
            for plog in self.storage.logs():
                b, s = rep.lag(plog, now)
                worst_bytes = max(worst_bytes, b)
                worst_secs = max(worst_secs, s)
            out.append({"replica": r, "in_sync": r in self.in_sync,
                        "listed": r in self.written, "lag_bytes": worst_bytes,
                        "lag_seconds": round(worst_secs, 3),
                        "last_fetch_seconds": round(now - rep.last_fetch, 3)})
        return out


def _notify(on_done: Callable[[], None]) -> None:
    """Tell a waiting put its wait ended (its connection writes its answer); a failure
    there is its connection's, never the caller's (a slave's get being served)."""
    try:
        on_done()
    except Exception:
        log.exception("answering a put whose replication wait ended failed")
