"""A broker's role among the replicas of its broker id, on the event loop side:
master (with its :class:`~metaq.broker._replicas.ReplicaSet`), slave (with its
:class:`~metaq.broker._follower.Follower`) or fenced, the epoch it serves in,
and the lease that lets a master accept puts.

::

                 (ZooKeeper names another replica master)
       MASTER  ───────────────────────────────────────────▶  FENCED
         ▲                                                     │ truncate to the
         │ named master (promotion), epoch node written        │ new epoch's ends
         │                                                     ▼
       SLAVE  ◀────────────────────────────────────────────────┘

Transitions are decided on the broker's ZooKeeper thread (``_registry``),
which calls the coroutines here through :meth:`Role.run` and waits for them;
everything here runs in the event loop, so a put is never half way through a
transition.

**The lease.**  Once ZooKeeper lists an in-sync slave, that slave may be
promoted the moment this master's session expires.  So a master in that state
accepts puts only until ``lease_seconds`` after the *sending* of its last
ZooKeeper read that confirmed it still leads (:meth:`Role.renewed`); ZooKeeper
ends a session no sooner than a full session timeout after it last heard from
the client, and the lease is half of that.  A master cut off from ZooKeeper (or
paused: SIGSTOP, a long GC) therefore stops accepting puts before anybody can
be promoted: two masters never both accept puts for one broker id.

**The marker** (``<data_dir>/replica.json``) remembers which replica this data
directory belongs to and the last epoch its logs were made consistent with; a
data directory without one is new (or was deleted), and such a broker never
leads with it while another replica may hold the data (``_registry``).
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from metaq._durable import write_durably
from metaq._errors import StorageError
from metaq.broker._follower import Follower
from metaq.broker._replicas import NotReplicatedError, ReplicaSet
from metaq.broker._txfeed import TxCopy
from metaq.broker._watermarks import WatermarkCopy, WatermarkFeed

if TYPE_CHECKING:
    import collections
    from concurrent.futures import Future

    from metaq.broker._config import BrokerConfig
    from metaq.broker._storage import Storage

__all__ = ["Role", "RoleName", "Marker"]

log = logging.getLogger(__name__)

MARKER = "replica.json"


class RoleName(enum.Enum):
    MASTER = "master"
    SLAVE = "slave"
    FENCED = "fenced"


class Marker:
    """``replica.json``: ``{"brokerId":0,"replica":1,"epoch":3}`` (see the module doc)."""

    def __init__(self, data_dir: Path, broker_id: int, replica: int) -> None:
        self.path = Path(data_dir) / MARKER
        self.broker_id = broker_id
        self.replica = replica
        self.epoch: int | None = None
        self.fresh = True
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        except OSError as e:
            raise StorageError(f"cannot read {self.path}: {e}") from e
        try:
            obj = json.loads(raw)
            bid, rep, epoch = obj["brokerId"], obj["replica"], obj["epoch"]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in (bid, rep, epoch)):
                raise ValueError("brokerId, replica and epoch must be integers")
        except (ValueError, KeyError, TypeError) as e:
            raise StorageError(f"{self.path} is damaged ({e}): {raw[:200]!r}; move it aside "
                               f"only if this data directory is known to be consistent") from None
        if bid != broker_id:
            raise StorageError(f"{self.path}: this data directory belongs to broker {bid}, "
                               f"not {broker_id}")
        self.epoch = epoch
        self.fresh = False

    def save(self, epoch: int) -> None:
        data = json.dumps({"brokerId": self.broker_id, "replica": self.replica,
                           "epoch": epoch}, separators=(",", ":")).encode()
        try:
            write_durably(self.path, data)
        except OSError as e:
            raise StorageError(f"cannot write {self.path}: {e}") from e
        self.epoch = epoch
        self.fresh = False


class Role:
    """The event loop side of replication (see the module docstring)."""

    def __init__(self, config: BrokerConfig, storage: Storage, *,
                 add_topic: Callable[[str, int], None], stats: collections.Counter,
                 write_in_sync: Callable[[tuple[int, ...]], Future],
                 accept_sync: Callable[[bool], None] = lambda on: None,
                 on_master: Callable[[], None] = lambda: None,
                 producers: Any = None, transactions: Any = None) -> None:
        self.config = config
        self.storage = storage
        self.stats = stats
        self.replica = config.replica
        self.marker = Marker(config.data_dir, config.broker_id, self.replica)
        self._add_topic = add_topic
        self._write_in_sync = write_in_sync
        self._accept_sync = accept_sync
        self._on_master = on_master
        #: the broker's idempotent-producer tables (``_producers.Producers``), or None
        self.producers = producers
        #: the broker's transactions (``_transactions.Transactions``), or None: a master
        #: feeds its prepared branches to its slaves, a slave copies them (``_txfeed``)
        self.transactions = transactions
        self.name = RoleName.FENCED
        self.epoch: int | None = None
        self.why = "starting"
        self.replicas: ReplicaSet | None = None
        self.follower: Follower | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        #: seconds a confirmation from ZooKeeper lets a master accept puts
        self.lease_seconds = config.zk_session_timeout / 2
        self.lease_until = 0.0
        self.lease_needed = False   # True once ZooKeeper lists an in-sync slave
        self.truncated: list[dict] = []   # what the last step down cut, for reports

    # -- from the ZooKeeper thread ---------------------------------------------------------
    def run(self, make: Callable[[], Awaitable[Any]], timeout: float = 60.0) -> Any:
        """Run ``make()`` in the event loop and wait for its result (ZooKeeper thread)."""
        return asyncio.run_coroutine_threadsafe(_call(make), self.loop).result(timeout)

    def renewed(self, sent_at: float, epoch: int, in_sync: tuple[int, ...]) -> None:
        """ZooKeeper confirmed (a read sent at ``sent_at``) that we lead ``epoch``."""
        self.loop.call_soon_threadsafe(self._renewed, sent_at, epoch, bool(in_sync))

    def _renewed(self, sent_at: float, epoch: int, lease_needed: bool) -> None:
        if self.name is RoleName.MASTER and epoch == self.epoch:
            self.lease_until = max(self.lease_until, sent_at + self.lease_seconds)
            self.lease_needed = lease_needed

    @property
    def leads(self) -> bool:
        """Master (whatever its lease)."""
        return self.name is RoleName.MASTER

    # -- the put gate (event loop, once per read of puts) -----------------------------------
    def put_refusal(self) -> str | None:
        """Why puts are refused now, or None."""
        if self.name is not RoleName.MASTER:
            return (f"broker {self.config.broker_id} replica {self.replica} is "
                    f"{self.name.value} ({self.why}): puts go to the master")
        if self.lease_needed and time.monotonic() > self.lease_until:
            self.stats["put_refused_lease"] += 1
            return (f"broker {self.config.broker_id} has not heard from ZooKeeper for over "
                    f"{self.lease_seconds:g} s: a slave may be promoted, so puts are refused "
                    f"until ZooKeeper confirms this master")
        return self.replicas.refusal if self.replicas is not None else None

    # -- the data path (event loop) ---------------------------------------------------------
    def wait(self, written: list, on_done: Callable[[], None] | None = None
             ) -> asyncio.Future | None:
        """(Master, after a put) what its acknowledgement waits for, or None
        (``on_done``: see ``ReplicaSet.wait``)."""
        replicas = self.replicas
        return None if replicas is None else replicas.wait(written, on_done)

    def fetched(self, replica: int, plog: object, offset: int) -> None:
        """(Master) a slave's get: it holds ``plog`` below ``offset``."""
        replicas = self.replicas
        if replicas is not None and replica != self.replica:
            replicas.fetched(replica, plog, offset)

    def answered(self, replica: int, plog: object, offset: int) -> None:
        """(Master) a slave's held get from ``offset``, which :meth:`fetched` counted,
        is answered now (``ReplicaSet.answered``)."""
        replicas = self.replicas
        if replicas is not None and replica != self.replica:
            replicas.answered(replica, plog, offset)

    # -- transitions (event loop) ----------------------------------------------------------
    async def become_master(self, epoch: int, in_sync: tuple[int, ...], mode: str) -> None:
        if self.follower is not None:
            await self.follower.stop()
            self.follower = None
        cfg = self.config
        self._accept_sync(False)
        self._on_master()
        self.replicas = ReplicaSet(self.storage, mode=mode, max_lag=cfg.replication_max_lag,
                                   max_lag_bytes=cfg.replication_max_lag_bytes,
                                   no_in_sync=cfg.no_in_sync, stats=self.stats,
                                   write_in_sync=self._write_in_sync, in_sync=in_sync,
                                   watermarks=WatermarkFeed(self.storage, max_hold=cfg.max_hold,
                                                            stats=self.stats))
        if self.transactions is not None:  # a slave's copied branches become its own
            self.transactions.lead(self.replicas, in_sync)
            self.replicas.feed = self.transactions.feed
        self.epoch = epoch
        self.lease_needed = bool(in_sync)
        self.lease_until = time.monotonic() + self.lease_seconds
        self.name, self.why = RoleName.MASTER, f"epoch {epoch}"
        if self.marker.epoch != epoch:
            self.marker.save(epoch)
        log.info("broker %d replica %d is master of epoch %d (%s replication)",
                 cfg.broker_id, self.replica, epoch, mode)

    async def fence(self, why: str) -> None:
        """Stop accepting puts now; puts waiting for slaves fail (not acknowledged)."""
        if self.name is RoleName.FENCED:
            return
        self._accept_sync(False)
        self.name, self.why = RoleName.FENCED, why
        if self.replicas is not None:
            self.replicas.fail(NotReplicatedError(why))
            self.replicas = None
        if self.transactions is not None:
            self.transactions.step_down(why)
        log.warning("broker %d replica %d fenced: %s", self.config.broker_id, self.replica, why)

    async def stop_following(self) -> dict[str, tuple[int, ...]]:
        """Stop copying (before a promotion); the log ends."""
        self.name, self.why = RoleName.FENCED, "taking over"
        if self.follower is not None:
            await self.follower.stop()
            unrecorded = self.follower.unrecorded()
            self.follower = None
            if unrecorded and self.config.replication == "sync":
                # messages copied without their producer records: never acknowledged
                # (a master answers a slave's records before it takes the slave's next
                # get as holding them); kept, a resent idempotent put would be stored
                # twice, so they go and the producer's resend stores them once
                for (topic, p), end in sorted(unrecorded.items()):
                    plog = self.storage.get(topic, p)
                    nbytes, count = plog.truncate(end)
                    if self.producers is not None:
                        self.producers.truncate(topic, p, end)
                    log.warning("broker %d replica %d: %s-%d: %d bytes (%d messages) copied "
                                "without their producer records are dropped before taking "
                                "over (never acknowledged; their producers send them again)",
                                self.config.broker_id, self.replica, topic, p, nbytes, count)
        return {t: tuple(self.storage.get(t, p).end for p in range(n))
                for t, n in sorted(self.storage.topics.items())}

    async def truncate(self, cut: dict[tuple[str, int], int], epoch: int) -> list[dict]:
        """Cut each partition back to ``cut[(topic, partition)]`` where it holds more
        (what no replica of the newer epoch ever had); then remember ``epoch``."""
        if self.follower is not None:
            await self.follower.stop()
            self.follower = None
        report = []
        for (topic, p), end in sorted(cut.items()):
            plog = self.storage.get(topic, p)
            if plog is None and (self.storage.data_dir / f"{topic}-{p}").is_dir():
                # a slave opens the topics it copied only when it hears of them from its
                # master, after this: open what is on disk now, or its cut is skipped
                self._add_topic(topic, p + 1)
                plog = self.storage.get(topic, p)
            if plog is None or plog.end <= end:
                continue
            if end < plog.min_offset:
                nbytes, count = plog.end - plog.min_offset, None  # all of it goes
                plog.reset(end)
            else:
                nbytes, count = plog.truncate(end)
            if self.producers is not None:  # resent puts of the cut runs are new again
                self.producers.truncate(topic, p, end)
            report.append({"topic": topic, "partition": p, "offset": end, "bytes": nbytes,
                           "messages": count})
            self.stats["replication_truncated_bytes"] += nbytes
            log.warning("broker %d replica %d: %s-%d cut back to offset %d: %d bytes (%s "
                        "messages) written in an older epoch that the new master never had "
                        "are dropped (not acknowledged by sync replication, or lost with "
                        "async replication)", self.config.broker_id, self.replica, topic, p,
                        end, nbytes, "?" if count is None else count)
        self.truncated = report
        self.marker.save(epoch)
        self.epoch = epoch
        return report

    async def become_slave(self, epoch: int | None, why: str) -> None:
        if self.replicas is not None:
            self.replicas.fail(NotReplicatedError(why))
            self.replicas = None
        tx = self.transactions
        if tx is not None and not tx.following:
            tx.step_down(why)
        cfg = self.config
        self._accept_sync(cfg.copy_by == "sync")
        if self.follower is None and cfg.copy_by == "fetch":
            self.follower = Follower(self.storage, replica=self.replica,
                                     tx=None if tx is None else TxCopy(
                                         tx.journal, replica=self.replica, stats=self.stats,
                                         executor=self.storage.executor),
                                     watermarks=WatermarkCopy(self.storage,
                                                              replica=self.replica,
                                                              stats=self.stats),
                                     add_topic=self._add_topic,
                                     apply_records=None if self.producers is None else
                                     self.producers.apply_producer_records,
                                     max_size=cfg.max_transfer_size,
                                     group_commit=cfg.unflush_threshold == 0, stats=self.stats)
        for plog in self.storage.logs():  # a slave serves what it holds
            plog.high_watermark = None
        self.epoch = epoch
        self.name, self.why = RoleName.SLAVE, why
        log.info("broker %d replica %d is a slave (%s)", self.config.broker_id,
                 self.replica, why)

    async def follow(self, master: tuple[str, int] | None) -> None:
        if self.follower is not None:
            self.follower.follow(master)

    async def set_partitions(self, topics: dict[str, int]) -> None:
        if self.follower is not None:
            self.follower.set_partitions(topics)

    async def close(self) -> None:
        if self.follower is not None:
            await self.follower.stop()
            self.follower = None
        if self.replicas is not None:
            self.replicas.fail(NotReplicatedError("broker stopping"))
            self.replicas = None

    # -- reporting -------------------------------------------------------------------------
    def status(self) -> dict:
        """Role, epoch, and per slave (master) or per partition (slave) progress
        (``Broker.replication_status``; :meth:`status_lines` renders it for ``stats``)."""
        out: dict = {"role": self.name.value, "epoch": self.epoch, "replica": self.replica,
                     "why": self.why, "truncated": list(self.truncated)}
        if self.replicas is not None:
            out["in_sync"] = sorted(self.replicas.in_sync)
            out["slaves"] = self.replicas.status()
        if self.follower is not None:
            out["master"] = self.follower.master
            out["copies"] = self.follower.status()
            if self.follower.tx is not None:
                out["transactions"] = self.follower.tx.status()
        elif self.transactions is not None and self.replicas is not None:
            out["transactions"] = self.transactions.feed.status()
        return out

    def status_lines(self) -> list[str]:
        st = self.status()
        lines = [f"replication_role {st['role']}",
                 f"replication_replica {st['replica']}",
                 f"replication_epoch {-1 if st['epoch'] is None else st['epoch']}",
                 f"replication_mode {self.config.replication}"]
        if "in_sync" in st:
            lines.append("replication_in_sync " + (",".join(map(str, st["in_sync"])) or "none"))
            for sl in st["slaves"]:
                lines.append(f"replication_slave {sl['replica']} in_sync "
                             f"{str(sl['in_sync']).lower()} lag_bytes {sl['lag_bytes']} "
                             f"lag_seconds {sl['lag_seconds']}")
        if "copies" in st:
            copies = st["copies"]
            lags = [c["lag_seconds"] for c in copies if c["lag_seconds"] is not None]
            master = st["master"]
            lines.append("replication_master "
                         + ("none" if master is None else f"{master[0]}:{master[1]}"))
            lines.append(f"replication_lag_seconds {max(lags, default=0)}")
            for c in copies:
                if c["state"] in ("diverged", "stopped"):
                    lines.append(f"replication_problem {c['topic']} {c['partition']} "
                                 f"{c['state']} {c['problem']}")
        txs = st.get("transactions")
        if txs is not None:
            lines.append(f"replication_tx_feed {txs['incarnation']} {txs['seq']}")
            if txs.get("problem"):
                lines.append(f"replication_problem transactions - stopped {txs['problem']}")
        for key in ("replication_copied_bytes", "replication_copied_messages",
                    "replication_diverged", "replication_resets",
                    "replication_request_timeouts", "replication_joins",
                    "replication_leaves", "replication_alone", "replication_truncated_bytes",
                    "put_refused_lease", "put_refused_role", "replication_tx_events",
                    "replication_tx_applied", "replication_tx_snapshots",
                    "replication_tx_damaged", "tx_found_committed"):
            lines.append(f"{key} {self.stats[key]}")
        return lines

async def _call(make: Callable[[], Awaitable[Any]]) -> Any:
    return await make()
