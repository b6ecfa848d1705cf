"""Consumer throughput: one MessageConsumer draining a loaded broker, against the raw limit.

Setup (once): a ZooKeeper server, one broker process (``python -m metaq broker
start``) with two topics of ``--partitions`` partitions each, loaded by
pipelined ``put`` requests round-robin over the partitions:

- ``small``: 5,000,000 messages of 100 B body (120 B on disk with the header);
- ``large``: 1,000,000 messages of 1 KiB body.

Each read of a topic takes about 0.3 to 0.7 s.  (Until 2026-11-27 it was a
fifth of that: a raw read of ``large`` took about 60 ms, a window in which the
scheduler's noise alone moved the raw client's rate from 1.6 to 3.7 M msg/s
between runs, and every ratio with it.)

Each run, for each topic, in this order:

1. **raw**: the in-run raw limit.  A plain Python client over loopback sends
   the same ``get`` requests (same partitions, same ``max_size``) and only
   walks the 20-byte headers of each reply (no CRC, no objects).  Two shapes,
   the faster counts: ``serial`` (one request at a time, partitions in turn,
   each from the end of the last whole message) and ``ahead`` (one request in
   flight per partition, sent as soon as the previous reply is read, for the
   bytes right after it: what the consumer's fetcher does).
2. **each**: MessageConsumer with a per-message listener.
3. **batch**: MessageConsumer with a batch listener (``on_messages(list)``).

Consumers: a new group each time (so it starts at offset 0), one member,
default strategy, ``verify_checksums=True``, ``bytes`` codec,
``fetch_runner_count=--runners``.  The listeners, decided once::

    def on_message(m):                      # per message
        count += 1; size += len(m.body)     # + one compare for the clock

    def on_messages(batch):                 # per batch
        s = 0
        for m in batch: s += len(m.body)
        count += len(batch); size += s

Counts and byte totals are checked against what was loaded.

Clock: from the first message delivered (first listener call; for raw, the
first reply read) to the last message delivered, ``time.perf_counter``.  The
start()-to-last figure (which adds joining the group: ZooKeeper registration,
rebalance, owner nodes) is printed too.  Medians over ``--runs``.

Also printed: the processing floor, ``process_batch`` alone over one reply
already in memory (no network, no threads), same listeners.

Run: ``.venv/bin/python bench/bench_consumer.py [--runs 7] [--runners 1]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from kazoo.client import KazooClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
# the repository root too: else tests/zk_layout/ shadows zk_layout where that is found only
# through an editable install's finder (tests/README.md)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers.procs import start_broker  # noqa: E402

from metaq import MessageConsumer  # noqa: E402
from metaq._zk import ZooKeeperServer  # noqa: E402
from metaq.consumer._processor import CRC32_IMPL  # noqa: E402
from metaq.protocol import (
    SPEEDUPS_STATUS,  # noqa: E402
    encode_put,  # noqa: E402
)

TOPICS = {"small": (5_000_000, 100), "large": (1_000_000, 1024)}
_header = struct.Struct(">iiqi").unpack_from


# -- loading -------------------------------------------------------------------------------

def load(port: int, topic: str, partitions: int, count: int, size: int) -> float:
    """Pipelined puts of ``count`` bodies of ``size`` bytes, round-robin; seconds taken."""
    pattern = bytes(range(256)) * (size // 256 + 2)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    acked = [0]
    errors: list[bytes] = []
    cond = threading.Condition()

    def read_replies() -> None:
        f = sock.makefile("rb", buffering=1 << 20)
        got = 0
        while got < count:
            line = f.readline()
            parts = line.split()
            if len(parts) != 4 or parts[0] != b"result":
                errors.append(line)
                break
            f.read(int(parts[2]))
            if parts[1] != b"200":
                errors.append(line)
                break
            got += 1
            if got % 1000 == 0 or got == count:
                with cond:
                    acked[0] = got
                    cond.notify_all()
        with cond:
            acked[0] = count
            cond.notify_all()

    reader = threading.Thread(target=read_replies, name="bench-load-reader", daemon=True)
    reader.start()
    t0 = time.perf_counter()
    chunk: list[bytes] = []
    for i in range(count):
        body = pattern[i % 256:i % 256 + size]
        chunk.append(encode_put(topic, i % partitions, body, 0,
                                zlib.crc32(body) & 0x7FFFFFFF, i))
        if len(chunk) == 1000 or i == count - 1:
            sock.sendall(b"".join(chunk))
            chunk = []
            with cond:
                while i + 1 - acked[0] > 50_000 and not errors:
                    cond.wait(1.0)
        if errors:
            break
    reader.join(120)
    sock.close()
    if errors:
        raise RuntimeError(f"loading {topic} failed: {errors[0][:200]!r}")
    return time.perf_counter() - t0


def expected_bytes(count: int, size: int) -> int:
    return count * size


# -- the raw limit -------------------------------------------------------------------------

class _RawConn:
    """Plain blocking socket with one receive buffer: ``get`` out, reply body back as bytes."""

    def __init__(self, port: int, max_size: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        self.buf = bytearray(max_size + 64 * 1024)
        self.view = memoryview(self.buf)
        self.start = self.end = 0

    def send_get(self, topic: bytes, partition: int, offset: int, max_size: int) -> None:
        self.sock.sendall(b"get %b raw %d %d %d %d\r\n" % (topic, partition, offset, max_size,
                                                           partition))

    def reply(self) -> bytes | None:
        """The body of a ``value`` reply, None for a ``result`` (404: nothing more)."""
        buf, view, sock = self.buf, self.view, self.sock
        while True:
            i = buf.find(b"\r\n", self.start, self.end)
            if i >= 0:
                break
            self._room(1)
            self.end += sock.recv_into(view[self.end:])
        head = bytes(buf[self.start:i]).split()
        self.start = i + 2
        length = int(head[1]) if head[0] == b"value" else int(head[2])
        self._room(length)
        while self.end - self.start < length:
            got = sock.recv_into(view[self.end:])
            if not got:
                raise ConnectionError("broker closed the connection")
            self.end += got
        body = bytes(view[self.start:self.start + length])
        self.start += length
        return body if head[0] == b"value" else None

    def _room(self, length: int) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif len(self.buf) - self.start < length + 64:
            unread = self.end - self.start
            self.buf[:unread] = self.buf[self.start:self.end]
            self.start, self.end = 0, unread

    def close(self) -> None:
        self.sock.close()


def _walk(data: bytes) -> tuple[int, int]:
    """(messages, bytes) of the complete messages at the start of ``data``: headers only."""
    n = len(data)
    pos = count = 0
    while pos + 20 <= n:
        length, _check, _msg_id, _flag = _header(data, pos)
        end = pos + 20 + length
        if end > n:
            break
        pos = end
        count += 1
    return count, pos


def raw_run(port: int, topic: str, partitions: int, max_size: int,
            ahead: bool) -> tuple[int, int, float, float]:
    """Pull a whole topic; (messages, body bytes, seconds from first reply to last walked,
    CPU seconds of this thread)."""
    conn = _RawConn(port, max_size)
    name = topic.encode()
    offsets = [0] * partitions
    count = size = 0
    first = 0.0
    cpu = time.thread_time()
    try:
        if ahead:
            # one get in flight per partition, sent as soon as the previous reply is in,
            # for the bytes right after it (a cut message is completed by the next reply)
            tails = [b""] * partitions
            for p in range(partitions):
                conn.send_get(name, p, 0, max_size)
            queue = list(range(partitions))
            while queue:
                p = queue.pop(0)
                body = conn.reply()
                if not first:
                    first = time.perf_counter()
                if body is None:
                    continue
                offsets[p] += len(body)
                conn.send_get(name, p, offsets[p], max_size)
                queue.append(p)
                data = tails[p] + body if tails[p] else body
                n, used = _walk(data)
                tails[p] = data[used:]
                count += n
                size += used - 20 * n
        else:
            live = list(range(partitions))
            while live:
                for p in list(live):
                    conn.send_get(name, p, offsets[p], max_size)
                    data = conn.reply()
                    if not first:
                        first = time.perf_counter()
                    if data is None:
                        live.remove(p)
                        continue
                    n, used = _walk(data)
                    offsets[p] += used
                    count += n
                    size += used - 20 * n
        last = time.perf_counter()
        cpu = time.thread_time() - cpu
    finally:
        conn.close()
    return count, size, last - first, cpu


# -- the consumer --------------------------------------------------------------------------

class _Clock:
    def __init__(self, total: int) -> None:
        self.total = total
        self.first = 0.0
        self.last = 0.0
        self.done = threading.Event()

    def mark(self, count: int) -> int:
        """Called at the first message and when ``count`` reaches the total; next mark."""
        now = time.perf_counter()
        if not self.first:
            self.first = now
        if count >= self.total:
            self.last = now
            self.done.set()
            return 1 << 62
        return self.total


def consumer_run(zk: str, topic: str, total: int, mode: str, runners: int, max_size: int,
                 group: str, timeout: float = 300.0) -> tuple[int, int, float, float, float]:
    """(messages, body bytes, seconds first->last, seconds start()->last, CPU seconds of
    the fetch runner threads, where the listeners run)."""
    clock = _Clock(total)
    count = size = 0
    mark = 1

    def on_message(m):  # noqa: ANN001, ANN202 - the bench's per-message listener
        nonlocal count, size, mark
        count += 1
        size += len(m.body)
        if count >= mark:
            mark = clock.mark(count)

    class Batch:
        def on_messages(self, batch):  # noqa: ANN001, ANN202 - the bench's batch listener
            nonlocal count, size, mark
            if not clock.first:
                clock.first = time.perf_counter()
            s = 0
            for m in batch:
                s += len(m.body)
            count += len(batch)
            size += s
            if count >= mark:
                mark = clock.mark(count)

    listener: Callable | Batch = on_message if mode == "each" else Batch()
    errors: list[BaseException] = []
    consumer = MessageConsumer(group, zk, fetch_runner_count=runners, verify_checksums=True,
                               start_position="earliest", commit_period=60.0,
                               on_error=errors.append)
    try:
        consumer.subscribe(topic, listener, max_size=max_size)
        clocks = [time.pthread_getcpuclockid(t.ident) for t in consumer.fetcher.threads
                  if t.ident is not None]
        cpu = sum(time.clock_gettime(c) for c in clocks)
        t_start = time.perf_counter()
        consumer.start()
        if not clock.done.wait(timeout):
            raise RuntimeError(f"{mode} consumer of {topic} stalled at {count}/{total}: "
                               f"{errors[:3]}")
        cpu = sum(time.clock_gettime(c) for c in clocks) - cpu
    finally:
        consumer.close()
    if errors:
        raise RuntimeError(f"consumer errors: {errors[:3]}")
    return count, size, clock.last - clock.first, clock.last - t_start, cpu


# -- in memory: the processing floor -------------------------------------------------------

def in_memory(size: int, mode: str, max_size: int, reps: int = 30) -> tuple[float, float]:
    """process_batch alone over ``max_size`` bytes of ``size``-byte messages already in
    memory (no network, no threads): (best M msg/s wall, best CPU ns per message)."""
    from metaq.consumer._processor import process_batch
    from metaq.consumer._subscription import PartitionState
    from metaq.protocol import encode_message, get_codec

    per = max_size // (size + 20)
    data = b"".join(encode_message(i, 0, bytes([i % 251]) * size) for i in range(per))
    count = total = 0

    def on_message(m):  # noqa: ANN001, ANN202 - same work as the consumer runs
        nonlocal count, total
        count += 1
        total += len(m.body)

    def on_messages(batch):  # noqa: ANN001, ANN202
        nonlocal count, total
        s = 0
        for m in batch:
            s += len(m.body)
        count += len(batch)
        total += s

    best_wall = best_cpu = float("inf")
    for _ in range(reps):
        pf = PartitionState(topic="t", partition="0-0", broker_id=0, index=0,
                            broker_address=None, offset=0, msg_id=-1, max_size=max_size,
                            listener=on_message if mode == "each" else None,
                            batch_listener=on_messages if mode == "batch" else None,
                            codec=get_codec("bytes"), verify=True, max_retries=5)
        w, c = time.perf_counter(), time.thread_time()
        process_batch(pf, data)
        best_cpu = min(best_cpu, time.thread_time() - c)
        best_wall = min(best_wall, time.perf_counter() - w)
    assert count == per * reps
    return per / best_wall / 1e6, best_cpu / per * 1e9


# -- main ------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--max-size", type=int, default=1024 * 1024,
                    help="get max_size, consumer and raw client alike (default 1 MiB)")
    ap.add_argument("--runners", type=int, default=1, help="fetch_runner_count (default 1)")
    ap.add_argument("--topics", default="small,large")
    ap.add_argument("--modes", default="each,batch")
    ap.add_argument("--scale", type=float, default=1.0,
                    help="fraction of the message counts to load (quick tries)")
    ap.add_argument("--json", help="also write every run's numbers to this file")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    topics = {t: (int(TOPICS[t][0] * args.scale), TOPICS[t][1])
              for t in args.topics.split(",")}
    modes = args.modes.split(",")
    results: dict[str, list[dict[str, float]]] = {}

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-consumer-")))
        zk = stack.enter_context(ZooKeeperServer())
        admin = KazooClient(hosts=zk.hosts)
        admin.start()
        admin.ensure_path("/bench")
        admin.stop()
        admin.close()
        zk_connect = zk.hosts + "/bench"
        transfer = max(args.max_size, 1024 * 1024)
        broker = stack.enter_context(start_broker(
            zk_connect, 0, tmp / "broker", {t: args.partitions for t in topics},
            extra_args=["--max-transfer-size", str(transfer)]))
        for topic, (count, size) in topics.items():
            took = load(broker.port, topic, args.partitions, count, size)
            print(f"loaded {topic}: {count} x {size} B in {took:.1f}s", flush=True)
        print(f"C speedups: {SPEEDUPS_STATUS}; Python crc32: {CRC32_IMPL}; "
              f"max_size {args.max_size}; partitions {args.partitions}; "
              f"fetch_runner_count {args.runners}; {args.runs} runs", flush=True)
        floor = {(t, m): in_memory(size, m, args.max_size)
                 for t, (_count, size) in topics.items() for m in modes}

        for run in range(args.runs):
            for topic, (count, size) in topics.items():
                want = (count, expected_bytes(count, size))
                best = None
                raw_cpu = 0.0
                for ahead in (False, True):
                    n, b, secs, cpu = raw_run(broker.port, topic, args.partitions,
                                              args.max_size, ahead)
                    if (n, b) != want:
                        raise RuntimeError(f"raw read {n} messages / {b} B of {topic}, "
                                           f"want {want}")
                    kind = "raw-ahead" if ahead else "raw-serial"
                    results.setdefault(f"{topic}/{kind}", []).append(
                        {"rate": n / secs, "cpu_ns": cpu / n * 1e9})
                    if n / secs > (best or 0.0):
                        best, raw_cpu = n / secs, cpu / n * 1e9
                results.setdefault(f"{topic}/raw", []).append({"rate": best or 0.0,
                                                               "cpu_ns": raw_cpu})
                for mode in modes:
                    n, b, secs, from_start, cpu = consumer_run(
                        zk_connect, topic, count, mode, args.runners, args.max_size,
                        f"bench-{topic}-{mode}-{run}")
                    if (n, b) != want:
                        raise RuntimeError(f"{mode} consumer got {n} messages / {b} B of "
                                           f"{topic}, want {want}")
                    results.setdefault(f"{topic}/{mode}", []).append(
                        {"rate": n / secs, "rate_from_start": n / from_start,
                         "ratio": (n / secs) / best if best else 0.0,
                         "cpu_ns": cpu / n * 1e9, "load": os.getloadavg()[0]})
                line = "  ".join(
                    f"{k.split('/')[1]} {v[-1]['rate'] / 1e6:.2f}"
                    for k, v in results.items() if k.startswith(topic + "/"))
                print(f"run {run + 1} {topic}: {line} (M msg/s)", flush=True)

    print()
    print(f"medians of {args.runs} runs; M msg/s from the first message delivered to the last; "
          f"CPU = fetch runner threads (raw: its one thread), ns per message")
    print(f"{'topic':<6} {'listener':<8} {'M msg/s':>8} {'from start':>10} {'raw M/s':>8} "
          f"{'ratio':>6} {'CPU ns':>7} {'CPU ratio':>9}")
    for topic in topics:
        raw = statistics.median(r["rate"] for r in results[f"{topic}/raw"])
        raw_cpu = statistics.median(r["cpu_ns"] for r in results[f"{topic}/raw"])
        serial = statistics.median(r["rate"] for r in results[f"{topic}/raw-serial"])
        ahead = statistics.median(r["rate"] for r in results[f"{topic}/raw-ahead"])
        print(f"{topic:<6} {'raw':<8} {raw / 1e6:>8.2f} {'':>10} {'':>8} {'':>6} "
              f"{raw_cpu:>7.0f} {'':>9}   (serial {serial / 1e6:.2f}, ahead {ahead / 1e6:.2f})")
        for mode in modes:
            rs = results[f"{topic}/{mode}"]
            rate = statistics.median(r["rate"] for r in rs)
            start = statistics.median(r["rate_from_start"] for r in rs)
            ratio = statistics.median(r["ratio"] for r in rs)
            cpu = statistics.median(r["cpu_ns"] for r in rs)
            print(f"{topic:<6} {mode:<8} {rate / 1e6:>8.2f} {start / 1e6:>10.2f} "
                  f"{raw / 1e6:>8.2f} {ratio:>6.0%} {cpu:>7.0f} {raw_cpu / cpu:>9.0%}")
    print()
    print("in memory (process_batch alone on one max_size reply, no network; best of 30):")
    for (topic, mode), (rate, cpu) in floor.items():
        print(f"{topic:<6} {mode:<8} {rate:>8.2f} M msg/s {cpu:>7.0f} CPU ns/msg")
    loads = [r["load"] for k, v in results.items() for r in v if "load" in r]
    print(f"load average during the runs: {min(loads):.1f} .. {max(loads):.1f} "
          f"(other work on this machine skews wall-clock numbers; CPU ns much less)")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": vars(args), "crc32": CRC32_IMPL, "speedups": SPEEDUPS_STATUS,
             "results": results,
             "in_memory": {f"{t}/{m}": v for (t, m), v in floor.items()}}, indent=1))


if __name__ == "__main__":
    main()
