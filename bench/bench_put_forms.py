"""Broker CPU per message for each put form (issue 29): the same bytes replayed.

Setup: one broker process (``python -m metaq broker start``, no ZooKeeper, Metaq's
default flush policy) serving topic ``bench`` with one partition; a raw client writes
pre-built put requests, 100 pipelined at a time (one write, then the 100 replies read),
``--messages`` messages of ``--size`` bytes per form and run, forms interleaved:

- **ours**: ``put <topic> <part> <len> <flag> <crc32> <opaque>`` (metaq-py's producer);
- **java -1**: ``... <flag> -1 <opaque>`` (Java's clients: checksum "not computed");
- **java 6-field**: ``... <flag> <opaque>`` (the legacy form, no checksum);
- **tx of 100 (ours)**: ``transaction ... BEGIN``, 100 puts ``... <crc32> <txKey>
  <opaque>``, ``COMMIT_ONE_PHASE`` (three round trips per 100 messages);
- **tx of 100 (java)**: the same with checksum -1.

Reported: the broker process's CPU (all its threads, from /proc) per message, medians of
``--runs``, and the ratio to **ours**; and, with less noise, the same bytes replayed in
process (an in-process broker's parser and request handling, its event-loop thread's
CPU per message: the put step without the sockets).  Run it against any tree (``PYTHONPATH``): the
broker subprocess inherits it.  Linux only (/proc).

Run: ``.venv/bin/python bench/bench_put_forms.py [--runs 3] [--messages 100000]``
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path

TOPIC = "bench"
_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid`` (``/proc/<pid>/task/*/schedstat``, in ns; a
    thread gone meanwhile is left out), else user + system in clock ticks."""
    total = 0
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                total += int((task / "schedstat").read_text().split()[0])
            except (FileNotFoundError, ProcessLookupError):
                pass
        return total / 1e9
    except FileNotFoundError:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK


def replies(sock: socket.socket, n: int, buf: bytearray) -> None:
    """Read ``n`` replies (``result <code> <len> <opaque>\\r\\n<body>``); all must be 200."""
    got = 0
    while True:
        while True:
            eol = buf.find(b"\r\n")
            if eol < 0:
                break
            head = buf[:eol].split()
            length = int(head[2])
            if len(buf) < eol + 2 + length:
                break
            assert head[1] == b"200", bytes(buf[:eol + 2 + length])
            del buf[:eol + 2 + length]
            got += 1
            if got == n:
                return
        data = sock.recv(1 << 20)
        if not data:
            raise ConnectionError("broker closed the connection")
        buf += data


def batches(form: str, body: bytes, n: int, run: int) -> list[tuple[bytes, int]]:
    """Each write and how many replies it gets."""
    crc = zlib.crc32(body) & 0x7FFFFFFF
    out = []
    for b in range(n // 100):
        if form.startswith("tx"):
            check = b"%d" % crc if form == "tx of 100 (ours)" else b"-1"
            key = b"TX:bench-%d-%d:1" % (run, b)
            puts = b"".join(b"put %s 0 %d 0 %s %s %d\r\n%s" % (
                TOPIC.encode(), len(body), check, key, k, body) for k in range(100))
            out.append((b"transaction %s bench-%d-%d BEGIN 1\r\n" % (key, run, b), 1))
            out.append((puts, 100))
            out.append((b"transaction %s bench-%d-%d COMMIT_ONE_PHASE 2\r\n" % (key, run, b),
                        1))
            continue
        if form == "ours":
            line = b"put %s 0 %d 0 %d %%d\r\n" % (TOPIC.encode(), len(body), crc)
        elif form == "java -1":
            line = b"put %s 0 %d 0 -1 %%d\r\n" % (TOPIC.encode(), len(body))
        else:
            line = b"put %s 0 %d 0 %%d\r\n" % (TOPIC.encode(), len(body))
        out.append((b"".join(line % k + body for k in range(100)), 100))
    return out


FORMS = ("ours", "java -1", "java 6-field", "tx of 100 (ours)", "tx of 100 (java)")


class _Sink:
    """A connection for the replay: its replies counted, not sent."""

    gone = False
    closing = False
    address = peer = "replay"

    def __init__(self) -> None:
        self.held: dict = {}
        self.replies = 0

    def send(self, data: bytes) -> None:
        self.replies += 1

    def send_gated(self, gate: object) -> None:
        self.replies += 1

    def close_after_replies(self) -> None:
        pass


def replay(runs: int, n: int, body: bytes) -> dict[str, list[float]]:
    """The same bytes replayed in process: an in-process broker's request parser and
    request handling on its event loop thread, that thread's CPU time per form."""
    from metaq.broker import Broker, BrokerConfig
    from metaq.protocol import RequestParser

    tmp = Path(tempfile.mkdtemp(prefix="metaq-bench-replay-"))
    out: dict[str, list[float]] = {}
    try:
        cfg = BrokerConfig(broker_id=0, data_dir=tmp, port=0, topics={TOPIC: 1})
        with Broker(cfg) as broker:
            server = broker._server  # noqa: SLF001 - a benchmark looks inside

            def one(work: list[tuple[bytes, int]]) -> float:
                try:
                    parser = RequestParser(max_line=cfg.max_line, tx_puts=True,
                                           max_payload=cfg.max_message_size,
                                           fast_puts=server.fast_keys)
                except TypeError:  # a tree before issue 29
                    parser = RequestParser(max_line=cfg.max_line,
                                           max_payload=cfg.max_message_size,
                                           fast_puts=server.fast_keys)
                conn = _Sink()
                t = time.thread_time()
                for data, _n in work:
                    server.handle(conn, parser.feed_lenient(data))
                took = time.thread_time() - t
                assert conn.replies == len(work), (conn.replies, len(work))
                return took

            for run in range(runs + 1):
                for form in FORMS:
                    work = batches(form, body, n, run)
                    took = broker._call(lambda work=work: one(work), timeout=300)  # noqa: SLF001
                    if run:  # the first round warms up
                        out.setdefault(form, []).append(took)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--size", type=int, default=100)
    args = ap.parse_args()
    body = b"x" * args.size
    tmp = Path(tempfile.mkdtemp(prefix="metaq-bench-forms-"))
    proc = subprocess.Popen(
        [sys.executable, "-m", "metaq", "broker", "start", "--id", "0", "--port", "0",
         "--data-dir", str(tmp / "data"), "--topic", f"{TOPIC}:1"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        cwd=tmp)  # not this directory: ``-m`` would put it first on sys.path
    cpu: dict[str, list[float]] = {}
    wall: dict[str, list[float]] = {}
    try:
        line = proc.stdout.readline()
        port = int(re.search(r":(\d+)\s*$", line).group(1))
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray()
        for form in FORMS:  # warm-up
            for data, n in batches(form, body, 2000, -1):
                sock.sendall(data)
                replies(sock, n, buf)
        for run in range(args.runs):
            for form in FORMS:
                work = batches(form, body, args.messages, run)
                c0, t0 = cpu_seconds(proc.pid), time.perf_counter()
                for data, n in work:
                    sock.sendall(data)
                    replies(sock, n, buf)
                wall.setdefault(form, []).append(time.perf_counter() - t0)
                cpu.setdefault(form, []).append(cpu_seconds(proc.pid) - c0)
        sock.close()
    finally:
        proc.terminate()
        proc.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    n = args.messages
    print(f"{args.size} B messages, {n} per form and run, medians of {args.runs} runs, "
          f"load average {os.getloadavg()[0]:.2f}")
    rep = replay(args.runs, n, body)
    base = statistics.median(rep["ours"])
    print("replayed in process: parser + request handling, event-loop thread CPU")
    print("| form | us/msg | vs ours |")
    print("|---|---:|---:|")
    for form in FORMS:
        m = statistics.median(rep[form])
        print(f"| {form} | {m / n * 1e6:.2f} | {m / base:.2f} |")
    print("over TCP: broker process CPU (all threads) and the raw client's rate")
    base = statistics.median(cpu["ours"])
    base_rate = n / statistics.median(wall["ours"])
    print("| form | broker CPU us/msg | vs ours | msgs/s (raw client) | vs ours |")
    print("|---|---:|---:|---:|---:|")
    for form in FORMS:
        m = statistics.median(cpu[form])
        rate = n / statistics.median(wall[form])
        print(f"| {form} | {m / n * 1e6:.2f} | {m / base:.2f} | {rate:,.0f} | "
              f"{rate / base_rate:.2f} |")


if __name__ == "__main__":
    main()
