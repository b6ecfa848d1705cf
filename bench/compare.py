"""Every benchmark before and after a change, interleaved in one session, into one markdown table.

Usage::

    .venv/bin/python bench/compare.py --before main --after . --out /tmp/compare.md
    .venv/bin/python bench/compare.py --before 8a79a7d --after HEAD --only consumer,rebalance
    .venv/bin/python bench/compare.py --before main --after main --quick --out /tmp/smoke.md

``--before`` is a revision, ``--after`` a revision or a directory (the working tree, say).  A
revision is checked out with ``git worktree add --detach`` under a temporary directory; the C
extension is built in it with this interpreter (``setup.py build_ext --inplace``), or its
``.so`` copied from this checkout or the ``--after`` directory when their ``_speedups.c`` is
the same file.  Each tree is checked before anything runs: with ``PYTHONPATH=<tree>`` (and
nothing else on it) ``import metaq`` and ``import zk_layout`` must come from that tree, in a
process started outside it and in a subprocess of that (as the brokers, consumer children and
group members the benchmarks start), and the C speedups must be in use.

Each benchmark runs from its own tree (``cd <tree> && PYTHONPATH=<tree> python
bench/bench_X.py ...``) with the arguments of its preset (``PRESETS`` below; ``--quick`` takes
the tiny ones, for a smoke test of the plumbing, not for figures).  Runs are interleaved per
benchmark, the two runs of a pair back to back: round 1 before then after, round 2 after then
before (``--rounds 3`` adds a round in round 1's order, and so on).  Each benchmark computes
its own medians over its ``--runs``; its printed summary is read (the summaries every revision
since issue 14 prints, so an older "before" needs no change to its benchmarks).

Written to ``--out`` and printed: the revisions, the C speedups of each tree, the machine's
load averages at the start and the end (and the 1-minute load at the start of every run, its
range), the table ``figure | before | after`` with ``round 1 / round 2`` in each cell (ratios
against each run's own in-run baseline where the benchmark has one), a key, and the exact
commands.  Every run's stdout and stderr are kept in ``<out stem>-logs/`` beside ``--out``; a
run that fails shows as ``failed (exit N)`` (or ``failed (timeout)``) in its cells, its stderr
tail is listed under the table, and the comparison goes on.  Worktrees and the temporary
directory are removed at the end, also after Ctrl-C or SIGTERM (a benchmark running then gets
SIGINT, so it stops its ZooKeeper and brokers; processes it leaves behind are ended by pid).
"""

from __future__ import annotations

import argparse
import contextlib
import filecmp
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# -- the presets -----------------------------------------------------------------------------
#
# name: (script, full-size arguments, --quick arguments, expected seconds of one full-size
#        run, of one quick run).  The full sizes are chosen so that every benchmark, both trees,
#        two rounds (36 runs) take about 22-23 minutes on the 2-core machine: the expected seconds
#        are estimated from the rates the quick runs and RESULTS.md show plus the fixed start-up
#        costs measured in quick runs (ZooKeeper, brokers, Spark); the quick ones were measured
#        (load average 4-8: the whole --quick comparison took about 5 minutes).  A run gets 5
#        times its expected seconds (at least 3 minutes) before it is stopped as timed out.
#        "replication" (issue 26) adds 4 runs of about 2 minutes (measured: 119 s full at load
#        average 2.5-5, 16 s quick), so about 30 minutes in all.
PRESETS: dict[str, tuple[str, list[str], list[str], float, float]] = {
    # MessageConsumer draining a loaded broker (1M x 100 B, 200k x 1 KiB), per-message and batch
    # listener, as % of the in-run raw client's rate and CPU efficiency; the in-memory
    # process_batch CPU per message.  Issue 14's arguments with 5 runs instead of 3 (cheap).
    "consumer": ("bench_consumer.py", ["--runs", "5"],
                 ["--runs", "1", "--scale", "0.02"], 30, 3),
    # Producer send_async / send_batch / send (100 B, 1 KiB, default flush) against its raw
    # pipelined / runs / one-at-a-time client: rate ratio and the bench process's CPU per
    # message.  Same arguments as issue 14.
    "producer": ("bench_producer.py", ["--runs", "3", "--policies", "default"],
                 ["--runs", "1", "--policies", "default", "--count-100", "5000",
                  "--count-1k", "2000", "--sync-count", "300", "--batch", "100"], 25, 3),
    # send -> listener latency (8 partitions, 500 msg/s for 10 s and 20,000 msg/s for 5 s,
    # held gets), the in-run loopback floor, and the synchronous send round trip.  Issue 14's
    # arguments with 2 runs instead of 3 (each run is ~35 s of sending).
    "latency": ("bench_latency.py", ["--runs", "2", "--cases", "steady,send"],
                ["--runs", "1", "--quick", "--cases", "steady,send"], 75, 22),
    # Settle time of a graceful join and leave, 8 consumers x 64 partitions, default and
    # sticky strategies.  Same arguments as issue 14.
    "rebalance": ("bench_rebalance.py", ["--runs", "5"], ["--runs", "1"], 25, 5),
    # Spark count and group-by of 2M messages over the metaq source against an in-memory
    # Python source of the same batches (the ceiling): ceiling time / metaq time, wall and CPU.
    # Same arguments as issue 14.
    "spark": ("bench_spark.py", ["--runs", "3"], ["--runs", "1", "--messages", "20000"], 65, 35),
    # Concurrent consumption (16 workers) against orderly (the baseline) with a 1 ms listener,
    # 1 and 4 partitions: the rate ratio (sleep-bound; 2,000 messages are enough).
    "concurrent": ("bench_concurrent.py", ["--runs", "3", "--messages", "2000"],
                   ["--runs", "1", "--messages", "200"], 20, 3),
    # Group settle time with members in 8 processes: join, leave, and kill -9 (minus the
    # 4 s session timeout), 32 members x 256 partitions, default and cooperative strategies;
    # join and leave also as a ratio to the bare ZooKeeper floor.  (Sticky at 8x64 is in
    # "rebalance"; RESULTS.md's issue-15 baseline took ~17 s a run at 32x256, 52 s at 64x1024.)
    "group_scale": ("bench_group_scale.py", ["--sizes", "32x256", "--strategies",
                                             "default,cooperative", "--runs", "2",
                                             "--rolling", ""],
                    ["--sizes", "4x16", "--strategies", "default", "--runs", "1",
                     "--rolling", "", "--procs", "2", "--quiet", "0.3"], 70, 7),
    # offset_for_time over 1M messages: the broker's time index and the client's search
    # against a full scan of the partition (the baseline: scan / median indexed seek).
    "seek_time": ("bench_seek_time.py", ["--messages", "1000000"],
                  ["--messages", "20000", "--seeks", "5", "--scans", "1"], 10, 1),
    # Local transactions of 1, 10 and 100 messages against send_batch of 100 (the baseline),
    # 20,000 messages of 100 B.
    "transactions": ("bench_transactions.py", ["--runs", "5", "--messages", "20000"],
                     ["--runs", "1", "--messages", "1000"], 15, 2),
    # Replication (issue 26): send_batch / send with sync and async replication against a
    # lone master (the baseline), default flush and group commit, 100 B and 1 KiB; async lag
    # at 20,000 msg/s; failover after a SIGKILL, session timeout excluded (3 repeats).
    "replication": ("bench_replication.py", ["--runs", "3"], ["--quick"], 120, 16),
    # The asyncio API beside the threaded one in the same run (issue 27): producer
    # send_async (200,000 x 100 B) and await send (3,000) as a ratio to the threaded
    # producer's, and the event loop's lag while sending.  Each section adds its rows.
    "aio": ("bench_aio.py", ["--runs", "3"],
            ["--runs", "1", "--count", "5000", "--sync-count", "300"], 20, 3),
}

#: What each benchmark's figures mean (printed under the table).
KEY = {
    "consumer": "consumer ratio = % of the in-run raw client's rate, cpu ratio = % of its CPU "
                "efficiency (higher is better); raw = the raw client's M msg/s; in-memory = "
                "CPU ns per message of process_batch on one reply",
    "producer": "producer vs raw = rate / the in-run raw client's (1.00 = as fast); cpu us = "
                "the bench process's CPU per message",
    "latency": "latency and send RTT in ms (send to listener, 100 B, held gets); floor = "
               "Python loopback round trip",
    "rebalance": "rebalance settle in ms, 8 consumers x 64 partitions",
    "spark": "spark % = ceiling time / metaq time (100 = as fast as an in-memory source); "
             "cpu % the same with CPU seconds",
    "concurrent": "concurrent x = concurrent rate / orderly rate, 1 ms listener",
    "group_scale": "group settle in ms (kill: beyond the session timeout); x floor = settle / "
                   "the bare ZooKeeper work",
    "seek_time": "seek ms (median over the seeks); scan / index = full scan time / median "
                 "indexed seek",
    "transactions": "tx vs batch = transaction rate / send_batch's; batch in msgs/s",
    "aio": "aio vs threaded = the asyncio API's rate / the threaded API's in the same run "
           "(1.00 = as fast); loop lag in ms (a 1 ms ticker's lateness while sending)",
    "replication": "repl vs none = rate or latency / the in-run lone master's; lag in ms from "
                   "the master's ack to readable on the slave; failover ms after the session "
                   "timeout",
}

Figures = list[tuple[str, str]]


# -- reading the benchmarks' summaries -------------------------------------------------------

def _num(text: str) -> str:
    return text.replace(",", "").rstrip("%x")


def parse_consumer(out: str) -> Figures:
    rows = re.findall(r"^(\w+)\s+(each|batch)\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+(\d+)%\s+\d+\s+"
                      r"(\d+)%\s*$", out, re.M)
    raws = re.findall(r"^(\w+)\s+raw\s+([\d.]+)\s", out, re.M)
    mem = re.findall(r"^(\w+)\s+(each|batch)\s+[\d.]+ M msg/s\s+(\d+) CPU ns/msg", out, re.M)
    figs: Figures = []
    for topic, mode, ratio, cpu in rows:
        figs += [(f"consumer {topic} {mode} ratio", ratio),
                 (f"consumer {topic} {mode} cpu ratio", cpu)]
    figs += [(f"consumer {topic} raw M msg/s", rate) for topic, rate in raws]
    figs += [(f"consumer in-memory {topic} {mode} ns", ns) for topic, mode, ns in mem]
    return figs


def parse_producer(out: str) -> Figures:
    figs: Figures = []
    for policy, size, kind, ratio, cpu in re.findall(
            r"^\| ([\w-]+) \| (\d+) B \| (async|batch|sync) \| [\d,]+ \| [\d.]+ \| ([\d.]+) \| "
            r"([\d.]+) \|", out, re.M):
        name = f"producer {size} B {kind}" + ("" if policy == "default" else f" {policy}")
        figs += [(f"{name} vs raw", ratio), (f"{name} cpu us", cpu)]
    return figs


def parse_latency(out: str) -> Figures:
    figs: Figures = []
    floor = re.search(r"floor p50 ([\d.]+):", out)
    if floor:
        figs.append(("floor p50 ms", floor.group(1)))
    for rate, p50, p99 in re.findall(r"^\s+(\d+)/s metaq held gets\s+p50\s+([\d.]+)\s+p99\s+"
                                     r"([\d.]+)", out, re.M):
        figs += [(f"latency {rate}/s p50 ms", p50), (f"latency {rate}/s p99 ms", p99)]
    rtt = re.search(r"^\s+default flush\s+p50\s+([\d.]+)", out, re.M)
    if rtt:
        figs.append(("send RTT p50 ms", rtt.group(1)))
    return figs


def parse_rebalance(out: str) -> Figures:
    figs: Figures = []
    for strategy, join, leave in re.findall(r"^(\w+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s+[\d.]+x",
                                            out, re.M):
        figs += [(f"rebalance {strategy} join ms", join),
                 (f"rebalance {strategy} leave ms", leave)]
    return figs


def parse_spark(out: str) -> Figures:
    m = re.search(r"^metaq\s+[\d.]+\s+[\d,]+\s+(\d+)%\s+[\d.]+\s+(\d+)%\s+[\d.]+\s+[\d,]+\s+"
                  r"(\d+)%\s+[\d.]+\s+(\d+)%", out, re.M)
    if not m:
        return []
    count, count_cpu, group, group_cpu = m.groups()
    return [("spark count %", count), ("spark group-by %", group),
            ("spark count cpu %", count_cpu), ("spark group-by cpu %", group_cpu)]


def parse_concurrent(out: str) -> Figures:
    return [(f"concurrent {parts} partition{'s' if parts != '1' else ''} x", ratio)
            for parts, ratio in re.findall(r"^\w+ \((\d+)p\)\s+[\d,]+\s+[\d,]+\s+([\d.]+)x",
                                           out, re.M)]


def parse_group_scale(out: str) -> Figures:
    figs: Figures = []
    for size, strategy, case, rest in re.findall(r"^(\d+x\d+)\s+([\w-]+)\s+(join|leave|kill)"
                                                 r"\s+(.*)$", out, re.M):
        name = f"group {size} {strategy} {case}"
        if rest.startswith("did not settle"):
            figs.append((f"{name} ms", "unsettled"))
            continue
        settle, minus, _moved, _pause, _floor, ratio = rest.split()[:6]
        if case == "kill":
            figs.append((f"{name} ms beyond timeout", minus))
        else:
            figs += [(f"{name} ms", settle), (f"{name} x floor", _num(ratio))]
    return figs


def parse_seek_time(out: str) -> Figures:
    figs: Figures = []
    names = {"seek, broker index": "seek index", "seek, search": "seek search",
             "first seek, rebuilt": "seek first after rebuild"}
    for name, trips, ms, ratio in re.findall(
            r"^(seek, broker index|seek, search|first seek, rebuilt)\s+round trips median "
            r"(\S+) max \d+; ms median ([\d.]+) max [\d.]+; scan / median: ([\d,]+)x",
            out, re.M):
        short = names[name]
        figs.append((f"{short} ms", ms))
        if name == "seek, broker index":
            figs.append(("seek scan / index x", _num(ratio)))
        if name == "seek, search":
            figs.append(("seek search round trips", trips))
    scan = re.search(r"^full scan with 1 MiB gets \(median of \d+\): (\d+) ms", out, re.M)
    if scan:
        figs.append(("seek full scan ms", scan.group(1)))
    return figs


def parse_transactions(out: str) -> Figures:
    figs: Figures = []
    for name, rate, ratio in re.findall(r"^\| (batch|tx of \d+) \| ([\d,]+) \| ([\d.]+) \|",
                                        out, re.M):
        if name == "batch":
            figs.append(("tx: send_batch msgs/s", rate))
        else:
            figs.append((f"{name} vs batch", ratio))
    return figs


def parse_replication(out: str) -> Figures:
    figs: Figures = []
    for policy, size, mode, rate, ratio, p50, p50r, _p99, p99r in re.findall(
            r"^\| ([\w-]+) \| (\d+) B \| (none|async|sync) \| ([\d,]+) \| ([\d.]+) \| "
            r"([\d.]+) \| ([\d.]+)x \| ([\d.]+) \| ([\d.]+)x \|", out, re.M):
        name = f"repl {policy} {size} B"
        if mode == "none":
            figs += [(f"{name} none batch msgs/s", rate), (f"{name} none send p50 ms", p50)]
        else:
            figs += [(f"{name} {mode} batch vs none", ratio),
                     (f"{name} {mode} send p50 vs none", p50r),
                     (f"{name} {mode} send p99 vs none", p99r)]
    for policy, p50, p99 in re.findall(r"^\| ([\w-]+) \| [\d,]+ \| ([\d.]+) \| ([\d.]+) \| "
                                       r"[\d.]+ \| [\d,]+ \| [\d,]+ \| [\d.]+ \|", out, re.M):
        figs += [(f"repl lag {policy} p50 ms", p50), (f"repl lag {policy} p99 ms", p99)]
    m = re.search(r"session timeout (\d+) ms \(kill.*?broker (\d+) ms, producer (\d+) ms", out)
    if m:
        figs += [("repl session timeout ms", m.group(1)), ("repl failover broker ms", m.group(2)),
                 ("repl failover producer ms", m.group(3))]
    return figs


def parse_aio(out: str) -> Figures:
    figs: Figures = []
    for section, call, ratio, note in re.findall(
            r"^\| (\w+) \| asyncio \| ([\w ]+?) \| [\d,]+ \| ([\d.]+) \| (.*?) \|\s*$",
            out, re.M):
        figs.append((f"aio {section} {call} vs threaded", ratio))
        lag = re.search(r"loop lag p99 ([\d.]+) ms", note)
        if lag:
            figs.append((f"aio {section} {call} loop lag p99 ms", lag.group(1)))
    return figs


PARSERS: dict[str, Callable[[str], Figures]] = {
    "consumer": parse_consumer, "producer": parse_producer, "latency": parse_latency,
    "rebalance": parse_rebalance, "spark": parse_spark, "concurrent": parse_concurrent,
    "group_scale": parse_group_scale, "seek_time": parse_seek_time,
    "transactions": parse_transactions, "replication": parse_replication,
    "aio": parse_aio,
}


# -- trees -----------------------------------------------------------------------------------

def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@dataclass
class Tree:
    side: str                 # "before" / "after"
    path: Path
    label: str                # what the report says it is
    worktree: bool            # made by us (removed at the end)
    speedups: str = "?"
    built: str = ""           # how its C extension got there


def describe_rev(repo: Path, sha: str) -> str:
    subject = git(repo, "log", "-1", "--format=%s", sha)
    return f"`{sha[:9]}` ({subject if len(subject) <= 70 else subject[:69] + '…'})"


def resolve(repo: Path, rev: str) -> str:
    try:
        return git(repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        sys.exit(f"compare: {rev!r} is neither a directory nor a revision of {repo}")


def make_tree(repo: Path, side: str, spec: str, tmp: Path) -> Tree:
    if side == "after" and Path(spec).is_dir():
        path = Path(spec).resolve()
        if not (path / "metaq" / "__init__.py").is_file() or not (path / "bench").is_dir():
            sys.exit(f"compare: --after {spec}: no metaq/ and bench/ in that directory")
        try:
            head = git(path, "rev-parse", "HEAD")
            dirty = len(git(path, "status", "--porcelain", "--untracked-files=no").splitlines())
            label = (f"the directory `{path}` (at {describe_rev(path, head)}"
                     + (f", {dirty} files changed)" if dirty else ")"))
        except subprocess.CalledProcessError:
            label = f"the directory `{path}`"
        return Tree(side, path, label, worktree=False)
    sha = resolve(repo, spec)
    path = tmp / side
    git(repo, "worktree", "add", "--detach", "--quiet", str(path), sha)
    return Tree(side, path, f"{describe_rev(repo, sha)}, `{spec}`", worktree=True)


def ensure_speedups(tree: Tree, donors: list[Path], log: Callable[[str], None]) -> None:
    """The C extension in ``tree``: copied from a donor with the same ``_speedups.c`` and a
    ``.so`` built after it, else built with this interpreter (only when missing or older than
    the source in a directory we did not make)."""
    rel = Path("metaq", "protocol")
    src = tree.path / rel / "_speedups.c"
    if not src.is_file():
        log(f"{tree.side}: no {rel}/_speedups.c in this revision; nothing to build")
        return
    name = "_speedups" + sysconfig.get_config_var("EXT_SUFFIX")
    so = tree.path / rel / name
    if so.is_file() and so.stat().st_mtime >= src.stat().st_mtime:
        tree.built = "its own build"
        return
    for donor in donors:
        dsrc, dso = donor / rel / "_speedups.c", donor / rel / name
        if (donor.resolve() != tree.path.resolve() and dso.is_file() and dsrc.is_file()
                and dso.stat().st_mtime >= dsrc.stat().st_mtime
                and filecmp.cmp(dsrc, src, shallow=False)):
            shutil.copy2(dso, so)
            os.utime(so)  # newer than the checked-out source
            tree.built = f"copied from {donor} (same _speedups.c)"
            log(f"{tree.side}: {name} {tree.built}")
            return
    log(f"{tree.side}: building the C extension in {tree.path}")
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"],
                          cwd=tree.path, capture_output=True, text=True)
    if done.returncode != 0 or not so.is_file():
        sys.exit(f"compare: building the C extension in {tree.path} failed "
                 f"(exit {done.returncode}):\n{done.stderr[-2000:]}")
    tree.built = "built here"


_CHECK = """
import json, subprocess, sys
import metaq, zk_layout
from metaq import protocol
child = subprocess.run([sys.executable, "-c", "import metaq, zk_layout; "
                        "print(metaq.__file__); print(zk_layout.__file__)"],
                       capture_output=True, text=True, check=True).stdout.split()
print(json.dumps({"metaq": metaq.__file__, "zk_layout": zk_layout.__file__, "child": child,
                  "speedups": getattr(protocol, "SPEEDUPS_STATUS", "unknown")}))
"""


def bench_env(tree: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(tree)
    env.pop("PYTHONHOME", None)
    return env


def check_tree(tree: Tree, tmp: Path) -> None:
    """``import metaq`` (here and in a subprocess) comes from the tree; speedups in use."""
    got = subprocess.run([sys.executable, "-c", _CHECK], cwd=tmp, env=bench_env(tree.path),
                         capture_output=True, text=True)
    if got.returncode != 0:
        sys.exit(f"compare: importing metaq from {tree.path} failed:\n{got.stderr[-2000:]}")
    info = json.loads(got.stdout.strip().splitlines()[-1])
    root = tree.path.resolve()
    for where in (info["metaq"], info["zk_layout"], *info["child"]):
        if not Path(where).resolve().is_relative_to(root):
            sys.exit(f"compare: with PYTHONPATH={tree.path}, a module came from {where}: "
                     f"the {tree.side} tree would not be what runs")
    tree.speedups = info["speedups"]
    if not tree.speedups.startswith(("in use", "unknown")):
        sys.exit(f"compare: C speedups of the {tree.side} tree: {tree.speedups}")


def remove_tree(repo: Path, tree: Tree) -> None:
    if tree.worktree:
        subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force",
                        str(tree.path)], capture_output=True)


# -- running ---------------------------------------------------------------------------------

def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every live (not zombie) process."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                table[int(entry)] = (int(fields[1]), fields[19])
    return table


def descendants(pid: int) -> dict[int, str]:
    """pid -> start time of every process below ``pid`` (also those in a session of their
    own, as the ZooKeeper JVMs and group members are)."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for p, (parent, _start) in table.items():
        children.setdefault(parent, []).append(p)
    out: dict[int, str] = {}
    todo = list(children.get(pid, ()))
    while todo:
        p = todo.pop()
        out[p] = table[p][1]
        todo += children.get(p, ())
    return out


def end_leftovers(seen: dict[int, str], grace: float = 5.0) -> int:
    """Stop processes a run left running (by pid, checked against their start time)."""
    def alive() -> list[int]:
        table = _proc_table()
        return [p for p, start in seen.items() if p in table and table[p][1] == start]

    left = alive()
    deadline = time.monotonic() + grace
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = alive()
    found = len(left)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in left:
            with contextlib.suppress(OSError):
                os.kill(p, sig)
        deadline = time.monotonic() + grace
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = alive()
    return found


@dataclass
class Run:
    bench: str
    side: str
    round: int
    status: str = ""          # "" ok, else "failed (exit N)" / "failed (timeout)" / ...
    figures: Figures = field(default_factory=list)
    seconds: float = 0.0
    load: float = 0.0
    stdout: Path | None = None
    stderr: Path | None = None
    note: str = ""


def stop_run(proc: subprocess.Popen, seen: dict[int, str]) -> None:
    """SIGINT to the run's process group (the benchmark stops its ZooKeeper and brokers on
    KeyboardInterrupt), then SIGKILL; then whatever it left."""
    seen.update(descendants(proc.pid))
    for sig, wait in ((signal.SIGINT, 30.0), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
    end_leftovers(seen, grace=2.0)


def run_bench(tree: Tree, bench: str, argv: list[str], rnd: int, logs: Path,
              timeout: float) -> Run:
    script = PRESETS[bench][0]
    run = Run(bench, tree.side, rnd, load=os.getloadavg()[0])
    run.stdout = logs / f"{bench}-{tree.side}-r{rnd}.stdout"
    run.stderr = logs / f"{bench}-{tree.side}-r{rnd}.stderr"
    if not (tree.path / "bench" / script).is_file():
        run.status = "no such bench"
        return run
    t0 = time.monotonic()
    seen: dict[int, str] = {}
    with run.stdout.open("w") as out, run.stderr.open("w") as err:
        proc = subprocess.Popen([sys.executable, f"bench/{script}", *argv], cwd=tree.path,
                                env=bench_env(tree.path), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=err, start_new_session=True)
        try:
            while True:
                try:
                    proc.wait(2.0)
                    break
                except subprocess.TimeoutExpired:
                    seen.update(descendants(proc.pid))
                if time.monotonic() - t0 > timeout:
                    stop_run(proc, seen)
                    run.status = "failed (timeout)"
                    break
        except BaseException:
            stop_run(proc, seen)
            raise
    run.seconds = time.monotonic() - t0
    left = end_leftovers(seen)
    if left:
        run.note = f"{left} processes it left running were stopped"
    if not run.status and proc.returncode != 0:
        run.status = f"failed (exit {proc.returncode})"
    if not run.status:
        run.figures = PARSERS[bench](run.stdout.read_text())
        if not run.figures:
            run.status = "no figures found"
    return run


# -- the report ------------------------------------------------------------------------------

def cell(runs: list[Run], figure: str) -> str:
    vals = []
    for r in sorted(runs, key=lambda r: r.round):
        if r.status:
            vals.append(r.status)
        else:
            vals.append(dict(r.figures).get(figure, "-"))
    return " / ".join(vals) if vals else "-"


def report(trees: dict[str, Tree], runs: list[Run], commands: list[str], loads: list[str],
           rounds: int, took: float, logs: Path, interrupted: bool) -> str:
    lines = ["## Before and after, same machine, same session (bench/compare.py)", ""]
    lines.append(f"- before: {trees['before'].label}; after: {trees['after'].label}")
    lines.append("- C speedups: " + "; ".join(
        f"{t.side} {t.speedups} ({t.built or 'no C source'})" for t in trees.values()))
    order = ", ".join(f"round {i + 1} " + ("before then after" if i % 2 == 0
                                           else "after then before") for i in range(rounds))
    lines.append(f"- {rounds} round{'s' if rounds > 1 else ''}, interleaved per benchmark "
                 f"({order}); each cell "
                 + " / ".join(f"r{i + 1}" for i in range(rounds))
                 + ", each figure the median over the benchmark's own runs")
    run_loads = [r.load for r in runs]
    lines.append(f"- machine: {os.cpu_count()} CPUs; load average (1, 5, 15 min) "
                 + "; ".join(loads)
                 + (f"; 1-min load at the start of each run {min(run_loads):.2f} .. "
                    f"{max(run_loads):.2f}" if run_loads else ""))
    lines.append(f"- took {took / 60:.1f} min"
                 + (" (INTERRUPTED: the table is partial)" if interrupted else ""))
    lines += ["", "| figure | before | after |", "|---|---|---|"]
    benches = list(dict.fromkeys(r.bench for r in runs))
    for bench in benches:
        mine = [r for r in runs if r.bench == bench]
        figures = list(dict.fromkeys(f for r in mine for f, _v in r.figures))
        if not figures:
            figures = [f"{bench} (no figures)"]
        for figure in figures:
            lines.append(f"| {figure} | {cell([r for r in mine if r.side == 'before'], figure)}"
                         f" | {cell([r for r in mine if r.side == 'after'], figure)} |")
    if benches:
        lines += ["", "Key: " + "; ".join(KEY[b] for b in benches) + "."]
    bad = [r for r in runs if r.status or r.note]
    if bad:
        lines += ["", "Runs that failed or left processes:", ""]
        for r in bad:
            tail = ""
            if r.stderr and r.stderr.is_file():
                text = r.stderr.read_text(errors="replace").strip().splitlines()
                tail = " | ".join(text[-3:])[-300:]
            lines.append(f"- {r.bench} {r.side} round {r.round}: {r.status or 'ok'}"
                         f"{'; ' + r.note if r.note else ''}; stderr {r.stderr}"
                         + (f": `{tail}`" if tail else ""))
    lines += ["", f"Commands, each run from its tree (<tree> = before `{trees['before'].path}`"
              + (", a worktree removed at the end" if trees["before"].worktree else "")
              + f"; after `{trees['after'].path}`"
              + (", a worktree removed at the end" if trees["after"].worktree else "")
              + f"); every run's stdout and stderr are in `{logs}`:", "", "```"]
    lines += commands
    lines += ["```"]
    if runs:
        lines += ["", "Run times (s): " + ", ".join(
            f"{b} {'/'.join(f'{r.seconds:.0f}' for r in runs if r.bench == b)}"
            for b in benches)]
    return "\n".join(lines) + "\n"


def loadavg() -> str:
    return ", ".join(f"{x:.2f}" for x in os.getloadavg())


# -- main ------------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True, help="a revision (worktree made under a temp dir)")
    ap.add_argument("--after", required=True,
                    help="a revision, or a directory (e.g. the working tree) used as it is")
    ap.add_argument("--rounds", type=int, default=2,
                    help="odd rounds run before then after, even ones after then before")
    ap.add_argument("--only", default=",".join(PRESETS),
                    help=f"comma separated, from {','.join(PRESETS)}")
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes: a smoke test of the plumbing, not figures")
    ap.add_argument("--out", required=True, help="the markdown report (also printed)")
    args = ap.parse_args()
    only = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = [b for b in only if b not in PRESETS]
    if unknown or not only:
        ap.error(f"--only: unknown benchmark(s) {unknown}; choose from {', '.join(PRESETS)}")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    repo = Path(git(Path(__file__).resolve().parent, "rev-parse", "--show-toplevel"))
    out = Path(args.out).resolve()
    logs = out.with_name(out.stem + "-logs")
    logs.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[compare {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)
    # also when started with SIGINT ignored (in the background): Ctrl-C / kill -INT stop us,
    # and the benchmarks start with SIGINT at its default (a handler is reset on exec, an
    # ignored signal is not), so that stop_run's SIGINT reaches them
    signal.signal(signal.SIGINT, signal.default_int_handler)

    tmp = Path(tempfile.mkdtemp(prefix="metaq-compare-"))
    trees: dict[str, Tree] = {}
    runs: list[Run] = []
    commands: list[str] = []
    loads = [f"at the start {loadavg()}"]
    t_start = time.monotonic()
    interrupted = False
    try:
        for side, spec in (("before", args.before), ("after", args.after)):
            trees[side] = make_tree(repo, side, spec, tmp)
            log(f"{side}: {trees[side].path}")
        donors = [repo] + [t.path for t in trees.values() if not t.worktree]
        for tree in trees.values():
            ensure_speedups(tree, donors, log)
            check_tree(tree, tmp)
            log(f"{tree.side}: metaq imported from {tree.path}; C speedups {tree.speedups}")
        for bench in only:
            argv = PRESETS[bench][1 if not args.quick else 2]
            commands.append(f"cd <tree> && PYTHONPATH=<tree> {sys.executable} "
                            f"bench/{PRESETS[bench][0]} {shlex.join(argv)}")
        expected = sum(PRESETS[b][4 if args.quick else 3] for b in only)
        log(f"{len(only)} benchmarks x 2 trees x {args.rounds} rounds, expected about "
            f"{expected * 2 * args.rounds / 60:.1f} min; logs in {logs}")
        for rnd in range(1, args.rounds + 1):
            sides = ("before", "after") if rnd % 2 else ("after", "before")
            for bench in only:
                script, full, quick, est_full, est_quick = PRESETS[bench]
                est = est_quick if args.quick else est_full
                for side in sides:
                    log(f"round {rnd}: {bench} {side} (load {loadavg()})")
                    run = run_bench(trees[side], bench, quick if args.quick else full, rnd,
                                    logs, timeout=max(180.0, 5 * est))
                    runs.append(run)
                    log(f"  {run.seconds:.0f} s: {run.status or f'{len(run.figures)} figures'}"
                        + (f"; {run.note}" if run.note else ""))
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: cleaning up")
    finally:
        for tree in trees.values():
            remove_tree(repo, tree)
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True)
    if len(trees) < 2:
        sys.exit(1)
    loads.append(f"at the end {loadavg()}")
    text = report(trees, runs, commands, loads, args.rounds, time.monotonic() - t_start, logs,
                  interrupted)
    out.write_text(text)
    print()
    print(text, end="")
    if interrupted:
        sys.exit(130)


if __name__ == "__main__":
    main()
