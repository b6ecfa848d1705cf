"""A scripted stand-in for a Java Metaq 1.4 broker that records every command line it gets.

It registers itself in ZooKeeper as broker ``broker_id`` (the same nodes our broker
writes, through ``metaq.broker._registry``) and answers the commands a producer sends
the way Java's broker does (``TransactionProcessor`` and ``TransactionalCommandProcessor``
in metamorphosis-server), keeping no messages:

- ``put ... [txKey] opaque`` + body: ``result 200`` with ``<msgId> <partition> <offset>``
  (offset ``-1`` for a put inside a transaction, as Java answers: the message is in the
  transaction journal, not yet in the partition);
- ``transaction <key> <sessionId> <type> [timeout] [uniqueQualifier] <opaque>``: BEGIN,
  COMMIT_ONE_PHASE, COMMIT_TWO_PHASE, ROLLBACK and FORGET answer ``result 200`` with no
  body; END gets no answer at all; PREPARE answers ``result 200`` with body ``0``
  (XAResource.XA_OK); RECOVER answers the keys of the XA branches prepared here and not
  yet committed or rolled back whose unique qualifier matches, joined by ``\\r\\n``;
- ``version``: ``result 200`` with a version text (the client's heartbeat);
- anything else: ``result 500``.

:attr:`lines` holds ``(connection number, command line)`` for every command, put bodies
left out (their length is in the line).  Used by ``test_java_client.py`` to pin down the
exact wire lines the Java client sends for transactions.
"""

from __future__ import annotations

import itertools
import socketserver
import threading

from metaq.broker._registry import BrokerRegistry

__all__ = ["StubBroker"]


class _Handler(socketserver.StreamRequestHandler):
    server: _Server

    def handle(self) -> None:
        stub = self.server.stub
        conn_no = stub._next_conn()
        rfile = self.rfile
        while True:
            raw = rfile.readline()
            if not raw:
                return
            line = raw.rstrip(b"\r\n").decode("utf-8", "replace")
            parts = line.split(" ")
            body = b""
            if parts[0] == "put":
                body = rfile.read(int(parts[3]))
            stub._record(conn_no, line)
            reply = stub._answer(parts, body)
            if reply is not None:
                self.wfile.write(reply)
                self.wfile.flush()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    stub: StubBroker


class StubBroker:
    """See the module doc.  A context manager: serving and registered inside ``with``."""

    def __init__(self, zk_connect: str, topics: dict[str, int], broker_id: int = 0) -> None:
        self.topics = dict(topics)
        self.broker_id = broker_id
        self.lines: list[tuple[int, str]] = []
        self._lock = threading.Lock()
        self._conns = itertools.count(1)
        self._msg_ids = itertools.count(1000)
        self._offsets: dict[tuple[str, str], int] = {}
        self._prepared: dict[str, str] = {}   # XA key -> unique qualifier
        self._server = _Server(("127.0.0.1", 0), _Handler, bind_and_activate=True)
        self._server.stub = self
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True,
                                        name="java-stub-broker")
        self._registry = BrokerRegistry(zk_connect=zk_connect, zk_root="/meta",
                                        broker_id=broker_id, host="127.0.0.1", port=self.port,
                                        topics=lambda: dict(self.topics))

    def __enter__(self) -> StubBroker:
        self._thread.start()
        try:
            self._registry.start()
        except BaseException:
            self._server.shutdown()
            self._server.server_close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._registry.stop()
        self._server.shutdown()
        self._server.server_close()

    # -- what it saw -----------------------------------------------------------------------

    def commands(self, verb: str | None = None) -> list[str]:
        """The command lines received, in arrival order (only ``verb``'s if given)."""
        with self._lock:
            return [line for _, line in self.lines
                    if verb is None or line.split(" ", 1)[0] == verb]

    def _record(self, conn_no: int, line: str) -> None:
        with self._lock:
            self.lines.append((conn_no, line))

    def _next_conn(self) -> int:
        with self._lock:
            return next(self._conns)

    # -- answers ---------------------------------------------------------------------------

    @staticmethod
    def _result(code: int, opaque: str, body: str = "") -> bytes:
        data = body.encode()
        return b"result %d %d %s\r\n" % (code, len(data), opaque.encode()) + data

    def _answer(self, parts: list[str], body: bytes) -> bytes | None:
        verb, opaque = parts[0], parts[-1]
        if verb == "version":
            return self._result(200, opaque, "metaq-java-stub")
        if verb == "put":
            # put <topic> <partition> <len> <flag> <checksum> [txKey] <opaque>
            topic, partition = parts[1], parts[2]
            in_tx = len(parts) == 8
            with self._lock:
                msg_id = next(self._msg_ids)
                key = (topic, partition)
                offset = self._offsets.get(key, 0)
                self._offsets[key] = offset + 20 + len(body)
            return self._result(200, opaque, f"{msg_id} {partition} {-1 if in_tx else offset}")
        if verb == "transaction":
            # transaction <key> <sessionId> <type> [timeout] [uniqueQualifier] <opaque>
            key, kind, extra = parts[1], parts[3], parts[4:-1]
            qualifier = next((x for x in extra if not x.isdigit()), None)
            if kind == "END":
                return None
            if kind == "PREPARE":
                with self._lock:
                    self._prepared[key] = qualifier or ""
                return self._result(200, opaque, "0")
            if kind == "RECOVER":
                with self._lock:
                    keys = [k for k, q in self._prepared.items() if q == qualifier]
                return self._result(200, opaque, "\r\n".join(keys))
            if kind in ("COMMIT_TWO_PHASE", "COMMIT_ONE_PHASE", "ROLLBACK", "FORGET"):
                with self._lock:
                    self._prepared.pop(key, None)
                return self._result(200, opaque)
            if kind == "BEGIN":
                return self._result(200, opaque)
            return self._result(500, opaque, f"Unknow transaction command type:{kind}")
        return self._result(500, opaque, f"unknown command {verb}")

