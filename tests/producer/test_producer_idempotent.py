"""The idempotent producer against real brokers: replies really lost (a TCP proxy drops
the broker's answers while it stores the puts, then the broker is SIGKILLed in the
middle of the traffic and restarted on the same data), every send completes, the log
holds each message exactly once where its result says; plain puts to a broker
without the extension; a message refused for good does not stall the later ones."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

import pytest
from helpers.procs import BrokerProc, read_partition

from metaq import BrokerError, Producer
from metaq.net import BrokerConnection, PipelinedConnection
from metaq.producer import _connections
from metaq.testing import wait_until

pytestmark = pytest.mark.broker

StartBroker = Callable[..., BrokerProc]


class DroppingProxy:
    """A TCP proxy to one port; while :attr:`drop` is set, what the broker answers is
    thrown away (requests still reach it): replies lost on the way, as a network
    failure loses them."""

    def __init__(self, port: int) -> None:
        self.upstream = port
        self.drop = False
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = self._server.getsockname()[1]
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._start(self._accept, "test-proxy-accept")

    def _start(self, target: Callable[..., None], name: str, *args: object) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            try:
                up = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
            except OSError:
                client.close()
                continue
            self._socks += [client, up]
            self._start(self._pump, "test-proxy-up", client, up, False)
            self._start(self._pump, "test-proxy-down", up, client, True)

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if not (replies and self.drop):
                    dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self._closed = True
        self._server.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass
        for t in self._threads:
            t.join(5)


def _stats(port: int) -> dict[str, str]:
    with BrokerConnection("127.0.0.1", port) as c:
        text = c.stats()
    return dict(line.split(" ", 2)[1:] for line in text.splitlines() if line.count(" ") >= 2)


def _log(b: BrokerProc, topic: str) -> list[tuple[str, object]]:
    out = []
    with b.connection() as conn:
        for index in range(b.topics[topic]):
            out += [(f"{b.broker_id}-{index}", m) for m in read_partition(conn, topic, index)]
    return out


def test_lost_replies_and_a_kill_leave_every_message_stored_once(
        brokers: StartBroker, zk_connect: str, monkeypatch: pytest.MonkeyPatch) -> None:
    b0 = brokers(0, {"i": 2})
    proxy = DroppingProxy(b0.port)

    class ViaProxy(PipelinedConnection):  # the producer's connections go through the proxy
        def __init__(self, host: str, port: int, **kw: object) -> None:
            super().__init__("127.0.0.1", proxy.port, **kw)  # type: ignore[arg-type]
            self.address = (host, port)

    monkeypatch.setattr(_connections, "PipelinedConnection", ViaProxy)
    sent: list[tuple[object, bytes]] = []  # (future, body); a batch: (future, [bodies])
    stop = threading.Event()
    try:
        with Producer(zk_connect, idempotent=True, send_timeout=40.0, retries=100,
                      request_timeout=1.0) as producer:
            producer.send("i", b"warm")
            assert all(c.idempotent for c in producer._connections.by_broker.values())

            def writer() -> None:
                i = 0
                while not stop.is_set():
                    if i % 20 == 0:
                        bodies = [b"b%d-%d" % (i, j) for j in range(40)]
                        sent.append((producer.send_batch("i", bodies), bodies))
                    else:
                        body = b"s%d" % i
                        sent.append((producer.send_async("i", body), body))
                    i += 1

            t = threading.Thread(target=writer, name="test-idem-writer")
            t.start()
            wait_until(lambda: len(sent) > 500, 20, what="sends in flight")
            appended = int(_stats(b0.port)["messages_appended"])
            proxy.drop = True  # from now on the broker stores puts whose answers are lost
            wait_until(lambda: int(_stats(b0.port)["messages_appended"]) > appended + 2000, 20,
                       what="puts stored while their replies are dropped")
            b0.pause()  # SIGSTOP with puts in flight, then SIGKILL: a crash
            b0.kill()
            stop.set()
            proxy.drop = False
            b0.start()  # same data directory: the log and the producer table recovered
            t.join(60)
            # the resends of what it had stored were answered from the recovered table
            wait_until(lambda: int(_stats(b0.port)["idem_duplicates"]) > 0, 30,
                       what="resent puts answered as duplicates")
            assert not t.is_alive()
            acked: list[tuple[object, bytes]] = [(producer.send("i", b"after"), b"after")]
            for fut, body in sent:
                result = fut.result(60)  # type: ignore[attr-defined]
                if isinstance(body, list):
                    acked += list(zip(result, body, strict=True))
                else:
                    acked.append((result, body))
    finally:
        stop.set()
        proxy.close()
    stored = _log(b0, "i")
    payloads = [m.payload for _p, m in stored]
    assert len(payloads) == len(set(payloads)), "a message is stored twice"
    assert len(stored) == len(acked) + 1  # + b"warm"
    where = {(p, m.offset): m for p, m in stored}
    for r, body in acked:
        m = where.get((r.partition, r.offset))
        assert m is not None and (m.payload, m.msg_id) == (body, r.msg_id), r


def test_plain_puts_to_a_broker_without_the_extension(broker_factory, zk_connect: str) -> None:
    """A broker that does not list +idempotent (as Java Metaq) gets plain put lines."""
    b = broker_factory({"p": 1}, zk_connect=zk_connect, idempotent=False)
    with Producer(zk_connect, idempotent=True) as producer:
        r1 = producer.send("p", b"one")
        r2 = producer.send_batch("p", [b"two", b"three"]).result(10)
        assert not any(c.idempotent for c in producer._connections.by_broker.values())
    assert [r1.offset] + [r.offset for r in r2] == sorted({r1.offset, *(r.offset for r in r2)})
    assert "idem_puts 0" in b.stats()
    with BrokerConnection("127.0.0.1", b.port) as c:
        assert len(read_partition(c, "p", 0)) == 3


def test_a_message_refused_for_good_does_not_stall_the_next(broker_factory,
                                                             zk_connect: str) -> None:
    """A message the broker refuses (400: over its size limit) fails; its seq is never
    stored, so the partition's sequence restarts and the next messages go at once."""
    b = broker_factory({"r": 1}, zk_connect=zk_connect, max_message_size=100)
    with Producer(zk_connect, idempotent=True, send_timeout=5.0) as producer:
        producer.send("r", b"first")
        with pytest.raises(BrokerError) as e:
            producer.send("r", b"x" * 200)
        assert e.value.code == 400
        results = [producer.send_async("r", b"n%d" % i) for i in range(50)]
        offsets = [f.result(5).offset for f in results]
        assert offsets == sorted(offsets)
    # (the refused one never reached the put step: the parser refused its length)
    assert "idem_puts 51" in b.stats(), b.stats()


def test_options_are_checked() -> None:
    from metaq import ConfigError, ProducerConfig
    from metaq.broker import BrokerConfig

    with pytest.raises(ConfigError, match="idempotent"):
        ProducerConfig(idempotent="yes")  # type: ignore[arg-type]
    for bad in ({"producer_window": 0}, {"producer_expiry_hours": 0}, {"idempotent": 1}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            BrokerConfig(broker_id=0, data_dir="/nonexistent", **bad)


def test_a_sequence_restarts_once_and_a_late_queueing_does_not_undo_it() -> None:
    from metaq.producer._idempotence import Sequences
    from zk_layout import Partition

    seqs = Sequences()
    part = Partition(0, 1)
    s = seqs.of(part)
    pid, seq = s.take()
    assert (pid, seq) == (seqs.pid, 0)
    s.taken(pid, seq, 3)
    assert s.take() == (pid, 3)
    late = s.take()  # a sender queueing when...
    seqs.restart(part, pid)  # ...a reader restarts the sequence (a message failed for good)
    s.taken(*late, 1)  # the late sender's bookkeeping must not undo the restart
    new_pid, new_seq = s.take()
    assert new_pid != pid and new_seq == 0
    seqs.restart(part, pid)  # a second failure of the old id: nothing more
    assert s.take() == (new_pid, 0)
