"""Producer throughput against one local broker process, beside in-run raw limits.

Setup: a real ZooKeeper (``metaq._zk`` launcher) and, per flush policy, one
broker process (``python -m metaq broker start``) serving topic ``bench``
with ``--partitions`` partitions:

- ``default``: Metaq's flush policy (fsync after 1000 messages or 10 s);
- ``group-commit``: ``--group-commit`` (fsync before a put is acknowledged).

For each body size (100 B and 1 KiB) and each run, in this order:

1. **raw-pipelined** (the broker-bound ceiling for round-robin puts): a plain
   socket client sends pre-encoded ``put`` requests (partition ``i % N``) in
   256 KiB writes, at most ``--window`` unanswered, while a reader thread
   only counts reply lines.
2. **async**: ``Producer.send_async`` for every message (round-robin), then
   ``result()`` of every future (each is checked); clock from the first
   send to the last result.
3. **raw-runs**: as raw-pipelined, but the puts go in runs of ``--batch`` to
   one partition, as batches do (the ceiling for ``batch``).
4. **batch**: ``Producer.send_batch`` of ``--batch`` messages at a time, then
   ``result()`` of every batch and every ``SendResult`` in it read (so the
   per-message results are built and paid for, as with ``async``).
5. **raw-sync**: a plain socket client, one ``put`` at a time (send, read the reply).
6. **sync**: ``Producer.send`` one at a time.

Beside each producer figure: the ratio to its raw counterpart (1.00 = as
fast as a client that does nothing but bytes), the CPU time per message of
the bench process (``time.process_time``), of which the cyclic garbage
collector (``gc.callbacks``), and of the broker process
(``/proc/<pid>/stat``), which also tell who is the bottleneck.  Once per
size, without a broker, the **encode-only** rate: codec + payload + CRC32 +
``encode_put`` per message in one thread (the least a producer must do).

MB/s counts body bytes.  Medians over ``--runs``.  The machine's load
averages (1, 5, 15 min, as ``uptime``) are printed at the start, before each
section and at the end: figures taken while other processes use the CPU are
low, the CPU-per-message columns much less so.

``--profile DIR``: one extra async and one extra batch run of
``--profile-seconds`` each under py-spy (bench process and broker; samples
of whichever thread holds the GIL, i.e. where the Python CPU goes) and
cProfile (the sending thread); summaries (self and inclusive time by
function, share per thread) are written to DIR/async and DIR/batch.

Run: ``.venv/bin/python bench/bench_producer.py [--runs 5] [--profile /tmp/prof]``.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import io
import os
import pstats
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

from kazoo.client import KazooClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
# the repository root too: else tests/zk_layout/ shadows zk_layout where that is found only
# through an editable install's finder (tests/README.md)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers.procs import BrokerProc, start_broker  # noqa: E402

from metaq import Producer  # noqa: E402
from metaq._zk import ZooKeeperServer  # noqa: E402
from metaq.protocol import crc32 as _crc32  # noqa: E402
from metaq.protocol import (
    encode_put,  # noqa: E402
    get_codec,  # noqa: E402
)

TOPIC = "bench"
SIZES = (100, 1024)
_CLK = os.sysconf("SC_CLK_TCK")


# -- measuring -----------------------------------------------------------------------------

def proc_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK


class Sample(collections.namedtuple("Sample", "rate cpu_self cpu_gc cpu_broker")):
    """msgs/s, and CPU microseconds per message in the bench process (of which in
    the garbage collector) and the broker."""


class _GcClock:
    """CPU time spent in the cyclic garbage collector (``gc.callbacks``; the
    collection runs in the thread that triggered it)."""

    def __init__(self) -> None:
        self.total = 0.0
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.thread_time()
        else:
            self.total += time.thread_time() - self._start


GC_CLOCK = _GcClock()


def measure(count: int, broker_pid: int, fn, *args) -> Sample:  # type: ignore[no-untyped-def]
    """Run ``fn(*args)`` that handles ``count`` messages."""
    gc.collect()  # start each run from the same heap, not with a collection owed
    b0 = proc_cpu(broker_pid)
    g0 = GC_CLOCK.total
    c0 = time.process_time()
    t0 = time.perf_counter()
    fn(*args)
    dt = time.perf_counter() - t0
    return Sample(count / dt, (time.process_time() - c0) / count * 1e6,
                  (GC_CLOCK.total - g0) / count * 1e6, (proc_cpu(broker_pid) - b0) / count * 1e6)


def loadavg() -> str:
    return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


# -- raw clients ---------------------------------------------------------------------------

def raw_pipelined(port: int, partitions: int, body: bytes, count: int, window: int,
                  run: int = 1) -> None:
    """Pre-encoded puts (runs of ``run`` per partition) in 256 KiB writes; a reader
    counts reply lines (CRLFs)."""
    check = zlib.crc32(body) & 0x7FFFFFFF
    reqs = [encode_put(TOPIC, (i // run) % partitions, body, 0, check, i) for i in range(count)]
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    done = [0]
    bad = []
    cond = threading.Condition()

    def reader() -> None:
        got = 0
        carry = b""
        while got < count:
            data = sock.recv(1 << 20)
            if not data:
                bad.append(b"connection closed")
                break
            chunk = carry + data
            got += chunk.count(b"\r\n")
            if b"result 200 " not in chunk[:64] and chunk.startswith(b"result"):
                bad.append(chunk[:80])
            carry = chunk[-1:] if chunk.endswith(b"\r") else b""
            with cond:
                done[0] = got
                cond.notify_all()

    t = threading.Thread(target=reader, name="bench-raw-reader", daemon=True)
    t.start()
    try:
        i = 0
        step = max(1, (256 * 1024) // (len(reqs[0]) or 1))
        while i < count:
            with cond:
                while i - done[0] > window and not bad:
                    cond.wait(1.0)
            sock.sendall(b"".join(reqs[i:i + step]))
            i += step
        t.join(120)
    finally:
        sock.close()
    if bad or done[0] < count:
        raise RuntimeError(f"raw client: {done[0]} of {count} replies; {bad[:1]}")


def raw_sync(port: int, partitions: int, body: bytes, count: int) -> None:
    check = zlib.crc32(body) & 0x7FFFFFFF
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    f = sock.makefile("rb")
    try:
        for i in range(count):
            sock.sendall(encode_put(TOPIC, i % partitions, body, 0, check, i))
            head = f.readline().split()
            if head[1] != b"200":
                raise RuntimeError(f"raw sync put failed: {head}")
            f.read(int(head[2]))
    finally:
        f.close()
        sock.close()


# -- the producer --------------------------------------------------------------------------

def producer_async(producer: Producer, body: bytes, count: int) -> None:
    send = producer.send_async
    futures = [send(TOPIC, body) for _ in range(count)]
    for f in futures:
        f.result()


def producer_batch(producer: Producer, body: bytes, count: int, size: int) -> None:
    bodies = [body] * size
    futures = [producer.send_batch(TOPIC, bodies) for _ in range(count // size)]
    got = 0
    for f in futures:
        for r in f.result():  # raises BatchSendError if any message failed
            got += r.offset >= 0
    if got != count // size * size:
        raise RuntimeError(f"batch: {got} results for {count} messages")


def producer_sync(producer: Producer, body: bytes, count: int) -> None:
    send = producer.send
    for _ in range(count):
        send(TOPIC, body)


def encode_only(body: bytes, count: int) -> float:
    """msgs/s of the per-message work no producer can skip (one thread)."""
    encode = get_codec("auto").encode
    crc = _crc32  # the producer's (ISA-L when installed)
    t0 = time.perf_counter()
    for i in range(count):
        data = encode(body)
        encode_put(TOPIC, i & 3, data, 0, crc(data) & 0x7FFFFFFF, i)
    return count / (time.perf_counter() - t0)


# -- profiling -----------------------------------------------------------------------------

def summarize_pyspy(raw: Path, top: int = 25) -> str:
    """Self and inclusive time by function from py-spy's raw (collapsed) output."""
    leaf: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    threads: collections.Counter[str] = collections.Counter()
    lines: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n_text = line.rpartition(" ")
        n = int(n_text)
        total += n
        frames = stack.split(";")
        threads[frames[0].split(" (")[0] + (frames[0].split(":", 1)[1] if ":" in frames[0]
                                            else "")] += n
        names = [f.split(" (")[0] + " (" + f.split(" (")[1].split(":")[0] + ")"
                 for f in frames[1:] if " (" in f]
        if names:
            leaf[names[-1]] += n
            lines[frames[-1].strip()] += n
        for name in set(names):
            incl[name] += n
    out = [f"{total} samples", "self time:"]
    out += [f"  {v * 100 / total:5.1f}%  {k}" for k, v in leaf.most_common(top)]
    out.append("self time by line:")
    out += [f"  {v * 100 / total:5.1f}%  {k}" for k, v in lines.most_common(top)]
    out.append("inclusive time:")
    out += [f"  {v * 100 / total:5.1f}%  {k}" for k, v in incl.most_common(top)]
    out.append("threads: " + ", ".join(f"{k} {v * 100 / total:.0f}%"
                                       for k, v in threads.most_common()))
    return "\n".join(out)


def profile_run(producer: Producer, broker: BrokerProc, body: bytes, seconds: float,
                outdir: Path, py_spy: str | None, batch: int | None = None) -> None:
    """Profile ``producer_async`` (or ``producer_batch`` of ``batch``) for ``seconds``."""
    outdir.mkdir(parents=True, exist_ok=True)
    spies = []
    if py_spy:
        for name, pid in (("producer", os.getpid()), ("broker", broker.pid)):
            raw = outdir / f"pyspy-{name}.txt"
            spies.append((name, raw, subprocess.Popen(
                [py_spy, "record", "--pid", str(pid), "--rate", "250", "--format", "raw",
                 "--threads", "--gil", "--duration", str(int(seconds)), "--output", str(raw)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
        time.sleep(0.5)  # let py-spy attach before the load starts (not a synchronisation)
    prof = cProfile.Profile()
    n = 0
    end = time.perf_counter() + seconds
    prof.enable()
    while time.perf_counter() < end:
        if batch:
            producer_batch(producer, body, 20 * batch, batch)
            n += 20 * batch
        else:
            producer_async(producer, body, 20_000)
            n += 20_000
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(25)
    (outdir / "cprofile-sending-thread.txt").write_text(f"{n} messages\n{s.getvalue()}")
    for name, raw, proc in spies:
        proc.wait(seconds + 30)
        if raw.exists():
            (outdir / f"pyspy-{name}-summary.txt").write_text(summarize_pyspy(raw))
    print(f"profiles written to {outdir}", flush=True)


# -- main ----------------------------------------------------------------------------------

def run_size(producer: Producer, broker: BrokerProc, body: bytes, n: int,
             args: argparse.Namespace) -> dict[str, list[Sample]]:
    got: dict[str, list[Sample]] = collections.defaultdict(list)
    pid = broker.pid
    assert pid is not None
    nb = n // args.batch * args.batch
    for run in range(args.runs):
        got["raw-pipelined"].append(measure(n, pid, raw_pipelined, broker.port, args.partitions,
                                            body, n, args.window))
        got["async"].append(measure(n, pid, producer_async, producer, body, n))
        got["raw-runs"].append(measure(nb, pid, raw_pipelined, broker.port, args.partitions,
                                       body, nb, args.window, args.batch))
        got["batch"].append(measure(nb, pid, producer_batch, producer, body, nb, args.batch))
        got["raw-sync"].append(measure(args.sync_count, pid, raw_sync, broker.port,
                                       args.partitions, body, args.sync_count))
        got["sync"].append(measure(args.sync_count, pid, producer_sync, producer, body,
                                   args.sync_count))
        print(f"  {'group-commit' if args.current_gc else 'default'} {len(body)} B run "
              f"{run + 1}: " + ", ".join(f"{k} {v[-1].rate:,.0f}/s" for k, v in got.items()),
              flush=True)
    return got


def _median(samples: list[Sample]) -> Sample:
    return Sample(*(statistics.median(getattr(s, f) for s in samples) for f in Sample._fields))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--count-100", type=int, default=200_000, help="async messages of 100 B")
    ap.add_argument("--count-1k", type=int, default=60_000, help="async messages of 1 KiB")
    ap.add_argument("--sync-count", type=int, default=3000)
    ap.add_argument("--window", type=int, default=16384, help="raw client's in-flight limit")
    ap.add_argument("--batch", type=int, default=1000, help="messages per send_batch")
    ap.add_argument("--policies", default="default,group-commit")
    ap.add_argument("--profile", metavar="DIR", help="write py-spy and cProfile summaries")
    ap.add_argument("--profile-seconds", type=float, default=8.0)
    ap.add_argument("--py-spy", default=shutil.which("py-spy"), help="py-spy executable")
    args = ap.parse_args()

    counts = {100: args.count_100, 1024: args.count_1k}
    print(f"{os.cpu_count()} CPUs, {loadavg()} at start; {args.runs} runs, medians; "
          f"batches of {args.batch}", flush=True)
    enc = {size: encode_only(b"x" * size, 200_000) for size in SIZES}
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="metaq-bench-producer-"))
    try:
        with ZooKeeperServer(data_dir=tmp / "zk") as zk:
            admin = KazooClient(hosts=zk.hosts)
            admin.start(30)
            admin.ensure_path("/bench")
            admin.stop()
            admin.close()
            zk_connect = zk.hosts + "/bench"
            for policy in args.policies.split(","):
                args.current_gc = policy == "group-commit"
                broker = start_broker(zk_connect, 0, tmp / f"broker-{policy}",
                                      {TOPIC: args.partitions},
                                      group_commit=policy == "group-commit",
                                      zk_session_timeout=30.0)
                try:
                    with Producer(zk_connect, send_timeout=30.0) as producer:
                        producer_async(producer, b"warm-up", 2000)
                        producer_batch(producer, b"warm-up", 2000, 100)
                        for size in SIZES:
                            print(f" {policy} {size} B, {loadavg()}", flush=True)
                            body = b"x" * size
                            n = counts[size]
                            got = run_size(producer, broker, body, n, args)
                            med = {k: _median(v) for k, v in got.items()}
                            for kind, base in (("raw-pipelined", None), ("async", "raw-pipelined"),
                                               ("raw-runs", None), ("batch", "raw-runs"),
                                               ("raw-sync", None), ("sync", "raw-sync")):
                                m = med[kind]
                                ratio = m.rate / med[base].rate if base else None
                                rows.append((policy, size, kind, m, ratio))
                        if args.profile and policy == args.policies.split(",")[0]:
                            for kind, batch in (("async", None), ("batch", args.batch)):
                                profile_run(producer, broker, b"x" * 100, args.profile_seconds,
                                            Path(args.profile) / kind, args.py_spy, batch)
                finally:
                    broker.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\n{loadavg()} at end\n")
    print("| flush | body | client | msgs/s | MB/s | vs raw | CPU us/msg: bench | of which GC "
          "| broker |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for policy, size, kind, m, ratio in rows:
        print(f"| {policy} | {size} B | {kind} | {m.rate:,.0f} | {m.rate * size / 1e6:.1f} | "
              f"{'' if ratio is None else f'{ratio:.2f}'} | {m.cpu_self:.1f} | "
              f"{m.cpu_gc:.1f} | {m.cpu_broker:.1f} |")
    for size in SIZES:
        print(f"| - | {size} B | encode-only (1 thread) | {enc[size]:,.0f} | "
              f"{enc[size] * size / 1e6:.1f} | | {1e6 / enc[size]:.1f} | | |")


if __name__ == "__main__":
    main()
