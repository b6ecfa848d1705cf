"""Seek to a time (issue 16): ``offset_for_time`` against a full scan of the partition.

Setup: a partition of ``--messages`` messages of ``--size`` payload bytes, written
straight into the broker's storage (``metaq.broker.Storage``, segments of
``--segment-mb`` MiB) with msgIds whose times rise by 1 ms every ``--per-ms``
messages; then one broker (in a child process, so it does not share this
process's GIL) serves it.

Measured, through one ``BrokerConnection`` on loopback:

- **seek**: ``offset_for_time`` for ``--seeks`` times spread over the partition
  (plus one before the first and one after the last message), each checked against
  the offset the build recorded; median and max round trips and ms;
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
        ctx = multiprocessing.get_context("spawn")
        ready, stop = ctx.Event(), ctx.Event()
        port = free_port()
        child = ctx.Process(target=serve, args=(d, port, seg, ready, stop))
        child.start()
        try:
            if not ready.wait(120):
                sys.exit("broker did not start")
            with BrokerConnection("127.0.0.1", port, timeout=120) as conn:
                last = T0 + (args.messages - 1) // args.per_ms
                whens = [T0 - 1, last + 1]
                whens += [T0 + (last - T0) * k // (args.seeks - 1) for k in range(args.seeks)]
                trips, ms = [], []
                for when in whens:
                    t = time.perf_counter()
                    r = offset_for_time(conn, TOPIC, 0, when, probe_size=args.probe_kb << 10)
                    ms.append((time.perf_counter() - t) * 1000)
                    trips.append(r.round_trips)
                    k = when - T0
                    want = firsts[k] if 0 <= k < len(firsts) else (0 if k < 0 else end)
                    assert r.offset == want, (when, r, want)
                scans = [full_scan(conn, end) for _ in range(args.scans)]
                assert all(c == args.messages for _t, c in scans)
        finally:
            stop.set()
            child.join(60)
    scan_ms = statistics.median(s for s, _c in scans)
    med = statistics.median(ms)
    print(f"seek, {len(whens)} times: round trips median {statistics.median(trips):g} "
          f"max {max(trips)}; ms median {med:.2f} max {max(ms):.2f} "
          f"(probe {args.probe_kb} KiB)")
    print(f"full scan with 1 MiB gets (median of {args.scans}): {scan_ms:.0f} ms; "
          f"ratio scan / median seek: {scan_ms / med:,.0f}x")


if __name__ == "__main__":
    main()
