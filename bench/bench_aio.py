"""The asyncio API (``metaq.aio``) beside the threaded API, in the same run.

Sections (``--only`` picks some, comma-separated; each adds rows to one table):

- **producer**: one broker process (``python -m metaq broker start``, default flush policy)
  serving topic ``bench`` with ``--partitions`` partitions, 100 B bodies, round-robin.
  Per run, in this order: the threaded ``Producer.send_async`` for ``--count`` messages
  then ``result()`` of each (clock from the first send to the last result);
  ``AsyncProducer.send_async`` the same way (every awaitable awaited, in order, after
  all were sent; the loop gets a turn every 1,000 sends and every 1,000 awaits, as a
  service's would); then
  ``--sync-count`` messages one at a time with the threaded ``send`` and with
  ``await AsyncProducer.send``.  Beside each asyncio figure: its ratio to the threaded
  figure of the same run (1.00 = as fast).  Also per asyncio run: the event loop's lag
  (a 1 ms ticker task's lateness, p99 and max) while it sends.

- **consumer**: ``AsyncConsumer`` beside ``MessageConsumer`` (``bench/_aio_consumer.py``
  says how): per-message and batch throughput at 100 B, send->handler latency at 500 and
  20,000 msg/s, and the event loop's lag (a 1 ms ticker) while consuming at full speed,
  with issue 27's targets.

Medians over ``--runs``.  The machine's load averages (1, 5, 15 min) are printed at the
start and the end: figures taken while other processes use the CPU are low; the ratios,
taken in the same run, much less so.

Run: ``.venv/bin/python bench/bench_aio.py [--runs 5] [--only producer]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from kazoo.client import KazooClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
# the repository root too: else tests/zk_layout/ shadows zk_layout where that is found only
# through an editable install's finder (tests/README.md)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers.procs import start_broker  # noqa: E402

from metaq import Producer  # noqa: E402
from metaq._zk import ZooKeeperServer  # noqa: E402
from metaq.aio import AsyncProducer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _aio_consumer  # noqa: E402

TOPIC = "bench"
BODY = b"x" * 100

Row = tuple[str, str, str, float, float | None, str]  # section, api, call, rate, ratio, note


def loadavg() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f}"


class Ticker:
    """A task waking every millisecond; keeps how late each wake-up was (seconds)."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + 0.001
            await asyncio.sleep(0.001)
            self.lags.append(loop.time() - due)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> tuple[float, float]:
        """p99 and max lag in ms."""
        assert self._task is not None
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        lags = sorted(self.lags) or [0.0]
        return lags[int(0.99 * (len(lags) - 1))] * 1e3, lags[-1] * 1e3


# -- producer ----------------------------------------------------------------------------

def threaded_async(producer: Producer, n: int) -> float:
    t = time.perf_counter()
    futures = [producer.send_async(TOPIC, BODY) for _ in range(n)]
    for f in futures:
        f.result()
    return n / (time.perf_counter() - t)


def threaded_sync(producer: Producer, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        producer.send(TOPIC, BODY)
    return n / (time.perf_counter() - t)


async def aio_async(producer: AsyncProducer, n: int) -> tuple[float, float, float]:
    ticker = Ticker()
    ticker.start()
    await asyncio.sleep(0)
    t = time.perf_counter()
    pending = []
    for i in range(n):
        pending.append(producer.send_async(TOPIC, BODY))
        if i % 1000 == 999:
            await asyncio.sleep(0)
    for i, p in enumerate(pending):
        await p  # a finished send does not yield: give the loop a turn as above, or the
        if i % 1000 == 999:  # ticker would time this loop's own run of awaits
            await asyncio.sleep(0)
    rate = n / (time.perf_counter() - t)
    return (rate, *await ticker.stop())


async def aio_sync(producer: AsyncProducer, n: int) -> float:
    t = time.perf_counter()
    for _ in range(n):
        await producer.send(TOPIC, BODY)
    return n / (time.perf_counter() - t)


def section_producer(zk_connect: str, tmp: Path, args: argparse.Namespace) -> list[Row]:
    broker = start_broker(zk_connect, 0, tmp / "broker-producer", {TOPIC: args.partitions},
                          zk_session_timeout=30.0)
    got: dict[str, list[float]] = {k: [] for k in ("t-async", "a-async", "t-sync", "a-sync",
                                                  "lag-p99", "lag-max")}
    try:
        with Producer(zk_connect, send_timeout=30.0) as threaded:
            threaded_async(threaded, 2000)  # warm-up

            async def run_aio() -> None:
                async with AsyncProducer(zk_connect, send_timeout=30.0) as producer:
                    await aio_async(producer, 2000)  # warm-up
                    for r in range(args.runs):
                        got["t-async"].append(threaded_async(threaded, args.count))
                        rate, p99, mx = await aio_async(producer, args.count)
                        got["a-async"].append(rate)
                        got["lag-p99"].append(p99)
                        got["lag-max"].append(mx)
                        got["t-sync"].append(threaded_sync(threaded, args.sync_count))
                        got["a-sync"].append(await aio_sync(producer, args.sync_count))
                        print(f"  producer run {r + 1}: " + ", ".join(
                            f"{k} {v[-1]:,.1f}" for k, v in got.items()), flush=True)

            asyncio.run(run_aio())
    finally:
        broker.stop()
    med = {k: statistics.median(v) for k, v in got.items()}
    lag = f"loop lag p99 {med['lag-p99']:.1f} ms, max {med['lag-max']:.1f} ms"
    return [("producer", "threaded", "send_async", med["t-async"], None, ""),
            ("producer", "asyncio", "send_async", med["a-async"],
             med["a-async"] / med["t-async"], lag),
            ("producer", "threaded", "send", med["t-sync"], None, ""),
            ("producer", "asyncio", "await send", med["a-sync"], med["a-sync"] / med["t-sync"],
             "")]


#: name -> the section's function (zk_connect, temporary directory, arguments) -> rows
SECTIONS: dict[str, Callable[[str, Path, argparse.Namespace], list[Row]]] = {
    "producer": section_producer,
    "consumer": _aio_consumer.section,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"sections to run, comma-separated (of {', '.join(SECTIONS)})")
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--count", type=int, default=200_000,
                    help="pipelined messages per producer run")
    ap.add_argument("--sync-count", type=int, default=3000,
                    help="one-at-a-time messages per producer run")
    ap.add_argument("--consumer-count", type=int, default=1_000_000,
                    help="messages each consumer run drains")
    ap.add_argument("--runners", type=int, default=1, help="consumers' fetch_runner_count")
    ap.add_argument("--seconds", type=float, default=5.0,
                    help="seconds of each latency rate")
    ap.add_argument("--skip-latency", action="store_true")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {unknown}: choose from {', '.join(SECTIONS)}")

    print(f"{os.cpu_count()} CPUs, {loadavg()} at start; {args.runs} runs, medians; "
          f"sections {', '.join(only)}", flush=True)
    rows: list[Row] = []
    tmp = Path(tempfile.mkdtemp(prefix="metaq-bench-aio-"))
    try:
        with ZooKeeperServer(data_dir=tmp / "zk") as zk:
            admin = KazooClient(hosts=zk.hosts)
            admin.start(30)
            admin.ensure_path("/bench")
            admin.stop()
            admin.close()
            for name in only:
                print(f" {name}, {loadavg()}", flush=True)
                rows += SECTIONS[name](zk.hosts + "/bench", tmp, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\n{loadavg()} at end\n")
    targets = [row[1] for row in rows if row[0] == "target"]
    print("| section | api | call | msgs/s (or ms) | vs threaded | note |")
    print("|---|---|---|---:|---:|---|")
    for section, api, call, rate, ratio, note in (r for r in rows if r[0] != "target"):
        figure = f"{rate:.3f}" if call.endswith(" ms") else f"{rate:,.0f}"
        print(f"| {section} | {api} | {call} | {figure} | "
              f"{'' if ratio is None else f'{ratio:.2f}'} | {note} |")
    if targets:
        print()
        print("\n".join(targets))


if __name__ == "__main__":
    main()
