"""Seek to a time (issue 16): ``offset_for_time`` against a full scan of the partition.

Setup: a partition of ``--messages`` messages of ``--size`` payload bytes, written
straight into the broker's storage (``metaq.broker.Storage``, segments of
``--segment-mb`` MiB) with msgIds whose times rise by 1 ms every ``--per-ms``
messages; then one broker (in a child process, so it does not share this
process's GIL) serves it.

Measured, through one ``BrokerConnection`` on loopback:

- **seek, broker index**: ``offset_for_time(use_index=True)`` (the broker's time
  index, ``+timeindex``: one round trip) for ``--seeks`` times spread over the
  partition (plus one before the first and one after the last message), each
  checked against the offset the build recorded; median and max round trips and ms;
- **seek, search**: the same times with ``use_index=False``, the binary search a
  client makes against a Java Metaq broker;
- **seek, index rebuilt**: the broker restarted after its ``.timeindex`` files were
  deleted: the first seek (to the last message, so every sealed segment's index
  is rebuilt by a checked scan), then the rest;
- **baseline, full scan**: reading the whole partition with 1 MiB ``get`` s walked
  message by message (the C walker), what finding the time without the search
  costs: its ms, and the ratio to the median seek.

Run: ``.venv/bin/python bench/bench_seek_time.py [--messages 1000000] [--size 100]``
(``--messages 10000000`` is the issue's partition: about 1.2 GB of disk and a few
minutes of building on a 2-core machine).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

from metaq.broker import Broker, BrokerConfig, Storage
from metaq.net import BrokerConnection, offset_for_time
from metaq.protocol import MSG_ID_EPOCH_MS, encode_message, scan
from metaq.testing import free_port

TOPIC = "seek"
T0 = 1_700_000_000_000


def build(data_dir: Path, n: int, size: int, per_ms: int, seg: int) -> tuple[list[int], int]:
    """Write the partition; return the offset of the first message of every ms, and
    the log end."""
    firsts: list[int] = []
    payload = bytes(range(256)) * (size // 256 + 2)
    batch = 10_000
    with Storage(data_dir, max_segment_size=seg) as storage:
        plog = storage.open_topic(TOPIC, 1)[0]
        for lo in range(0, n, batch):
            parts = []
            base = plog.end
            rec = 20 + size
            for i in range(lo, min(n, lo + batch)):
                ms = T0 + i // per_ms
                if i % per_ms == 0:
                    firsts.append(base + (i - lo) * rec)
                parts.append(encode_message(((ms - MSG_ID_EPOCH_MS) << 22) | (i & 0xFFF), 0,
                                            payload[i % 256:i % 256 + size]))
            off = plog.append(b"".join(parts), len(parts))
            assert off == base
        end = plog.end
    return firsts, end


class BrokerChild:
    """The broker in a child process (``with``: started, then stopped)."""

    def __init__(self, data_dir: str, seg: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.ready, self.stop = ctx.Event(), ctx.Event()
        self.port = free_port()
        self.child = ctx.Process(target=serve, args=(data_dir, self.port, seg, self.ready,
                                                     self.stop))

    def __enter__(self) -> int:
        self.child.start()
        if not self.ready.wait(120):
            self.stop.set()
            sys.exit("broker did not start")
        return self.port

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.child.join(60)


def seeks(conn: BrokerConnection, whens: list[int], firsts: list[int], end: int,
          index: bool, probe: int) -> tuple[list[int], list[float]]:
    """Each seek checked; its round trips and ms."""
    trips, ms = [], []
    for when in whens:
        t = time.perf_counter()
        r = offset_for_time(conn, TOPIC, 0, when, probe_size=probe, use_index=index)
        ms.append((time.perf_counter() - t) * 1000)
        trips.append(r.round_trips)
        k = when - T0
        want = firsts[k] if 0 <= k < len(firsts) else (0 if k < 0 else end)
        assert r.offset == want, (when, r, want)
    return trips, ms


def row(name: str, trips: list[int], ms: list[float]) -> str:
    return (f"{name:<22} round trips median {statistics.median(trips):g} max {max(trips)}; "
            f"ms median {statistics.median(ms):.2f} max {max(ms):.2f}")


def serve(data_dir: str, port: int, seg: int, ready, stop) -> None:  # child process
    cfg = BrokerConfig(broker_id=0, data_dir=data_dir, port=port, topics={TOPIC: 1},
                       max_segment_size=seg)
    with Broker(cfg):
        ready.set()
        stop.wait()


def full_scan(conn: BrokerConnection, end: int) -> tuple[float, int]:
    t = time.perf_counter()
    pos = count = 0
    while pos < end:
        data = conn.get(TOPIC, "bench", 0, pos, 1 << 20)
        _b, k, stop, _kind, _a, _c = scan(data, True, 1 << 30, False)
        count += k
        pos += stop
    return (time.perf_counter() - t) * 1000, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--messages", type=int, default=1_000_000)
    ap.add_argument("--size", type=int, default=100, help="payload bytes")
    ap.add_argument("--per-ms", type=int, default=100, help="messages per ms of msgId time")
    ap.add_argument("--segment-mb", type=int, default=64)
    ap.add_argument("--probe-kb", type=int, default=64)
    ap.add_argument("--seeks", type=int, default=25)
    ap.add_argument("--scans", type=int, default=3)
    args = ap.parse_args()
    seg = args.segment_mb << 20
    with tempfile.TemporaryDirectory(prefix="bench-seek-") as d:
        t = time.perf_counter()
        firsts, end = build(Path(d), args.messages, args.size, args.per_ms, seg)
        print(f"built {args.messages:,} messages of {args.size} B: {end / 1e6:.1f} MB, "
              f"segments of {args.segment_mb} MiB, in {time.perf_counter() - t:.1f} s",
              flush=True)
        probe = args.probe_kb << 10
        last = T0 + (args.messages - 1) // args.per_ms
        whens = [T0 - 1, last + 1]
        whens += [T0 + (last - T0) * k // (args.seeks - 1) for k in range(args.seeks)]
        with BrokerChild(d, seg) as port, BrokerConnection("127.0.0.1", port,
                                                            timeout=120) as conn:
            # the search first: its reads bring the log into the page cache, as they
            # would be for the index's reads, which touch ~64 KiB per seek
            searched = seeks(conn, whens, firsts, end, False, probe)
            indexed = seeks(conn, whens, firsts, end, True, probe)
            scans = [full_scan(conn, end) for _ in range(args.scans)]
            assert all(c == args.messages for _t, c in scans)
        files = list(Path(d).glob(f"{TOPIC}-0/*.timeindex"))
        for f in files:
            f.unlink()
        with BrokerChild(d, seg) as port, BrokerConnection("127.0.0.1", port,
                                                            timeout=300) as conn:
            cold = seeks(conn, [last], firsts, end, True, probe)
            warm = seeks(conn, whens, firsts, end, True, probe)
    scan_ms = statistics.median(s for s, _c in scans)
    print(f"{len(whens)} times; probe {args.probe_kb} KiB; {len(files)} sealed segments")
    for name, (trips, ms) in (("seek, broker index", indexed), ("seek, search", searched),
                              ("first seek, rebuilt", cold), ("then, index rebuilt", warm)):
        print(row(name, trips, ms) + f"; scan / median: {scan_ms / statistics.median(ms):,.0f}x")
    print(f"full scan with 1 MiB gets (median of {args.scans}): {scan_ms:.0f} ms "
          f"(the baseline); search / index (median ms): "
          f"{statistics.median(searched[1]) / statistics.median(indexed[1]):.1f}x")


if __name__ == "__main__":
    main()
