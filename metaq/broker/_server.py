"""The broker's asyncio TCP server: Metaq's text protocol (reference section 6).

One :class:`_Connection` (an ``asyncio.Protocol``) per client.  Each read is
parsed in one go; runs of pipelined puts are checked, appended with one write
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
import socket
import time
import zlib
from collections.abc import Callable

from metaq import __version__
from metaq._errors import ProtocolError, StorageError
from metaq._message import HEADER, MsgIdGenerator
from metaq._protocol import (
    BadRequest,
    GetRequest,
    OffsetRequest,
    PutRequest,
    QuitRequest,
    RequestParser,
    StatsRequest,
    VersionRequest,
    check_topic,
    encode_result,
    encode_value_header,
)
from metaq.broker._config import BrokerConfig
from metaq.broker._storage import LogSlice, PartitionLog, Storage

__all__ = ["BrokerServer", "VERSION"]

log = logging.getLogger(__name__)

#: Answer to ``version``: the Metaq release we speak, then ours.
VERSION = f"1.4.6 metaq-py/{__version__}"
#: ``get`` replies at least this big go out with sendfile; smaller ones are copied.
SENDFILE_MIN = 64 * 1024

_MASK = 0x7FFFFFFF
_CLOSE = object()
_crc32 = zlib.crc32
_pack = HEADER.pack


def _result(code: int, text: str, opaque: int | None) -> bytes:
    return encode_result(code, text.encode("utf-8", "replace"), 0 if opaque is None else opaque)


class _Gate:
    """Replies that may leave only once ``fut`` is done (group commit)."""

    __slots__ = ("fut", "data", "opaques")

    def __init__(self, fut: asyncio.Future, data: bytes, opaques: list[int]) -> None:
        self.fut = fut
        self.data = data
        self.opaques = opaques

    def render(self) -> bytes:
        if self.fut.cancelled() or self.fut.exception() is not None:
            err = "cancelled" if self.fut.cancelled() else str(self.fut.exception())
            return b"".join(_result(500, f"message written but not synced: {err}", o)
                            for o in self.opaques)
        res = self.fut.result()
        return res if type(res) is bytes else self.data


class _File:
    __slots__ = ("header", "slice", "plog")

    def __init__(self, header: bytes, s: LogSlice, plog: PartitionLog) -> None:
        self.header = header
        self.slice = s
        self.plog = plog


class BrokerServer:
    """Serves one :class:`Storage` over TCP."""

    def __init__(self, config: BrokerConfig, storage: Storage, ids: MsgIdGenerator, *,
                 on_topic_added: Callable[[str, int], None] | None = None) -> None:
        self.config = config
        self.storage = storage
        self.ids = ids
        self.on_topic_added = on_topic_added
        self.connections: set[_Connection] = set()
        self.started = time.time()
        self.stats = collections.Counter()
        self._rr: dict[str, int] = {}
        #: b"<topic> <partition>" -> (log, partition bytes); b"<topic> -1" -> (None, topic)
        self.fast_keys: dict[bytes, tuple] = {}
        self._index_topics()
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self) -> int:
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Connection(self), self.config.host, self.config.port,
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
    def handle(self, conn: _Connection, reqs: list) -> None:
        i = 0
        n = len(reqs)
        while i < n:
            r = reqs[i]
            t = type(r)
            if t is tuple:  # fast put (see RequestParser.fast_puts)
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
                conn.send(_result(400, str(r.error), r.opaque))
                if r.fatal:
                    log.info("closing connection from %s: %s", conn.peer, r.error)
                    conn.close_after_replies()
                    return
                log.debug("bad request from %s: %s", conn.peer, r.error)
            elif t is OffsetRequest:
                self._offset(conn, r)
            elif t is VersionRequest:
                conn.send(encode_result(200, VERSION.encode(), r.opaque))
            elif t is StatsRequest:
                self.stats["cmd_stats"] += 1
                conn.send(encode_result(200, self.stats_text(r.item).encode(), r.opaque))
            elif t is QuitRequest:
                conn.close_after_replies()
                return

    def _puts(self, conn: _Connection, puts: list) -> None:
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
                    replies[k] = _result(400, f"bad partition {partition}", opaque)
                    continue
                partition = self._pick_partition(topic)
                if partition is None:
                    replies[k] = _result(404, f"topic {topic} not found", opaque)
                    continue
            plog = storage.get(topic, partition)
            if plog is None:
                if topic not in storage.topics and self._auto_create(topic):
                    plog = storage.get(topic, partition)
                if plog is None:
                    replies[k] = _result(404, f"topic {topic} partition {partition} not found",
                                         opaque)
                    continue
            if _crc32(payload) & _MASK != check:
                replies[k] = _result(400, "checksum mismatch", opaque)
                continue
            if plog.closed:
                replies[k] = _result(403, f"partition {topic}-{partition} is closed", opaque)
                continue
            if length > max_size:
                replies[k] = _result(400, f"message of {length} bytes is over the limit "
                                          f"{max_size}", opaque)
                continue
            if tx_key is not None:
                replies[k] = _result(400, "transactions are not supported", opaque)
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
                replies[k] = _result(500, f"write failed: {failed}", opaque)
                continue
            body = b"%d %d %d" % (msg_id, partition, start + rel)
            replies[k] = b"result 200 %d %d\r\n%b" % (len(body), opaque, body)
        self.stats["put_failed"] += n - len(todo)
        data = b"".join(replies)
        if self.config.unflush_threshold == 0 and groups:
            futs = [plog.request_flush() for plog in groups]
            fut = futs[0] if len(futs) == 1 else asyncio.gather(*futs)
            conn.send_gated(_Gate(fut, data, [puts[k][6] for k in range(n)]))
        else:
            conn.send(data)

    def _fast_puts(self, conn: _Connection, puts: list) -> None:
        """The hot path: valid puts to known partitions, as tuples from the parser."""
        n = len(puts)
        self.stats["cmd_put"] += n
        ids = self.ids.next_ids(n)
        id_len = len(b"%d" % ids[0])
        if len(b"%d" % ids[-1]) != id_len:
            id_len = 0  # digits change inside this batch: count per message
        replies: list[bytes] = []
        add_reply = replies.append
        groups: dict[PartitionLog, list] = {}
        plog = None            # current group, kept in locals
        parts: list = []
        add = parts.append
        idxs: list[int] = []
        base = size = 0
        pbytes = b""
        off_len = next_pow = 0
        bad = 0
        for k in range(n):
            target, length, flag, check, opaque, payload = puts[k]
            if _crc32(payload) & _MASK != check:
                add_reply(b"result 400 17 %b\r\nchecksum mismatch" % opaque)
                bad += 1
                continue
            t_log = target[0]
            if t_log is None:  # partition -1: the broker picks
                p = self._pick_partition(target[1])
                t_log = self.storage.get(target[1], p) if p is not None else None
                if t_log is None:
                    add_reply(_result(404, f"topic {target[1]} not found", int(opaque)))
                    bad += 1
                    continue
            if t_log is not plog:
                if plog is not None:
                    groups[plog] = [parts, base, size, idxs, pbytes, off_len, next_pow]
                g = groups.get(t_log)
                if g is None:
                    g = [[], t_log.end, 0, [], b"%d" % t_log.partition, 0, 0]
                parts, base, size, idxs, pbytes, off_len, next_pow = g
                add = parts.append
                plog = t_log
            if plog.closed:
                add_reply(_result(403, f"partition {plog.topic}-{plog.partition} is closed",
                                  int(opaque)))
                bad += 1
                continue
            msg_id = ids[k]
            add(_pack(length, check, msg_id, flag))
            add(payload)
            off = base + size
            size += 20 + length
            if off >= next_pow:
                off_len = len(b"%d" % off)
                next_pow = 10 ** off_len
            idxs.append(len(replies))
            add_reply(b"result 200 %d %b\r\n%d %b %d" % (
                (id_len or len(b"%d" % msg_id)) + off_len + len(pbytes) + 2, opaque,
                msg_id, pbytes, off))
        if plog is not None:
            groups[plog] = [parts, base, size, idxs, pbytes, off_len, next_pow]
        for glog, g in groups.items():
            if not g[0]:
                continue
            try:
                start = glog.append(b"".join(g[0]), len(g[0]) >> 1)
                if start != g[1]:  # cannot happen: offsets are only assigned here
                    raise StorageError(f"append to {glog.dir} landed at {start}, "
                                       f"expected {g[1]}")
            except StorageError as e:
                log.error("put failed: %s", e)
                for i in g[3]:
                    opaque = replies[i].split(b"\r\n", 1)[0].rsplit(b" ", 1)[1]
                    replies[i] = _result(500, f"write failed: {e}", int(opaque))
                    bad += 1
        self.stats["put_failed"] += bad
        data = b"".join(replies)
        if self.config.unflush_threshold == 0 and groups:
            futs = [glog.request_flush() for glog, g in groups.items() if g[0]]
            if futs:
                fut = futs[0] if len(futs) == 1 else asyncio.gather(*futs)
                conn.send_gated(_Gate(fut, data, [int(p[4]) for p in puts]))
                return
        conn.send(data)

    def _get(self, conn: _Connection, r: GetRequest) -> None:
        self.stats["cmd_get"] += 1
        topic, _group, partition, offset, max_size, opaque = r
        if max_size <= 0:
            conn.send(_result(400, f"bad maxSize {max_size}", opaque))
            return
        plog = self.storage.get(topic, partition)
        if plog is None:
            self.stats["get_miss"] += 1
            conn.send(_result(404, f"topic {topic} partition {partition} not found", opaque))
            return
        if plog.closed:
            conn.send(_result(403, f"partition {topic}-{partition} is closed", opaque))
            return
        if offset < plog.min_offset:
            conn.send(_result(301, str(plog.min_offset), opaque))
            return
        end = plog.end
        if offset > end and self.config.correct_offsets:
            conn.send(_result(301, str(end), opaque))
            return
        s = plog.read(offset, min(max_size, self.config.max_transfer_size))
        if s is None:
            self.stats["get_miss"] += 1
            conn.send(_result(404, f"no message at offset {offset} (end {end})", opaque))
            return
        header = encode_value_header(s.length, opaque)
        self.stats["get_bytes"] += s.length
        if s.length < SENDFILE_MIN:
            conn.send(header + s.segment.pread(offset, s.length))
        else:
            conn.send_file(_File(header, s, plog))

    def _offset(self, conn: _Connection, r: OffsetRequest) -> None:
        self.stats["cmd_offset"] += 1
        plog = self.storage.get(r.topic, r.partition)
        if plog is None:
            conn.send(_result(404, f"topic {r.topic} partition {r.partition} not found",
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
                out.set_result(_result(500, f"cannot find a valid offset: {f.exception()}",
                                       r.opaque))
            else:
                out.set_result(encode_result(200, b"%d" % f.result(), r.opaque))

        fut.add_done_callback(done)
        conn.send_gated(_Gate(out, b"", []))

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
                f"topics {len(self.storage.topics)}",
                f"partitions {len(logs)}",
                f"messages_appended {sum(p.messages_appended for p in logs)}",
                f"flush_errors {self.storage.flush_errors}",
            ]
            for key in ("cmd_put", "put_failed", "cmd_get", "get_miss", "get_bytes",
                        "get_sendfile", "get_sendfile_fallback", "cmd_offset", "cmd_stats",
                        "bad_requests", "connections_total"):
                lines.append(f"{key} {self.stats[key]}")
        elif item == "topics":
            for topic, n in sorted(self.storage.topics.items()):
                lines.append(f"{topic} partitions {n}")
        elif item == "offsets":
            for plog in sorted(self.storage.logs(), key=lambda p: (p.topic, p.partition)):
                lines.append(f"{plog.topic} part {plog.partition} min_offset {plog.min_offset} "
                             f"max_offset {plog.end} closed {str(plog.closed).lower()}")
        elif item == "config":
            for key, value in sorted(vars(self.config).items()):
                lines.append(f"{key} {dict(value) if key == 'topics' else value}")
        else:
            lines.append(f"unknown stats item {item} (items: topics, offsets, config)")
        return "".join(f"STAT {line}\r\n" for line in lines)


class _Connection(asyncio.Protocol):
    """One client: parse, hand to the server, send replies in order."""

    def __init__(self, server: BrokerServer) -> None:
        self.server = server
        cfg = server.config
        self.parser = RequestParser(max_line=cfg.max_line, max_payload=cfg.max_message_size,
                                    fast_puts=server.fast_keys)
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self._outq: collections.deque = collections.deque()
        self._busy = False            # a sendfile is running
        self._closing = False
        self._quit = False            # no more requests are read (quit, fatal error, EOF)
        self._write_paused = False
        self._read_paused = False

    # -- asyncio callbacks -----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        transport.set_write_buffer_limits(high=4 * 1024 * 1024)  # type: ignore[attr-defined]
        srv = self.server
        srv.stats["connections_total"] += 1
        if len(srv.connections) >= srv.config.max_connections:
            log.warning("refusing connection from %s: %d connections open", self.peer,
                        len(srv.connections))
            transport.close()
            return
        srv.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self._closing or self._quit:
            return
        try:
            reqs = self.parser.feed_lenient(data)
        except ProtocolError as e:  # stream broken earlier; nothing more to parse
            self.abort(str(e))
            return
        if reqs:
            try:
                self.server.handle(self, reqs)
            except Exception:
                log.exception("internal error serving %s; closing its connection", self.peer)
                self.send(_result(500, "internal broker error", 0))
                self.close_after_replies()
        self._check_backpressure()

    def eof_received(self) -> bool:
        self.close_after_replies()
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self.server.connections.discard(self)
        for item in self._outq:
            if type(item) is _File:
                item.plog.unpin(item.slice)
        self._outq.clear()

    def pause_writing(self) -> None:
        self._write_paused = True
        self._check_backpressure()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._check_backpressure()

    # -- output ----------------------------------------------------------------------------
    def _check_backpressure(self) -> None:
        t = self.transport
        if t is None or self._closing:
            return
        cfg = self.server.config
        over = (self._write_paused or len(self._outq) > cfg.max_inflight_requests
                or t.get_write_buffer_size() > cfg.max_pending_bytes)
        if over and not self._read_paused:
            self._read_paused = True
            t.pause_reading()
        elif not over and self._read_paused:
            self._read_paused = False
            t.resume_reading()

    def send(self, data: bytes) -> None:
        if self._outq or self._busy:
            self._outq.append(data)
        elif not self._closing:
            self.transport.write(data)

    def send_gated(self, gate: _Gate) -> None:
        self._outq.append(gate)
        gate.fut.add_done_callback(lambda _f: self._drain())

    def send_file(self, item: _File) -> None:
        item.plog.pin(item.slice)
        self._outq.append(item)
        if not self._busy:
            self._drain()

    def close_after_replies(self) -> None:
        if not self._closing and not self._quit:
            self._quit = True
            self._outq.append(_CLOSE)
            self._drain()

    def abort(self, why: str) -> None:
        if self.transport is not None and not self.transport.is_closing():
            log.debug("closing connection from %s: %s", self.peer, why)
            self.transport.close()
        self._closing = True

    def _drain(self) -> None:
        if self._busy or self._closing:
            return
        q = self._outq
        chunks = []
        while q:
            item = q[0]
            t = type(item)
            if t is bytes:
                chunks.append(item)
            elif t is _Gate:
                if not item.fut.done():
                    break
                chunks.append(item.render())
            elif item is _CLOSE:
                q.clear()
                if chunks:
                    self.transport.write(b"".join(chunks))
                self._closing = True
                self.transport.close()
                return
            else:  # _File
                q.popleft()
                if chunks:
                    self.transport.write(b"".join(chunks))
                    chunks = []
                self._busy = True
                asyncio.get_running_loop().create_task(self._sendfile(item))
                return
            q.popleft()
        if chunks:
            self.transport.write(b"".join(chunks))
        self._check_backpressure()

    async def _sendfile(self, item: _File) -> None:
        s = item.slice
        try:
            self.transport.write(item.header)
            try:
                await asyncio.get_running_loop().sendfile(
                    self.transport, s.file, s.position, s.length, fallback=False)
                self.server.stats["get_sendfile"] += 1
            except (asyncio.SendfileNotAvailableError, RuntimeError) as e:
                if self.transport.is_closing():
                    raise ConnectionResetError("connection closed during sendfile") from e
                self.server.stats["get_sendfile_fallback"] += 1
                self.transport.write(s.segment.pread(s.segment.start + s.position, s.length))
            if self._read_paused:
                self.transport.pause_reading()
        except (ConnectionError, OSError) as e:
            self.abort(f"sendfile failed: {e}")
        except Exception:
            log.exception("sendfile to %s failed", self.peer)
            self.abort("sendfile failed")
        finally:
            item.plog.unpin(s)
            self._busy = False
        self._drain()
