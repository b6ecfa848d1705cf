"""A fake broker for client-side failure tests: a loopback TCP server that parses each
connection's requests and writes back what the test's ``answer(requests)`` returns.

``answer`` returns bytes to send, ``None`` to say nothing, or :data:`CLOSE` to close
the connection; with ``close_after`` every answer is followed by closing it.  Real
brokers serve every other test; this one plays the brokers no real one imitates
(silent, garbage, closing mid-request).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from metaq._types import BrokerAddress
from metaq.protocol import RequestParser

__all__ = ["CLOSE", "FakeBroker", "fake_brokers"]

#: an answer that closes the connection instead of replying
CLOSE = b"CLOSE"

Answer = Callable[[list], "bytes | None"]


class FakeBroker:
    """A TCP server on 127.0.0.1 answering with ``answer(parsed requests)``."""

    def __init__(self, answer: Answer, *, close_after: bool = False) -> None:
        self.answer = answer
        self.close_after = close_after
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.address = BrokerAddress("127.0.0.1", self.port)
        self.conns: list[socket.socket] = []
        self.received = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="test-fake-broker", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            parser = RequestParser()
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    break
                if not data:
                    break
                reqs = parser.feed(data)
                self.received += len(reqs)
                out = self.answer(reqs)
                if out is None:
                    continue
                if out == CLOSE:
                    conn.close()
                    break
                conn.sendall(out)
                if self.close_after:
                    conn.close()
                    break

    def close(self) -> None:
        self.stop.set()
        for s in (self.sock, *self.conns):  # shutdown wakes a thread blocked in accept/recv
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self.thread.join(5)


@contextmanager
def fake_brokers() -> Iterator[Callable[..., FakeBroker]]:
    """A factory of fake brokers, all closed on exit (for a fixture)."""
    made: list[FakeBroker] = []

    def make(answer: Answer, **kw: bool) -> FakeBroker:
        s = FakeBroker(answer, **kw)
        made.append(s)
        return s

    try:
        yield make
    finally:
        for s in made:
            s.close()
