"""Latency: the time from ``send`` to the listener, what an idle consumer costs.

Setup: a ZooKeeper server and one broker process (``python -m metaq broker
start``) with an 8-partition topic per case.  The producer runs in this process
(``Producer.send_async`` on a steady schedule: each tick sends what is due, each
body carries ``time.monotonic_ns()`` taken just before the send, a clock shared
by every process of the machine); the consumer is a separate process (this
file, ``child`` mode) with a per-message listener that records ``now - sent``.

Cases, each for the consumer as it is (default ``fetch_hold``: the broker holds a get
at the log end) and as before (``fetch_hold=0``: Metaq's backoff, the same as
against a Java Metaq broker):

1. **steady 500 msg/s** and **steady 20,000 msg/s** over 8 partitions:
   p50 / p99 / max of send→listener;
2. **after silence**: single messages after 1, 5 and 30 s of nothing;
3. **idle CPU**: a consumer that owns 1,024 idle partitions, its process CPU
   (user + system) over 30 s after it settled, as % of one core;
4. **producer round trip**: ``Producer.send`` (synchronous) p50 / p99, into a
   broker with the default flush policy and with ``--group-commit``.

Baselines measured in the same run:

- **floor**: a Python loopback TCP round trip between two processes
  (ping-pong of a 16-byte message, blocking sockets, TCP_NODELAY): no Python
  messaging system can deliver faster than about this;
- **Redis Streams** (where ``redis-server`` is installed): XADD from this
  process, XREADGROUP BLOCK in a consumer process, same schedules and the same
  clock; a minimal RESP client over a socket, so no extra package.

Run: ``.venv/bin/python bench/bench_latency.py [--runs 3] [--quick]``
(``--quick``: shorter cases and 1/2 s silences, for a look; not for figures).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
# the repository root too: else tests/zk_layout/ shadows zk_layout where that is found only
# through an editable install's finder (tests/README.md)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers.procs import start_broker  # noqa: E402

from metaq import ConsumerConfig, MessageConsumer, Producer  # noqa: E402
from metaq._zk import ZooKeeperServer  # noqa: E402
from metaq.protocol import SPEEDUPS_STATUS  # noqa: E402
from metaq.testing import free_port, wait_until  # noqa: E402

HERE = Path(__file__).resolve()
#: the consumer as it is: its default hold (the broker answers at once when a message lands)
HOLD = ConsumerConfig(group="x").fetch_hold


# ------------------------------------------------------------------ consumer child
def child(zk: str, group: str, topic: str, expect: int, out: str, hold: float) -> None:
    """Consume ``expect`` messages, write their latencies (ns) to ``out``."""
    lat: list[int] = []
    done = threading.Event()
    now = time.monotonic_ns

    def on_message(m):  # noqa: ANN001, ANN202
        if m.body == b"0":
            return  # the message that made the route known before the clock started
        lat.append(now() - int(m.body))
        if len(lat) >= expect:
            done.set()

    with MessageConsumer(group, zk, fetch_hold=hold, fetch_runner_count=1,
                         codec="bytes") as consumer:
        consumer.subscribe(topic, on_message)
        consumer.start()
        if not consumer.wait_settled(60):
            raise SystemExit("consumer did not settle")
        print("ready", flush=True)
        if expect == 0:  # idle mode: report our CPU when asked
            sys.stdin.readline()
            t = os.times()
            print(f"cpu {t.user + t.system}", flush=True)
            sys.stdin.readline()
            t = os.times()
            print(f"cpu {t.user + t.system}", flush=True)
            return
        done.wait()
    Path(out).write_text("\n".join(map(str, lat)))


class Child:
    def __init__(self, zk: str, group: str, topic: str, expect: int, hold: float) -> None:
        self.out = tempfile.mktemp(prefix="lat-")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE), "child", zk, group, topic, str(expect), self.out,
             str(hold)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise RuntimeError(f"consumer child failed to start: {line!r}")

    def cpu(self) -> float:
        self.proc.stdin.write("\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline().split()[1])

    def result(self, timeout: float = 120.0) -> list[float]:
        self.proc.wait(timeout)
        data = Path(self.out).read_text().split()
        os.unlink(self.out)
        return [int(x) / 1e6 for x in data]  # ms


# ------------------------------------------------------------------ schedules
def steady(send, rate: int, seconds: float) -> int:  # noqa: ANN001
    """Call ``send(ts)`` ``rate`` times a second, spread over 1 ms ticks."""
    total = int(rate * seconds)
    start = time.monotonic()
    sent = 0
    while sent < total:
        due = min(total, int((time.monotonic() - start) * rate) + 1)
        while sent < due:
            send(time.monotonic_ns())
            sent += 1
        nxt = start + sent / rate
        delay = nxt - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    return total


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summary(xs: list[float]) -> str:
    return f"p50 {pct(xs, 0.5):7.3f}  p99 {pct(xs, 0.99):7.3f}  max {max(xs):8.3f} ms"


# ------------------------------------------------------------------ floor
def _echo_server(port_file: str) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    Path(port_file).write_text(str(srv.getsockname()[1]))
    c, _ = srv.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        d = c.recv(64)
        if not d:
            return
        c.sendall(d)


def floor(n: int = 3000) -> list[float]:
    pf = tempfile.mktemp()
    p = subprocess.Popen([sys.executable, str(HERE), "echo", pf])
    try:
        wait_until(lambda: os.path.exists(pf) and Path(pf).read_text(), 10, what="echo server")
        s = socket.create_connection(("127.0.0.1", int(Path(pf).read_text())))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = []
        for _ in range(n):
            t = time.perf_counter_ns()
            s.sendall(b"0123456789abcdef")
            got = 0
            while got < 16:
                got += len(s.recv(64))
            out.append((time.perf_counter_ns() - t) / 1e6)
        s.close()
        return out
    finally:
        p.wait(10)
        os.unlink(pf)


# ------------------------------------------------------------------ redis
class Resp:
    """A minimal RESP2 client: enough for XGROUP, XADD and XREADGROUP."""

    def __init__(self, port: int) -> None:
        self.s = socket.create_connection(("127.0.0.1", port))
        self.s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.f = self.s.makefile("rb")

    @staticmethod
    def encode(*args: str | bytes) -> bytes:
        out = [b"*%d\r\n" % len(args)]
        for a in args:
            b = a if isinstance(a, bytes) else str(a).encode()
            out.append(b"$%d\r\n%b\r\n" % (len(b), b))
        return b"".join(out)

    def send(self, *args: str | bytes) -> None:
        self.s.sendall(self.encode(*args))

    def read(self):  # noqa: ANN201
        line = self.f.readline()
        t, rest = line[:1], line[1:-2]
        if t in (b"+", b":"):
            return rest
        if t == b"-":
            raise RuntimeError(rest.decode())
        if t == b"$":
            n = int(rest)
            if n < 0:
                return None
            data = self.f.read(n + 2)
            return data[:-2]
        if t == b"*":
            n = int(rest)
            return None if n < 0 else [self.read() for _ in range(n)]
        raise RuntimeError(f"bad RESP line {line!r}")

    def call(self, *args: str | bytes):  # noqa: ANN201
        self.send(*args)
        return self.read()


def redis_child(port: int, expect: int, out: str) -> None:
    r = Resp(port)
    now = time.monotonic_ns
    lat: list[int] = []
    print("ready", flush=True)
    while len(lat) < expect:
        reply = r.call("XREADGROUP", "GROUP", "g", "c1", "COUNT", "1000", "BLOCK", "0",
                       "STREAMS", "s", ">")
        t = now()
        for _stream, entries in reply:
            for _id, fields in entries:
                lat.append(t - int(fields[1]))
    Path(out).write_text("\n".join(map(str, lat)))


class RedisChild(Child):
    def __init__(self, port: int, expect: int) -> None:  # noqa: D107
        self.out = tempfile.mktemp(prefix="lat-")
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE), "redis-child", str(port), str(expect), self.out],
            stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "ready"


@contextlib.contextmanager
def redis_server():  # noqa: ANN201
    exe = shutil.which("redis-server")
    if exe is None:
        yield None
        return
    port = free_port()
    p = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        def up() -> bool:
            try:
                Resp(port).call("PING")
                return True
            except OSError:
                return False
        wait_until(up, 10, what="redis-server")
        yield port
    finally:
        p.terminate()
        p.wait(10)


def redis_steady(port: int, rate: int, seconds: float) -> list[float]:
    r = Resp(port)
    with contextlib.suppress(RuntimeError):
        r.call("DEL", "s")
    r.call("XGROUP", "CREATE", "s", "g", "$", "MKSTREAM")
    expect = int(rate * seconds)
    c = RedisChild(port, expect)
    pending = [0]

    def send(ts: int) -> None:
        r.send("XADD", "s", "*", "t", str(ts))
        pending[0] += 1

    # read XADD replies on the side so the socket never fills
    def reader() -> None:
        for _ in range(expect):
            r.read()
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    steady(send, rate, seconds)
    t.join(60)
    return c.result()


def redis_silence(port: int, silences: list[float]) -> dict[float, list[float]]:
    r = Resp(port)
    with contextlib.suppress(RuntimeError):
        r.call("DEL", "s")
    r.call("XGROUP", "CREATE", "s", "g", "$", "MKSTREAM")
    c = RedisChild(port, len(silences))
    for s in silences:
        time.sleep(s)
        r.call("XADD", "s", "*", "t", str(time.monotonic_ns()))
    got = c.result()
    return _by_silence(silences, got)


def _by_silence(silences: list[float], got: list[float]) -> dict[float, list[float]]:
    out: dict[float, list[float]] = {}
    for s, v in zip(silences, got, strict=True):
        out.setdefault(s, []).append(v)
    return out


# ------------------------------------------------------------------ metaq cases
class Cluster:
    def __init__(self, stack: contextlib.ExitStack, group_commit: bool = False) -> None:
        self.tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-lat-")))
        self.zk = stack.enter_context(ZooKeeperServer())
        self.zk_connect = self.zk.hosts
        self.topics = {f"t{i}": 8 for i in range(16)} | {"idle": 1024}
        self.broker = stack.enter_context(start_broker(
            self.zk_connect, 0, self.tmp / "b0", self.topics, group_commit=group_commit))
        self.producer = stack.enter_context(Producer(self.zk_connect))
        self.n = 0

    def topic(self) -> str:
        self.n += 1
        return f"t{self.n - 1}"


def metaq_steady(cl: Cluster, hold: float, rate: int, seconds: float) -> list[float]:
    topic = cl.topic()
    cl.producer.send(topic, b"0")  # the route is known before the clock starts
    expect = int(rate * seconds)
    c = Child(cl.zk_connect, f"g-{topic}", topic, expect, hold)
    send_async = cl.producer.send_async
    futures = []
    steady(lambda ts: futures.append(send_async(topic, b"%d" % ts)), rate, seconds)
    for f in futures:
        f.result(30)
    return c.result()


def metaq_silence(cl: Cluster, hold: float, silences: list[float]) -> dict[float, list[float]]:
    topic = cl.topic()
    cl.producer.send(topic, b"0")
    c = Child(cl.zk_connect, f"g-{topic}", topic, len(silences), hold)
    for s in silences:
        time.sleep(s)
        cl.producer.send(topic, b"%d" % time.monotonic_ns())
    return _by_silence(silences, c.result())


def idle_cpu(cl: Cluster, hold: float, seconds: float) -> float:
    c = Child(cl.zk_connect, f"idle-{hold}", "idle", 0, hold)
    time.sleep(2.0)  # let the first round of fetches pass
    a = c.cpu()
    time.sleep(seconds)
    b = c.cpu()
    c.proc.wait(30)
    return 100.0 * (b - a) / seconds


def send_rtt(cl: Cluster, n: int = 2000) -> list[float]:
    topic = cl.topic()
    cl.producer.send(topic, b"0")
    out = []
    for _ in range(n):
        t = time.perf_counter_ns()
        cl.producer.send(topic, b"x" * 100)
        out.append((time.perf_counter_ns() - t) / 1e6)
    return out


# ------------------------------------------------------------------ main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--idle-seconds", type=float, default=30.0)
    ap.add_argument("--cases", default="steady,silence,idle,send",
                    help="which cases to run (comma separated)")
    args = ap.parse_args()
    secs = {500: 4.0 if args.quick else 10.0, 20_000: 2.0 if args.quick else 5.0}
    silences = [1.0, 2.0] if args.quick else [1.0] * 3 + [5.0] * 3 + [30.0]
    idle_s = 5.0 if args.quick else args.idle_seconds
    print(f"speedups: {SPEEDUPS_STATUS}; cores: {os.cpu_count()}; "
          f"load: {os.getloadavg()[0]:.2f}")
    rows: dict[str, list[list[float]]] = {}
    floors: list[list[float]] = []
    with contextlib.ExitStack() as stack:
        cl = Cluster(stack)
        rport = stack.enter_context(redis_server())
        cases = set(args.cases.split(","))
        for run in range(args.runs if "steady" in cases else 0):
            floors.append(floor())
            print(f"run {run + 1} floor, Python loopback TCP round trip: {summary(floors[-1])}")
            for rate, s in secs.items():
                for name, hold in (("metaq held gets", HOLD), ("metaq backoff (before)", 0.0)):
                    lat = metaq_steady(cl, hold, rate, s)
                    rows.setdefault(f"{rate}/s {name}", []).append(lat)
                    print(f"run {run + 1} {rate:>6}/s {name:24} {summary(lat)}", flush=True)
                if rport is not None:
                    lat = redis_steady(rport, rate, s)
                    rows.setdefault(f"{rate}/s redis streams", []).append(lat)
                    print(f"run {run + 1} {rate:>6}/s {'redis streams':24} {summary(lat)}",
                          flush=True)
        if not floors:
            floors.append(floor())
        fl = statistics.median(pct(f, 0.5) for f in floors)
        if rows:
            print(f"\nmedians over runs of each figure (ms); floor p50 {fl:.3f}:")
        for key, runs in rows.items():
            med = [statistics.median(pct(r, q) for r in runs) for q in (0.5, 0.99)]
            mx = statistics.median(max(r) for r in runs)
            print(f"  {key:34} p50 {med[0]:7.3f}  p99 {med[1]:7.3f}  max {mx:8.3f}  "
                  f"p50/floor {med[0] / fl:6.1f}x")
        if "silence" in cases:
            print("\nsingle messages after silence (ms, each sample):")
            for name, hold in (("metaq held gets", HOLD), ("metaq backoff (before)", 0.0)):
                res = metaq_silence(cl, hold, silences)
                print(f"  {name:24} " + "  ".join(
                    f"{s:g}s: " + ",".join(f"{v:.2f}" for v in vs) for s, vs in res.items()))
            if rport is not None:
                res = redis_silence(rport, silences)
                print(f"  {'redis streams':24} " + "  ".join(
                    f"{s:g}s: " + ",".join(f"{v:.2f}" for v in vs) for s, vs in res.items()))
        if "idle" in cases:
            print(f"\nidle consumer owning 1,024 partitions, CPU over {idle_s:g} s:")
            for name, hold in (("metaq held gets", HOLD), ("metaq backoff (before)", 0.0)):
                print(f"  {name:24} {idle_cpu(cl, hold, idle_s):6.2f} % of a core", flush=True)
        if "send" in cases:
            print(f"\nProducer.send round trip (100 B, synchronous); floor p50 {fl:.3f}:")
            print(f"  {'default flush':24} {summary(send_rtt(cl))}")
    if "send" in cases:
        with contextlib.ExitStack() as stack:
            cl = Cluster(stack, group_commit=True)
            print(f"  {'--group-commit':24} {summary(send_rtt(cl))}")

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        child(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]), sys.argv[6],
              float(sys.argv[7]))
    elif len(sys.argv) > 1 and sys.argv[1] == "redis-child":
        redis_child(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    elif len(sys.argv) > 1 and sys.argv[1] == "echo":
        _echo_server(sys.argv[2])
    else:
        main()
