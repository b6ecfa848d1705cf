"""Group scale (issue 15): rebalance settle time with members spread over OS processes.

Each size ``MxP`` starts M consumers of one group over P partitions (topics published in
ZooKeeper under two broker ids, no brokers: the fetchers have nothing to pull), spread over
``--procs`` worker processes (bench/_group_member.py): one process holds exactly one member
(the one killed), the others are divided among the remaining processes.  Once the group is
settled, three cases follow one another in each run:

- join: one member started in a settled group of M (M+1 after);
- leave: one original member closed gracefully (M after);
- kill: the one-member process killed with SIGKILL (M-1 after); its partitions can only be
  taken over once ZooKeeper expires its session, so the settle time is shown beside the
  session timeout (``--session-timeout``) and minus it.

Settled = every partition owned by exactly one live member and every live member STABLE,
from the members' own reports (``on_assigned``/``on_revoked`` callbacks and ``state``,
polled every 2 ms, each stamped with ``time.time()`` in the member's process), and staying
so for ``--quiet`` seconds; the settle time runs from the action (the member's process just
before ``start()``/``close()``, the parent just before ``kill``) to the report that made the
group settled.  Once settled, the owner nodes are read from ZooKeeper and checked against the
reports (``zk`` column: cases where they disagreed).  ``moved`` = partitions whose owner
differs before and after; ``pause`` = the longest revoke-to-reassign gap of a partition that
did NOT move (its owner let it go and took it back): it should be 0.

In-run baseline (``floor``), as in bench_rebalance.py: one kazoo client doing sequentially
the least ZooKeeper work a rebalance of that size needs (read the member list, create and
delete P/M owner nodes); the ratio is settle / floor (for kill: (settle - timeout) / floor).

Run: ``.venv/bin/python bench/bench_group_scale.py --sizes 8x64,32x256 --runs 3``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from kazoo.client import KazooClient

from metaq._zk import ZooKeeperServer
from zk_layout import Layout, TopicBroker, encode_topic_broker

L = Layout()
TOPIC = "bench"
GROUP = "g"
BROKERS = 2
WORKER = Path(__file__).with_name("_group_member.py")
ROOT = Path(__file__).resolve().parent.parent


class Worker:
    """One member process: commands in on stdin, JSON reports out into a shared queue."""

    def __init__(self, idx: int, zk: str, args: argparse.Namespace, strategy: str,
                 events: queue.Queue, errlog: Path, static_grace: float = 0.0) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self.idx = idx
        self._err = errlog.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "--zk", zk, "--group", GROUP, "--topic", TOPIC,
             "--strategy", strategy, "--session-timeout", str(args.session_timeout),
             "--static-grace", str(static_grace)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
            env=env, start_new_session=True)  # a Ctrl-C reaches the parent only
        self._events = events
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self._events.put(json.loads(line))
            except ValueError:
                pass
        self._events.put({"ev": "eof", "proc": self.idx, "t": time.time()})

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self._err.close()

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            try:
                self.send(cmd="exit")
                self.proc.wait(timeout)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


class Group:
    """The parent's view of the group, built from the members' reports."""

    def __init__(self, parts: set[str]) -> None:
        self.parts = parts
        self.events: queue.Queue = queue.Queue()
        self.assign: dict[str, set[str]] = {}
        self.state: dict[str, str | None] = {}
        self.cid: dict[str, str] = {}
        self.live: set[str] = set()
        self.count: Counter[str] = Counter()  # partition -> live members claiming it
        self.log: list[dict] = []
        self.actions: dict[str, float] = {}
        self.errors: list[dict] = []

    def add_live(self, mid: str) -> None:
        self.live.add(mid)
        self.state.setdefault(mid, None)
        for p in self.assign.get(mid, ()):
            self.count[p] += 1

    def drop_live(self, mid: str) -> None:
        if mid in self.live:
            self.live.discard(mid)
            for p in self.assign.get(mid, ()):
                self.count[p] -= 1

    def apply(self, ev: dict) -> None:
        self.log.append(ev)
        kind, mid = ev["ev"], ev.get("id")
        if kind == "assigned":
            self.assign.setdefault(mid, set()).add(ev["p"])
            if mid in self.live:
                self.count[ev["p"]] += 1
        elif kind == "revoked":
            self.assign.setdefault(mid, set()).discard(ev["p"])
            if mid in self.live:
                self.count[ev["p"]] -= 1
        elif kind == "state":
            self.state[mid] = ev["state"]
        elif kind == "started":
            self.cid[mid] = ev["cid"]
        elif kind == "action":
            self.actions[mid] = ev["t"]
        elif kind == "error":
            self.errors.append(ev)

    def settled(self) -> bool:
        if any(self.state.get(m) != "stable" for m in self.live):
            return False
        covered = [p for p, n in self.count.items() if n > 0]
        return (len(covered) == len(self.parts) and all(n <= 1 for n in self.count.values())
                and set(covered) == self.parts)

    def owners(self) -> dict[str, str]:
        return {p: m for m in self.live for p in self.assign.get(m, ())}

    def wait_settled(self, timeout: float, quiet: float) -> float | None:
        """Time stamp of the report that made the group settled, or None after timeout."""
        start = time.time()
        since: float | None = None  # report time stamp of the last move into settled
        since_wall = 0.0
        was = self.settled()
        if was:
            since, since_wall = time.time(), time.time()
        while True:
            now = time.time()
            if was and now - since_wall >= quiet:
                return since
            if now - start > timeout:
                return None
            try:
                ev = self.events.get(timeout=0.02)
            except queue.Empty:
                continue
            self.apply(ev)
            ok = self.settled()
            if ok and not was:
                since, since_wall = ev["t"], time.time()
            was = ok


def check_zk(client: KazooClient, group: Group) -> int:
    """Partitions whose owner node in ZooKeeper disagrees with the members' reports."""
    owners = group.owners()
    path = L.owners_dir(GROUP, TOPIC)
    names = set(client.get_children(path))
    bad = len(names ^ group.parts)
    pending = {p: client.get_async(f"{path}/{p}") for p in names & group.parts}
    for p, res in pending.items():
        data = res.get()[0].decode()
        if data != group.cid.get(owners.get(p, ""), None):
            bad += 1
    return bad


def measure(group: Group, t0: float, before: dict[str, str], t_settled: float | None,
            zk: KazooClient) -> dict[str, Any]:
    if t_settled is None:
        return {"settle": None}
    after = group.owners()
    moved = sum(1 for p in group.parts if before.get(p) != after.get(p))
    stay = {p for p in group.parts if before.get(p) == after.get(p)}
    revoked: dict[tuple[str, str], float] = {}
    pause = 0.0
    for ev in group.log:
        if ev["t"] < t0 or ev.get("p") not in stay:
            continue
        key = (ev["id"], ev["p"])
        if ev["ev"] == "revoked":
            revoked[key] = ev["t"]
        elif ev["ev"] == "assigned" and key in revoked:
            pause = max(pause, ev["t"] - revoked.pop(key))
    if revoked:  # let go and never taken back, yet the same owner: cannot be, but say so
        pause = float("inf")
    return {"settle": t_settled - t0, "moved": moved, "pause": pause,
            "zk_bad": check_zk(zk, group)}


def floor(client: KazooClient, parts: set[str], members: int) -> float:
    moved = max(1, len(parts) // members)
    t0 = time.perf_counter()
    client.get_children(L.consumer_ids(GROUP))
    for p in sorted(parts)[:moved]:
        client.create(L.owner("g-baseline", TOPIC, p), b"x", ephemeral=True, makepath=True)
    for p in sorted(parts)[:moved]:
        client.delete(L.owner("g-baseline", TOPIC, p))
    return time.perf_counter() - t0


def wait_action(group: Group, mid: str, timeout: float = 30.0) -> float:
    deadline = time.time() + timeout
    while mid not in group.actions:
        if time.time() > deadline:
            raise TimeoutError(f"no action report from {mid}")
        try:
            group.apply(group.events.get(timeout=0.05))
        except queue.Empty:
            pass
    return group.actions[mid]


def publish(hosts: str, chroot: str, nparts: int) -> tuple[str, KazooClient, set[str]]:
    """A fresh chroot with the topic published under BROKERS broker ids (no brokers run):
    its connect string, a started client on it, and the partition names."""
    admin = KazooClient(hosts=hosts)
    admin.start()
    admin.ensure_path(chroot)
    admin.stop()
    admin.close()
    zk = hosts + chroot
    client = KazooClient(hosts=zk)
    client.start()
    per = nparts // BROKERS
    for b in range(BROKERS):
        client.create(L.topic_sub(TOPIC, b),
                      encode_topic_broker(TopicBroker(num_parts=per, broker_id=b)),
                      makepath=True)
    return zk, client, {f"{b}-{i}" for b in range(BROKERS) for i in range(per)}


def start_all(group: Group, workers: list[Worker], ids: list[str], where: dict[str, int],
              args: argparse.Namespace) -> bool:
    """Start every member in its process; True once the group has settled."""
    for i, worker in enumerate(workers):
        mine = [m for m in ids if where[m] == i]
        for m in mine:
            group.add_live(m)
        worker.send(cmd="start", ids=mine)
    return group.wait_settled(args.settle_timeout * 3, args.quiet) is not None


def one_run(hosts: str, members: int, nparts: int, strategy: str, run: int,
            args: argparse.Namespace, workers: list[Worker], logdir: Path) -> dict[str, Any]:
    chroot = f"/gs-{members}x{nparts}-{strategy}-{run}"
    zk, client, parts = publish(hosts, chroot, nparts)
    group = Group(parts)
    procs = max(2, min(args.procs, members))
    try:
        for i in range(procs):
            workers.append(Worker(i, zk, args, strategy, group.events,
                                  logdir / f"{chroot[1:]}-p{i}.err"))
        # the last process holds only the victim; the others share the rest round-robin
        ids = [f"m{i}" for i in range(members)]
        victim = ids[-1]
        where: dict[str, int] = {victim: procs - 1}
        for k, mid in enumerate(ids[:-1]):
            where[mid] = k % (procs - 1)
        out: dict[str, Any] = {}
        if not start_all(group, workers, ids, where, args):
            out["initial"] = "did not settle"
            return out
        out["floor"] = floor(client, parts, members)

        # join: one more member, in the first process
        before = group.owners()
        group.add_live("j0")
        workers[0].send(cmd="start", ids=["j0"])
        t0 = wait_action(group, "j0")
        out["join"] = measure(group, t0, before,
                              group.wait_settled(args.settle_timeout, args.quiet), client)
        if out["join"]["settle"] is None:
            return out

        # leave: an original member of the second process (or the first) closes
        leaver = next(m for m in ids if where[m] == min(1, procs - 2))
        before = group.owners()
        group.drop_live(leaver)
        group.actions.pop(leaver, None)  # its start's action report is not this one
        workers[where[leaver]].send(cmd="close", id=leaver)
        t0 = wait_action(group, leaver)
        out["leave"] = measure(group, t0, before,
                               group.wait_settled(args.settle_timeout, args.quiet), client)
        if out["leave"]["settle"] is None:
            return out

        # kill -9: the one-member process
        before = group.owners()
        group.drop_live(victim)
        t0 = time.time()
        os.kill(workers[procs - 1].proc.pid, signal.SIGKILL)
        out["kill"] = measure(group, t0, before,
                              group.wait_settled(args.settle_timeout, args.quiet), client)
        if group.errors:
            out["errors"] = group.errors[:3]
        return out
    finally:
        for w in workers:
            w.stop()
        workers.clear()
        client.stop()
        client.close()


def rolling_run(hosts: str, members: int, nparts: int, strategy: str, run: int,
                args: argparse.Namespace, workers: list[Worker], logdir: Path) -> dict[str, Any]:
    """Every member static (grace ``args.static_grace``); each in turn closed and started
    again in its process, the next once the group has settled.  Reports partitions that
    ever had an owner other than their first (``moved``), the restart of a member (from
    close() to STABLE again, its claims done) and how much longer than its own member's
    restart any partition waited for its owner (revoked to assigned again; 0 or less
    when nothing but its own member's restart kept it waiting)."""
    chroot = f"/gs-rolling-{members}x{nparts}-{strategy}-{run}"
    zk, client, parts = publish(hosts, chroot, nparts)
    group = Group(parts)
    procs = max(1, min(args.procs, members))
    try:
        for i in range(procs):
            workers.append(Worker(i, zk, args, strategy, group.events,
                                  logdir / f"{chroot[1:]}-p{i}.err", args.static_grace))
        ids = [f"m{i}" for i in range(members)]
        where = {mid: k % procs for k, mid in enumerate(ids)}
        out: dict[str, Any] = {}
        if not start_all(group, workers, ids, where, args):
            out["initial"] = "did not settle"
            return out
        out["floor"] = floor(client, parts, members)
        first = group.owners()
        t_roll = time.time()
        restarts: list[float] = []
        extra = 0.0
        for mid in ids:
            mark = len(group.log)
            group.actions.pop(mid, None)
            workers[where[mid]].send(cmd="restart", id=mid)
            t0 = wait_action(group, mid)
            if group.wait_settled(args.settle_timeout, args.quiet) is None:
                out["rolling"] = {"settle": None}
                return out
            log = group.log[mark:]
            # the member's own restart: from close() to its being STABLE again, claims done
            k = next((i for i, e in enumerate(log)
                      if e["ev"] == "restarted" and e["id"] == mid), None)
            if k is None:
                continue
            back = next((e["t"] for e in log[k:] if e["ev"] == "state" and e["id"] == mid
                         and e["state"] == "stable"), log[k]["t"])
            restarts.append(back - t0)
            revoked = {e["p"]: e["t"] for e in log if e["ev"] == "revoked" and e["id"] == mid}
            for e in log:
                if e["ev"] == "assigned" and e["p"] in revoked:
                    extra = max(extra, (e["t"] - revoked[e["p"]]) - (back - t0))
        ever: dict[str, set[str]] = {}
        for e in group.log:
            if e["ev"] == "assigned" and e["t"] >= t_roll:
                ever.setdefault(e["p"], set()).add(e["id"])
        moved = sum(1 for p, who in ever.items() if who - {first.get(p)})
        out["rolling"] = {"settle": statistics.median(restarts) if restarts else None,
                          "restart_max": max(restarts, default=0.0), "moved": moved,
                          "extra_wait": extra, "zk_bad": check_zk(client, group)}
        if group.errors:
            out["errors"] = group.errors[:3]
        return out
    finally:
        for w in workers:
            w.stop()
        workers.clear()
        client.stop()
        client.close()


def fmt(x: float | None, scale: float = 1000.0, width: int = 9) -> str:
    return f"{'-':>{width}}" if x is None else f"{x * scale:>{width}.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="8x64,32x256,64x1024",
                    help="members x partitions, comma separated")
    ap.add_argument("--strategies", default="default,sticky")
    ap.add_argument("--procs", type=int, default=8, help="member processes (one holds the victim)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--session-timeout", type=float, default=4.0,
                    help="members' zk_session_timeout, seconds")
    ap.add_argument("--settle-timeout", type=float, default=60.0,
                    help="give up on one case after this many seconds")
    ap.add_argument("--quiet", type=float, default=1.0,
                    help="seconds the group must stay settled to count as settled")
    ap.add_argument("--json", help="also write every run's figures to this file")
    ap.add_argument("--rolling", default="16x256",
                    help="sizes for the static rolling restart ('' for none)")
    ap.add_argument("--static-grace", type=float, default=30.0,
                    help="static members' grace in the rolling restart, seconds")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logdir = Path(tempfile.mkdtemp(prefix="bench-group-scale-"))
    workers: list[Worker] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    results: dict[str, list[dict]] = {}
    try:
        with ZooKeeperServer() as zks:
            print(f"group scale: {args.procs} member processes, session timeout "
                  f"{args.session_timeout:g} s, {args.runs} runs, medians "
                  f"(worker stderr in {logdir})", flush=True)
            print(f"{'size':<9} {'strategy':<9} {'case':<6} {'settle ms':>9} {'-timeout':>9} "
                  f"{'moved':>6} {'pause ms':>9} {'floor ms':>9} {'ratio':>8} {'zk':>3} "
                  f"{'settled':>8}", flush=True)
            for size in [s for s in args.sizes.split(",") if s]:
                members, nparts = (int(x) for x in size.split("x"))
                for strategy in args.strategies.split(","):
                    runs = []
                    for r in range(args.runs):
                        t = time.time()
                        runs.append(one_run(zks.hosts, members, nparts, strategy, r, args,
                                            workers, logdir))
                        runs[-1]["wall"] = time.time() - t
                    results[f"{size} {strategy}"] = runs
                    report(size, strategy, runs, args)
            for size in [s for s in args.rolling.split(",") if s]:
                members, nparts = (int(x) for x in size.split("x"))
                for strategy in args.strategies.split(","):
                    runs = [rolling_run(zks.hosts, members, nparts, strategy, r, args, workers,
                                        logdir) for r in range(args.runs)]
                    results[f"{size} {strategy} rolling"] = runs
                    report_rolling(size, strategy, runs)
    finally:
        for w in workers:
            w.kill()
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1, default=str))


def report(size: str, strategy: str, runs: list[dict], args: argparse.Namespace) -> None:
    floors = [r["floor"] for r in runs if "floor" in r]
    base = statistics.median(floors) if floors else None
    if base is None:
        print(f"{size:<9} {strategy:<9} initial group did not settle in "
              f"{args.settle_timeout * 3:g} s", flush=True)
        return
    for case in ("join", "leave", "kill"):
        done = [r[case] for r in runs if r.get(case, {}).get("settle") is not None]
        if not done:
            print(f"{size:<9} {strategy:<9} {case:<6} did not settle in "
                  f"{args.settle_timeout:g} s (0/{len(runs)})", flush=True)
            continue
        settle = statistics.median(d["settle"] for d in done)
        minus = settle - args.session_timeout if case == "kill" else None
        moved = statistics.median(d["moved"] for d in done)
        pause = max(d["pause"] for d in done)
        ratio = (minus if minus is not None else settle) / base
        zk_bad = sum(1 for d in done if d["zk_bad"])
        print(f"{size:<9} {strategy:<9} {case:<6} {fmt(settle)} {fmt(minus)} {moved:>6g} "
              f"{fmt(pause)} {fmt(base)} {ratio:>7.1f}x {zk_bad:>3} "
              f"{len(done):>4}/{len(runs)}", flush=True)


def report_rolling(size: str, strategy: str, runs: list[dict]) -> None:
    done = [r["rolling"] for r in runs if r.get("rolling", {}).get("settle") is not None]
    if not done:
        print(f"{size:<9} {strategy:<9} rolling did not settle (0/{len(runs)})", flush=True)
        return
    restart = statistics.median(d["settle"] for d in done)
    worst = max(d["restart_max"] for d in done)
    moved = max(d["moved"] for d in done)
    extra = max(d["extra_wait"] for d in done)
    print(f"{size:<9} {strategy:<9} static rolling restart of every member: moved {moved} "
          f"(max over runs), member restart median {restart * 1000:.1f} ms (max "
          f"{worst * 1000:.1f}), longest partition wait beyond its member's restart "
          f"{extra * 1000:.1f} ms, zk disagreements {sum(1 for d in done if d['zk_bad'])}, "
          f"{len(done)}/{len(runs)} runs", flush=True)


if __name__ == "__main__":
    main()
