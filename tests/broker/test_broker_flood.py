"""A broker that stays fair under pressure (issue 29), against a real broker process:
a flood of 20,000 idle connections from the producer's own address does not stop the
producer's sends (each within its ``send_timeout``), slowloris connections (a byte a
second, never a whole line) are closed at ``request_timeout``, connections that never
send a request at ``first_request_timeout``, and nothing acknowledged is lost."""

from __future__ import annotations

import resource
import select
import socket
import subprocess
import sys
import time

import pytest
from helpers.raw_client import RawClient

from metaq import Producer
from metaq.protocol import encode_get, encode_stats, encode_version, iter_messages
from metaq.testing import wait_until

FLOOD = 20_000
#: The flood comes from two processes (each holds its sockets open): a process's open
#: files are capped by RLIMIT_NOFILE, often 20,000 at most.
FLOODERS = 2

# Opens ``count`` connections to the port and keeps them open, idle, until its stdin
# closes: prints "up <n>" every 1000 connections and "done <opened> <failed>" at the end.
_FLOODER = r"""
import resource, socket, sys
port, count = int(sys.argv[1]), int(sys.argv[2])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
want = count + 64
if soft < want:
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
socks, failed = [], 0
for i in range(count):
    try:
        socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
    except OSError:
        failed += 1
    if (i + 1) % 1000 == 0:
        print("up", i + 1, flush=True)
print("done", len(socks), failed, flush=True)
sys.stdin.read()
"""


def _stats(port: int) -> dict[str, str]:
    with RawClient(port, timeout=30) as c:
        body = c.call(encode_stats(None, 1)).body.decode()
    return dict(line.split(" ", 2)[1:] for line in body.splitlines())


def _need_files(n: int) -> None:
    """Skip unless a process may open ``n`` files (raising its soft limit if it must)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < n:
        pytest.skip(f"RLIMIT_NOFILE's hard limit is {hard}: a flooder needs {n} open files")


def test_a_flood_of_idle_connections_does_not_stop_a_producer(brokers, zk_connect):
    per = FLOOD // FLOODERS
    _need_files(per + 64)
    b = brokers(0, {"t": 1})
    body = b"x" * 100
    acked: list = []
    with Producer(zk_connect, send_timeout=3.0) as producer:
        acked.append(producer.send("t", body))  # connected and working before the flood
        flooders = [subprocess.Popen([sys.executable, "-c", _FLOODER, str(b.port), str(per)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                    for _ in range(FLOODERS)]
        try:
            for f in flooders:  # the flood is under way
                assert f.stdout.readline().startswith("up "), "a flooder failed to start"
            slowest = 0.0
            sent_during = 0
            while len(acked) < 501:
                t = time.monotonic()
                acked.append(producer.send("t", body))  # raises past send_timeout
                slowest = max(slowest, time.monotonic() - t)
                if any(f.poll() is None for f in flooders):
                    sent_during += 1
            # a newcomer from the flood's own address gets in too, and is answered
            t = time.monotonic()
            with RawClient(b.port, timeout=10) as c:
                assert c.call(encode_version(3)).opaque == 3
            newcomer = time.monotonic() - t
            done = []
            for f in flooders:
                line = f.stdout.readline()
                while line.startswith("up "):
                    line = f.stdout.readline()
                done.append(line.split())
        finally:
            for f in flooders:
                f.stdin.close()
                f.wait(30)
    opened = sum(int(d[1]) for d in done)
    assert opened >= FLOOD * 0.9, done  # the flood did happen (a few connects may fail)
    assert sent_during > 0, "the sends finished before the flood got going"
    assert slowest < 3.0 and newcomer < 10.0
    st = _stats(b.port)
    assert int(st["connections_total"]) >= opened
    assert int(st["connections_evicted"]) > 0, st
    # nothing acknowledged lost: every acknowledged message is in the log, in order
    with RawClient(b.port) as c:
        data = c.call(encode_get("t", "g", 0, 0, 1 << 20, 1)).body
    stored = [(m.offset, m.msg_id, m.payload) for m in iter_messages(data, 0)]
    assert [(r.offset, r.msg_id, body) for r in acked] == stored
    print(f"flood {opened} connections, {sent_during} sends during it, slowest "
          f"{slowest * 1000:.0f} ms, newcomer {newcomer * 1000:.0f} ms, evicted "
          f"{st['connections_evicted']}")


def test_slowloris_connections_are_closed_at_the_request_deadline(brokers):
    deadline = 2.0
    b = brokers(0, {"t": 1}, extra_args=["--request-timeout", str(deadline)])
    line = encode_get("t", "g", 0, 0, 100, 1)[:-2]  # never the CRLF
    socks = [socket.create_connection(("127.0.0.1", b.port), timeout=10) for _ in range(50)]
    first: dict[socket.socket, float] = {}
    closed: dict[socket.socket, float] = {}
    sent = 0
    try:
        give_up = time.monotonic() + deadline + 15
        next_byte = time.monotonic()
        with RawClient(b.port) as worker:
            while len(closed) < len(socks) and time.monotonic() < give_up:
                now = time.monotonic()
                if now >= next_byte and sent < len(line):  # a byte a second, each of them
                    for s in socks:
                        if s not in closed:
                            s.send(line[sent:sent + 1])
                            first.setdefault(s, time.monotonic())
                    sent += 1
                    next_byte += 1.0
                    # and a client doing real work is served all along
                    assert worker.call(encode_version(sent)).opaque == sent
                ready, _, _ = select.select([s for s in socks if s not in closed], [], [],
                                            max(0.0, next_byte - time.monotonic()))
                for s in ready:
                    try:
                        got = s.recv(4096)
                    except ConnectionError:
                        got = b""
                    if not got:
                        closed[s] = time.monotonic()
        assert len(closed) == len(socks), f"{len(closed)} of {len(socks)} closed"
        late = [closed[s] - first[s] for s in socks]
        # not before the deadline, and within it (plus the loop's and this test's delays)
        assert min(late) >= deadline - 0.05 and max(late) <= deadline + 1.0, late
        print(f"slowloris: {len(socks)} closed {min(late):.3f}..{max(late):.3f} s after "
              f"their first byte (deadline {deadline:g} s)")
        st = _stats(b.port)
        assert int(st["slow_closed"]) == len(socks)
        assert int(st["curr_connections"]) == 1  # the stats request's own
    finally:
        for s in socks:
            s.close()


def test_connections_that_never_send_a_request_are_closed(brokers):
    timeout = 1.0
    b = brokers(0, {"t": 1}, extra_args=["--first-request-timeout", str(timeout)])
    start = time.monotonic()
    silent = [socket.create_connection(("127.0.0.1", b.port), timeout=10) for _ in range(20)]
    with RawClient(b.port) as worker:
        assert worker.call(encode_version(1)).opaque == 1

        def all_closed() -> bool:
            for s in silent:
                s.setblocking(False)
                try:
                    if s.recv(1) != b"":
                        return False
                except BlockingIOError:
                    return False
                except ConnectionError:
                    pass
            return True

        wait_until(all_closed, 10, interval=0.05, what="the silent connections closed")
        took = time.monotonic() - start
        assert timeout - 0.05 <= took <= timeout + 1.5, took
        print(f"unused: {len(silent)} closed {took:.3f} s after connecting (timeout "
              f"{timeout:g} s)")
        # the one that sent a request stays, past the timeout
        assert worker.call(encode_version(2)).opaque == 2
        st = _stats(b.port)
        assert int(st["unused_closed"]) == len(silent), st
        assert int(st["curr_connections"]) == 2  # the worker and the stats request
    for s in silent:
        s.close()
