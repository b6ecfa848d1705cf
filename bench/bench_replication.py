"""Replication (issue 26): what a slave costs the producer, how far an async slave lags,
how fast a slave takes over from a killed master.

Setup: a real ZooKeeper (``metaq._zk`` launcher) and broker processes
(``python -m metaq broker start``), all on this machine.  Per flush policy
(``default``: Metaq's, fsync after 1000 messages or 10 s; ``group-commit``:
``--group-commit`` on the master **and** the slave), three brokers ids side by side,
each serving its own topic with ``--partitions`` partitions:

- **none** (the baseline): a lone master;
- **async**: a master (``--replication async``) and its slave (``--slave-of <id>
  --slave-id 1``);
- **sync**: a master (``--replication sync``) and its slave; a put is acknowledged
  once the in-sync slave has fetched past it.

The slaves copy with held gets (group ``meta-slave-group-1``); each measurement
starts with both slaves in the in-sync set (ZooKeeper's replication node) and
caught up (every partition's end on the slave equal to the master's), and every
run waits for that again afterwards, so that a slave's backlog never spills into
the next measurement (and checks that the copy is complete).

1. **send_batch and send.**  Per body size (100 B, 1 KiB) and run, the three
   setups in turn (the order rotates per run): ``Producer.send_batch`` of
   ``--batch`` messages at a time (all batches queued, then every ``SendResult``
   read, as ``bench_producer.py``), msgs/s; then ``Producer.send`` one at a time,
   ``--sync-count`` of them, each timed: p50 and p99.  Medians over ``--runs``;
   beside each, the ratio of the median to none's (the in-run baseline).  Where
   the time goes: the CPU per message of this process, the master and the slave
   (``/proc/<pid>/stat``; the slave's until it has caught up) during ``send_batch``;
   and as many ``put`` requests one at a time on a plain connection to the master
   (no producer: the broker's part of a ``send``), their round trip p50 and the
   master's and slave's CPU per put.
2. **Replication lag** of the async setup under a steady 20,000 msg/s
   (``--lag-rate``, 100 B, ``send_async`` on 1 ms ticks, as ``bench_latency.py``) for
   ``--lag-seconds``: every 20th message's acknowledgement time is recorded (its
   future's done callback, this process's ``perf_counter``); a poller thread asks
   the master and then the slave for every partition's end (``offset`` at the
   largest offset) every ``--poll-ms``.  The lag of a message is the time from its
   acknowledgement to the first poll reply in which the slave's end is past its
   offset (an upper bound: the poll cycle is printed as the resolution); the byte
   lag is master end - slave end summed over partitions, per poll.  The master's
   own ``stats`` (``replication_slave 1 ... lag_bytes .. lag_seconds ..``) is
   sampled every 100 ms beside it.  p50 / p99 per run, medians of the runs.
3. **Failover.**  ``--failovers`` times, a fresh pair (own broker id, own data):
   master ``--replication sync --zk-session-timeout S``, slave the same plus
   ``--auto-promote``; a ``Producer`` (``send_timeout`` 30 s, ``retries`` 100) sends
   one message at a time in a thread; a second thread puts directly to the slave's
   port every 2 ms (refused while it is a slave).  Then the master is killed
   (SIGKILL).  Measured: kill -> the master node's deletion seen by a ZooKeeper
   watch (the **session timeout**, reported separately), and from that deletion
   to the first put the promoted slave acknowledged on its port (**broker**) and to
   the first ``Producer.send`` that returned (**producer**): the failover with the
   session timeout excluded.  Medians over the repeats.

Targets (issue 26, this 2-core machine), printed PASS or MISS:

- sync ``send`` p50 at most 2x none's; sync ``send_batch`` at least 50 % of none's
  (each flush policy and body size);
- async lag p99 under 50 ms at 20,000 msg/s;
- failover, session timeout excluded (producer), under 1 s.

Run: ``.venv/bin/python bench/bench_replication.py [--runs 3] [--quick]``
(``--quick``: small counts, 1 run, 2 s of lag, 1 failover; for the plumbing, not for figures).
"""

from __future__ import annotations

import argparse
import bisect
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path

from kazoo.client import KazooClient
from kazoo.recipe.watchers import DataWatch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
# the repository root too: else tests/zk_layout/ shadows zk_layout where that is found only
# through an editable install's finder (tests/README.md)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers.procs import BrokerProc, start_broker, stop_all  # noqa: E402

import zk_layout  # noqa: E402
from metaq import Producer  # noqa: E402
from metaq._zk import ZooKeeperServer  # noqa: E402
from metaq.protocol import SPEEDUPS_STATUS  # noqa: E402
from metaq.testing import wait_until  # noqa: E402

SIZES = (100, 1024)
MODES = ("none", "async", "sync")
END = 2**63 - 1
LAYOUT = zk_layout.Layout()
_CLK = os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def proc_cpu(pid: int | None) -> float:
    """User + system CPU seconds of process ``pid`` (0 for None)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK


def loadavg() -> str:
    return "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


# -- brokers -----------------------------------------------------------------------------------

def kazoo(hosts: str) -> KazooClient:
    client = KazooClient(hosts=hosts, timeout=10.0)
    client.start(30)
    return client


def in_sync(admin: KazooClient, broker_id: int) -> tuple[int, ...]:
    got = zk_layout.read_replication(admin, LAYOUT, broker_id)
    return () if got is None else tuple(got[0].in_sync)


def ends(broker: BrokerProc, topic: str, partitions: int) -> list[int]:
    with broker.connection() as c:
        return [c.offset(topic, "bench", p, END) for p in range(partitions)]


class Pair:
    """One broker id: a master and, unless ``mode`` is none, its slave."""

    def __init__(self, zk_connect: str, tmp: Path, broker_id: int, mode: str, topic: str,
                 partitions: int, group_commit: bool, session: float = 30.0,
                 auto_promote: bool = False) -> None:
        self.mode, self.topic, self.partitions = mode, topic, partitions
        self.broker_id = broker_id
        common = ["--zk-session-timeout", f"{session:g}"]
        if mode != "none":
            common += ["--replication", mode]
        self.master = start_broker(zk_connect, broker_id, tmp / f"b{broker_id}-m",
                                   {topic: partitions}, group_commit=group_commit,
                                   zk_session_timeout=session, extra_args=common)
        self.slave: BrokerProc | None = None
        if mode != "none":
            args = ["--slave-of", str(broker_id), "--slave-id", "1", *common]
            if auto_promote:
                args.append("--auto-promote")
            try:
                self.slave = start_broker(zk_connect, broker_id, tmp / f"b{broker_id}-s", {},
                                          group_commit=group_commit,
                                          zk_session_timeout=session, extra_args=args)
            except BaseException:
                self.master.kill()
                raise

    @property
    def procs(self) -> list[BrokerProc]:
        return [self.master] + ([self.slave] if self.slave is not None else [])

    def wait_in_sync(self, admin: KazooClient, timeout: float = 60.0) -> None:
        if self.slave is None:
            return
        wait_until(lambda: 1 in in_sync(admin, self.broker_id), timeout, 0.02,
                   what=f"broker {self.broker_id}'s slave to be in sync")

    def wait_caught_up(self, timeout: float = 60.0) -> None:
        if self.slave is None:
            return
        want = ends(self.master, self.topic, self.partitions)
        wait_until(lambda: ends(self.slave, self.topic, self.partitions) == want, timeout,
                   0.01, what=f"broker {self.broker_id}'s slave to reach {want}")


# -- 1. send_batch and send -------------------------------------------------------------------

def batch_rate(producer: Producer, pair: Pair, body: bytes, count: int, size: int
               ) -> tuple[float, tuple[float, float, float]]:
    """msgs/s, and CPU microseconds per message of this process, the master and the
    slave (the slave's until it has caught up: its copying is part of the cost)."""
    bodies = [body] * size
    topic = pair.topic
    spid = pair.slave.pid if pair.slave is not None else None
    c0 = (time.process_time(), proc_cpu(pair.master.pid), proc_cpu(spid))
    t0 = time.perf_counter()
    futures = [producer.send_batch(topic, bodies) for _ in range(count // size)]
    got = 0
    for f in futures:
        for r in f.result(120):
            got += r.offset >= 0
    dt = time.perf_counter() - t0
    mine = time.process_time()
    if got != count // size * size:
        raise RuntimeError(f"batch: {got} results for {count} messages")
    pair.wait_caught_up()
    c1 = (mine, proc_cpu(pair.master.pid), proc_cpu(spid))
    cpu = [(b - a) / got * 1e6 for a, b in zip(c0, c1, strict=True)]
    return got / dt, (cpu[0], cpu[1], cpu[2])


def send_latencies(producer: Producer, topic: str, body: bytes, count: int) -> list[float]:
    send = producer.send
    out = []
    for _ in range(count):
        t = time.perf_counter()
        send(topic, body)
        out.append((time.perf_counter() - t) * 1e3)
    return out


def raw_puts(pair: Pair, body: bytes, count: int) -> tuple[list[float], float, float]:
    """One ``put`` at a time over a plain connection to the master (partition ``i % N``):
    each round trip in ms (the broker's part of ``send``, without the producer), and the
    CPU microseconds per put of the master and of the slave (until it has caught up)."""
    check = zlib.crc32(body) & 0x7FFFFFFF
    spid = pair.slave.pid if pair.slave is not None else None
    m0, s0 = proc_cpu(pair.master.pid), proc_cpu(spid)
    out = []
    with pair.master.connection() as c:
        for i in range(count):
            t = time.perf_counter()
            c.read_result(c.send_put(pair.topic, i % pair.partitions, body, 0, check))
            out.append((time.perf_counter() - t) * 1e3)
    pair.wait_caught_up()
    return (out, (proc_cpu(pair.master.pid) - m0) / count * 1e6,
            (proc_cpu(spid) - s0) / count * 1e6)


def throughput_section(zk_connect: str, admin: KazooClient, tmp: Path,
                       args: argparse.Namespace) -> list[tuple]:
    """Rows: (policy, size, mode, batch rates, send p50s, send p99s, batch CPU, raw put
    p50s, raw put CPU) per run."""
    rows = []
    for pi, policy in enumerate(args.policies.split(",")):
        gc = policy == "group-commit"
        pairs: dict[str, Pair] = {}
        try:
            for mi, mode in enumerate(MODES):
                pairs[mode] = Pair(zk_connect, tmp / policy, 10 * pi + mi, mode,
                                   f"{mode}-{policy}", args.partitions, gc)
            for pair in pairs.values():
                pair.wait_in_sync(admin)
            with Producer(zk_connect, send_timeout=30.0) as producer:
                for pair in pairs.values():  # routes known, connections open
                    batch_rate(producer, pair, b"warm-up", 2000, 100)
                    send_latencies(producer, pair.topic, b"warm-up", 100)
                    pair.wait_caught_up()
                for size in SIZES:
                    body = b"x" * size
                    count = args.count_100 if size == 100 else args.count_1k
                    got = {m: ([], [], [], [], [], []) for m in MODES}
                    print(f" {policy} {size} B, {loadavg()}", flush=True)
                    for run in range(args.runs):
                        order = MODES[run % 3:] + MODES[:run % 3]
                        for mode in order:
                            pair = pairs[mode]
                            rate, cpu = batch_rate(producer, pair, body, count, args.batch)
                            lat = send_latencies(producer, pair.topic, body, args.sync_count)
                            pair.wait_caught_up()
                            raw, mcpu, scpu = raw_puts(pair, body, args.sync_count)
                            got[mode][0].append(rate)
                            got[mode][1].append(pct(lat, 0.5))
                            got[mode][2].append(pct(lat, 0.99))
                            got[mode][3].append(cpu)
                            got[mode][4].append(pct(raw, 0.5))
                            got[mode][5].append((mcpu, scpu))
                        print(f"  run {run + 1}: " + "; ".join(
                            f"{m} {got[m][0][-1]:,.0f}/s p50 {got[m][1][-1]:.3f} p99 "
                            f"{got[m][2][-1]:.3f} ms" for m in MODES), flush=True)
                    for mode in MODES:
                        rows.append((policy, size, mode, *got[mode]))
        finally:
            stop_all(p for pair in pairs.values() for p in pair.procs)
    return rows


# -- 2. replication lag -----------------------------------------------------------------------

class LagPoller(threading.Thread):
    """Polls the master's and the slave's partition ends; samples the master's stats."""

    def __init__(self, pair: Pair, poll_s: float) -> None:
        super().__init__(name="bench-lag-poller", daemon=True)
        self.pair, self.poll_s = pair, poll_s
        self.stop_event = threading.Event()
        #: per partition: reply times and slave ends (ends never decrease)
        self.times: list[list[float]] = [[] for _ in range(pair.partitions)]
        self.ends: list[list[int]] = [[] for _ in range(pair.partitions)]
        self.byte_lags: list[int] = []
        self.cycles: list[float] = []
        self.stats_bytes: list[int] = []
        self.stats_secs: list[float] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        pair = self.pair
        topic, n = pair.topic, pair.partitions
        try:
            with pair.master.connection() as mc, pair.slave.connection() as sc:
                next_stats = 0.0
                while not self.stop_event.is_set():
                    t0 = time.perf_counter()
                    mends = [mc.offset(topic, "bench", p, END) for p in range(n)]
                    lag = 0
                    for p in range(n):
                        e = sc.offset(topic, "bench", p, END)
                        self.times[p].append(time.perf_counter())
                        self.ends[p].append(e)
                        lag += max(0, mends[p] - e)
                    self.byte_lags.append(lag)
                    if t0 >= next_stats:
                        next_stats = t0 + 0.1
                        for line in mc.stats().splitlines():
                            f = line.split()
                            if f[:1] == ["STAT"]:
                                f = f[1:]
                            if f[:2] == ["replication_slave", "1"]:
                                self.stats_bytes.append(int(f[f.index("lag_bytes") + 1]))
                                self.stats_secs.append(
                                    float(f[f.index("lag_seconds") + 1]) * 1e3)
                    self.cycles.append((time.perf_counter() - t0) * 1e3)
                    left = self.poll_s - (time.perf_counter() - t0)
                    if left > 0:
                        time.sleep(left)
        except BaseException as e:  # noqa: BLE001 - reported by the caller
            self.error = e

    def readable_at(self, partition: int, offset: int) -> float | None:
        """The first poll reply time at which the slave's end was past ``offset``."""
        i = bisect.bisect_right(self.ends[partition], offset)
        return self.times[partition][i] if i < len(self.times[partition]) else None


def steady(send, rate: int, seconds: float) -> int:  # noqa: ANN001
    """Call ``send()`` ``rate`` times a second, spread over 1 ms ticks (bench_latency's)."""
    total = int(rate * seconds)
    start = time.monotonic()
    sent = 0
    while sent < total:
        due = min(total, int((time.monotonic() - start) * rate) + 1)
        while sent < due:
            send()
            sent += 1
        delay = start + sent / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    return total


def lag_run(producer: Producer, pair: Pair, args: argparse.Namespace) -> dict[str, float]:
    poller = LagPoller(pair, args.poll_ms / 1e3)
    acks: list[tuple[float, int, int]] = []
    body = b"x" * 100
    send_async = producer.send_async
    futures = []
    k = [0]

    def record(f) -> None:  # noqa: ANN001 - on the producer's reader thread
        t = time.perf_counter()
        r = f.result()
        acks.append((t, r.index, r.offset))

    def send() -> None:
        f = send_async(pair.topic, body)
        k[0] += 1
        if k[0] % 20 == 0:
            f.add_done_callback(record)
        futures.append(f)

    poller.start()
    t0 = time.perf_counter()
    steady(send, args.lag_rate, args.lag_seconds)
    for f in futures:
        f.result(60)
    achieved = len(futures) / (time.perf_counter() - t0)
    pair.wait_caught_up()
    time.sleep(max(0.05, 3 * args.poll_ms / 1e3))  # one more poll after the last copy
    poller.stop_event.set()
    poller.join(30)
    if poller.error is not None:
        raise RuntimeError(f"lag poller failed: {poller.error!r}")
    lags = []
    for t_ack, p, off in acks:
        t = poller.readable_at(p, off)
        if t is None:
            raise RuntimeError(f"partition {p} offset {off} never seen on the slave")
        lags.append(max(0.0, t - t_ack) * 1e3)
    return {"rate": achieved, "samples": len(lags),
            "p50": pct(lags, 0.5), "p99": pct(lags, 0.99), "max": max(lags),
            "bytes p50": pct(poller.byte_lags, 0.5), "bytes p99": pct(poller.byte_lags, 0.99),
            "cycle": statistics.median(poller.cycles),
            "stats bytes p99": pct(poller.stats_bytes, 0.99) if poller.stats_bytes else -1,
            "stats ms p99": pct(poller.stats_secs, 0.99) if poller.stats_secs else -1}


def lag_section(zk_connect: str, admin: KazooClient, tmp: Path,
                args: argparse.Namespace) -> list[tuple[str, list[dict]]]:
    out = []
    for pi, policy in enumerate(args.policies.split(",")):
        pair = Pair(zk_connect, tmp / f"lag-{policy}", 100 + pi, "async", f"lag-{policy}",
                    args.partitions, policy == "group-commit")
        try:
            pair.wait_in_sync(admin)
            with Producer(zk_connect, send_timeout=30.0) as producer:
                send_latencies(producer, pair.topic, b"warm-up", 100)
                pair.wait_caught_up()
                runs = []
                for run in range(args.runs):
                    r = lag_run(producer, pair, args)
                    runs.append(r)
                    print(f"  lag {policy} run {run + 1}: {r['rate']:,.0f} msg/s, "
                          f"{r['samples']} samples, p50 {r['p50']:.2f} p99 {r['p99']:.2f} "
                          f"max {r['max']:.2f} ms; bytes p50 {r['bytes p50']:,.0f} "
                          f"p99 {r['bytes p99']:,.0f}; poll cycle {r['cycle']:.2f} ms; "
                          f"master stats p99 {r['stats bytes p99']:,.0f} B "
                          f"{r['stats ms p99']:.0f} ms", flush=True)
                out.append((policy, runs))
        finally:
            stop_all(pair.procs)
    return out


# -- 3. failover ------------------------------------------------------------------------------

def failover_once(zk_connect: str, admin: KazooClient, tmp: Path, broker_id: int,
                  session: float) -> dict[str, float]:
    topic = f"fo{broker_id}"
    pair = Pair(zk_connect, tmp, broker_id, "sync", topic, 2, False, session=session,
                auto_promote=True)
    stop = threading.Event()
    acked: list[tuple[float, int]] = []
    errors: list[BaseException] = []
    probe_ok: list[float] = []
    gone: list[float] = []
    killed = [float("inf")]
    threads = []
    try:
        pair.wait_in_sync(admin)

        def produce() -> None:
            with Producer(zk_connect, send_timeout=30.0, retries=100) as producer:
                while not stop.is_set():
                    try:
                        r = producer.send(topic, b"failover")
                    except Exception as e:  # noqa: BLE001 - reported below
                        errors.append(e)
                    else:
                        acked.append((time.perf_counter(), r.broker_id))

        def probe() -> None:
            body = b"probe"
            check = zlib.crc32(body) & 0x7FFFFFFF
            conn = None
            while not stop.is_set() and not probe_ok:
                try:
                    if conn is None:
                        conn = pair.slave.connection(timeout=2.0)
                    conn.read_result(conn.send_put(topic, 0, body, 0, check))
                    probe_ok.append(time.perf_counter())
                except Exception:  # noqa: BLE001 - refused while a slave
                    pass
                time.sleep(0.002)
            if conn is not None:
                conn.close()

        path = LAYOUT.broker_master(broker_id)

        def watch(data, stat, event) -> None:  # noqa: ANN001
            if time.perf_counter() > killed[0] and not gone and event is not None:
                gone.append(time.perf_counter())

        DataWatch(admin, path, watch)
        threads = [threading.Thread(target=produce, name="bench-failover-producer"),
                   threading.Thread(target=probe, name="bench-failover-probe")]
        for t in threads:
            t.start()
        wait_until(lambda: len(acked) > 200, 30, what="sends before the kill")
        killed[0] = time.perf_counter()
        pair.master.kill()
        wait_until(lambda: gone and probe_ok and acked[-1][0] > gone[0], session + 30, 0.005,
                   what="the promoted slave to acknowledge a put")
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        stop_all(pair.procs)
    if errors:
        raise RuntimeError(f"producer errors during failover: {errors[:3]}")
    first = next(t for t, _b in acked if t > gone[0])
    return {"session": (gone[0] - killed[0]) * 1e3, "broker": (probe_ok[0] - gone[0]) * 1e3,
            "producer": (first - gone[0]) * 1e3, "total": (first - killed[0]) * 1e3}


# -- main -------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for the plumbing")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--count-100", type=int, default=100_000, help="send_batch messages, 100 B")
    ap.add_argument("--count-1k", type=int, default=30_000, help="send_batch messages, 1 KiB")
    ap.add_argument("--batch", type=int, default=100, help="messages per send_batch")
    ap.add_argument("--sync-count", type=int, default=2000,
                    help="timed sends (and raw puts) per run")
    ap.add_argument("--policies", default="default,group-commit")
    ap.add_argument("--lag-rate", type=int, default=20_000)
    ap.add_argument("--lag-seconds", type=float, default=5.0)
    ap.add_argument("--poll-ms", type=float, default=1.0)
    ap.add_argument("--failovers", type=int, default=3)
    ap.add_argument("--session-timeout", type=float, default=3.0)
    ap.add_argument("--sections", default="send,lag,failover")
    args = ap.parse_args()
    if args.quick:
        args.runs, args.count_100, args.count_1k = 1, 5000, 2000
        args.sync_count, args.lag_seconds, args.failovers = 200, 2.0, 1
    sections = set(args.sections.split(","))
    print(f"speedups: {SPEEDUPS_STATUS}; {os.cpu_count()} CPUs, {loadavg()} at start; "
          f"{args.runs} runs, medians; {args.partitions} partitions, batches of {args.batch}",
          flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="metaq-bench-repl-"))
    rows: list[tuple] = []
    lags: list[tuple[str, list[dict]]] = []
    fails: list[dict[str, float]] = []
    try:
        with ZooKeeperServer(data_dir=tmp / "zk") as zk:
            admin = kazoo(zk.hosts)
            admin.ensure_path("/bench")
            admin.stop()
            admin.close()
            zk_connect = zk.hosts + "/bench"
            admin = kazoo(zk_connect)
            try:
                if "send" in sections:
                    rows = throughput_section(zk_connect, admin, tmp, args)
                if "lag" in sections:
                    print(f" lag at {args.lag_rate:,} msg/s, {loadavg()}", flush=True)
                    lags = lag_section(zk_connect, admin, tmp, args)
                if "failover" in sections:
                    print(f" failover, {loadavg()}", flush=True)
                    for i in range(args.failovers):
                        r = failover_once(zk_connect, admin, tmp / f"fo{i}", 200 + i,
                                          args.session_timeout)
                        fails.append(r)
                        print(f"  failover {i + 1}: session timeout {r['session']:.0f} ms, "
                              f"then broker {r['broker']:.0f} ms, producer "
                              f"{r['producer']:.0f} ms (kill to producer {r['total']:.0f} ms)",
                              flush=True)
            finally:
                admin.stop()
                admin.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\n{loadavg()} at end\n")
    targets: list[str] = []
    if rows:
        print(f"send_batch ({args.batch} a batch) and send, medians of {args.runs} runs; "
              "ratios against none (the lone master) of the same run")
        print("| flush | body | replication | batch msgs/s | vs none | send p50 ms | vs none "
              "| send p99 ms | vs none | batch CPU us/msg: bench | master | slave |")
        print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        med = {(pol, size, mode): (statistics.median(r), statistics.median(p50),
                                   statistics.median(p99),
                                   [statistics.median(c[i] for c in cpu) for i in range(3)])
               for pol, size, mode, r, p50, p99, cpu, _raw, _rcpu in rows}
        for (pol, size, mode), (rate, p50, p99, cpu) in med.items():
            base = med[(pol, size, "none")]
            print(f"| {pol} | {size} B | {mode} | {rate:,.0f} | {rate / base[0]:.2f} | "
                  f"{p50:.3f} | {p50 / base[1]:.2f}x | {p99:.3f} | {p99 / base[2]:.2f}x | "
                  f"{cpu[0]:.1f} | {cpu[1]:.1f} | {'-' if mode == 'none' else f'{cpu[2]:.1f}'} |")
            if mode == "sync":
                lat, thr = p50 / base[1], rate / base[0]
                targets.append(f"target {pol} {size} B: sync send p50 <= 2x none: "
                               f"{lat:.2f}x {verdict(lat <= 2.0)}")
                targets.append(f"target {pol} {size} B: sync send_batch >= 50% of none: "
                               f"{thr * 100:.0f}% {verdict(thr >= 0.5)}")
    if rows:
        print(f"\nwhere a put's time goes: one put at a time on a plain connection to the "
              f"master ({args.sync_count} a run; no producer), medians of {args.runs} runs")
        print("| flush | body | replication | raw put p50 ms | vs none | CPU us/put: master "
              "| slave |")
        print("|---|---|---|---:|---:|---:|---:|")
        raw = {(pol, size, mode): (statistics.median(r),
                                   [statistics.median(c[i] for c in rc) for i in range(2)])
               for pol, size, mode, _r, _p50, _p99, _cpu, r, rc in rows}
        for (pol, size, mode), (p50, (mcpu, scpu)) in raw.items():
            base = raw[(pol, size, "none")][0]
            print(f"| {pol} | {size} B | {mode} | {p50:.3f} | {p50 / base:.2f}x | {mcpu:.1f} | "
                  f"{'-' if mode == 'none' else f'{scpu:.1f}'} |")
    if lags:
        print(f"\nasync replication lag at {args.lag_rate:,} msg/s (100 B, "
              f"{args.partitions} partitions), medians of {args.runs} runs; ms from the "
              f"master's acknowledgement to readable on the slave (upper bound, + one poll "
              f"cycle); bytes = master end - slave end, summed over partitions")
        print("| flush | msg/s sent | lag p50 ms | lag p99 ms | max ms | bytes p50 | bytes p99 "
              "| poll cycle ms | master stats p99 bytes | master stats p99 ms |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for pol, runs in lags:
            m = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(f"| {pol} | {m['rate']:,.0f} | {m['p50']:.2f} | {m['p99']:.2f} | "
                  f"{m['max']:.2f} | {m['bytes p50']:,.0f} | {m['bytes p99']:,.0f} | "
                  f"{m['cycle']:.2f} | {m['stats bytes p99']:,.0f} | "
                  f"{m['stats ms p99']:.0f} |")
            targets.append(f"target {pol}: async lag p99 < 50 ms at {args.lag_rate:,} msg/s: "
                           f"{m['p99']:.2f} ms {verdict(m['p99'] < 50.0)}")
    if fails:
        m = {k: statistics.median(r[k] for r in fails) for k in fails[0]}
        print(f"\nfailover (SIGKILL of a sync master, --auto-promote, session timeout "
              f"{args.session_timeout:g} s), medians of {len(fails)}: session timeout "
              f"{m['session']:.0f} ms (kill to the master node's deletion); failover, "
              f"session timeout excluded: broker {m['broker']:.0f} ms, producer "
              f"{m['producer']:.0f} ms; kill to first put {m['total']:.0f} ms")
        targets.append(f"target: failover (session timeout excluded, producer) < 1 s: "
                       f"{m['producer']:.0f} ms {verdict(m['producer'] < 1000.0)}")
    if targets:
        print()
        print("\n".join(targets))


if __name__ == "__main__":
    main()
