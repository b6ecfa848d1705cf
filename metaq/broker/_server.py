"""The broker's asyncio TCP server: Metaq's text protocol (reference section 6).

One ``Connection`` (an ``asyncio.Protocol``, see ``_connection``) per client.
Each read is parsed in one go; runs of pipelined puts are checked, appended with one write
per partition and answered with one socket write.  Replies leave in request
order: with group commit a batch of put replies waits for its fsync, and a
``get`` of a large range goes out with ``sendfile``; replies queued behind
them wait.  Bad input gets a 400 naming what was wrong; when the stream cannot
be resynchronised (bad put length, endless line) the connection is closed
after that answer.  Nothing a client sends can stop the broker or stall other
connections.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from collections.abc import Callable

from metaq import __version__
from metaq._errors import ProtocolError, StorageError
from metaq.broker._config import BrokerConfig
from metaq.broker._connection import Connection, FileReply, Gate, result
from metaq.broker._hold import HOLD_CAPABILITY, HeldGets
from metaq.broker._putpath import (  # the put fast path and what the slow path shares
    _MASK,
    _crc32,
    _opaque_of_put,
    _pack,
    _target_of,
    put_group,
)
from metaq.broker._putpath import runs as group_runs
from metaq.broker._storage import PartitionLog, Storage
from metaq.protocol import (
    BadRequest,
    GetRequest,
    MsgIdGenerator,
    OffsetRequest,
    PutRequest,
    QuitRequest,
    StatsRequest,
    VersionRequest,
    check_topic,
    encode_result,
    encode_value_header,
)

__all__ = ["BrokerServer", "VERSION", "SMALL_CLIENT"]

#: An address holding fewer connections than this may use the connection reserve.
SMALL_CLIENT = 8

log = logging.getLogger(__name__)

#: Answer to ``version``: the Metaq release we speak, then ours; then the extensions a
#: broker offers are listed (``+hold``: held gets, see ``_hold``, unless max_hold is 0).
VERSION = f"1.4.6 metaq-py/{__version__}"

class BrokerServer:
    """Serves one :class:`Storage` over TCP."""

    def __init__(self, config: BrokerConfig, storage: Storage, ids: MsgIdGenerator, *,
                 on_topic_added: Callable[[str, int], None] | None = None,
                 status: Callable[[], list[str]] | None = None) -> None:
        self.config = config
        self.storage = storage
        self.ids = ids
        self.on_topic_added = on_topic_added
        self.status = status
        self.connections: set[Connection] = set()
        #: client address -> connections open from it
        self.per_address: collections.Counter = collections.Counter()
        self._refusals_logged: dict[str, float] = {}
        self.started = time.time()
        self.stats = collections.Counter()
        self.version_text = VERSION + (f" {HOLD_CAPABILITY}" if config.max_hold > 0 else "")
        self.held = HeldGets(self._get, max_hold=config.max_hold,
                             max_held=config.max_held_gets, stats=self.stats)
        self._rr: dict[str, int] = {}
        #: b"<topic> <partition>" -> (log, partition bytes); b"<topic> -1" -> (None, topic)
        self.fast_keys: dict[bytes, tuple] = {}
        self._index_topics()
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self) -> int:
        self._server = await asyncio.get_running_loop().create_server(
            lambda: Connection(self), self.config.host, self.config.port,
            reuse_address=True, backlog=1024)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.abort("broker shutting down")
        if self._server is not None:
            await self._server.wait_closed()

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
        now = time.monotonic()
        if now - self._refusals_logged.get(address, -60.0) >= 60.0:
            self._refusals_logged[address] = now
            if len(self._refusals_logged) > 10_000:
                self._refusals_logged.clear()
            log.warning("refusing connections from %s: %s", address, why)

    # -- topics ----------------------------------------------------------------------------
    def _index_topics(self) -> None:
        keys = self.fast_keys
        for plog in self.storage.logs():
            p = b"%d" % plog.partition
            keys[plog.topic.encode() + b" " + p] = (plog, p)
        for topic in self.storage.topics:
            keys[topic.encode() + b" -1"] = (None, topic)

    def add_topic(self, topic: str, partitions: int) -> None:
        check_topic(topic)
        before = self.storage.topics.get(topic, 0)
        self.storage.open_topic(topic, partitions)
        self._index_topics()
        if self.storage.topics[topic] != before and self.on_topic_added is not None:
            self.on_topic_added(topic, self.storage.topics[topic])

    def _auto_create(self, topic: str) -> bool:
        if not self.config.auto_create_topics or topic in self.storage.topics:
            return False
        try:
            self.add_topic(topic, self.config.num_partitions)
        except (StorageError, ProtocolError) as e:
            log.error("could not auto-create topic %r: %s", topic, e)
            return False
        log.info("auto-created topic %r with %d partitions", topic, self.config.num_partitions)
        return True

    def _pick_partition(self, topic: str) -> int | None:
        n = self.storage.topics.get(topic)
        if n is None:
            if not self._auto_create(topic):
                return None
            n = self.storage.topics[topic]
        start = self._rr.get(topic, 0)
        for k in range(n):
            p = (start + k) % n
            plog = self.storage.get(topic, p)
            if plog is not None and not plog.closed:
                self._rr[topic] = p + 1
                return p
        return start % n  # all closed: the put gets 403

    # -- requests --------------------------------------------------------------------------
    def handle(self, conn: Connection, reqs: list) -> None:
        i = 0
        n = len(reqs)
        while i < n:
            if conn.gone:  # the client went away: what it still asked is not served
                self.stats["requests_dropped"] += n - i
                return
            r = reqs[i]
            t = type(r)
            if t is tuple:  # fast put (see RequestParser.fast_puts)
                if not i and type(reqs[-1]) is tuple and (
                        n < 3 or list(map(type, reqs)).count(tuple) == n):
                    self._fast_puts(conn, reqs)  # the usual read: nothing but fast puts
                    return
                j = i + 1
                while j < n and type(reqs[j]) is tuple:
                    j += 1
                self._fast_puts(conn, reqs[i:j] if i or j < n else reqs)
                i = j
                continue
            if t is PutRequest:
                j = i + 1
                while j < n and type(reqs[j]) is PutRequest:
                    j += 1
                self._puts(conn, reqs[i:j] if i or j < n else reqs)
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
                conn.send(encode_result(200, self.version_text.encode(), r.opaque))
            elif t is StatsRequest:
                self.stats["cmd_stats"] += 1
                conn.send(encode_result(200, self.stats_text(r.item).encode(), r.opaque))
            elif t is QuitRequest:
                conn.close_after_replies()
                return

    def _puts(self, conn: Connection, puts: list) -> None:
        storage = self.storage
        max_size = self.config.max_message_size
        n = len(puts)
        self.stats["cmd_put"] += n
        replies: list = [None] * n
        ids = self.ids.next_ids(n)
        groups: dict[PartitionLog, list] = {}
        todo = []  # (index, group, relative offset, msgId, partition, opaque)
        for k in range(n):
            topic, partition, length, flag, check, tx_key, opaque, payload = puts[k]
            if partition < 0:
                if partition != -1:
                    replies[k] = result(400, f"bad partition {partition}", opaque)
                    continue
                partition = self._pick_partition(topic)
                if partition is None:
                    replies[k] = result(404, f"topic {topic} not found", opaque)
                    continue
            plog = storage.get(topic, partition)
            if plog is None:
                if topic not in storage.topics and self._auto_create(topic):
                    plog = storage.get(topic, partition)
                if plog is None:
                    replies[k] = result(404, f"topic {topic} partition {partition} not found",
                                         opaque)
                    continue
            if _crc32(payload) & _MASK != check:
                replies[k] = result(400, "checksum mismatch", opaque)
                continue
            if plog.closed:
                replies[k] = result(403, f"partition {topic}-{partition} is closed", opaque)
                continue
            if length > max_size:
                replies[k] = result(400, f"message of {length} bytes is over the limit "
                                          f"{max_size}", opaque)
                continue
            if tx_key is not None:
                replies[k] = result(400, "transactions are not supported", opaque)
                continue
            g = groups.get(plog)
            if g is None:
                g = groups[plog] = [[], 0, 0]  # parts, size, start
            parts = g[0]
            msg_id = ids[k]
            todo.append((k, g, g[1], msg_id, partition, opaque))
            parts.append(_pack(length, check, msg_id, flag))
            parts.append(payload)
            g[1] += 20 + length
        failed = None
        for plog, g in groups.items():
            try:
                g[2] = plog.append(b"".join(g[0]), len(g[0]) >> 1)
            except StorageError as e:
                log.error("put failed: %s", e)
                g[2] = None
                failed = str(e)
        for k, g, rel, msg_id, partition, opaque in todo:
            start = g[2]
            if start is None:
                replies[k] = result(500, f"write failed: {failed}", opaque)
                continue
            body = b"%d %d %d" % (msg_id, partition, start + rel)
            replies[k] = b"result 200 %d %d\r\n%b" % (len(body), opaque, body)
        self.stats["put_failed"] += n - len(todo)
        data = b"".join(replies)
        if self.config.unflush_threshold == 0 and groups:
            futs = [plog.request_flush() for plog in groups]
            fut = futs[0] if len(futs) == 1 else asyncio.gather(*futs)
            conn.send_gated(Gate(fut, data, [puts[k][6] for k in range(n)]))
        else:
            conn.send(data)

    def _fast_puts(self, conn: Connection, puts: list) -> None:
        """The hot path: valid puts to known partitions, as tuples from the parser.

        Puts are grouped by partition (one group when a client writes one
        partition, else buckets in request order); each group is checked,
        packed, written and answered with whole-list operations
        (:meth:`_put_group`), one write per group.
        """
        n = len(puts)
        self.stats["cmd_put"] += n
        ids = self.ids.next_ids(n)
        first = puts[0][0]
        bad = 0
        written = []
        targets = list(map(_target_of, puts))
        if first[0] is not None and targets.count(first) == n:
            replies, bad, wrote = self._put_group(first, puts, ids)
            if wrote:
                written.append(first[0])
        elif (runs := group_runs(targets)) is not None:  # a few runs (batches): one group each
            replies = []
            start = 0
            for target, count in runs:
                stop = start + count
                group, group_bad, wrote = self._put_group(target, puts[start:stop],
                                                          ids[start:stop])
                replies += group
                bad += group_bad
                if wrote and target[0] not in written:
                    written.append(target[0])
                start = stop
        else:
            replies = [None] * n
            buckets: dict[tuple, list[int]] = {}
            for k, t in enumerate(targets):
                if t[0] is None:  # partition -1: the broker picks
                    t = self._rr_target(t[1])
                    if t is None:
                        replies[k] = result(404, f"topic {puts[k][0][1]} not found",
                                            int(puts[k][4]))
                        bad += 1
                        continue
                b = buckets.get(t)
                if b is None:
                    buckets[t] = [k]
                else:
                    b.append(k)
            for target, idxs in buckets.items():
                group, group_bad, wrote = self._put_group(
                    target, [puts[k] for k in idxs], [ids[k] for k in idxs])
                for k, reply in zip(idxs, group, strict=True):
                    replies[k] = reply
                bad += group_bad
                if wrote:
                    written.append(target[0])
        self.stats["put_failed"] += bad
        data = b"".join(replies)
        if written and self.config.unflush_threshold == 0:
            futs = [plog.request_flush() for plog in written]
            fut = futs[0] if len(futs) == 1 else asyncio.gather(*futs)
            conn.send_gated(Gate(fut, data, list(map(int, map(_opaque_of_put, puts)))))
        else:
            conn.send(data)
    def _put_group(self, target: tuple, puts: list, ids: list[int]
                   ) -> tuple[list[bytes], int, bool]:
        return put_group(target, puts, ids)

    def _rr_target(self, topic: str) -> tuple | None:
        p = self._pick_partition(topic)
        if p is None:
            return None
        return self.fast_keys.get(b"%b %d" % (topic.encode(), p))

    def _get(self, conn: Connection, r: GetRequest) -> None:
        self.stats["cmd_get"] += 1
        topic, _group, partition, offset, max_size, opaque, hold_ms = r
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
        if max_size > cap:
            # One message bigger than maxTransferSize must still be readable (the producer
            # accepts up to 4 MiB): serve it whole when the client asked for that much.
            head = plog.read_bytes(offset, 4)
            if len(head) == 4:
                need = 20 + int.from_bytes(head, "big", signed=True)
                if cap < need <= max_size:
                    cap = need
        s = plog.read(offset, cap)
        if s is None:
            if hold_ms and plog.readable_end <= offset <= end and self.held.hold(conn, r, plog):
                return  # answered when a put lands (or at the end of the hold)
            self.stats["get_miss"] += 1
            conn.send(result(404, f"no message at offset {offset} (end {end})", opaque))
            return
        self.stats["get_bytes"] += s.length
        conn.send_file(FileReply(encode_value_header(s.length, opaque), s, plog))

    def _offset(self, conn: Connection, r: OffsetRequest) -> None:
        self.stats["cmd_offset"] += 1
        plog = self.storage.get(r.topic, r.partition)
        if plog is None:
            conn.send(result(404, f"topic {r.topic} partition {r.partition} not found",
                              r.opaque))
            return
        if r.offset <= plog.min_offset or r.offset >= plog.end:
            conn.send(encode_result(200, b"%d" % plog.nearest_valid_offset(r.offset), r.opaque))
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
                out.set_result(encode_result(200, b"%d" % f.result(), r.opaque))

        fut.add_done_callback(done)
        conn.send_gated(Gate(out, b"", []))

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
                f"held_gets {len(self.held)}",
                f"queued_replies {sum(c.queued for c in self.connections)}",
                f"unsent_reply_bytes {sum(c.unsent_bytes for c in self.connections)}",
                f"topics {len(self.storage.topics)}",
                f"partitions {len(logs)}",
                f"messages_appended {sum(p.messages_appended for p in logs)}",
                f"flush_errors {self.storage.flush_errors}",
            ]
            if self.status is not None:
                lines += self.status()
            for key in ("cmd_put", "put_failed", "cmd_get", "get_miss", "get_bytes",
                        "get_hold_asked", "get_held", "get_held_woken", "get_held_expired",
                        "get_hold_refused", "get_damaged",
                        "get_sendfile", "get_sendfile_fallback", "cmd_offset", "cmd_stats",
                        "bad_requests", "connections_total", "connections_refused",
                        "clients_vanished", "requests_dropped", "slow_closed", "idle_closed"):
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
