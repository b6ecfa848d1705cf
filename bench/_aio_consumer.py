"""The consumer section of ``bench_aio.py``: AsyncConsumer beside MessageConsumer in
the same run (throughput, send->handler latency, event loop lag).

Setup (once per section): one broker process with topic ``small``
(``--partitions`` partitions) loaded with ``--consumer-count`` messages of 100 B by
pipelined puts (bench_consumer.py's ``load``), and an empty topic ``live``.

Each run:

1. **throughput** (a new group each time, from offset 0, one member,
   ``fetch_runner_count=--runners``), clock from the first message handled to
   the last: threaded ``each`` (a per-message listener), threaded ``batch``
   (``on_messages``), asyncio ``each`` (``async def handle(m)``, awaited per
   message), asyncio ``batch`` (async ``on_messages``), asyncio ``iter``
   (``async for m in consumer``).  Every handler counts messages; counts are checked.
2. **latency**: a producer thread sends ``live`` at 500 and 20,000 msg/s for
   ``--seconds`` each, the send time (``time.time_ns``) in the body; each consumer
   (threaded listener, then async handler) records now minus that time per
   message: p50 / p99 in ms.
3. **loop lag**: a ticker coroutine sleeping 1 ms records how late it wakes
   while asyncio ``each`` drains ``small`` at full speed: p99 in ms.

Medians over ``--runs``; ratios are asyncio / threaded.  Targets (issue 27):
asyncio each >= 1 M msg/s, latency p50 within 1.5x of threaded, loop lag p99 < 5 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import statistics
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from bench_consumer import load  # noqa: E402
from helpers.procs import start_broker  # noqa: E402

from metaq import MessageConsumer, Producer  # noqa: E402
from metaq.aio import AsyncConsumer  # noqa: E402

_groups = itertools.count()


def _group(kind: str) -> str:
    return f"bench-{kind}-{next(_groups)}-{time.monotonic_ns()}"


class _Count:
    """Messages handled so far; the clock from the first to the ``total``-th, then
    ``done()``."""

    def __init__(self, total: int, done) -> None:  # noqa: ANN001
        self.total, self.done = total, done
        self.n, self.first, self.last = 0, 0.0, 0.0

    def add(self, k: int) -> None:
        if not self.n:
            self.first = time.perf_counter()
        self.n += k
        if self.n >= self.total:
            self.last = time.perf_counter()
            self.done()

    def rate(self) -> float:
        return self.total / (self.last - self.first)


def threaded_run(zk: str, topic: str, total: int, mode: str, runners: int) -> float:
    """msg/s of MessageConsumer, first message to last."""
    done = threading.Event()
    count = _Count(total, done.set)

    def on_message(m):  # noqa: ANN001, ANN202
        count.add(1)

    class Batch:
        def on_messages(self, batch):  # noqa: ANN001, ANN202
            count.add(len(batch))

    c = MessageConsumer(_group("t"), zk, fetch_runner_count=runners, commit_period=60.0)
    try:
        c.subscribe(topic, on_message if mode == "each" else Batch())
        c.start()
        if not done.wait(300):
            raise RuntimeError(f"threaded {mode} stalled at {count.n}/{total}")
    finally:
        c.close()
    return count.rate()


async def aio_run(zk: str, topic: str, total: int, mode: str, runners: int,
                  lag: list[float] | None = None) -> float:
    """msg/s of AsyncConsumer, first message to last (``lag``: a 1 ms ticker's
    lateness while it runs, in ms)."""
    done = asyncio.Event()
    count = _Count(total, done.set)

    async def handle(m):  # noqa: ANN001, ANN202
        count.add(1)

    class Batch:
        async def on_messages(self, batch):  # noqa: ANN001, ANN202
            count.add(len(batch))

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        while not done.is_set():
            t = loop.time()
            await asyncio.sleep(0.001)
            assert lag is not None
            lag.append((loop.time() - t - 0.001) * 1000)

    c = AsyncConsumer(_group("a"), zk, fetch_runner_count=runners, commit_period=60.0,
                      blocking_threshold=None, handler_timeout=None)
    try:
        if mode == "iter":
            c.subscribe(topic)
        else:
            c.subscribe(topic, handle if mode == "each" else Batch())
        await c.start()
        tick = asyncio.ensure_future(ticker()) if lag is not None else None
        if mode == "iter":
            async for m in c:
                await handle(m)
                if done.is_set():
                    break
        else:
            await asyncio.wait_for(done.wait(), 300)
        if tick is not None:
            await tick
    finally:
        await c.close()
    return count.rate()


def steady(zk: str, topic: str, rate: int, seconds: float) -> int:
    """Send ``rate`` msg/s for ``seconds``, the send time in each body; how many."""
    n = 0
    with Producer(zk) as p:
        t0 = time.perf_counter()
        step = 1.0 / rate
        futures = []
        while True:
            now = time.perf_counter()
            due = int((now - t0) / step) + 1
            if now - t0 >= seconds:
                break
            while n < due:
                futures.append(p.send_async(topic, str(time.time_ns()).encode()))
                n += 1
            time.sleep(0.0005)
        for f in futures:
            f.result(30)
    return n


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def latency(zk: str, topic: str, rate: int, seconds: float, kind: str) -> list[float]:
    """ms from send to handler, for one consumer kind at one rate."""
    got: list[float] = []

    def record(m) -> None:  # noqa: ANN001
        got.append((time.time_ns() - int(m.body)) / 1e6)

    if kind == "threaded":
        c = MessageConsumer(_group("lt"), zk, start_position="latest", commit_period=60.0)
        c.subscribe(topic, record)
        c.start()
        c.wait_settled(30)
        try:
            n = steady(zk, topic, rate, seconds)
            deadline = time.monotonic() + 30
            while len(got) < n and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            c.close()
        return got

    async def main() -> list[float]:
        async def handle(m):  # noqa: ANN001, ANN202
            record(m)

        c = AsyncConsumer(_group("la"), zk, start_position="latest", commit_period=60.0)
        c.subscribe(topic, handle)
        await c.start()
        await c.wait_settled(30)
        try:
            n = await asyncio.to_thread(steady, zk, topic, rate, seconds)
            deadline = time.monotonic() + 30
            while len(got) < n and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            await c.close()
        return got

    return asyncio.run(main())


def section(zk_connect: str, tmp: Path, args: argparse.Namespace) -> list[tuple]:
    """bench_aio.py's ``consumer`` section: its rows (see bench_aio.Row) and the target
    lines (printed at the end)."""
    logging.getLogger("metaq").setLevel(logging.WARNING)
    rates: dict[str, list[float]] = {}
    lat: dict[tuple[str, int], list[tuple[float, float]]] = {}
    lags: list[float] = []
    with start_broker(zk_connect, 0, tmp / "broker-consumer",
                      {"small": args.partitions, "live": 1}) as broker:
        took = load(broker.port, "small", args.partitions, args.consumer_count, 100)
        print(f"  loaded small: {args.consumer_count} x 100 B in {took:.1f}s", flush=True)
        for run in range(args.runs):
            for mode in ("each", "batch"):
                r = threaded_run(zk_connect, "small", args.consumer_count, mode, args.runners)
                rates.setdefault(f"threaded-{mode}", []).append(r)
            for mode in ("each", "batch", "iter"):
                lag = [] if mode == "each" else None
                r = asyncio.run(aio_run(zk_connect, "small", args.consumer_count, mode,
                                        args.runners, lag))
                rates.setdefault(f"aio-{mode}", []).append(r)
                if lag is not None:
                    lags.append(pct(lag, 0.99))
            if not args.skip_latency:
                for rate in (500, 20_000):
                    for kind in ("threaded", "aio"):
                        xs = latency(zk_connect, "live", rate, args.seconds, kind)
                        lat.setdefault((kind, rate), []).append((pct(xs, 0.5), pct(xs, 0.99)))
            print(f"  consumer run {run + 1}: " + ", ".join(
                f"{k} {v[-1]:,.0f}" for k, v in rates.items()), flush=True)
    med = {k: statistics.median(v) for k, v in rates.items()}
    loop_p99 = statistics.median(lags)
    rows: list[tuple] = []
    for mode in ("each", "batch"):
        rows.append(("consumer", "threaded", mode, med[f"threaded-{mode}"], None, ""))
    for mode, base in (("each", "each"), ("batch", "batch"), ("iter", "each")):
        note = f"loop lag p99 {loop_p99:.2f} ms" if mode == "each" else ""
        rows.append(("consumer", "asyncio", mode, med[f"aio-{mode}"],
                     med[f"aio-{mode}"] / med[f"threaded-{base}"], note))
    targets = [f"target: asyncio each >= 1,000,000 msg/s: {med['aio-each']:,.0f} "
               f"{'PASS' if med['aio-each'] >= 1e6 else 'MISS'}",
               f"target: event loop lag p99 < 5 ms while consuming: {loop_p99:.2f} ms "
               f"{'PASS' if loop_p99 < 5 else 'MISS'}"]
    for rate in (500, 20_000) if lat else ():
        base = statistics.median(p for p, _ in lat[("threaded", rate)])
        for kind in ("threaded", "aio"):
            p50 = statistics.median(p for p, _ in lat[(kind, rate)])
            p99 = statistics.median(p for _, p in lat[(kind, rate)])
            rows.append((f"latency {rate:,} msg/s", "threaded" if kind == "threaded"
                         else "asyncio", "p50 ms", p50, None if kind == "threaded"
                         else p50 / base, f"p99 {p99:.3f} ms"))
        p50 = statistics.median(p for p, _ in lat[("aio", rate)])
        targets.append(f"target: latency p50 at {rate:,} msg/s within 1.5x threaded: "
                       f"{p50 / base:.2f}x {'PASS' if p50 <= 1.5 * base else 'MISS'}")
    return rows + [("target", t) for t in targets]
