"""What ZooKeeper saw during a chaos run: commit history and periodic tree samples.

:class:`ZkAudit` has its own kazoo client on the ensemble (a long session, so
it survives node restarts) and records

- every committed offset of every partition, from a data watch on each
  offset node: value, node version, ``mtime`` (the server's wall clock) and
  ``mzxid``; a jump in versions means a value was missed (the watch fired
  while the client was away) and the analysis is then lenient about it;
- a sample of the group every ``interval`` seconds: registered members with
  their session (read before and after the owners, since one sample is not
  atomic), each partition's owner node with its session, and the static
  member records (issue 15: ``consumers/<group>/static/<consumerId>``) with
  their away time and grace, so the audit knows whose partitions were held.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NoNodeError

from zk_layout import Layout, NodeDataError, decode_offset, decode_static_member


@dataclass(frozen=True, slots=True)
class Commit:
    seen: float     # when the audit saw it (time.time())
    version: int    # offset node version
    value: int      # committed offset
    mtime: float    # server time of the write, seconds
    zxid: int


@dataclass(frozen=True, slots=True)
class Sample:
    t0: float                           # before the first read
    t: float                            # after the last read
    ids_before: dict[str, int]          # consumer id -> session
    owners: dict[str, tuple[str, int]]  # partition -> (consumer id, session)
    ids_after: dict[str, int]
    published: frozenset[str]           # partitions whose broker is registered
    #: static member records: consumer id -> (away since, grace), ms (away: None
    #: while the member is there, or until someone marks it away)
    statics: dict[str, tuple[int | None, int]] = field(default_factory=dict)


@dataclass
class ZkAudit:
    hosts: str               # ensemble hosts + chroot
    group: str
    topic: str
    partitions: list[str]
    interval: float = 0.1
    layout: Layout = field(default_factory=Layout)
    commits: dict[str, list[Commit]] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)
    failed_samples: int = 0

    def __post_init__(self) -> None:
        self.client = KazooClient(hosts=self.hosts, timeout=30.0)
        self._stop = threading.Event()
        self._pace = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._sample_loop, name="chaos-zk-sampler",
                                        daemon=True)

    def start(self) -> ZkAudit:
        self.client.start(timeout=30)
        for d in (self.layout.consumer_ids(self.group),
                  self.layout.owners_dir(self.group, self.topic),
                  self.layout.offsets_dir(self.group, self.topic)):
            self.client.ensure_path(d)
        for p in self.partitions:
            self.commits[p] = []
            self.client.DataWatch(self.layout.offset(self.group, self.topic, p),
                                  self._offset_watch(p))
        return self

    def start_sampling(self) -> None:
        self._thread.start()

    def _offset_watch(self, part: str):  # noqa: ANN202
        def watch(data: bytes | None, stat, *_: object) -> None:  # noqa: ANN001
            if data is None or stat is None:
                return
            try:
                value = decode_offset(data).offset
            except NodeDataError:
                return  # garbage a fault wrote: not a commit (the version gap shows it)
            c = Commit(time.time(), stat.version, value, stat.mtime / 1000.0, stat.mzxid)
            with self._lock:  # append only: the watch thread must not block
                self.commits[part].append(c)
        return watch

    def _read_ids(self) -> dict[str, int]:
        d = self.layout.consumer_ids(self.group)
        names = self.client.get_children(d)
        pending = {n: self.client.exists_async(f"{d}/{n}") for n in names}
        out = {}
        for n, r in pending.items():
            stat = r.get(timeout=10)
            if stat is not None:
                out[n] = stat.ephemeralOwner
        return out

    def sample(self) -> Sample:
        t0 = time.time()
        before = self._read_ids()
        pending = {p: self.client.get_async(self.layout.owner(self.group, self.topic, p))
                   for p in self.partitions}
        owners = {}
        for p, r in pending.items():
            try:
                data, stat = r.get(timeout=10)
            except NoNodeError:
                continue
            owners[p] = (data.decode("utf-8", "replace"), stat.ephemeralOwner)
        brokers = self.client.get_children(self.layout.topic_sub_dir(self.topic))
        published = frozenset(p for p in self.partitions
                              if any(b.startswith(p.split("-", 1)[0] + "-") for b in brokers))
        statics = self._read_statics()
        after = self._read_ids()
        return Sample(t0, time.time(), before, owners, after, published, statics)

    def _read_statics(self) -> dict[str, tuple[int | None, int]]:
        d = self.layout.static_members(self.group)
        try:
            names = self.client.get_children(d)
        except NoNodeError:
            return {}
        pending = {n: self.client.get_async(f"{d}/{n}") for n in names}
        out: dict[str, tuple[int | None, int]] = {}
        for n, r in pending.items():
            try:
                data, _stat = r.get(timeout=10)
                rec = decode_static_member(data)
            except (NoNodeError, NodeDataError):
                continue  # deleted meanwhile (a grace ran out)
            out[n] = (rec.away_since_ms, rec.grace_ms)
        return out

    def session_of(self, consumer_id: str, timeout: float = 30.0) -> int | None:
        """The session holding ``consumer_id``'s ids node now (None: not registered);
        asks again while ZooKeeper is unavailable (an election), up to ``timeout``."""
        path = f"{self.layout.consumer_ids(self.group)}/{consumer_id}"
        deadline = time.monotonic() + timeout
        while True:
            try:
                stat = self.client.exists(path)
                return None if stat is None else stat.ephemeralOwner
            except KazooException:
                if time.monotonic() > deadline:
                    raise
                self._pace.wait(0.1)  # retry pacing while ZooKeeper elects (never set)

    def _sample_loop(self) -> None:
        while not self._stop.wait(self.interval):  # the sampling period itself
            try:
                s = self.sample()
            except (KazooException, OSError, TimeoutError):
                self.failed_samples += 1
                continue
            with self._lock:
                self.samples.append(s)

    def commit_history(self, part: str) -> list[Commit]:
        """Commits of ``part`` in server order, each version once."""
        with self._lock:
            seen = {c.version: c for c in self.commits[part]}
        return [seen[v] for v in sorted(seen)]

    def stop_sampling(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(30)
            assert not self._thread.is_alive(), "ZooKeeper sampler did not stop"

    def stop(self) -> None:
        """Stop sampling, read every offset node a last time, close the client."""
        self.stop_sampling()
        # a last read of every offset node: the final versions (to spot missed commits)
        for p in self.partitions:
            try:
                data, stat = self.client.get(self.layout.offset(self.group, self.topic, p))
                value = decode_offset(data).offset
            except (NoNodeError, NodeDataError):
                continue
            with self._lock:
                self.commits[p].append(Commit(time.time(), stat.version, value,
                                              stat.mtime / 1000.0, stat.mzxid))
        self.client.stop()
        self.client.close()
