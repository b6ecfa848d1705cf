"""A raw Metaq protocol client for broker tests: send bytes, read parsed replies.

``RawClient(port)`` speaks to a broker over one socket with no client library in
between, so a test controls every byte (pipelining, idempotent marks, ``sync``
lines, garbage) and sees every reply as :class:`~metaq.protocol.Result` /
:class:`~metaq.protocol.Value`.
"""

from __future__ import annotations

import socket

from metaq.protocol import (
    ReplyParser,
    Value,
    build_payload,
    checksum,
    encode_get,
    encode_idem_mark,
    encode_put,
)

__all__ = ["RawClient"]


class RawClient:
    """One connection to a broker on localhost (see the module doc)."""

    def __init__(self, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.parser = ReplyParser(max_body=64 * 1024 * 1024)
        self.pending: list = []
        self.eof = False

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def replies(self, n: int) -> list:
        while len(self.pending) < n:
            data = self.sock.recv(1 << 20)
            if not data:
                self.eof = True
                raise ConnectionError(f"closed after {len(self.pending)} of {n} replies")
            self.pending += self.parser.feed(data)
        out, self.pending = self.pending[:n], self.pending[n:]
        return out

    def call(self, data: bytes):
        self.send(data)
        return self.replies(1)[0]

    def put(self, topic: str, partition: int, body: bytes, opaque: int = 1,
            attribute: str | None = None):
        payload, flag = build_payload(body, attribute)
        return self.call(encode_put(topic, partition, payload, flag, checksum(payload), opaque))

    def puts(self, topic: str, partition: int, bodies: list[bytes], *, pid: int | None = None,
             seq: int = 0, opaque: int = 1) -> list:
        """Put ``bodies`` in one write (after an idempotent mark when ``pid``); their
        replies."""
        data = [] if pid is None else [encode_idem_mark(pid, seq, len(bodies))]
        for k, body in enumerate(bodies):
            data.append(encode_put(topic, partition, body, 0, checksum(body), opaque + k))
        self.send(b"".join(data))
        return self.replies(len(bodies))

    def log(self, topic: str, partition: int) -> bytes:
        """The partition's whole log from offset 0, read with gets."""
        out, off = [], 0
        while True:
            r = self.call(encode_get(topic, "g", partition, off, 1 << 20, 1))
            if not isinstance(r, Value):
                assert r.code == 404, r
                return b"".join(out)
            out.append(r.body)
            off += len(r.body)

    def rest_until_closed(self) -> list:
        """Every remaining reply, until the broker closes the connection."""
        out = list(self.pending)
        self.pending = []
        while True:
            data = self.sock.recv(1 << 20)
            if not data:
                self.eof = True
                return out
            out += self.parser.feed(data)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
