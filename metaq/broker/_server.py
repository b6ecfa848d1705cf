"""The broker's asyncio TCP server: Metaq's text protocol (reference section 6)
served from one :class:`Storage`.

The server accepts connections (``_connection``; limits per address and in
all), dispatches each read's parsed requests in order, and serves them: puts by
the one put step of ``_puts`` (runs of pipelined puts checked, appended with one
write per partition and answered with one socket write), gets from the log
(``sendfile`` for large ranges; held gets in ``_hold``), ``offset``, ``version``
and ``stats``.  Replies leave in request order: with group commit a batch of put
replies waits for its fsync, and replies queued behind it wait.  Bad input gets
a 400 naming what was wrong; when the stream cannot be resynchronised (bad put
length, endless line) the connection is closed after that answer.  Nothing a
client sends can stop the broker or stall other connections.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import Callable

from metaq import __version__
from metaq.broker._config import BrokerConfig
from metaq.broker._connection import Connection
from metaq.broker._hold import HeldGets
from metaq.broker._producers import Producers
from metaq.broker._puts import (
    idem_marks,
    opaque_of,
    put_group,
    store,
    store_idempotent,
    store_requests,
    target_of,
)
from metaq.broker._replies import FileReply, Gate, answer, result
from metaq.broker._role import Role
from metaq.broker._storage import PartitionLog, Storage
from metaq.broker._topics import PutTarget, Topics
from metaq.broker._transactions import Transactions
from metaq.protocol import (
    BOUNDARY_CAPABILITY,
    CHECKSUM_MASK,
    HOLD_CAPABILITY,
    IDEMPOTENT_CAPABILITY,
    RECORDS_CAPABILITY,
    TIME_INDEX_CAPABILITY,
    TXLOG_CAPABILITY,
    TXPIPE_CAPABILITY,
    WATERMARK_CAPABILITY,
    BadRequest,
    GetRequest,
    IdemMark,
    MsgIdGenerator,
    OffsetRequest,
    ProducersRequest,
    PutRequest,
    QuitRequest,
    StatsRequest,
    SyncRequest,
    TransactionRequest,
    TxLogRequest,
    TxPut,
    VersionRequest,
    WatermarkRequest,
    crc32,
    encode_value_header,
    replica_of_group,
    unwritten_partition_text,
)

__all__ = ["BrokerServer", "VERSION", "SMALL_CLIENT"]

#: An address holding fewer connections than this may use the connection reserve.
SMALL_CLIENT = 8

log = logging.getLogger(__name__)

#: Answer to ``version``: the Metaq release we speak, then ours; then the extensions a
#: broker offers are listed (``+hold``: held gets, see ``_hold``, unless max_hold is 0;
#: ``+timeindex``: ``offset ... time=<ms>``, see ``_timeindex``, unless time_index is off;
#: ``+txpipe``: pipelined local transactions, see ``_transactions``).
VERSION = f"1.4.6 metaq-py/{__version__}"


#: A read of at most this many requests gets the held gets its puts woke answered at
#: once (:meth:`BrokerServer.handle`).
_FIRE_NOW_MAX = 4

#: The counters of :meth:`BrokerServer.connection_stats`.
_CONNECTION_COUNTERS = ("connections_total", "connections_refused", "connections_evicted",
                        "idle_closed", "slow_closed", "unused_closed")


def _due(logged: dict[str, float], address: str) -> bool:
    """True at most once a minute per address: whether to log for it now."""
    now = time.monotonic()
    if now - logged.get(address, -60.0) < 60.0:
        return False
    if len(logged) > 10_000:
        logged.clear()
    logged[address] = now
    return True


class BrokerServer:
    """Serves one :class:`Storage` over TCP (the :class:`~metaq.broker._connection.Host`
    of its connections)."""

    def __init__(self, config: BrokerConfig, storage: Storage, ids: MsgIdGenerator, *,
                 on_topic_added: Callable[[str, int], None] | None = None,
                 status: Callable[[], list[str]] | None = None) -> None:
        self.config = config
        self.storage = storage
        self.ids = ids
        self.status = status
        self.connections: set[Connection] = set()
        #: client address -> connections open from it
        self.per_address: collections.Counter = collections.Counter()
        #: client address -> its connections that have not sent a whole request yet, in
        #: the order they were accepted (those a newcomer may take the place of)
        self.unused: dict[str, dict[Connection, None]] = {}
        self._refusals_logged: dict[str, float] = {}
        self._evictions_logged: dict[str, float] = {}
        self._unused_logged: dict[str, float] = {}
        self.started = time.time()
        self.stats = collections.Counter()
        self.version_text = VERSION + "".join(
            f" {cap}" for cap, offered in ((HOLD_CAPABILITY, config.max_hold > 0),
                                          (TIME_INDEX_CAPABILITY, config.time_index),
                                          (BOUNDARY_CAPABILITY, not config.java_tell_max_offset),
                                          (IDEMPOTENT_CAPABILITY, config.idempotent),
                                          (RECORDS_CAPABILITY, config.idempotent),
                                          (TXLOG_CAPABILITY, True),
                                          (TXPIPE_CAPABILITY, True),
                                          (WATERMARK_CAPABILITY, True))
            if offered)
        self._continue_ids()
        #: idempotent producers: per partition, the table of stored runs (``_producers``)
        self.producers = Producers(storage, keep_seqs=config.producer_window,
                                   expiry_s=config.producer_expiry_hours * 3600)
        #: connection -> the rest of an idem mark whose puts had not all arrived
        self._idem_open: dict[Connection, IdemMark] = {}
        #: open transactions and their journal (recovered here, before serving)
        self.tx = Transactions(storage, ids, group_commit=config.unflush_threshold == 0,
                               max_message_size=config.max_message_size,
                               max_timeout=config.max_transaction_timeout,
                               max_size=config.max_transaction_size, stats=self.stats,
                               max_hold=config.max_hold)
        self.tx.recover()
        self.held = HeldGets(self._get, max_hold=config.max_hold,
                             max_held=config.max_held_gets, stats=self.stats,
                             answer_replica=self._replica_get)
        self.topics = Topics(storage, auto_create=config.auto_create_topics,
                             num_partitions=config.num_partitions, on_added=on_topic_added)
        #: the parsers' put-loop mapping: b"<topic> <partition>" -> target (see ``_topics``)
        self.fast_keys = self.topics.keys
        #: this broker's replication role (``_role``), set by the broker with ZooKeeper
        self.role: Role | None = None
        self._server: asyncio.base_events.Server | None = None
        self.port = 0
        #: answer ``sync`` (a master replicating a put, :meth:`_sync`): a slave's broker
        #: sets it; otherwise a sync is answered 403
        self.accepts_sync = False
        #: :meth:`close` began: a connection still being made is refused
        self._shutting_down = False
        #: every connection made and not lost yet, refused ones included
        self._made: set[Connection] = set()

    async def start(self) -> int:
        self._server = await asyncio.get_running_loop().create_server(
            lambda: Connection(self), self.config.host, self.config.port,
            reuse_address=True, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Stop accepting, close every connection and wait (a second at most) until
        every socket is closed, so no client is left connected to a stopped broker.

        Accepting stops first (the listening socket's reader is removed), the socket
        itself is closed last: asyncio makes the connections accepted just before
        (two turns of the loop: the accept's task, then ``connection_made``, where they
        are refused), and a connection made after ``Server.close()`` would fail to
        attach to the closed server (CPython 3.11 asserts) and leak its socket until a
        garbage collection."""
        self._shutting_down = True
        loop = asyncio.get_running_loop()
        if self._server is not None:
            for sock in self._server.sockets:
                loop.remove_reader(sock.fileno())
        for conn in list(self.connections):
            conn.abort("broker shutting down")
        deadline = loop.time() + 1.0
        turns = 0
        while (turns < 2 or self._made) and loop.time() < deadline:
            await asyncio.sleep(0 if turns < 20 else 0.01)
            turns += 1
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        self.tx.close()
        self.producers.close()

    # -- connections -----------------------------------------------------------------------
    def admit(self, address: str) -> str | None:
        """Why a new connection from ``address`` is refused, or None to admit it.

        Limits: ``max_connections`` in all, ``max_connections_per_address`` from one
        address, and the last ``connection_reserve`` places only for addresses that
        hold fewer than :data:`SMALL_CLIENT` connections (a client that already
        holds many cannot take the places others need to get in)."""
        cfg = self.config
        total = len(self.connections)
        mine = self.per_address.get(address, 0)
        if total >= cfg.max_connections:
            return f"{total} connections open (max_connections)"
        if mine >= cfg.max_connections_per_address:
            return f"{mine} connections open from it (max_connections_per_address)"
        if total >= cfg.max_connections - cfg.connection_reserve and mine >= SMALL_CLIENT:
            return (f"{mine} connections open from it and only the reserve of "
                    f"{cfg.connection_reserve} places left (connection_reserve)")
        return None

    def refused(self, address: str, why: str) -> None:
        """Count a refused connection; log at most one line a minute per address."""
        self.stats["connections_refused"] += 1
        if _due(self._refusals_logged, address):
            log.warning("refusing connections from %s: %s", address, why)

    def connection_opened(self, conn: Connection) -> bool:
        """Admit ``conn`` (count it) or refuse it (:meth:`admit`).  At a limit, with
        ``evict_unused_connections``, a connection that has not sent a whole request
        yet makes way for it (:meth:`_make_room`)."""
        self.stats["connections_total"] += 1
        self._made.add(conn)
        if self._shutting_down:
            return False
        address = conn.address
        why = self.admit(address)
        if why is not None and self.config.evict_unused_connections:
            why = self._make_room(address, why)
        if why is not None:
            self.refused(address, why)
            return False
        self.connections.add(conn)
        self.per_address[address] += 1
        mine = self.unused.get(address)
        if mine is None:
            self.unused[address] = {conn: None}
        else:
            mine[conn] = None
        return True

    def _make_room(self, address: str, why: str) -> str | None:
        """Close unused connections (none of their requests whole yet), the oldest
        first, until a newcomer from ``address`` is admitted: ``address``'s own at its
        per-address limit, else the address holding most of them.  Returns why the
        newcomer is still refused, or None."""
        cfg = self.config
        while True:  # one eviction frees a place in both counts (the reserve may need more)
            if self.per_address.get(address, 0) >= cfg.max_connections_per_address:
                pool = self.unused.get(address)
            else:
                pool = max(self.unused.values(), key=len, default=None)
            if not pool:
                return why
            victim = next(iter(pool))
            self._forget(victim)
            self.stats["connections_evicted"] += 1
            if _due(self._evictions_logged, victim.address):
                log.warning("closing unused connections from %s to admit new ones (%s)",
                            victim.address, why)
            victim.abort(f"unused, closed to admit a new connection ({why})")
            why = self.admit(address)
            if why is None:
                return None

    def first_request(self, conn: Connection) -> None:
        """``conn`` sent its first whole request: no newcomer takes its place now."""
        mine = self.unused.get(conn.address)
        if mine is not None and mine.pop(conn, 0) is None and not mine:
            del self.unused[conn.address]

    def timed_out(self, conn: Connection, why: str) -> None:
        """Close ``conn``: its first request did not come in ``first_request_timeout``
        (``why`` "first_request"), or the one coming in is not whole after
        ``request_timeout`` ("request", a slow client)."""
        if why == "first_request":  # a flood closes thousands: one line a minute an address
            t = self.config.first_request_timeout
            self.stats["unused_closed"] += 1
            if _due(self._unused_logged, conn.address):
                log.info("closing connections from %s that sent no request within %gs of "
                         "connecting (%d so far, all addresses)", conn.address, t,
                         self.stats["unused_closed"])
            conn.abort(f"no request within {t:g}s")
        else:
            t = self.config.request_timeout
            log.info("closing %s: a request has been coming in for over %gs", conn.peer, t)
            self.stats["slow_closed"] += 1
            conn.abort(f"request incomplete after {t:g}s")

    def _forget(self, conn: Connection) -> None:
        """No longer count ``conn`` among the open connections."""
        if conn in self.connections:
            self.connections.discard(conn)
            address = conn.address
            n = self.per_address[address] - 1
            if n > 0:
                self.per_address[address] = n
            else:
                del self.per_address[address]
            self.first_request(conn)

    def connection_closed(self, conn: Connection) -> None:
        """``conn`` is gone: forget it and its held gets."""
        self._made.discard(conn)
        self._forget(conn)
        if conn.held:
            self.held.drop(conn)
        self._idem_open.pop(conn, None)
        self.tx.connection_closed(conn)
        replicas = None if self.role is None else self.role.replicas
        if replicas is not None and replicas.watermarks is not None:
            replicas.watermarks.connection_closed(conn)

    def close_idle(self, now: float, idle: float) -> None:
        """Close the connections that sent nothing for ``idle`` seconds (> 0).  (The
        deadlines of a request and of the first one are each connection's timer.)"""
        for conn in list(self.connections):
            if conn.idle_for(now) > idle:
                log.info("closing %s: idle for over %gs", conn.peer, idle)
                self.stats["idle_closed"] += 1
                conn.abort(f"idle for over {idle:g}s")

    def connection_stats(self) -> dict[str, int]:
        """The connection counters (``stats`` and the Prometheus metrics): open now,
        accepted, refused at a limit, evicted (unused, for a newcomer), and closed for
        being idle, slow (a request not whole in time) or unused (no first request)."""
        st = self.stats
        return {"curr_connections": len(self.connections),
                "unused_connections": sum(map(len, self.unused.values())),
                **{k: st[k] for k in _CONNECTION_COUNTERS}}

    # -- topics ----------------------------------------------------------------------------
    def add_topic(self, topic: str, partitions: int) -> None:
        """Serve ``topic`` with (at least) ``partitions`` partitions."""
        self.topics.add(topic, partitions)
        self._continue_ids()  # its logs may be older ones, reopened

    # -- requests --------------------------------------------------------------------------
    def handle(self, conn: Connection, reqs: list) -> None:
        """Serve one read's requests in order.  After a read of a few requests (a lone
        put: a synchronous ``send``), the held gets its puts woke are answered at once,
        not on the loop's next turn (a read of many, a batch stream, leaves them to
        that turn, where the puts of every read of this turn go out as one chunk)."""
        held = self.held
        held.deferred = True
        try:
            self._handle(conn, reqs)
        finally:
            held.fire_due(len(reqs) <= _FIRE_NOW_MAX)

    def _handle(self, conn: Connection, reqs: list) -> None:
        i = 0
        n = len(reqs)
        if self._idem_open:  # an idem mark's puts continue in this read (idempotent puts)
            mark = self._idem_open.pop(conn, None)
            if mark is not None:
                i = self._idem(conn, mark, reqs, 0)
        while i < n:
            if conn.gone:  # the client went away: what it still asked is not served
                self.stats["requests_dropped"] += n - i
                return
            r = reqs[i]
            t = type(r)
            if t is TxPut or (t is PutRequest and r.tx_key is not None):  # a run joining
                j = i + 1                                                    # transactions
                while j < n and (type(reqs[j]) is TxPut or (
                        type(reqs[j]) is PutRequest and reqs[j].tx_key is not None)):
                    j += 1
                why = None if self.role is None else self.role.put_refusal()
                if why is not None:  # a slave (or a master without its lease) keeps none
                    self._refuse_puts(conn, reqs[i:j], why)
                else:
                    self.tx.puts(conn, reqs[i:j])
                i = j
                continue
            if t is tuple or t is PutRequest:  # a run of puts (tuple: see RequestParser)
                if not i and t is tuple and type(reqs[-1]) is tuple and (
                        n < 3 or list(map(type, reqs)).count(tuple) == n):
                    # the usual read: nothing but fast puts
                    self._puts(conn, reqs, True, n <= _FIRE_NOW_MAX)
                    return
                j = i + 1
                tuples_only = t is tuple
                while j < n:
                    tj = type(reqs[j])
                    if tj is not tuple:
                        if tj is not PutRequest or reqs[j].tx_key is not None:
                            break
                        tuples_only = False
                    j += 1
                self._puts(conn, reqs[i:j] if i or j < n else reqs, tuples_only)
                i = j
                continue
            i += 1
            if t is GetRequest:
                self._get(conn, r)
            elif t is BadRequest:
                self.stats["bad_requests"] += 1
                conn.send(result(400, str(r.error), r.opaque))
                if r.fatal:
                    log.info("closing connection from %s: %s", conn.peer, r.error)
                    conn.close_after_replies()
                    return
                log.debug("bad request from %s: %s", conn.peer, r.error)
            elif t is OffsetRequest:
                self._offset(conn, r)
            elif t is VersionRequest:
                conn.send(answer(self.version_text.encode(), r.opaque))
            elif t is StatsRequest:
                self.stats["cmd_stats"] += 1
                conn.send(answer(self.stats_text(r.item).encode(), r.opaque))
            elif t is TransactionRequest:
                why = None if self.role is None or r.type in ("END", "RECOVER") \
                    else self.role.put_refusal()
                if why is not None:  # transactions are the master's (copied by its slaves)
                    self.stats["tx_errors"] += 1
                    conn.send(result(503, why, r.opaque))
                else:
                    self.tx.handle(conn, r)
            elif t is SyncRequest:
                self._sync(conn, r)
            elif t is QuitRequest:
                conn.close_after_replies()
                return
            elif t is IdemMark:  # metaq-py's idempotent producer: the puts after it
                if self.config.idempotent:
                    i = self._idem(conn, r, reqs, i)
                else:  # not offered: its puts are stored as plain puts
                    self.stats["bad_requests"] += 1
            elif t is ProducersRequest:
                self._producers(conn, r)
            elif t is TxLogRequest:  # a slave copying this master's transactions
                if self.role is not None and not self.role.leads:
                    conn.send(result(503, f"broker {self.config.broker_id} replica "
                                          f"{self.role.replica} is not the master", r.opaque))
                else:
                    self.tx.feed.request(conn, r)
            elif t is WatermarkRequest:  # a slave learning what consumers may read
                feed = None if self.role is None or self.role.replicas is None \
                    else self.role.replicas.watermarks
                if feed is None:
                    conn.send(result(503, f"broker {self.config.broker_id} is not a master "
                                          f"with slaves", r.opaque))
                else:
                    feed.request(conn, r)

    def _puts(self, conn: Connection, puts: list, tuples_only: bool,
              fire: bool = False) -> None:
        """A run of puts (``tuples_only``: the parser's tuples only, else PutRequests
        among them): stored by the one put step (``_puts.store``, after
        ``_puts.store_requests`` has given PutRequests their targets), answered with
        one send, behind their fsync with group commit.  ``fire`` (the read held
        these few puts only): when they wait for slaves, the held gets they woke (a
        synchronous slave's) are answered as soon as the wait is registered, before
        the producer's answer is set up: the slave's copy is what the round trip
        waits on."""
        n = len(puts)
        self.stats["cmd_put"] += n
        role = self.role
        if role is not None:
            why = role.put_refusal()
            if why is not None:
                self._refuse_puts(conn, puts, why)
                return
        ids = self.ids.next_ids(n)
        if tuples_only:
            replies, failed, written = store(puts, list(map(target_of, puts)), ids,
                                             self._put_group, self.topics)
        else:
            replies, failed, written = store_requests(puts, ids, self._put_group, self.topics,
                                                      self.config.max_message_size)
        self.stats["put_failed"] += failed
        group_commit = self.config.unflush_threshold == 0
        # without group commit the slaves' wait is all there is: the replica set
        # writes the answer itself the moment the last in-sync slave holds it
        synced = None if role is None or not written else \
            role.wait(written, None if group_commit else conn.drain)
        if fire and (synced is not None or written):
            # a synchronous slave's get (its copy is what the round trip waits on), or a
            # consumer's held get: answered before the producer's reply, as Redis answers
            # its blocked readers before the XADD's reply
            held = self.held
            held.fire_due()
            held.deferred = True  # (``handle`` ends it)
        data = b"".join(replies)
        if synced is not None or (written and group_commit):
            futs = [plog.request_flush() for plog in written] if group_commit else []
            if synced is not None:
                futs.append(synced)
            fut = futs[0] if len(futs) == 1 else asyncio.gather(*futs)
            opaques = (list(map(int, map(opaque_of, puts))) if tuples_only else
                       [int(p[4]) if type(p) is tuple else p.opaque for p in puts])
            conn.send_gated(Gate(fut, data, opaques), notified=not group_commit)
        else:
            conn.send(data)

    def _refuse_puts(self, conn: Connection, puts: list, why: str) -> None:
        """Answer a run of puts 503 (not the master, or it may not accept puts now):
        nothing written; the producer tries again, at the master."""
        self.stats["put_failed"] += len(puts)
        self.stats["put_refused_role"] += len(puts)
        conn.send(b"".join(
            result(503, why, p.opaque if type(p) is PutRequest else int(p[4])) for p in puts))

    def _put_group(self, target: PutTarget, puts: list, ids: list[int]
                   ) -> tuple[list[bytes], int, bool]:
        """One group of the put step (``_puts.put_group``); a method, looked up per
        read, so that a test can watch how a read's puts are grouped."""
        return put_group(target, puts, ids)

    def _sync(self, conn: Connection, r: SyncRequest) -> None:
        """``sync``: store the master's put with the msgId it carries at the partition's
        end, answered as Java's Gregor slave does (``GregorCommandProcessor``: the put's
        ``result 200 <msgId> <partition> <offset>``, 403 for a closed partition; the
        topic created as a put would create it), through the put step (its checksum
        check, 400 and nothing written when wrong; the reply behind the fsync with
        group commit).  403 unless :attr:`accepts_sync`."""
        self.stats["cmd_put"] += 1
        if not self.accepts_sync:
            self.stats["put_failed"] += 1
            conn.send(result(403, f"broker {self.config.broker_id} is not a slave; sync is "
                                  f"only accepted by a slave", r.opaque))
            return
        target = self.topics.target(r.topic, r.partition) if r.partition >= 0 else None
        if target is None:
            self.stats["put_failed"] += 1
            conn.send(result(404 if r.partition >= 0 else 400,
                             f"topic {r.topic} partition {r.partition} not found"
                             if r.partition >= 0 else f"bad partition {r.partition}", r.opaque))
            return
        check = r.checksum if r.checksum != -1 else crc32(r.payload) & CHECKSUM_MASK
        replies, failed, wrote = self._put_group(
            target, [(target, r.length, r.flag, check, b"%d" % r.opaque, r.payload)],
            [r.msg_id])
        self.stats["put_failed"] += failed
        if wrote and self.config.unflush_threshold == 0:
            conn.send_gated(Gate(target.log.request_flush(), replies[0], [r.opaque]))
        else:
            conn.send(replies[0])

    def _replica_get(self, conn: Connection, r: GetRequest, plog: PartitionLog,
                     replica: int) -> None:
        """A slave's held get that a put woke: its bytes, on the short path where
        nothing but reading them is left to decide (the get was checked when it was
        held); else the whole :meth:`_get`."""
        offset, max_size = r.offset, r.max_size
        if (plog.closed or not 0 < max_size <= self.config.max_transfer_size or self.role is None
                or (r.records is not None and self.config.idempotent
                    and self.producers.table(plog).pids)):
            self._get(conn, r._replace(hold_ms=0))
            return
        s = plog.read(offset, max_size)
        if s is None or s.segment.damaged:
            self._get(conn, r._replace(hold_ms=0))
            return
        self.stats["cmd_get"] += 1
        self.role.answered(replica, plog, offset)  # (``fetched`` counted it when held)
        self.stats["get_bytes"] += s.length
        data = plog.recent(offset, s.length)  # the put that woke it, still in memory
        if data is not None:
            conn.send(encode_value_header(s.length, r.opaque) + data)
        else:
            conn.send_file(FileReply(encode_value_header(s.length, r.opaque), s, plog))

    def _get(self, conn: Connection, r: GetRequest) -> None:
        self.stats["cmd_get"] += 1
        topic, _group, partition, offset, max_size, opaque, hold_ms, records = r
        if hold_ms:
            self.stats["get_hold_asked"] += 1
        if max_size <= 0:
            conn.send(result(400, f"bad maxSize {max_size}", opaque))
            return
        plog = self.storage.get(topic, partition)
        if plog is None:
            self.stats["get_miss"] += 1
            conn.send(result(404, f"topic {topic} partition {partition} not found", opaque))
            return
        if plog.closed:
            conn.send(result(403, f"partition {topic}-{partition} is closed", opaque))
            return
        hw = None
        if self.role is not None:
            replica = replica_of_group(_group)
            if replica is not None:
                self.role.fetched(replica, plog, offset)
                # a slave caught up (the usual get of a synchronous copy): held at once
                if hold_ms and offset == plog.readable_end and offset >= plog.min_offset \
                        and not self.config.java_tell_max_offset \
                        and self.held.hold(conn, r, plog):
                    return
            else:
                hw = plog.high_watermark
        if offset < plog.min_offset:
            conn.send(result(301, str(plog.min_offset), opaque))
            return
        damage = plog.damage_at(offset)
        if damage is not None:  # known damaged bytes: send the reader past them
            self.stats["get_damaged"] += 1
            conn.send(result(301, str(damage[1]), opaque))
            return
        end = plog.end
        if offset > end and self.config.correct_offsets:
            conn.send(result(301, str(end), opaque))
            return
        cap = min(max_size, self.config.max_transfer_size)
        if max_size > cap and not self.config.java_transfer_cap:
            # One message bigger than maxTransferSize must still be readable (the producer
            # accepts up to 4 MiB): serve it whole when the client asked for that much.
            head = plog.read_bytes(offset, 4)
            if len(head) == 4:
                need = 20 + int.from_bytes(head, "big", signed=True)
                if cap < need <= max_size:
                    cap = need
        if hw is not None:  # a consumer reads what every in-sync slave holds
            if offset >= hw:
                if hold_ms and offset <= end and self.held.hold(conn, r, plog):
                    return
                self.stats["get_miss"] += 1
                conn.send(result(404, f"no message at offset {offset} (end {end})", opaque))
                return
            cap = min(cap, hw - offset)
        s = plog.read(offset, cap)
        if s is None:
            if self.config.java_tell_max_offset and offset > plog.durable_end:
                conn.send(result(301, str(plog.durable_end), opaque))  # Java's rewind
                return
            if hold_ms and plog.readable_end <= offset <= end and self.held.hold(conn, r, plog):
                return  # answered when a put lands (or at the end of the hold)
            self.stats["get_miss"] += 1
            conn.send(result(404, f"no message at offset {offset} (end {end})", opaque))
            return
        self.stats["get_bytes"] += s.length
        if records is not None and self.config.idempotent:
            # a slave's get (``+records``): the producer records of what it copies go
            # first, so they are on their way before its next get counts it as holding
            # their messages; none, no answer (``_idempotence``)
            table = self.producers.table(plog)
            data = table.records_bytes(offset) if table.pids else b""
            if data:
                self.stats["cmd_producers"] += 1
                conn.send(answer(data, records))
        conn.send_file(FileReply(encode_value_header(s.length, opaque), s, plog))

    def _continue_ids(self) -> None:
        """msgIds continue after the greatest time in the logs (``_timeindex``)."""
        ahead = self.ids.continue_after(self.storage.last_time)
        if ahead > 1000:
            log.warning("the logs hold messages %.1f s later than this machine's clock; "
                        "new msgIds carry the logs' last time until the clock catches up "
                        "(so times never go back within a partition)", ahead / 1000)

    def _offset(self, conn: Connection, r: OffsetRequest) -> None:
        self.stats["cmd_offset"] += 1
        plog = self.storage.get(r.topic, r.partition)
        if plog is None:
            conn.send(result(404, f"topic {r.topic} partition {r.partition} not found",
                              r.opaque))
            return
        if self.config.java_unwritten_404 and plog.end == 0:
            conn.send(result(404, unwritten_partition_text(r.topic, r.partition), r.opaque))
            return
        if r.time_ms >= 0:
            self._offset_for_time(conn, r, plog)
            return
        if r.offset <= plog.min_offset or r.offset >= plog.end:
            conn.send(answer(b"%d" % plog.nearest_valid_offset(r.offset), r.opaque))
            return
        s = plog.read(r.offset, 1) or plog.read(plog.min_offset, 1)
        loop = asyncio.get_running_loop()
        if s is not None:
            plog.pin(s)
        fut = loop.run_in_executor(None, plog.nearest_valid_offset, r.offset)
        out = loop.create_future()

        def done(f: asyncio.Future) -> None:
            if s is not None:
                plog.unpin(s)
            if f.exception() is not None:
                log.error("offset %d of %s-%d: %s", r.offset, r.topic, r.partition,
                          f.exception())
                out.set_result(result(500, f"cannot find a valid offset: {f.exception()}",
                                       r.opaque))
            else:
                out.set_result(answer(b"%d" % f.result(), r.opaque))

        fut.add_done_callback(done)
        conn.send_gated(Gate(out, b"", []))

    def _offset_for_time(self, conn: Connection, r: OffsetRequest, plog: PartitionLog
                         ) -> None:
        """``offset ... time=<ms>``: ``<offset> <its time or -1>`` from the time index,
        looked up off the event loop with the segments pinned."""
        self.stats["cmd_offset_time"] += 1
        if not self.config.time_index:
            conn.send(result(400, "this broker does not offer the time index "
                                  "(time_index is off)", r.opaque))
            return
        segments = plog.pin_all()
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, plog.offset_for_time, r.time_ms)
        out = loop.create_future()

        def done(f: asyncio.Future) -> None:
            plog.unpin_all(segments)
            e = f.exception()
            if e is not None:
                log.error("time %d of %s-%d: %s", r.time_ms, r.topic, r.partition, e)
                out.set_result(result(500, f"cannot look up time {r.time_ms}: {e}", r.opaque))
            else:
                out.set_result(answer(b"%d %d" % f.result(), r.opaque))

        fut.add_done_callback(done)
        conn.send_gated(Gate(out, b"", []))

    # -- idempotent puts (metaq-py's extension; ``_producers``, ``_puts.store_idempotent``) --
    def _idem(self, conn: Connection, mark: IdemMark, reqs: list, i: int) -> int:
        """The puts ``mark`` (and the marks right after them) cover from ``reqs[i]`` on,
        stored once (``_puts.idem_marks``); returns where the requests after them
        begin.  A mark whose puts had not all arrived waits for the next read."""
        marks, j, rest = idem_marks(mark, reqs, i)
        if rest is not None:
            self._idem_open[conn] = rest
        if marks:
            self._idem_puts(conn, reqs, marks)
        return j

    def _idem_puts(self, conn: Connection, reqs: list,
                   marks: list[tuple[int, int, int, int]]) -> None:
        puts: list = []
        spans = []
        for pid, seq, start, stop in marks:  # the puts alone, marks left out
            spans.append((pid, seq, len(puts), len(puts) + stop - start))
            puts += reqs[start:stop]
        n = len(puts)
        self.stats["cmd_put"] += n
        self.stats["idem_puts"] += n
        # a server with a replication role (``_role``, when there is one) refuses and
        # waits for idempotent puts exactly as for plain ones (see ``_puts``)
        role = getattr(self, "role", None)
        if role is not None:
            why = role.put_refusal()
            if why is not None:
                self._refuse_puts(conn, puts, why)
                return
        replies, failed, touched = store_idempotent(puts, spans, self.ids.next_ids(n),
                                                    self.topics, self.producers,
                                                    self.config.max_message_size)
        self.stats["put_failed"] += failed
        data = b"".join(replies)
        # answers (stored now, or before: a resend) leave once what they answer is as
        # safe as a plain put's: with group commit on disk with the table, and on the
        # in-sync slaves when the role says so
        replicated = None if role is None or not touched else role.wait(touched)
        group_commit = self.config.unflush_threshold == 0
        if replicated is not None or (touched and group_commit):
            opaques = [int(p[4]) if type(p) is tuple else p.opaque for p in puts]
            fut = asyncio.ensure_future(self._synced(touched if group_commit else [],
                                                     replicated))
            conn.send_gated(Gate(fut, data, opaques))
        else:
            conn.send(data)

    async def _synced(self, logs: list[PartitionLog],
                      replicated: asyncio.Future | None = None) -> None:
        for plog in logs:
            await plog.request_flush()
            synced = self.producers.table(plog).synced
            if synced is not None:
                await asyncio.wrap_future(synced)
        if replicated is not None:
            await replicated

    def _producers(self, conn: Connection, r: ProducersRequest) -> None:
        """``producers <topic> <partition> <fromOffset> <opaque>``: the producer records
        of that partition's runs from ``fromOffset`` on (``_idempotence``)."""
        self.stats["cmd_producers"] += 1
        plog = self.storage.get(r.topic, r.partition)
        if plog is None:
            conn.send(result(404, f"topic {r.topic} partition {r.partition} not found",
                             r.opaque))
            return
        conn.send(answer(self.producers.table(plog).records_bytes(r.from_offset), r.opaque))

    def stats_text(self, item: str | None) -> str:
        now = time.time()
        lines = []
        if item in (None, ""):
            logs = self.storage.logs()
            lines += [
                f"pid {os.getpid()}",
                f"broker_id {self.config.broker_id}",
                f"port {self.port}",
                f"uptime {int(now - self.started)}",
                f"version {VERSION}",
                f"curr_connections {len(self.connections)}",
                f"unused_connections {sum(map(len, self.unused.values()))}",
                f"held_gets {len(self.held)}",
                f"open_transactions {len(self.tx.xa) + sum(map(len, self.tx.local.values()))}",
                f"queued_replies {sum(c.queued for c in self.connections)}",
                f"unsent_reply_bytes {sum(c.unsent_bytes for c in self.connections)}",
                f"topics {len(self.storage.topics)}",
                f"partitions {len(logs)}",
                f"messages_appended {sum(p.messages_appended for p in logs)}",
                f"flush_errors {self.storage.flush_errors}",
                f"idem_duplicates {self.producers.duplicates}",
            ]
            if self.status is not None:
                lines += self.status()
            for key in ("cmd_put", "put_failed", "cmd_get", "get_miss", "get_bytes",
                        "get_hold_asked", "get_held", "get_held_woken", "get_held_expired",
                        "get_hold_refused", "get_damaged",
                        "get_sendfile", "get_sendfile_fallback", "cmd_offset", "cmd_offset_time",
                        "cmd_stats", "cmd_transaction", "idem_puts", "cmd_producers",
                        "tx_begun", "tx_puts", "tx_prepared",
                        "tx_committed", "tx_rolled_back", "tx_timed_out", "tx_errors",
                        "bad_requests", "connections_total", "connections_refused",
                        "clients_vanished", "requests_dropped", "slow_closed", "idle_closed",
                        "unused_closed", "connections_evicted"):
                lines.append(f"{key} {self.stats[key]}")
        elif item == "topics":
            for topic, n in sorted(self.storage.topics.items()):
                lines.append(f"{topic} partitions {n}")
        elif item == "offsets":
            for plog in sorted(self.storage.logs(), key=lambda p: (p.topic, p.partition)):
                damaged = plog.damaged
                lines.append(f"{plog.topic} part {plog.partition} min_offset {plog.min_offset} "
                             f"max_offset {plog.end} closed {str(plog.closed).lower()} "
                             f"damaged {len(damaged)} damaged_bytes "
                             f"{sum(b - a for a, b, _ in damaged)}")
        elif item == "config":
            for key, value in sorted(vars(self.config).items()):
                lines.append(f"{key} {dict(value) if key == 'topics' else value}")
        else:
            lines.append(f"unknown stats item {item} (items: topics, offsets, config)")
        return "".join(f"STAT {line}\r\n" for line in lines)
