"""The dashboard (issue 28): the group page's time, and what polling it costs ZooKeeper.

Setup: an embedded ZooKeeper; ``--brokers`` metaq-py brokers (each in a child process,
so they do not share this process's GIL) serving topic ``bench`` with ``--partitions``
partitions in all, one message written into each; a group of ``--members`` members
over them, its nodes written straight into ZooKeeper as a settled group leaves them
(member ids with their topic, one owner node per partition by range, one committed
offset per partition at 0: every partition one message behind).  ``metaq dashboard``
runs as a subprocess on a free port (``--sample-interval 1``), as a user runs it.

Measured:

- **page**: ``GET /groups/g`` (the HTML page) and ``GET /api/groups/g`` (its JSON),
  ``--requests`` each after the first sample is in, each a fresh HTTP connection;
  median, p95 and max ms.  The issue's target: under 200 ms for 64 x 1,024;
- **baseline, raw ZooKeeper read of the same data** (in-run): what a dashboard that
  rescans per request pays before it renders anything: the group's ids, owners and
  offsets read through one kazoo client, sequentially (``get`` per node, as
  ``zk_layout.take_snapshot`` and ``metaq group describe`` read), and pipelined
  (every ``get_async`` sent, then every reply waited for); the ratio page / pipelined;
- **page after a change**: the same page fetched right after offsets changed (the
  snapshot of the cached tree and the report are built anew, not memoized);
- **ZooKeeper reads per poll**: the page polled every second for ``--polls`` polls,
  first with nothing changing (idle: should be 0 reads), then with ``--changes``
  offset nodes committed anew before each poll (a writer client, as members commit);
  reads counted by the dashboard's cache (every request it sent, ``/api/status``'s
  ``zk_reads``) and the nodes changed by the writer: reads per changed node (target: at
  most 1).

Run: ``.venv/bin/python bench/bench_dashboard.py [--members 64] [--partitions 1024]``
(about a minute on a 2-core machine).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kazoo.client import KazooClient

from metaq._zk import ZooKeeperServer
from metaq.broker import Broker, BrokerConfig
from metaq.net import BrokerConnection
from metaq.protocol import build_payload, checksum
from metaq.testing import free_port
from zk_layout import Layout, StoredOffset, encode_offset, encode_owner

L = Layout()
TOPIC = "bench"
GROUP = "g"
ROOT = Path(__file__).resolve().parent.parent


def serve(zk: str, broker_id: int, parts: int, data_dir: str, port: int, ready, stop
          ) -> None:  # child process
    cfg = BrokerConfig(broker_id=broker_id, data_dir=data_dir, port=port,
                       topics={TOPIC: parts}, zk_connect=zk)
    with Broker(cfg):
        ready.set()
        stop.wait()


def wait_json(url: str, pred, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                value = json.loads(r.read())
            if pred(value):
                return value
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting on {url}")
        time.sleep(0.1)


def timed_get(url: str) -> float:
    t = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as r:
        body = r.read()
        assert r.status == 200 and body
    return (time.perf_counter() - t) * 1000


def stats(ms: list[float]) -> str:
    s = sorted(ms)
    p95 = s[min(len(s) - 1, round(0.95 * (len(s) - 1)))]
    return f"median {statistics.median(s):7.1f}  p95 {p95:7.1f}  max {s[-1]:7.1f}"


def build_group(client: KazooClient, members: int, names: list[str]) -> list[str]:
    ids = [f"{GROUP}_m{i:03d}" for i in range(members)]
    tx = []
    for cid in ids:
        tx.append((L.consumer_id(GROUP, cid), TOPIC.encode()))
    per = -(-len(names) // members)
    for k, part in enumerate(names):
        tx.append((L.owner(GROUP, TOPIC, part), encode_owner(ids[min(k // per, members - 1)])))
        tx.append((L.offset(GROUP, TOPIC, part), encode_offset(StoredOffset(offset=0,
                                                                            msg_id=-1))))
    for d in (L.consumer_ids(GROUP), L.owners(GROUP) + f"/{TOPIC}",
              L.offsets(GROUP) + f"/{TOPIC}"):
        client.ensure_path(d)
    for r in [client.create_async(p, d) for p, d in tx]:
        r.get()
    return ids


def raw_read(client: KazooClient, pipelined: bool) -> float:
    """ms to read the group's ids, owners and offsets as a rescanning reader would."""
    t = time.perf_counter()
    dirs = [L.consumer_ids(GROUP), L.owners(GROUP) + f"/{TOPIC}",
            L.offsets(GROUP) + f"/{TOPIC}"]
    for d in dirs:
        names = client.get_children(d)
        if pipelined:
            for r in [client.get_async(f"{d}/{n}") for n in names]:
                r.get()
        else:
            for n in names:
                client.get(f"{d}/{n}")
    return (time.perf_counter() - t) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--members", type=int, default=64)
    ap.add_argument("--partitions", type=int, default=1024)
    ap.add_argument("--brokers", type=int, default=2)
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--polls", type=int, default=10)
    ap.add_argument("--changes", type=int, default=32,
                    help="offset nodes committed anew before each busy poll")
    args = ap.parse_args()
    if args.partitions % args.brokers:
        sys.exit("--partitions must divide evenly among --brokers")
    per_broker = args.partitions // args.brokers
    ctx = multiprocessing.get_context("spawn")
    with ZooKeeperServer() as zk, tempfile.TemporaryDirectory(prefix="bench-dash-") as tmp:
        hosts = f"{zk.hosts}/bench"
        admin = KazooClient(hosts=zk.hosts)
        admin.start(30)
        admin.ensure_path("/bench")
        admin.stop()
        children, ports = [], []
        stop = ctx.Event()
        for b in range(args.brokers):
            ready, port = ctx.Event(), free_port()
            child = ctx.Process(target=serve, args=(hosts, b, per_broker,
                                                    os.path.join(tmp, f"b{b}"), port, ready,
                                                    stop))
            child.start()
            if not ready.wait(120):
                stop.set()
                sys.exit(f"broker {b} did not start")
            children.append(child)
            ports.append(port)
        dash = None
        client = KazooClient(hosts=hosts, timeout=30)
        client.start(30)
        try:
            body, flag = build_payload(b"x" * 100, None)
            for port in ports:
                with BrokerConnection("127.0.0.1", port, timeout=60) as conn:
                    ops = [conn.send_put(TOPIC, i, body, flag, checksum(body))
                           for i in range(per_broker)]
                    for op in ops:
                        conn.read_result(op)
            names = [f"{b}-{i}" for b in range(args.brokers) for i in range(per_broker)]
            t = time.perf_counter()
            build_group(client, args.members, names)
            print(f"{args.members} members x {args.partitions} partitions on {args.brokers} "
                  f"brokers; group written in {time.perf_counter() - t:.1f} s", flush=True)
            env = dict(os.environ)
            env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
            dash = subprocess.Popen([sys.executable, "-m", "metaq", "dashboard", "--zk", hosts,
                                     "--port", "0", "--sample-interval", "1"],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                    text=True, env=env)
            assert dash.stdout is not None
            url = dash.stdout.readline().split()[2].rstrip("/")
            t = time.perf_counter()
            wait_json(url + f"/api/groups/{GROUP}", lambda g: len(g["partitions"]) ==
                      args.partitions and all(p["lag_seconds"] is not None
                                              for p in g["partitions"]))
            print(f"dashboard up at {url}; first full sample after "
                  f"{time.perf_counter() - t:.1f} s", flush=True)
            page = [timed_get(url + f"/groups/{GROUP}") for _ in range(args.requests)]
            api = [timed_get(url + f"/api/groups/{GROUP}") for _ in range(args.requests)]
            seq = [raw_read(client, False) for _ in range(5)]
            pip = [raw_read(client, True) for _ in range(5)]
            print(f"{'GET /groups/g (HTML)':<38} ms {stats(page)}")
            print(f"{'GET /api/groups/g (JSON)':<38} ms {stats(api)}")
            print(f"{'baseline: raw ZK read, sequential':<38} ms {stats(seq)}")
            print(f"{'baseline: raw ZK read, pipelined':<38} ms {stats(pip)}")
            print(f"page / pipelined raw read (medians): "
                  f"{statistics.median(page) / statistics.median(pip):.2f}x; target: page "
                  f"median under 200 ms: {'met' if statistics.median(page) < 200 else 'MISSED'}")

            def reads() -> int:
                with urllib.request.urlopen(url + "/api/status", timeout=30) as r:
                    return json.loads(r.read())["zk_reads"]

            time.sleep(2)  # the sampler's reads are broker reads, never ZooKeeper's
            r0 = reads()
            for _ in range(args.polls):
                timed_get(url + f"/api/groups/{GROUP}")
                time.sleep(1)
            idle = reads() - r0
            r0 = reads()
            changed = 0
            offset = 1
            busy_ms = []
            for _ in range(args.polls):
                batch = names[(changed % len(names)):][:args.changes]
                ops = [client.set_async(L.offset(GROUP, TOPIC, p),
                                        encode_offset(StoredOffset(offset=offset, msg_id=-1)))
                       for p in batch]
                for op in ops:
                    op.get()
                changed += len(batch)
                offset += 1
                time.sleep(1)
                busy_ms.append(timed_get(url + f"/groups/{GROUP}"))
            deadline = time.monotonic() + 10
            while reads() - r0 < changed and time.monotonic() < deadline:
                time.sleep(0.1)  # the last watches' reads may still be on their way
            busy = reads() - r0
            print(f"ZooKeeper reads, {args.polls} idle polls (1/s): {idle} "
                  f"({idle / args.polls:.2f} per poll)")
            print(f"ZooKeeper reads, {args.polls} polls with {args.changes} offsets changed "
                  f"before each: {busy} for {changed} changed nodes "
                  f"({busy / max(1, changed):.2f} per changed node; target at most 1: "
                  f"{'met' if busy <= changed else 'MISSED'})")
            print(f"{'GET /groups/g after each change':<38} ms {stats(busy_ms)} (the tree "
                  f"changed since the last request: snapshot and report built anew)")
        finally:
            if dash is not None:
                dash.terminate()
                dash.wait(30)
            client.stop()
            client.close()
            stop.set()
            for child in children:
                child.join(60)


if __name__ == "__main__":
    main()
