"""Asking the brokers (only when told to: ``group NAME --brokers``): each partition's
log end, and the lag of a group in bytes and in seconds.

The rest of the inspector reads ZooKeeper alone.  This module opens one TCP
connection to each broker the group's partitions live on and speaks two requests
of Metaq 1.4's text protocol (reference section 6), nothing else (it needs no
``metaq`` import, so the inspector stays usable where only ``zk_layout`` is)::

    offset <topic> <group> <part> <2**62> <opaque>   ->  the log end
    get <topic> <group> <part> <committed> 64 <opaque> -> the header of the next
                                                          message: its msgId time

Lag in bytes is ``log end - committed offset``; lag in seconds is the age of the
oldest unconsumed message (``now - its msgId time``), 0 when caught up, as
``metaq group describe`` reports it.  A partition with no committed offset
starts where its group's consumers are configured to (unknown here): no lag.
A broker that does not answer, or answers an error, gives that partition an
``error`` naming it; the others are unaffected.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass

from zk_layout._codecs import MSG_ID_EPOCH_MS, BrokerUri

__all__ = ["PartitionLag", "probe_partitions"]

_END = 1 << 62
_ID = struct.Struct(">q")
_MAX_REPLY = 1 << 20


@dataclass(frozen=True, kw_only=True)
class PartitionLag:
    """What a partition's broker said: ``log_end``, ``lag_bytes`` and ``lag_seconds``
    (None when not known), or ``error``."""

    log_end: int | None = None
    lag_bytes: int | None = None
    lag_seconds: float | None = None
    error: str | None = None


class _Conn:
    def __init__(self, uri: BrokerUri, timeout: float) -> None:
        self.where = f"{uri.host}:{uri.port}"
        self.sock = socket.create_connection((uri.host, uri.port), timeout=timeout)
        self.buf = b""
        self.opaque = 0

    def close(self) -> None:
        self.sock.close()

    def request(self, line: str) -> tuple[int, bytes]:
        """``(code, body)``: 200 for a ``value`` reply."""
        self.opaque += 1
        self.sock.sendall(f"{line} {self.opaque}\r\n".encode())
        while b"\r\n" not in self.buf:
            self._more()
        head, self.buf = self.buf.split(b"\r\n", 1)
        parts = head.split()
        try:
            if parts[0] == b"value" and len(parts) == 3:
                code, length = 200, int(parts[1])
            elif parts[0] == b"result" and len(parts) == 4:
                code, length = int(parts[1]), int(parts[2])
            else:
                raise ValueError
        except (ValueError, IndexError):
            raise OSError(f"{self.where} answered {head[:80]!r}, not a Metaq reply") from None
        if not 0 <= length <= _MAX_REPLY:
            raise OSError(f"{self.where} announced a reply of {length} bytes")
        while len(self.buf) < length:
            self._more()
        body, self.buf = self.buf[:length], self.buf[length:]
        return code, body

    def _more(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise OSError(f"{self.where} closed the connection")
        self.buf += data


def _one(conn: _Conn, topic: str, group: str, index: int, committed: int | None,
         now_ms: int) -> PartitionLag:
    code, body = conn.request(f"offset {topic} {group} {index} {_END}")
    if code != 200:
        return PartitionLag(error=f"offset: {code} {body[:100].decode('utf-8', 'replace')}")
    try:
        end = int(body)
    except ValueError:
        return PartitionLag(error=f"offset: not a number: {body[:40]!r}")
    if committed is None:
        return PartitionLag(log_end=end)
    if committed >= end:
        return PartitionLag(log_end=end, lag_bytes=end - committed, lag_seconds=0.0)
    code, body = conn.request(f"get {topic} {group} {index} {committed} 64")
    seconds = None
    if code == 200 and len(body) >= 16:
        sent = (_ID.unpack_from(body, 8)[0] >> 22) + MSG_ID_EPOCH_MS
        seconds = max(0.0, (now_ms - sent) / 1000)
    return PartitionLag(log_end=end, lag_bytes=end - committed, lag_seconds=seconds)


def probe_partitions(wanted: Iterable[tuple[str, int, BrokerUri | None, int | None]], *,
                     group: str, timeout: float, now_ms: int | None = None
                     ) -> list[PartitionLag]:
    """For each ``(topic, index, broker address or None, committed offset or None)``
    its :class:`PartitionLag`, in order; one connection per broker."""
    now = int(time.time() * 1000) if now_ms is None else now_ms
    conns: dict[BrokerUri, _Conn | str] = {}
    out = []
    try:
        for topic, index, uri, committed in wanted:
            if uri is None:
                out.append(PartitionLag(error="its broker is not registered"))
                continue
            conn = conns.get(uri)
            if conn is None:
                try:
                    conn = conns[uri] = _Conn(uri, timeout)
                except OSError as e:
                    conn = conns[uri] = f"cannot connect to {uri.host}:{uri.port}: {e}"
            if isinstance(conn, str):
                out.append(PartitionLag(error=conn))
                continue
            try:
                out.append(_one(conn, topic, group, index, committed, now))
            except OSError as e:
                conn.close()
                conns[uri] = f"{conn.where}: {e}"
                out.append(PartitionLag(error=conns[uri]))
    finally:
        for c in conns.values():
            if not isinstance(c, str):
                c.close()
    return out
