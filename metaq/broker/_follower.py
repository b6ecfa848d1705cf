"""A slave's copy of its master: every partition fetched with ``get`` and
appended at the same offsets, byte for byte.

The follower runs in the slave broker's event loop.  It holds one TCP
connection to the master (:class:`_MasterLink`, replies matched by opaque) and
one copy task per partition: ask from the local log's end (``get`` with the
group ``meta-slave-group-<N>``, held at the end when the master offers
``+hold``, polled every ``poll_delay`` otherwise, as from a Java master), append
the whole messages of the reply with ``PartitionLog.append_copy`` (which checks
every header and checksum), with group commit fsync before asking again (the
next get's offset is what tells the master the slave holds it), repeat.  From a
master with idempotent producers (``+idempotent``) it also stores their producer
records: a ``+records`` master sends those of each chunk right before it (the get
carries ``records=<opaque>``; none sent, none there), an older one is asked with
``producers`` after each chunk (the request goes before the next get).

What it reports instead of copying (``Follower.status``, ``stats``, a log line
naming topic, partition and offset):

- a reply that does not continue the log (a damaged message, a gap) and a master
  whose log ends below this slave's end (cut, or not the log this one copied):
  the partition stops copying, ``diverged`` (never silently different);
- a master log that starts above the slave's end (retention removed what the
  slave never copied): the slave's copy restarts there (``reset``), logged;
- a Java master (no ``+boundary`` in its ``version``) answers a get past its max
  offset with ``301`` and that max offset, which is what it has flushed and may
  lag what its gets already served: a 301 below the slave's end from such a
  master is first taken as "not flushed yet" and asked again every
  ``poll_delay``; only when it stays below for ``flush_grace`` seconds (longer
  than Java's default ``unflushInterval``) is the copy ``diverged``.  (Its
  ``offset`` answers the start of a position's segment, so the check on
  connecting is for ``+boundary`` masters only; a Java master with
  ``updateConsumerOffsets=false`` answers a get past its max offset 404, so one
  whose log was cut below this slave's end is not noticed);
- a write that fails (a full disk): copying pauses, ``stopped``, and is tried
  again every ``retry_delay``;
- a get the master leaves unanswered for ``answer_timeout`` seconds past its hold
  (a request lost on its way, a master stuck): the connection is closed and made
  again, the copy asks again from its end (logged, ``replication_request_timeouts``);
  a copy never waits on its master forever.

New topics and partitions of the master reach :meth:`Follower.set_partitions`
from the broker's ZooKeeper thread; the master's address (and its changes)
reach :meth:`Follower.follow`.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from metaq._errors import (
    BrokerUnavailableError,
    ConnectionClosedError,
    ProtocolError,
    ReplicaDivergedError,
    StorageError,
)
from metaq._types import BrokerAddress
from metaq.protocol import (
    BOUNDARY_CAPABILITY,
    HEADER_SIZE,
    HOLD_CAPABILITY,
    IDEMPOTENT_CAPABILITY,
    OPAQUE_MASK,
    RECORDS_CAPABILITY,
    TXLOG_CAPABILITY,
    WATERMARK_CAPABILITY,
    ReplyParser,
    Result,
    Value,
    decode_producer_records,
    encode_get_head,
    encode_offset,
    encode_producers,
    encode_version,
    replica_group,
)

if TYPE_CHECKING:
    from metaq.broker._storage import PartitionLog, Storage
    from metaq.broker._txfeed import TxCopy
    from metaq.broker._watermarks import WatermarkCopy

__all__ = ["Follower", "PartitionCopy"]

log = logging.getLogger(__name__)


class _MasterLink(asyncio.Protocol):
    """One connection to the master; each request's future gets its reply."""

    def __init__(self, address: BrokerAddress) -> None:
        self.address = address
        self.parser = ReplyParser()
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, asyncio.Future] = {}
        self.opaques = itertools.count(1)
        self.closed = asyncio.get_running_loop().create_future()
        self.capabilities: frozenset[str] = frozenset()
        #: opaque -> a handler that may take its reply right here, in ``data_received``
        #: (``handler(reply, fut)`` True: taken; ``fut`` now waits on for a later reply)
        self.fast: dict[int, Callable[[object, asyncio.Future], bool]] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            replies = self.parser.feed(data)
        except ProtocolError as e:
            self._fail(BrokerUnavailableError(f"master {self.address[0]}:{self.address[1]} "
                                              f"sent a reply that does not parse: {e}",
                                              address=self.address))
            return
        fast = self.fast
        for reply in replies:
            opaque = reply.opaque
            fut = self.pending.pop(opaque, None)
            if fut is not None and not fut.done():
                handler = fast.pop(opaque, None) if fast else None
                if handler is None or not handler(reply, fut):
                    fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(ConnectionClosedError(
            f"master {self.address[0]}:{self.address[1]} closed the connection"
            + (f": {exc}" if exc else ""), address=self.address))

    def _fail(self, err: Exception) -> None:
        pending, self.pending = self.pending, {}
        self.fast = {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)
                fut.exception()
        if not self.closed.done():
            self.closed.set_result(err)
        if self.transport is not None:
            self.transport.abort()

    def request(self, encode: Callable[[int], bytes], fut: asyncio.Future | None = None,
                fast: Callable[[object, asyncio.Future], bool] | None = None
                ) -> asyncio.Future:
        """Send a request; the future its reply resolves (``fut``: that one, still
        waiting).  ``fast(reply, fut)`` sees the reply first (see :attr:`fast`)."""
        if self.closed.done():
            raise self.closed.result()
        opaque = next(self.opaques) & OPAQUE_MASK
        return self.send(opaque, encode(opaque), fut, fast)

    async def ask(self, encode: Callable[[int], bytes], limit: float, what: str,
                  stats: collections.Counter) -> object:
        """:meth:`request`, its reply awaited ``limit`` seconds at most: one that does not
        come (a request lost on its way, a stuck master) closes this connection, which
        the follower makes again, and raises BrokerUnavailableError (counted in
        ``stats`` as ``replication_request_timeouts``).  For the requests a master holds
        (``txlog``, ``watermarks``): ``limit`` is their hold and a margin."""
        try:
            return await asyncio.wait_for(self.request(encode), limit)
        except TimeoutError:
            why = f"{what} unanswered for over {limit:g}s"
            self.give_up(why, stats)
            raise BrokerUnavailableError(f"master {self.address[0]}:{self.address[1]} left "
                                         f"{why}", address=self.address) from None

    def give_up(self, why: str, stats: collections.Counter) -> None:
        """A request of this connection went unanswered (``why`` names it): counted,
        logged, and the connection closed (the follower makes it again)."""
        stats["replication_request_timeouts"] += 1
        log.warning("master %s:%d left %s; connecting again", self.address[0],
                    self.address[1], why)
        self.close(why)

    def next_opaque(self) -> int:
        """An opaque for a request given to :meth:`send`."""
        return next(self.opaques) & OPAQUE_MASK

    def send(self, opaque: int, data: bytes, fut: asyncio.Future | None = None,
             fast: Callable[[object, asyncio.Future], bool] | None = None) -> asyncio.Future:
        """:meth:`request` of a request already encoded with ``opaque``."""
        if self.closed.done():
            raise self.closed.result()
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
        self.pending[opaque] = fut
        if fast is not None:
            self.fast[opaque] = fast
        self.transport.write(data)
        return fut

    def expect(self) -> tuple[int, _Expected]:
        """An opaque for a reply that may come or not (``records=``), and what holds it
        if it does; :meth:`forget` it once it can no longer come."""
        opaque = next(self.opaques) & OPAQUE_MASK
        slot = self.pending[opaque] = _Expected()
        return opaque, slot  # type: ignore[return-value]

    def forget(self, opaque: int) -> None:
        self.pending.pop(opaque, None)

    def close(self, why: str = "follower stopped") -> None:
        self._fail(ConnectionClosedError(why, address=self.address))


class PartitionCopy:
    """One partition's copy: its state and counters (``Follower.status``)."""

    __slots__ = ("plog", "state", "problem", "copied_bytes", "copied_messages",
                 "caught_up_at", "task", "max_size", "below_since", "records_to",
                 "applying", "pushed", "asked_at", "get_head", "fast", "asked_time")

    def __init__(self, plog: PartitionLog, max_size: int) -> None:
        self.plog = plog
        self.state = "starting"       # copying, caught-up, diverged, stopped
        self.problem: str | None = None
        self.copied_bytes = 0
        self.copied_messages = 0
        self.caught_up_at: float | None = None
        self.task: asyncio.Task | None = None
        self.max_size = max_size
        #: with a master that has idempotent producers' records: the log end up to which
        #: this copy holds them (None: records not tracked, the master has none)
        self.records_to: int | None = None
        #: waiting for the producer records of what it copied (``Follower.stop`` lets
        #: that finish: the master may already count the copy as held)
        self.applying = False
        #: the get in flight asked a ``+records`` master for its records: (the link,
        #: the opaque, the future their answer resolves if there are any)
        self.pushed: tuple[_MasterLink, int, _Expected] | None = None
        #: when an unflushed Java master's max offset was first seen below this end
        self.below_since: float | None = None
        #: the offset the get in flight asked from
        self.asked_at = 0
        #: when the get in flight was sent (None: none waits for its answer)
        self.asked_time: float | None = None
        #: the start of its gets (``encode_get_head``: names checked once)
        self.get_head: bytes | None = None
        #: (link, hold, the fast path's handler for them), made once per link
        self.fast: tuple[_MasterLink, int, Callable[[object, asyncio.Future], bool]] | None \
            = None

    def lag_seconds(self, now: float) -> float | None:
        """Seconds since this copy last reached the master's end (None: never)."""
        if self.state == "caught-up":
            return 0.0
        return None if self.caught_up_at is None else now - self.caught_up_at


class Follower:
    """Copies the master's partitions into ``storage`` (see the module docstring).

    ``add_topic(topic, partitions)`` opens (and registers) a topic locally: the
    broker's own ``add_topic`` path, so a copied topic is served and published
    like any other.
    """

    def __init__(self, storage: Storage, *, replica: int, add_topic: Callable[[str, int], None],
                 max_size: int, group_commit: bool, stats: collections.Counter,
                 apply_records: Callable[[str, int, list], int] | None = None,
                 tx: TxCopy | None = None, watermarks: WatermarkCopy | None = None,
                 hold_ms: int = 500, poll_delay: float = 0.1,
                 retry_delay: float = 1.0, connect_timeout: float = 5.0,
                 flush_grace: float = 15.0, answer_timeout: float = 10.0) -> None:
        self.storage = storage
        self.replica = replica
        self.group = replica_group(replica)
        #: when the fast path last copied a lone message (``expecting``)
        self.lone_at = -1.0
        self.add_topic = add_topic
        #: stores a master's producer records (``Producers.apply_producer_records``)
        self.apply_records = apply_records
        #: copies the master's transaction feed into this broker's journal (``_txfeed``)
        self.tx = tx
        #: serves consumers below the master's watermarks (``_watermarks``)
        self.watermarks = watermarks
        self._tx_task: asyncio.Task | None = None
        self._hw_task: asyncio.Task | None = None
        self.max_size = max_size
        self.group_commit = group_commit
        self.stats = stats
        self.hold_ms = hold_ms
        self.poll_delay = poll_delay
        self.retry_delay = retry_delay
        self.connect_timeout = connect_timeout
        #: how long :meth:`stop` waits for producer records already asked for
        self.records_grace = 2.0
        self.flush_grace = flush_grace
        #: how long past its hold a get may wait for its answer before the connection
        #: is made again (:meth:`_watch`)
        self.answer_timeout = answer_timeout
        self._watch_task: asyncio.Task | None = None
        self.master: BrokerAddress | None = None
        self.copies: dict[tuple[str, int], PartitionCopy] = {}
        self._link: _MasterLink | None = None
        self._linked = asyncio.Event()
        self._connector: asyncio.Task | None = None
        self._stopped = False

    # -- from the ZooKeeper side -----------------------------------------------------------
    def follow(self, master: BrokerAddress | None) -> None:
        """Copy from ``master`` (None: there is none now; wait)."""
        if master == self.master:
            return
        log.info("replica %d: master is %s", self.replica,
                 "gone" if master is None else f"{master[0]}:{master[1]}")
        self.master = master
        self._drop_link()
        for copy in self.copies.values():  # a new master may continue a diverged copy
            if copy.state == "diverged":
                copy.state, copy.problem = "starting", None
                self._start(copy)
        if master is not None and not self._stopped:
            self._connector = asyncio.get_running_loop().create_task(
                self._connect(master), name=f"metaq-follower-{self.replica}-connect")

    def set_partitions(self, topics: dict[str, int]) -> None:
        """The master's topics and partition counts: copy every one."""
        if self._stopped:
            return
        for topic, n in sorted(topics.items()):
            have = self.storage.topics.get(topic, 0)
            if have < n:
                self.add_topic(topic, n)
            for p in range(n):
                if (topic, p) not in self.copies:
                    plog = self.storage.get(topic, p)
                    copy = self.copies[(topic, p)] = PartitionCopy(plog, self.max_size)
                    if self.watermarks is not None:
                        self.watermarks.apply(plog)
                    self._start(copy)

    # -- lifecycle -------------------------------------------------------------------------
    async def stop(self) -> dict[str, tuple[int, ...]]:
        """Stop copying (waits for the copy tasks); the log ends, topic -> per partition."""
        self._stopped = True
        applying = [c.task for c in self.copies.values() if c.applying and c.task is not None]
        if applying:  # records on their way: the master may count their messages as held
            await asyncio.wait(applying, timeout=self.records_grace)
        self._drop_link()
        tasks = [c.task for c in self.copies.values() if c.task is not None]
        for t in tasks:
            t.cancel()
        if self._connector is not None:
            self._connector.cancel()
            tasks.append(self._connector)
        await asyncio.gather(*tasks, return_exceptions=True)
        return self.ends()

    def unrecorded(self) -> dict[tuple[str, int], int]:
        """Partitions holding messages whose producer records did not come (the master
        went first): ``(topic, partition) -> the end up to which records are held``."""
        return {key: c.records_to for key, c in self.copies.items()
                if c.records_to is not None and c.records_to < c.plog.end}

    def ends(self) -> dict[str, tuple[int, ...]]:
        return {topic: tuple(self.storage.get(topic, p).end for p in range(n))
                for topic, n in sorted(self.storage.topics.items())}

    def _start(self, copy: PartitionCopy) -> None:
        plog = copy.plog
        copy.task = asyncio.get_running_loop().create_task(
            self._copy(copy), name=f"metaq-follower-{plog.topic}-{plog.partition}")

    def _drop_link(self) -> None:
        if self._connector is not None:
            self._connector.cancel()
            self._connector = None
        self._cancel_feeds()
        if self._link is not None:
            self._link.close()
            self._link = None
        self._linked.clear()

    def _cancel_feeds(self) -> None:
        for task in (self._tx_task, self._hw_task, self._watch_task):
            if task is not None:
                task.cancel()
        self._tx_task = self._hw_task = self._watch_task = None

    async def _connect(self, master: BrokerAddress) -> None:
        loop = asyncio.get_running_loop()
        while self.master == master and not self._stopped:
            try:
                _t, link = await asyncio.wait_for(loop.create_connection(
                    lambda: _MasterLink(master), master[0], master[1]), self.connect_timeout)
                reply = await asyncio.wait_for(link.request(encode_version),
                                               self.connect_timeout)
                link.capabilities = frozenset(reply.body.decode("utf-8", "replace").split())
                if self.tx is not None and TXLOG_CAPABILITY in link.capabilities:
                    # the feed first: the master counts this slave's acknowledgements
                    # before any get of this connection can put it in the in-sync set
                    await asyncio.wait_for(self.tx.step(link, 0), self.connect_timeout)
            except (TimeoutError, OSError, BrokerUnavailableError) as e:
                self.stats["replication_connect_failed"] += 1
                log.warning("replica %d: cannot reach master %s:%d (%s); retrying",
                            self.replica, master[0], master[1], e)
                await asyncio.sleep(self.retry_delay)
                continue
            self._link = link
            if self.tx is not None and TXLOG_CAPABILITY in link.capabilities:
                self._tx_task = loop.create_task(self.tx.run(link),
                                                 name=f"metaq-follower-{self.replica}-tx")
            if self.watermarks is not None and WATERMARK_CAPABILITY in link.capabilities:
                self._hw_task = loop.create_task(self.watermarks.run(link),
                                                 name=f"metaq-follower-{self.replica}-hw")
            self._watch_task = loop.create_task(self._watch(link),
                                                name=f"metaq-follower-{self.replica}-watch")
            self._linked.set()
            log.info("replica %d: copying from %s:%d", self.replica, master[0], master[1])
            err = await link.closed
            if self._link is link:
                self._link = None
                self._linked.clear()
                self._cancel_feeds()
                log.warning("replica %d: connection to master lost (%s); reconnecting",
                            self.replica, err)
            await asyncio.sleep(min(self.retry_delay, 0.2))

    async def _watch(self, link: _MasterLink) -> None:
        """While ``link`` is this follower's: close it when a copy's get (or its
        ``offset`` on connecting) waits for its answer ``answer_timeout`` seconds past its
        hold (the connector makes it again; every copy asks again from its end)."""
        hold = (self.hold_ms if HOLD_CAPABILITY in link.capabilities else 0) / 1000.0
        while self._link is link and not link.closed.done():
            await asyncio.sleep(max(0.05, min(1.0, self.answer_timeout / 4)))
            limit = hold + self.answer_timeout
            now = time.monotonic()
            late = [c for c in self.copies.values()
                    if c.asked_time is not None and now - c.asked_time > limit]
            if late and self._link is link:
                plog = late[0].plog
                link.give_up(f"replica {self.replica}'s get of {plog.topic}-{plog.partition} "
                             f"at offset {late[0].asked_at} unanswered for over {limit:g}s",
                             self.stats)
                return

    # -- one partition ---------------------------------------------------------------------
    async def _copy(self, copy: PartitionCopy) -> None:
        plog = copy.plog
        topic, p = plog.topic, plog.partition
        checked: _MasterLink | None = None
        ahead: asyncio.Future | None = None   # the next get, sent before records were read
        ahead_on: _MasterLink | None = None   # ... on this connection
        while not self._stopped:
            await self._linked.wait()
            link = self._link
            if link is None:
                continue
            if ahead_on is not link:  # sent on a connection since replaced: drop it
                ahead = ahead_on = None
                copy.pushed = None
            offset = plog.end
            hold = self.hold_ms if HOLD_CAPABILITY in link.capabilities else 0
            try:
                if ahead is None:
                    if checked is not link:  # once per connection: does the master reach us?
                        copy.asked_time = time.monotonic()  # (watched as a get is)
                        ans = await link.request(lambda o, t=topic, p=p, off=offset:
                                                 encode_offset(t, self.group, p, off, o))
                        copy.asked_time = None
                        # a Java master answers the start of a position's segment, not of
                        # its message: only an exact (+boundary) answer can be checked
                        if (type(ans) is Result and ans.code == 200
                                and BOUNDARY_CAPABILITY in link.capabilities
                                and not self._check_master_end(copy, ans.body, offset)):
                            return
                        checked = link
                        # a new connection: the records of everything held (a copy cut
                        # short before its records came gets them now)
                        if self.apply_records is not None \
                                and IDEMPOTENT_CAPABILITY in link.capabilities \
                                and await self._apply_records(copy, link.request(
                                    lambda o, t=topic, p=p, off=plog.min_offset:
                                    encode_producers(t, p, off, o))):
                            copy.records_to = offset
                    ahead, ahead_on = self._get(link, copy, offset, hold), link
                reply, ahead = await ahead, None
                copy.asked_time = None
                offset = copy.asked_at  # (the fast path may have copied and asked on)
            except BrokerUnavailableError:
                copy.asked_time = None
                ahead = ahead_on = None
                copy.pushed = None
                if self._link is link:  # the connector reconnects; wait for it
                    self._link = None
                    self._linked.clear()
                await asyncio.sleep(0)
                continue
            pushed, copy.pushed = copy.pushed, None
            if pushed is not None:  # its records, if any, came before the reply
                pushed[0].forget(pushed[1])
            if reply is _APPEND_FAILED:  # the fast path's append failed (state says why)
                if copy.state == "diverged":
                    return
                await asyncio.sleep(self.retry_delay)
                continue
            if type(reply) is Value or reply.code != 301:
                copy.below_since = None
            if type(reply) is Value:
                if not await self._append(copy, reply.body, offset):
                    if copy.state == "diverged":
                        return
                    await asyncio.sleep(self.retry_delay)
                elif pushed is not None:
                    # the records of what we copied came right before it (``+records``):
                    # the next get goes first, then they are stored
                    upto = plog.end
                    ahead, ahead_on = self._get(link, copy, upto, hold), link
                    ahead.add_done_callback(_retrieved)
                    if self._pushed_records(copy, pushed[2]):
                        copy.records_to = upto
                elif self.apply_records is not None \
                        and IDEMPOTENT_CAPABILITY in link.capabilities:
                    # the idempotent producers' records of what we just copied (a master
                    # stores a run's record before its messages, so every run ending in
                    # what we copied is in the answer), asked BEFORE the next get, which
                    # tells the master we hold the copy: it is answered first, in order
                    records = link.request(lambda o, t=topic, p=p, off=offset:
                                           encode_producers(t, p, off, o))
                    upto = plog.end
                    ahead, ahead_on = self._get(link, copy, upto, hold), link
                    ahead.add_done_callback(_retrieved)
                    if await self._apply_records(copy, records):
                        copy.records_to = upto
                continue
            code, body = reply.code, reply.body.decode("utf-8", "replace")
            if code == 404 and "not found" not in body:  # nothing new
                copy.state = "caught-up"
                copy.caught_up_at = time.monotonic()
                if not hold:
                    await asyncio.sleep(self.poll_delay)
            elif code == 301:
                if not self._moved(copy, body, offset, BOUNDARY_CAPABILITY in link.capabilities):
                    return
                if copy.below_since is not None:  # not flushed yet: ask again soon
                    await asyncio.sleep(self.poll_delay)
            else:  # unknown to the master yet, closed partition, ...
                copy.problem = f"master answered {code}: {body}"
                await asyncio.sleep(self.retry_delay)

    def _get(self, link: _MasterLink, copy: PartitionCopy, offset: int,
             hold: int, fut: asyncio.Future | None = None) -> asyncio.Future:
        """Ask for ``copy`` from ``offset`` (the reply resolves ``fut``, or a new future).

        A ``value`` reply is copied right where it is read, when it can be (the fast
        path, :meth:`_copied_now`): appended, and the next get sent, in the same call,
        the future left waiting; anything else resolves it for the copy task."""
        copy.asked_at = offset
        copy.asked_time = time.monotonic()
        head = copy.get_head
        if head is None:
            plog = copy.plog
            head = copy.get_head = encode_get_head(plog.topic, self.group, plog.partition)
        if self.group_commit:
            fast = None
        else:
            made = copy.fast
            if made is None or made[0] is not link or made[1] != hold:
                made = copy.fast = (link, hold, functools.partial(self._copied_now, copy, link,
                                                                  hold))
            fast = made[2]
        opaque = link.next_opaque()
        if self.apply_records is not None and IDEMPOTENT_CAPABILITY in link.capabilities:
            if RECORDS_CAPABILITY not in link.capabilities:  # ``producers`` asked after
                fast = None                                   # each chunk: the task's
            else:
                records, rfut = link.expect()
                copy.pushed = (link, records, rfut)
                return link.send(opaque, head + b"%d %d %d hold=%d records=%d\r\n" % (
                    offset, copy.max_size, opaque, max(hold, 0), records), fut, fast)
        if hold > 0:
            return link.send(opaque, head + b"%d %d %d hold=%d\r\n" % (
                offset, copy.max_size, opaque, hold), fut, fast)
        return link.send(opaque, head + b"%d %d %d\r\n" % (offset, copy.max_size, opaque),
                         fut, fast)

    def expecting(self) -> bool:
        """Whether a lone put's copy came a moment ago (:data:`LONE_WINDOW`): one at a
        time, a synchronous ``send`` after another, the next is on its way, and the
        event loop polls for it before it sleeps (``_spin``)."""
        return time.monotonic() - self.lone_at < LONE_WINDOW

    def _copied_now(self, copy: PartitionCopy, link: _MasterLink, hold: int, reply: object,
                    fut: asyncio.Future) -> bool:
        """(In the link's ``data_received``) copy a ``value`` reply and ask on at once,
        as the copy task would, without waking it: the master learns that this slave
        holds it (the next get) in the same turn of the loop as the bytes arrived, which
        is what a synchronous put waits for.  False: the task takes ``reply``."""
        if type(reply) is not Value or self._stopped or self._link is not link:
            return False
        pushed, copy.pushed = copy.pushed, None
        if pushed is not None:  # its records, if any, came before the reply
            link.forget(pushed[1])
        copy.below_since = None
        before = copy.copied_messages
        if not self._append_now(copy, reply.body, copy.asked_at):
            fut.set_result(_APPEND_FAILED)
            return True
        if copy.copied_messages - before == 1:  # a lone put's: another may follow soon
            self.lone_at = time.monotonic()
        upto = copy.plog.end
        try:
            self._get(link, copy, upto, hold, fut)
        except BrokerUnavailableError as e:  # closed meanwhile: the task reconnects
            fut.set_exception(e)
            return True
        if pushed is not None and self._pushed_records(copy, pushed[2]):
            copy.records_to = upto
        return True

    def _pushed_records(self, copy: PartitionCopy, fut: _Expected) -> bool:
        """Store the records a ``+records`` master sent before the value just copied
        (not done: it had none for it); False when they are damaged or not stored."""
        if not fut.done() or fut.cancelled() or fut.exception() is not None:
            return True
        return self._store_records(copy, fut.result())

    async def _apply_records(self, copy: PartitionCopy, records: asyncio.Future) -> bool:
        """Store the master's producer records whose messages this log now holds (a
        promoted slave then still answers a resent idempotent put with its first place);
        False when they did not come."""
        copy.applying = True
        try:
            reply = await records
        except BrokerUnavailableError:
            return False  # asked again on the next connection
        finally:
            copy.applying = False
        return self._store_records(copy, reply)

    def _store_records(self, copy: PartitionCopy, reply: object) -> bool:
        """Store the producer records of a ``producers`` answer; False when it is not
        one, or they are damaged or not stored."""
        plog = copy.plog
        if type(reply) is not Result or reply.code != 200:
            return False
        found, used = decode_producer_records(reply.body)
        if used != len(reply.body):
            log.error("replica %d: %s-%d: the master's producer records are damaged after "
                      "%d bytes; the rest is asked for again", self.replica, plog.topic,
                      plog.partition, used)
        if found:
            try:
                self.stats["replication_producer_records"] += self.apply_records(
                    plog.topic, plog.partition, found)
            except StorageError as e:
                log.error("replica %d: %s-%d: storing producer records failed: %s",
                          self.replica, plog.topic, plog.partition, e)
                return False
        return used == len(reply.body)

    async def _append(self, copy: PartitionCopy, data: bytes, offset: int) -> bool:
        if not self._append_now(copy, data, offset):
            return False
        if self.group_commit and copy.state == "copying":
            try:
                await copy.plog.request_flush()
            except StorageError as e:
                copy.state, copy.problem = "stopped", str(e)
                return False
        return True

    def _append_now(self, copy: PartitionCopy, data: bytes, offset: int) -> bool:
        """Append a reply's whole messages (no fsync); False when they were not
        (``copy.state`` says why: diverged, stopped)."""
        plog = copy.plog
        try:
            n, count = plog.append_copy(data, offset)
        except ReplicaDivergedError as e:
            self._diverged(copy, str(e))
            return False
        except StorageError as e:
            copy.state, copy.problem = "stopped", str(e)
            self.stats["replication_write_failed"] += 1
            log.error("replica %d: copying %s-%d stopped at offset %d: %s; retrying in %gs",
                      self.replica, plog.topic, plog.partition, offset, e, self.retry_delay)
            return False
        if n == 0:  # one message bigger than the reply: ask for all of it
            if len(data) >= HEADER_SIZE:
                need = HEADER_SIZE + int.from_bytes(data[:4], "big", signed=True)
                copy.max_size = max(copy.max_size, need)
            return True
        copy.max_size = self.max_size
        copy.state, copy.problem = "copying", None
        copy.copied_bytes += n
        copy.copied_messages += count
        self.stats["replication_copied_bytes"] += n
        self.stats["replication_copied_messages"] += count
        return True

    def _check_master_end(self, copy: PartitionCopy, body: bytes, offset: int) -> bool:
        try:
            master_end = int(body)
        except ValueError:
            return True
        if master_end < offset:
            plog = copy.plog
            self._diverged(copy, f"{plog.topic}-{plog.partition}: the master's log ends at "
                                 f"{master_end}, below this slave's end {offset} (the master's "
                                 f"log was cut, or it is not the log this slave copied)")
            return False
        return True

    def _moved(self, copy: PartitionCopy, body: str, offset: int, exact: bool) -> bool:
        plog = copy.plog
        try:
            to = int(body)
        except ValueError:
            self._diverged(copy, f"{plog.topic}-{plog.partition}: master answered 301 with "
                                 f"{body!r} at offset {offset}")
            return False
        if to > offset:  # the master no longer has what we would copy next (retention)
            log.warning("replica %d: %s-%d: the master's log now starts at %d, above this "
                        "slave's end %d; the copy restarts there", self.replica, plog.topic,
                        plog.partition, to, offset)
            self.stats["replication_resets"] += 1
            plog.reset(to)
            return True
        if not exact:  # a Java master's max offset is what it flushed: wait for the flush
            now = time.monotonic()
            if copy.below_since is None:
                copy.below_since = now
            if now - copy.below_since < self.flush_grace:
                copy.problem = (f"the master's max offset {to} is below this slave's end "
                                f"{offset}: waiting for the master to flush")
                return True
        self._diverged(copy, f"{plog.topic}-{plog.partition}: the master's log ends at {to}, "
                             f"below this slave's end {offset}")
        return False

    def _diverged(self, copy: PartitionCopy, why: str) -> None:
        copy.state, copy.problem = "diverged", why
        self.stats["replication_diverged"] += 1
        log.error("replica %d: not copying %s-%d any more: %s", self.replica,
                  copy.plog.topic, copy.plog.partition, why)

    # -- reporting -------------------------------------------------------------------------
    def status(self) -> list[dict]:
        now = time.monotonic()
        out = []
        for (topic, p), c in sorted(self.copies.items()):
            lag = c.lag_seconds(now)
            out.append({"topic": topic, "partition": p, "state": c.state,
                        "end": c.plog.end, "copied_bytes": c.copied_bytes,
                        "lag_seconds": None if lag is None else round(lag, 3),
                        "problem": c.problem})
        return out



#: After a lone put's copy, the slave's loop polls for the next put this long (seconds).
LONE_WINDOW = 0.001

#: what the fast path resolves a get's future with when its append failed
_APPEND_FAILED = object()


class _Expected:
    """Holds a reply that may come or not (:meth:`_MasterLink.expect`): as much of a
    future as the link's reading and :meth:`Follower._pushed_records` use, without
    one of the event loop's futures per get (a synchronous slave asks one per put)."""

    __slots__ = ("_done", "_result", "_error")

    def __init__(self) -> None:
        self._done = False
        self._result: object = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def set_result(self, result: object) -> None:
        self._done, self._result = True, result

    def set_exception(self, error: BaseException) -> None:
        self._done, self._error = True, error

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> object:
        if self._error is not None:
            raise self._error
        return self._result


def _retrieved(fut: asyncio.Future) -> None:
    """A request sent ahead whose failure may go unread (the loop stopped)."""
    if not fut.cancelled():
        fut.exception()
