"""CPU per message of ``send_async`` + ``result()``, per thread, A/B between source trees.

One ZooKeeper and one broker (topic ``bench``, 4 partitions) are started once; then,
``ROUNDS`` times, each tree in turn runs a child process (``PYTHONPATH=<tree>``) that
sends ``N`` messages of ``SIZE`` bytes with ``send_async`` (or ``send_batch`` of 1000
with ``MODE=batch``) and reads every result, and reports CPU microseconds per message
of: the sending thread while sending (``send``) and while reading results
(``result``), the connections' reader and writer threads (``pthread_getcpuclockid``),
and the cyclic collector (``gc.callbacks``).  Medians per tree at the end.  CPU, not
wall clock: usable on a shared machine (issue 29's measure).

Run: ``.venv/bin/python bench/cpu_send_async.py 200000 3 100 /path/to/main /path/to/branch``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r'''
import gc, json, sys, threading, time
from metaq import Producer
import metaq
zk, n, size, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
gct = [0.0, 0.0]
def cb(phase, info):
    if phase == "start": gct[1] = time.thread_time()
    else: gct[0] += time.thread_time() - gct[1]
gc.callbacks.append(cb)
def tcpu(t):
    return time.clock_gettime(time.pthread_getcpuclockid(t.ident))
with Producer(zk, send_timeout=30.0) as p:
    body = b"x" * size
    for f in [p.send_async("bench", b"warm") for _ in range(5000)]: f.result()
    others = [t for t in threading.enumerate() if t.name.startswith("metaq-pipe")]
    gc.collect()
    o0 = {t.name: tcpu(t) for t in others}
    g0 = gct[0]
    send = p.send_async
    t0 = time.thread_time(); w0 = time.perf_counter()
    if mode == "batch":
        bodies = [body] * 1000
        futs = [p.send_batch("bench", bodies) for _ in range(n // 1000)]
        t1 = time.thread_time()
        for f in futs:
            for r in f.result(): pass
    else:
        futs = [send("bench", body) for _ in range(n)]
        t1 = time.thread_time()
        for f in futs: f.result()
    t2 = time.thread_time(); w1 = time.perf_counter()
    o1 = {t.name: tcpu(t) for t in others}
    rd = sum(o1[k] - o0[k] for k in o1 if "reader" in k)
    wr = sum(o1[k] - o0[k] for k in o1 if "writer" in k)
    print(json.dumps(dict(tree=metaq.__file__, send=(t1-t0)/n*1e6, result=(t2-t1)/n*1e6,
        reader=rd/n*1e6, writer=wr/n*1e6, gc=(gct[0]-g0)/n*1e6, rate=n/(w1-w0))))
'''
KEYS = ("send", "result", "reader", "writer", "gc", "rate")


def main() -> None:
    n, rounds, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    trees = sys.argv[4:]
    mode = os.environ.get("MODE", "async")
    here = Path(__file__).resolve().parent.parent
    sys.path[:0] = [str(here / "tests"), str(here)]
    from helpers.procs import start_broker
    from kazoo.client import KazooClient

    from metaq._zk import ZooKeeperServer

    tmp = Path(tempfile.mkdtemp(prefix="metaq-cpu-send-async-"))
    res: dict[str, list[dict]] = {t: [] for t in trees}
    try:
        with ZooKeeperServer(data_dir=tmp / "zk") as zk:
            admin = KazooClient(hosts=zk.hosts)
            admin.start(30)
            admin.ensure_path("/bench")
            admin.stop()
            admin.close()
            zc = zk.hosts + "/bench"
            broker = start_broker(zc, 0, tmp / "b", {"bench": 4}, zk_session_timeout=30.0)
            try:
                for _ in range(rounds):
                    for t in trees:
                        out = subprocess.run(
                            [sys.executable, "-c", CHILD, zc, str(n), str(size), mode],
                            env=dict(os.environ, PYTHONPATH=t), capture_output=True,
                            text=True, timeout=600, check=True)
                        d = json.loads(out.stdout.strip().splitlines()[-1])
                        res[t].append(d)
                        print(t, {k: round(d[k], 3) for k in KEYS}, flush=True)
            finally:
                broker.stop()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for t in trees:
        med = {k: statistics.median(d[k] for d in res[t]) for k in KEYS}
        med["total"] = statistics.median(d["send"] + d["result"] + d["reader"] + d["writer"]
                                         for d in res[t])
        print("MEDIAN", t, {k: round(v, 3) for k, v in med.items()})


if __name__ == "__main__":
    main()
