"""What the dashboard shows, as JSON-ready dicts: :class:`Dashboard` joins the watched
copy of the tree (:class:`~metaq.dashboard._tree.ZkTreeCache`) with what a sampler
thread asks the brokers every ``sample_interval`` seconds (log starts and ends, the
msgId time and size of the message at each lagging position, which brokers answer),
and keeps each group's lag over the last hour.

A page costs no ZooKeeper read and no broker round trip: the group report is
:func:`metaq._admin.evaluate_group` (what ``metaq group describe`` computes) over the
cached tree and the last sample.  Members and owners are live (the tree as the
watches keep it); each partition's committed offset, log end and lag are as of the
last sample, the commit read just before the log end, so that the lag is never
understated by a log end older than the commit.  Only the message browser, a broker's ``stats``
and the write actions talk to a broker or to ZooKeeper, when asked.

Garbage in ZooKeeper and unreachable brokers are data here, never exceptions: a
damaged node is a flagged row (``flagged: true`` with its ``error``), a broker that
does not answer has ``reachable: false`` and its partitions ``log_end: null``
(state ``unknown``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace
from typing import Any

from kazoo.client import KazooClient

from metaq._admin import evaluate_group, lag_positions, reset_offsets
from metaq._errors import BrokerError, BrokerUnavailableError, ConfigError, MetaqError
from metaq._time import format_time_ms, parse_time_ms
from metaq._types import PartitionKey
from metaq.dashboard._messages import browse
from metaq.dashboard._tree import ZkTreeCache
from metaq.net import BrokerConnection, header_at
from zk_layout import (
    GroupInfo,
    Layout,
    Snapshot,
    broker_address,
    partition_broker_id,
    take_snapshot,
)

__all__ = ["Dashboard", "NotFound"]

log = logging.getLogger(__name__)

#: the group name the dashboard's broker requests carry (offset, get, stats)
ADMIN_GROUP = "metaq-dashboard"
_LOG_END = 2**63 - 1
#: a message at a lagging position bigger than this is asked for whole once, to see
#: whether its broker sends it at all (as ``metaq group describe`` does)
_CAP_CHECK_FROM = 64 * 1024
#: how far back each group's lag is kept (the chart's hour)
LAG_HISTORY_SECONDS = 3600.0


class NotFound(MetaqError):
    """No such group, topic or broker in the tree (the API answers 404)."""


def _hex(data: bytes | None, limit: int = 64) -> str | None:
    if data is None:
        return None
    return data[:limit].hex() + ("..." if len(data) > limit else "")


def _iso(ms: float | None) -> str | None:
    return None if ms is None else format_time_ms(int(ms))


class Dashboard:
    """The dashboard's state and queries (see the module doc); :meth:`start` then
    :meth:`close`.  ``client`` is a started kazoo client: the cache reads through it,
    and the write actions write through it."""

    def __init__(self, client: KazooClient, layout: Layout | None = None, *,
                 zk_display: str = "", sample_interval: float = 5.0, timeout: float = 5.0,
                 allow_writes: bool = False, window: float | None = None) -> None:
        if sample_interval <= 0:
            raise ConfigError(f"sample interval must be > 0 seconds, got {sample_interval}")
        self.client = client
        self.layout = layout or Layout()
        self.zk_display = zk_display
        self.sample_interval = sample_interval
        self.timeout = timeout
        self.allow_writes = allow_writes
        #: Burrow's window: a group's state compares now with the sample this old
        self.window = window if window is not None else max(10.0, 2 * sample_interval)
        self.cache = ZkTreeCache(client, self.layout.root)
        self._lock = threading.Lock()
        self._snapshots: dict[str | None, tuple[int, float, Snapshot]] = {}
        self._reports: dict[str, tuple[tuple[int, int], float, dict[str, Any]]] = {}
        self._ends: dict[str, dict[str, tuple[int | None, int | None]]] = {}
        self._ends_at = 0.0
        self._unwritten: dict[str, set[str]] = {}
        self._capped: dict[str, dict[str, tuple[int, int]]] = {}
        self._heads: dict[tuple[str, str, int], tuple[int, int]] = {}
        self._reach: dict[str, tuple[bool, str | None]] = {}
        self._windows: dict[str, deque[tuple[float, GroupInfo, dict]]] = {}
        self._lag: dict[str, deque[dict[str, Any]]] = {}
        self._samples = 0
        self._sample_ms = 0.0
        self._conns: dict[tuple[str, int], BrokerConnection] = {}
        self._stop = threading.Event()
        self._sampled = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metaq-dashboard-sampler",
                                        daemon=True)

    # -- life ------------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> None:
        self.cache.start(timeout)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.timeout + 5)
        self.cache.close()
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()

    def wait_sampled(self, timeout: float) -> bool:
        """True once the first broker sample is in."""
        return self._sampled.wait(timeout)

    # -- the tree --------------------------------------------------------------------------
    def snapshot(self, group: str | None = None) -> Snapshot:
        """The tree as :func:`zk_layout.take_snapshot` reads it, from the cache (built
        again only when the tree changed, or after a second for static members' hold
        times); with ``group`` only that group is read."""
        version = self.cache.version
        now = time.time()
        with self._lock:
            memo = self._snapshots.get(group)
            whole = self._snapshots.get(None)
        if memo is not None and memo[0] == version and now - memo[1] < 1.0:
            return memo[2]
        if group is not None and whole is not None and whole[0] == version and \
                now - whole[1] < 1.0:
            return whole[2]  # the whole tree, as current: it has the group too
        snap = take_snapshot(self.cache.view(only_group=group), self.layout)
        with self._lock:
            if len(self._snapshots) > 64:
                self._snapshots.clear()
            self._snapshots[group] = (version, now, snap)
        return snap

    # -- the sampler -----------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - the sampler must outlive any one bad sample
                log.exception("dashboard sample failed")
            self._sample_ms = (time.monotonic() - t0) * 1000
            self._sampled.set()
            self._stop.wait(max(0.05, self.sample_interval - (time.monotonic() - t0)))

    def _conn(self, address: tuple[str, int]) -> BrokerConnection:
        conn = self._conns.get(address)
        if conn is not None and not conn.idle_and_open():  # the broker closed it (restarted)
            del self._conns[address]
            conn = None
        if conn is None:
            conn = BrokerConnection(*address, timeout=self.timeout)
            self._conns[address] = conn
        return conn

    def _drop(self, address: tuple[str, int]) -> None:
        conn = self._conns.pop(address, None)
        if conn is not None:
            conn.close()

    def _ask(self, address: tuple[str, int], fn: Callable[[BrokerConnection], Any]) -> Any:
        """``fn(conn)`` on the pooled connection to ``address``; on a transport failure
        the connection is dropped and the broker marked unreachable (re-raised)."""
        key = f"{address[0]}:{address[1]}"
        try:
            out = fn(self._conn(address))
        except BrokerUnavailableError as e:
            self._drop(address)
            self._reach[key] = (False, str(e))
            raise
        self._reach[key] = (True, None)
        return out

    def sample(self) -> None:
        """One sample: every topic's log bounds, every broker's reachability, the
        message at each group's lagging positions; then each group's lag point."""
        snap = self.snapshot()
        view = self.cache.view()
        now = time.time()
        ends: dict[str, dict[str, tuple[int | None, int | None]]] = {}
        unwritten: dict[str, set[str]] = {}
        for b in snap.brokers:
            for uri in [b.master, *(u for _, u in b.slaves)]:
                if uri is None:
                    continue
                try:
                    self._ask(uri.address, lambda c: c.version())
                except (BrokerUnavailableError, BrokerError):
                    pass
        for t in snap.topics:
            per: dict[str, tuple[int | None, int | None]] = {}
            unwritten[t.topic] = set()
            by_broker: dict[int, list[str]] = {}
            for p in t.partitions:
                by_broker.setdefault(p.broker_id, []).append(str(p))
            for bid, parts in by_broker.items():
                address = broker_address(view, self.layout, bid)
                for p in parts:
                    per[p] = (None, None)
                if address is None:
                    continue

                def bounds(conn: BrokerConnection, topic: str = t.topic,
                           parts: list[str] = parts, per: dict = per, bid: int = bid) -> None:
                    for p in parts:
                        index = int(p.split("-", 1)[1])
                        try:
                            per[p] = (conn.offset(topic, ADMIN_GROUP, index, 0),
                                      conn.offset(topic, ADMIN_GROUP, index, _LOG_END))
                        except BrokerError as e:
                            log.info("broker %d: no bounds for %s/%s: %s", bid, topic, p, e)
                        if (topic, index) in conn.unwritten:
                            unwritten[topic].add(p)
                try:
                    self._ask(address, bounds)
                except BrokerUnavailableError as e:
                    log.info("broker %d at %s:%s did not answer: %s", bid, *address, e)
            ends[t.topic] = per
        # the message at every lagging position: its time (lag in seconds) and size
        capped: dict[str, dict[str, tuple[int, int]]] = {}
        wanted: set[tuple[str, str, int]] = set()
        for info in snap.groups:
            for gt in info.topics:
                for part, pos in lag_positions(gt, ends.get(gt.topic, {})).items():
                    wanted.add((gt.topic, part, pos))
        heads = {k: v for k, v in self._heads.items() if k in wanted}
        for topic, part, pos in sorted(wanted - set(heads)):
            address = broker_address(view, self.layout, partition_broker_id(part))
            if address is None:
                continue
            index = int(part.split("-", 1)[1])

            def head(conn: BrokerConnection, topic: str = topic, index: int = index,
                     pos: int = pos, part: str = part) -> None:
                got = header_at(conn, topic, index, pos, group=ADMIN_GROUP)
                if got is None:
                    return
                heads[(topic, part, pos)] = got
                if got[1] > _CAP_CHECK_FROM:
                    sent = len(conn.get(topic, ADMIN_GROUP, index, pos, got[1]))
                    if sent < got[1]:
                        capped.setdefault(topic, {})[part] = (got[1], sent)
            try:
                self._ask(address, head)
            except (BrokerUnavailableError, BrokerError):
                pass
        for topic, part, pos in heads:
            old = self._capped.get(topic, {}).get(part)
            if old is not None and (topic, part, pos) in wanted:
                capped.setdefault(topic, {}).setdefault(part, old)
        with self._lock:
            self._ends, self._ends_at, self._unwritten = ends, now, unwritten
            self._heads, self._capped = heads, capped
            self._samples += 1
        for info in snap.groups:
            win = self._windows.setdefault(info.group, deque())
            win.append((now, info, ends))
            while len(win) > 2 and now - win[1][0] >= self.window:
                win.popleft()
            report = self._report(info, now, live=False)
            point = {"time_ms": int(now * 1000), "lag": report["total_lag"],
                     "lag_messages": report["total_lag_messages"],
                     "lag_seconds": report["max_lag_seconds"], "status": report["status"]}
            with self._lock:  # lag_series copies it from a request's thread
                points = self._lag.setdefault(info.group, deque())
                points.append(point)
                while points and now - points[0]["time_ms"] / 1000 > LAG_HISTORY_SECONDS:
                    points.popleft()
        with self._lock:
            for g in set(self._lag) - {g.group for g in snap.groups}:
                self._lag.pop(g, None)
                self._windows.pop(g, None)

    # -- the group report -----------------------------------------------------------------
    def _as_sampled(self, info: GroupInfo) -> GroupInfo:
        """``info`` (live: members and owners as they are now) with each partition's
        committed offset as of the last sample, read just before its log ends: the
        lag then compares a commit with a log end read after it, never with an older
        one (which would show a busy group as caught up)."""
        win = self._windows.get(info.group)
        if not win:
            return info
        sampled = {(gt.topic, str(ps.partition)): ps for gt in win[-1][1].topics
                   for ps in gt.partitions}
        topics = []
        for gt in info.topics:
            parts = []
            for ps in gt.partitions:
                old = sampled.get((gt.topic, str(ps.partition)))
                if old is not None and (old.offset != ps.offset or old.errors != ps.errors):
                    ps = replace(ps, offset=old.offset, errors=old.errors)
                parts.append(ps)
            topics.append(replace(gt, partitions=tuple(parts)))
        return replace(info, topics=tuple(topics))

    def _report(self, info: GroupInfo, now: float, *, live: bool = True) -> dict[str, Any]:
        with self._lock:
            ends, ends_at = self._ends, self._ends_at
            heads, capped, unwritten = self._heads, self._capped, self._unwritten
        if live:
            info = self._as_sampled(info)
        view = self.cache.view()
        # a commit newer than the last sample of the log end is not "out of range": the
        # end moved since (it is taken as the end until the next sample says)
        adjusted: dict[str, dict[str, tuple[int | None, int | None]]] = {}
        for gt in info.topics:
            per = dict(ends.get(gt.topic, {}))
            for ps in gt.partitions:
                name = str(ps.partition)
                start, end = per.get(name, (None, None))
                if ps.offset is not None and end is not None and ps.offset.offset > end:
                    stat = view.exists(self.layout.offset(info.group, gt.topic, name))
                    if stat is not None and stat.mtime / 1000 > ends_at:
                        per[name] = (start, ps.offset.offset)
            adjusted[gt.topic] = per
        times: dict[str, dict[str, int]] = {}
        sizes: dict[tuple[str, str], int] = {}
        for gt in info.topics:
            for part, pos in lag_positions(gt, adjusted[gt.topic]).items():
                got = heads.get((gt.topic, part, pos))
                if got is not None:
                    times.setdefault(gt.topic, {})[part] = got[0]
                    sizes[(gt.topic, part)] = got[1]
        first = None
        ends_first = None
        interval = 0.0
        win = self._windows.get(info.group)
        if win:
            old = win[0]
            if now - old[0] >= self.window * 0.99:
                first, ends_first, interval = old[1], old[2], now - old[0]
        report = evaluate_group(view, self.layout, info, ends=adjusted, times=times,
                                unwritten=unwritten, capped=capped, first=first,
                                ends_first=ends_first, interval=interval, now=now)
        # GroupReport.as_json()'s fields, without dataclasses.asdict's deep copies (a
        # third of the page's time at 1,024 partitions)
        rows = [dict(vars(p)) for p in report.partitions]
        out = {"group": report.group, "status": report.status,
               "members": list(report.members),
               "member_states": [dict(vars(m), topics=list(m.topics))
                                 for m in report.member_states],
               "partitions": rows, "total_lag": sum(p["lag"] or 0 for p in rows)}
        total_msgs = 0
        max_seconds = 0.0
        for row in rows:
            lag = row["lag"]
            size = sizes.get((row["topic"], row["partition"]))
            if lag is None:
                msgs, exact = None, False
            elif lag == 0:
                msgs, exact = 0, True
            elif size:
                msgs = max(1, round(lag / size))
                exact = msgs == 1 and lag == size
            else:
                msgs, exact = None, False
            row["lag_bytes"] = lag
            row["lag_messages"] = msgs
            row["lag_messages_estimated"] = msgs is not None and not exact
            row["flagged"] = row["state"] not in ("ok", "lagging", "warn")
            row["committed_time"] = None
            total_msgs += msgs or 0
            if row["lag_seconds"] is not None:
                max_seconds = max(max_seconds, row["lag_seconds"])
        out["total_lag_bytes"] = out["total_lag"]
        out["total_lag_messages"] = total_msgs
        out["max_lag_seconds"] = max_seconds
        out["damaged"] = [{"path": d.path, "error": d.error, "data_hex": _hex(d.data)}
                          for d in info.damaged]
        out["window_seconds"] = round(interval, 3) if first is not None else None
        out["sampled_at"] = _iso(ends_at * 1000) if ends_at else None
        return out

    # -- queries (the JSON API) -----------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The dashboard itself: how current it is and what it costs ZooKeeper."""
        return {"zk": self.zk_display, "root": self.layout.root,
                "read_only": not self.allow_writes, "zk_connected": self.cache.connected,
                "zk_reads": self.cache.reads, "zk_changes": self.cache.changes,
                "cached_nodes": self.cache.nodes, "samples": self._samples,
                "sample_interval": self.sample_interval,
                "last_sample_ms": round(self._sample_ms, 1),
                "sampled_at": _iso(self._ends_at * 1000) if self._ends_at else None}

    def brokers(self, snap: Snapshot | None = None) -> list[dict[str, Any]]:
        """One row per registered broker: every master and slave, with replication."""
        snap = snap or self.snapshot()
        rows = []
        for b in snap.brokers:
            rep = b.replication
            members = [("master", None, b.master)] + [("slave", n, u) for n, u in b.slaves]
            for role, n, uri in members:
                if uri is None:
                    rows.append({"broker_id": b.broker_id, "role": role, "slave_no": n,
                                 "address": None, "uri": None, "reachable": None,
                                 "error": "no master registered", "in_sync": None,
                                 "epoch": None if rep is None else rep.epoch,
                                 "replication_mode": None if rep is None else rep.mode,
                                 "flagged": True})
                    continue
                address = f"{uri.address[0]}:{uri.address[1]}"
                ok, err = self._reach.get(address, (None, None))
                rows.append({"broker_id": b.broker_id, "role": role, "slave_no": n,
                             "address": address, "uri": str(uri), "reachable": ok,
                             "error": err,
                             "in_sync": None if rep is None or role == "master"
                             else n in rep.in_sync,
                             "epoch": None if rep is None else rep.epoch,
                             "replication_mode": None if rep is None else rep.mode,
                             "flagged": ok is False or (role == "slave" and rep is not None
                                                        and n not in rep.in_sync)})
            for d in b.damaged:
                rows.append({"broker_id": b.broker_id, "role": "damaged", "slave_no": None,
                             "address": None, "uri": None, "reachable": None,
                             "error": f"{d.path}: {d.error}", "in_sync": None, "epoch": None,
                             "replication_mode": None, "flagged": True})
        return rows

    def topics(self, snap: Snapshot | None = None) -> list[dict[str, Any]]:
        snap = snap or self.snapshot()
        with self._lock:
            ends = self._ends
        rows = []
        for t in snap.topics:
            per = ends.get(t.topic, {})
            known = [per.get(str(p), (None, None)) for p in t.partitions]
            sizes = [e - s for s, e in known if s is not None and e is not None]
            rows.append({"topic": t.topic, "partitions": len(t.partitions),
                         "brokers": sorted({b.broker_id for b in t.brokers}),
                         "bytes": sum(sizes) if sizes else None,
                         "unknown_partitions": len(known) - len(sizes),
                         "damaged": [{"path": d.path, "error": d.error} for d in t.damaged],
                         "flagged": bool(t.damaged) or len(sizes) < len(known)})
        return rows

    def topic(self, name: str) -> dict[str, Any]:
        snap = self.snapshot()
        t = snap.topic(name)
        if t is None:
            raise NotFound(f"no topic {name!r} under {self.layout.root}")
        with self._lock:
            per = self._ends.get(name, {})
            unwritten = self._unwritten.get(name, set())
        parts = []
        for p in t.partitions:
            s, e = per.get(str(p), (None, None))
            parts.append({"partition": str(p), "broker_id": p.broker_id, "log_start": s,
                          "log_end": e, "bytes": None if s is None or e is None else e - s,
                          "note": "empty: never written" if str(p) in unwritten
                          else "its broker did not answer" if e is None else None,
                          "flagged": e is None})
        return {"topic": name, "partitions": parts,
                "brokers": [asdict(b) for b in t.brokers],
                "damaged": [{"path": d.path, "error": d.error, "data_hex": _hex(d.data)}
                            for d in t.damaged]}

    def groups(self, snap: Snapshot | None = None) -> list[dict[str, Any]]:
        snap = snap or self.snapshot()
        now = time.time()
        rows = []
        for info in snap.groups:
            report = self._report(info, now)
            rows.append({"group": info.group, "status": report["status"],
                         "members": len(info.members), "away": len(info.away_members),
                         "topics": sorted(gt.topic for gt in info.topics),
                         "partitions": len(report["partitions"]),
                         "lag": report["total_lag"],
                         "lag_messages": report["total_lag_messages"],
                         "lag_seconds": report["max_lag_seconds"],
                         "damaged": len(info.damaged),
                         "flagged": report["status"] != "ok" or bool(info.damaged)})
        return rows

    def group(self, name: str) -> dict[str, Any]:
        """The group's report; the same dict (not to be changed) for every request until
        the tree or the sample changed or half a second passed (its lag in seconds)."""
        key = (self.cache.version, self._samples)
        now = time.time()
        with self._lock:
            memo = self._reports.get(name)
        if memo is not None and memo[0] == key and now - memo[1] < 0.5:
            return memo[2]
        snap = self.snapshot(group=name)
        info = snap.group(name)
        if info is None:
            raise NotFound(f"no consumer group {name!r} under {self.layout.root}")
        out = self._report(info, now)
        out["read_only"] = not self.allow_writes
        with self._lock:
            if len(self._reports) > 256:
                self._reports.clear()
            self._reports[name] = (key, now, out)
        return out

    def lag_series(self, name: str) -> dict[str, Any]:
        if self.snapshot(group=name).group(name) is None:
            raise NotFound(f"no consumer group {name!r} under {self.layout.root}")
        with self._lock:
            points = list(self._lag.get(name, ()))
        return {"group": name, "sample_interval": self.sample_interval,
                "seconds": LAG_HISTORY_SECONDS, "points": points}

    def cluster(self) -> dict[str, Any]:
        snap = self.snapshot()
        return {**self.status(), "exists": snap.exists, "brokers": self.brokers(snap),
                "topics": self.topics(snap), "groups": self.groups(snap),
                "damaged": [{"path": d.path, "error": d.error, "data_hex": _hex(d.data)}
                            for d in snap.damaged],
                "unknown": list(snap.unknown)}

    def broker_stats(self, broker_id: int) -> dict[str, Any]:
        """``stats`` of broker id's master and slaves, asked now (one round trip each)."""
        snap = self.snapshot()
        b = snap.broker(broker_id)
        if b is None:
            raise NotFound(f"no broker {broker_id} under {self.layout.root}")
        out = []
        for role, n, uri in [("master", None, b.master)] + [("slave", n, u)
                                                             for n, u in b.slaves]:
            if uri is None:
                continue
            row: dict[str, Any] = {"role": role, "slave_no": n,
                                   "address": f"{uri.address[0]}:{uri.address[1]}",
                                   "reachable": True, "error": None, "stats": {}}
            try:
                with BrokerConnection(*uri.address, timeout=self.timeout) as conn:
                    text = conn.stats()
                for line in text.splitlines():
                    f = line.split(None, 2)
                    if len(f) >= 2 and f[0] == "STAT":
                        row["stats"][f[1]] = f[2] if len(f) > 2 else ""
            except (BrokerUnavailableError, BrokerError) as e:
                row.update(reachable=False, error=str(e))
            out.append(row)
        return {"broker_id": broker_id, "brokers": out,
                "rows": [r for r in self.brokers(snap) if r["broker_id"] == broker_id]}

    def messages(self, topic: str, partition: str, *, offset: int | None = None,
                 when: str | None = None, count: int = 20, before: int = 5,
                 codec: str = "auto") -> dict[str, Any]:
        snap = self.snapshot()
        t = snap.topic(topic)
        if t is None:
            raise NotFound(f"no topic {topic!r} under {self.layout.root}")
        if partition not in {str(p) for p in t.partitions}:
            raise NotFound(f"topic {topic!r} has no partition {partition!r} "
                           f"(it has {', '.join(str(p) for p in t.partitions)})")
        when_ms = None if when in (None, "") else parse_time_ms(when, "time")
        address = broker_address(self.cache.view(), self.layout, partition_broker_id(partition))
        if address is None:
            return {"topic": topic, "partition": partition, "messages": [],
                    "error": f"broker {partition_broker_id(partition)} has no registered "
                             "master or slave", "flagged": True}
        return browse(address, topic, partition, offset=offset, when_ms=when_ms, count=count,
                      before=before, codec=codec, timeout=self.timeout, group=ADMIN_GROUP)

    # -- history, what-if, audit (their own modules; shown when this build has them) ------
    def history(self, name: str, since: str | None = None) -> dict[str, Any] | None:
        try:
            from zk_layout import ownership_timeline, read_history, timeline_to_json
        except ImportError:
            return None
        if self.snapshot(group=name).group(name) is None:
            raise NotFound(f"no consumer group {name!r} under {self.layout.root}")
        since_ms = None if since in (None, "") else parse_time_ms(since, "since")
        records = read_history(self.cache.view(), self.layout, name, since=since_ms)
        return {"group": name, "records": [r.to_json() for r in records],
                "timeline": timeline_to_json(ownership_timeline(records))}

    def what_if(self, name: str, *, add: int = 0, remove: Iterable[str] = (),
                strategy: str | None = None) -> dict[str, Any] | None:
        try:
            from metaq._insight import what_if
        except ImportError:
            return None
        snap = self.snapshot(group=name)
        if snap.group(name) is None:
            raise NotFound(f"no consumer group {name!r} under {self.layout.root}")
        return what_if(snap, name, add=add, remove=tuple(remove),
                       strategy=strategy or None).to_json()

    def audit(self, name: str) -> dict[str, Any] | None:
        try:
            from metaq._insight import audit
        except ImportError:
            return None
        snap = self.snapshot(group=name)
        if snap.group(name) is None:
            raise NotFound(f"no consumer group {name!r} under {self.layout.root}")
        return {"group": name, "findings": [f.to_json() for f in audit(snap, name)]}

    def capacity(self, name: str, target: str | None = None) -> dict[str, Any] | None:
        """The capacity hint over the sampled window (the oldest sample kept and the
        last), where the build has it; ``target``: seconds, or ``90s``, ``10m``, ``1h``."""
        try:
            from metaq._insight import PartitionReading, Reading, capacity
        except ImportError:
            return None
        if self.snapshot(group=name).group(name) is None:
            raise NotFound(f"no consumer group {name!r} under {self.layout.root}")
        target_s = _duration(target) if target not in (None, "") else None
        win = self._windows.get(name)
        if not win or len(win) < 2:
            return {"group": name, "available": True, "error": "not enough samples yet: "
                    "the hint needs two, one sample interval apart"}

        def reading(sample: tuple[float, GroupInfo, dict]) -> Any:
            at, info, ends = sample
            parts = {}
            for gt in info.topics:
                for ps in gt.partitions:
                    part = str(ps.partition)
                    parts[PartitionKey(gt.topic, part)] = PartitionReading(
                        owner=ps.owner, committed=ps.offset.offset if ps.offset else None,
                        log_end=ends.get(gt.topic, {}).get(part, (None, None))[1])
            return Reading(group=name, at=at,
                           members=tuple(m.consumer_id for m in info.members),
                           partitions=parts)

        hint = capacity(reading(win[0]), reading(win[-1]), target=target_s)
        return {"available": True, **hint.to_json()}

    # -- writes (only with allow_writes; the caller checked the confirmation) --------------
    def reset(self, group: str, topic: str, to: str | int | tuple[str, int], *,
              partitions: Iterable[str] | None = None, who: str = "?"
              ) -> dict[str, tuple[int | None, int]]:
        """``metaq group reset-offsets`` (refused while the group has live members),
        through the real client, and logged."""
        if not self.allow_writes:
            raise ConfigError("this dashboard is read-only: start it with --allow-writes")
        parts = None if partitions is None else list(partitions)
        log.warning("dashboard write by %s: reset offsets of group %r topic %r%s to %r",
                    who, group, topic, f" partitions {parts}" if parts else "", to)
        try:
            done = reset_offsets(self.client, self.layout, group, topic, to=to,
                                 timeout=self.timeout, partitions=parts)
        except MetaqError as e:
            log.warning("dashboard write by %s refused: %s", who, e)
            raise
        log.warning("dashboard write by %s done: group %r topic %r: %s", who, group, topic,
                    {p: new for p, (_old, new) in done.items()})
        return done


def _duration(text: str) -> float:
    """Seconds from ``600``, ``90s``, ``10m`` or ``1h``."""
    value = text.strip().lower()
    scale = {"s": 1, "m": 60, "h": 3600}.get(value[-1:])
    number = value[:-1] if scale else value
    try:
        seconds = float(number) * (scale or 1)
    except ValueError:
        raise ConfigError(f"a duration must be seconds or like 90s, 10m, 1h; got {text!r}"
                          ) from None
    if not seconds > 0:
        raise ConfigError(f"a duration must be > 0, got {text!r}")
    return seconds


def parse_target(value: str) -> str | int | tuple[str, int]:
    """A reset target as the form gives it: earliest, latest, an offset, or time:T."""
    value = (value or "").strip()
    if value in ("earliest", "latest"):
        return value
    if value.startswith("time:"):
        return ("time", parse_time_ms(value[5:], "time"))
    if value.isdigit():
        return int(value)
    raise ConfigError(f"reset target must be earliest, latest, an offset >= 0 or "
                      f"time:<ISO-8601 or epoch ms>, got {value!r}")
