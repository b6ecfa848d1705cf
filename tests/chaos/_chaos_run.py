"""One chaos run: set up the cluster, inject the seeded faults, settle, audit, report.

Cluster: the 3-node ZooKeeper ensemble (a fresh chroot per run), 3 broker
processes serving topic ``chaos`` with 4 partitions each, 4 member processes
in group ``chaos-g`` (each behind its own proxies to the ensemble; with
``static_members``, that many of them static members, issue 15), and a
producer thread sending sequence-numbered messages.

:meth:`ChaosRun.execute` never raises for a failed expectation: it collects
every problem in :attr:`ChaosRun.problems` (plus the :class:`Verdict`'s
violations) so that the report is always complete; the test asserts on them.

With ``replicated`` (issue 26), 2 broker ids serve the topic, each as a master
and a slave process (``--replication sync --group-commit --auto-promote``, a
3 s ZooKeeper session), the producer is idempotent, and the replica faults join
the plan (``_chaos_faults``).  At the end, with the members stopped, the run
reads every partition from both replicas of each broker id (once the slave is
back in sync and both hold the same log) and ``_chaos_check.check_replicas``
audits them: every acknowledged message in the final master's log at its
acknowledged offset, no body twice in a partition, both replicas identical.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from _chaos_check import Verdict, check, check_replicas
from _chaos_faults import (
    KINDS,
    MEMBER_KINDS,
    REPLICA_KINDS,
    STATIC_KINDS,
    Fault,
    FaultRunner,
    make_plan,
)
from _chaos_procs import Event, Member, ProducerLoop, child_pids
from _chaos_zk import ZkAudit
from helpers.procs import BrokerProc, read_partition, stop_all
from kazoo.client import KazooClient
from kazoo.exceptions import KazooException

from metaq import MetaqError
from metaq._admin import describe_group
from metaq._zk import ZooKeeperEnsemble
from metaq.protocol import iter_messages, scan_messages
from metaq.testing import WaitTimeout, wait_until
from zk_layout import (
    Layout,
    NodeDataError,
    ReplicationState,
    decode_static_member,
    read_replication,
)

TOPIC = "chaos"
GROUP = "chaos-g"
BROKERS = 3
PARTS_PER_BROKER = 4
MEMBERS = 4
#: what zk_garbage writes into an offset node (issue 13's examples)
_GARBAGE = (b"garbage", b"", b"\xff\xfe\x00", b"1--5")
#: replicated runs: broker ids (each a master and a slave process) and their session
REPLICATED_BROKERS = 2
BROKER_SESSION = 3.0
_REPLICA_ARGS = ("--replication", "sync", "--auto-promote",
                 "--zk-session-timeout", f"{BROKER_SESSION:g}")


@dataclass(frozen=True, kw_only=True)
class ChaosSettings:
    window: float = 35.0           # seconds of fault injection
    rate: float = 200.0            # messages per second
    session_timeout: float = 3.0   # members' ZooKeeper session
    commit_period: float = 0.5
    max_size: int = 2048           # fetch size: small batches, small in-flight windows
    idle_bound: float = 10.0
    unowned_bound: float = 15.0
    settle_timeout: float = 90.0
    #: how many of the 4 slots run as static members (instance id ``c<slot>``), spread
    #: over the sorted ids (2: c0 and c2); their faults join the plan (STATIC_KINDS)
    static_members: int = 0
    #: their grace: shorter than the fault window, so members both come back within it
    #: and stay away past it (static_away)
    static_grace: float = 8.0
    #: each broker id a master and a slave (issue 26): see the module doc
    replicated: bool = False

    def broker_ids(self) -> int:
        return REPLICATED_BROKERS if self.replicated else BROKERS

    def static_slots(self) -> tuple[int, ...]:
        n = self.static_members
        assert 0 <= n <= MEMBERS, f"static_members must be in 0..{MEMBERS}"
        return tuple(sorted({i * MEMBERS // n for i in range(n)})) if n else ()


class ChaosRun:
    def __init__(self, seed: int, ensemble: ZooKeeperEnsemble, workdir: Path,
                 settings: ChaosSettings) -> None:
        self.seed = seed
        self.ensemble = ensemble
        self.workdir = workdir
        self.s = settings
        self.broker_ids = settings.broker_ids()
        self.partitions = [f"{b}-{i}" for b in range(self.broker_ids)
                           for i in range(PARTS_PER_BROKER)]
        self.static_slots = settings.static_slots()
        self.plan = make_plan(seed, settings.window, members=MEMBERS, brokers=self.broker_ids,
                              session_timeout=settings.session_timeout,
                              static_slots=self.static_slots,
                              static_grace=settings.static_grace,
                              replicas=settings.replicated,
                              broker_session_timeout=BROKER_SESSION)
        self.problems: list[str] = []
        self.events: list[Event] = []
        self.events_lock = threading.Lock()
        self.brokers: list[BrokerProc] = []
        #: replicated runs: broker id -> its processes by replica id (0 started as master)
        self.replicas: dict[int, list[BrokerProc]] = {}
        #: replicated runs, at the end: broker id -> replica id -> partition -> messages
        self.logs: dict[int, dict[int, dict[str, list]]] = {}
        self.final_masters: dict[int, int] = {}
        self.takeovers = 0
        self.members: list[Member] = []
        self.producer: ProducerLoop | None = None
        self.audit: ZkAudit | None = None
        self.verdict = Verdict()
        self.timings: dict[str, float] = {}
        self.exit_codes: list[int] = []
        self._rng = random.Random(seed ^ 0x5EED)
        self.broker_refusals = 0
        self.unowned_detail = ""
        self._zk: KazooClient | None = None  # on the run's chroot, for data faults
        self._zk_connect = ""

    # -- faults ----------------------------------------------------------------------------

    def _inject(self, f: Fault) -> None:
        if f.kind in REPLICA_KINDS or f.role is not None:
            self._inject_replica(f)
            return
        if f.kind in MEMBER_KINDS or f.kind == "duplicate_instance":
            assert self.audit is not None
            f.session = self.audit.session_of(self.members[int(f.target)].consumer_id)
        if f.kind in ("consumer_kill", "static_away"):
            self.members[int(f.target)].kill()
        elif f.kind == "consumer_restart":
            self._graceful_stop(self.members[int(f.target)])
        elif f.kind == "duplicate_instance":
            m = self.members[int(f.target)]
            if f.session is None:
                raise AssertionError(f"{m.name} was not registered when its duplicate was due")
            f.who = m.start_duplicate()
            try:  # until refused (waits out the session timeout + 2 s of conflict)
                wait_until(lambda: self._refused(f.who), timeout=30, interval=0.1,
                           what=f"the duplicate {f.who} of {m.name} to be refused")
            except WaitTimeout:
                pass  # judged in _repair: not refused
        elif f.kind == "consumer_sigstop":
            self.members[int(f.target)].pause()
        elif f.kind == "session_expire":
            self.members[int(f.target)].block_zk()
        elif f.kind == "broker_kill":
            self.brokers[int(f.target)].kill()
        elif f.kind == "disk_flip":
            broker = self.brokers[int(f.target)]
            broker.kill()
            f.damaged = self._flip_a_message(broker)
        elif f.kind == "zk_garbage":
            assert self._zk is not None
            path = Layout().offset(GROUP, TOPIC, self.partitions[int(f.target)])
            self._zk.ensure_path(path)
            self._zk.set(path, self._rng.choice(_GARBAGE))
        elif f.kind == "zk_stop":
            leader = self.ensemble.wait_quorum(timeout=60)
            if f.target == "leader":
                f.node = leader
            else:
                f.node = self._rng.choice([i for i in range(3) if i != leader])
            self.ensemble.stop_node(f.node)

    def _refused(self, who: str | None) -> bool:
        with self.events_lock:
            return any(e.who == who and e.kind == "I" for e in self.events)

    def _graceful_stop(self, m: Member) -> None:
        """SIGTERM: the member closes (a static one marks itself away), exits 0 and
        leaves no thread behind."""
        who = m.who
        code = m.stop(60)
        with self.events_lock:
            census = [e.body for e in self.events if e.who == who and e.kind == "T"]
        if code != 0 or not census or not census[-1].startswith("0 "):
            raise AssertionError(f"{who} closed with exit code {code}, threads left: "
                                 f"{census[-1] if census else '(no census)'}")

    def _static_held_out(self, m: Member) -> bool:
        """Whether ``m``'s static record says its grace is over (or it is gone)."""
        assert self._zk is not None
        path = Layout().static_member(GROUP, m.consumer_id)

        def read() -> bytes | None:
            try:
                return self._zk.get(path)[0] if self._zk.exists(path) else b""
            except KazooException:
                return None  # ZooKeeper electing: ask again
        data = wait_until(lambda: (d := read()) is not None and [d], timeout=30,
                          interval=0.2, what=f"the static record of {m.name}")[0]
        if not data:
            return True  # deleted: the others planned without it
        try:
            until = decode_static_member(data).held_until_ms
        except NodeDataError:
            return False
        return until is not None and until <= time.time() * 1000

    # -- replica faults (replicated runs) ----------------------------------------------------

    def _state(self, b: int) -> ReplicationState | None:
        """Broker id ``b``'s replication node (asked again through ZooKeeper elections)."""
        assert self._zk is not None

        def read() -> list | None:
            try:
                got = read_replication(self._zk, Layout(), b)
            except KazooException:
                return None
            return [None if got is None else got[0]]
        return wait_until(read, timeout=30, interval=0.2,
                          what=f"broker {b}'s replication node")[0]

    def _in_sync(self, b: int, timeout: float = 40.0) -> ReplicationState:
        """Wait until both replicas of broker id ``b`` run and its slave is in sync."""
        procs = self.replicas[b]
        last: list[ReplicationState | None] = [None]

        def both() -> ReplicationState | None:
            st = last[0] = self._state(b)
            ok = (st is not None and all(p.alive for p in procs)
                  and (1 - st.master) in st.in_sync)
            return st if ok else None
        try:
            return wait_until(both, timeout=timeout, interval=0.2,
                              what=f"broker {b}: both replicas running, the slave in sync")
        except WaitTimeout as e:
            alive = [p.alive for p in procs]
            raise WaitTimeout(f"{e} (last state {last[0]}, replicas alive {alive})") from None

    def _inject_replica(self, f: Fault) -> None:
        b = int(f.target)
        st = self._in_sync(b)  # a failover loses nothing only towards an in-sync slave
        f.epoch = st.epoch
        if f.kind == "promote":
            f.replica = 1 - st.master
            out = subprocess.run(
                [sys.executable, "-m", "metaq", "broker", "promote", str(b), "--replica",
                 str(f.replica), "--zk", self._zk_connect],
                capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
            if out.returncode != 0:
                raise AssertionError(f"metaq broker promote {b} --replica {f.replica} "
                                     f"exited with {out.returncode}: {out.stderr.strip()}")
            return
        f.replica = 1 - st.master if f.role == "slave" else st.master
        proc = self.replicas[b][f.replica]
        if f.kind == "master_pause":
            proc.pause()
        else:
            proc.kill()

    def _taken_over(self, f: Fault, timeout: float) -> bool:
        """Whether the replica ``f`` did not hit (promote: the one it named) leads in a
        later epoch (waits)."""
        b = int(f.target)
        leader = f.replica if f.kind == "promote" else 1 - (f.replica or 0)
        try:
            wait_until(lambda: (st := self._state(b)) is not None and st.epoch > (f.epoch or 0)
                       and st.master == leader, timeout=timeout, interval=0.1,
                       what=f"broker {b}: replica {leader} to take over")
        except WaitTimeout:
            return False
        return True

    def _repair_replica(self, f: Fault) -> None:
        """Undo a replica fault and judge it: the slave took over (a killed or paused
        master; the promoted slave leads), the replica hit came back and rejoined as an
        in-sync slave."""
        b = int(f.target)
        if f.replica is None:
            return  # failed before it hit anything (the error is recorded)
        proc = self.replicas[b][f.replica]
        if f.kind == "promote":
            if not self._taken_over(f, 20):
                raise AssertionError(f"broker {b}: replica {f.replica} was promoted but "
                                     f"does not lead (state {self._state(b)})")
            self.takeovers += 1
        elif f.role == "slave":
            self._restart_broker(proc)
        elif f.kind == "master_pause":
            took = self._taken_over(f, 10)  # still stopped: its session must end first
            proc.resume()
            if not took:
                f.effective = None if self._election_during(f) else False
                self._in_sync(b)
                return
            self.takeovers += 1
        else:  # master_kill, broker_kill of the master: the slave takes over, then restart
            took = self._taken_over(f, BROKER_SESSION + 15)
            self._restart_broker(proc)
            if not took:
                raise AssertionError(f"broker {b}: the slave did not take over after its "
                                     f"master (replica {f.replica}) was killed (state "
                                     f"{self._state(b)})")
            self.takeovers += 1
        st = self._in_sync(b)
        if f.kind != "promote" and f.role != "slave" and st.master == f.replica:
            raise AssertionError(f"broker {b}: replica {f.replica} leads again after it "
                                 f"was replaced ({st}): it should follow")
        f.effective = True

    def _repair(self, f: Fault) -> None:
        if f.kind in REPLICA_KINDS or f.role is not None:
            self._repair_replica(f)
            return
        if f.kind == "duplicate_instance":
            self._repair_duplicate(f)
            return
        self._undo(f)
        if f.kind not in MEMBER_KINDS:
            f.effective = True
            return
        # Keep the member out of new faults until it is registered again: each member
        # fault then hits a registered member, and its effect is checked on the server
        # (the old session ended and a new one registered).  A ZooKeeper leader election
        # during the hold restarts session timers, so a held session may survive it: then
        # the fault is "masked", not ineffective.
        assert self.audit is not None
        m = self.members[int(f.target)]
        gone = (None, f.session) if f.kind in ("consumer_kill", "consumer_restart",
                                               "static_away") else (None,)
        try:
            session = wait_until(lambda: self.audit.session_of(m.consumer_id) not in gone
                                 and self.audit.session_of(m.consumer_id), timeout=25,
                                 interval=0.1, what=f"{m.name} to register after {f.kind}")
        except WaitTimeout:
            f.effective = False
            return
        if session != f.session:
            f.effective = True
        else:
            f.effective = None if self._election_during(f) else False  # None: masked
        if f.kind == "static_away" and f.effective and not f.held_out:
            # restarted while still held: masked when an election kept its old session
            # alive (its hold began late); else the others marked it away late
            f.effective = None if self._election_during(
                f, f.started + self.s.session_timeout + 2.0) else False

    def _repair_duplicate(self, f: Fault) -> None:
        """Stop the duplicate: it must have been refused (else the fault had no effect,
        or an election masked it) and exit cleanly; the member it duplicated keeps its
        session throughout."""
        assert self.audit is not None and f.started is not None
        m = self.members[int(f.target)]
        code = m.stop_duplicate(60)
        if self._refused(f.who):
            f.effective = True
        else:
            f.effective = None if self._election_during(f, time.time()) else False
        session = self.audit.session_of(m.consumer_id)
        if code != 0:
            raise AssertionError(f"the duplicate {f.who} exited with {code}")
        if session != f.session and not self._election_during(f, time.time()):
            raise AssertionError(
                f"{m.name} lost its session {f.session and hex(f.session)} (now "
                f"{session and hex(session)}) while its duplicate {f.who} ran")

    def _election_during(self, f: Fault, end: float | None = None) -> bool:
        assert f.started is not None
        end = f.started + f.hold if end is None else end
        return any(z.kind == "zk_stop" and z.started is not None and z.started < end
                   and (z.repaired is None or z.repaired > f.started) for z in self.plan)

    def _undo(self, f: Fault) -> None:
        if f.kind in ("consumer_kill", "consumer_restart"):
            self.members[int(f.target)].start()
        elif f.kind == "static_away":
            m = self.members[int(f.target)]
            f.held_out = self._static_held_out(m)
            m.start()
        elif f.kind == "consumer_sigstop":
            self.members[int(f.target)].resume()
        elif f.kind == "session_expire":
            self.members[int(f.target)].unblock_zk()
        elif f.kind in ("broker_kill", "disk_flip"):
            self._restart_broker(self.brokers[int(f.target)])
        elif f.kind == "zk_stop" and f.node is not None:
            self.ensemble.start_node(f.node)
            self.ensemble.wait_quorum(timeout=60)

    def _flip_a_message(self, broker: BrokerProc) -> list | None:
        """Flip bytes inside one message of a partition's writable segment (the broker
        is down): ``[partition, offset, next offset]`` of that message, or None when no
        partition of the broker holds a message yet."""
        order = list(range(PARTS_PER_BROKER))
        self._rng.shuffle(order)
        for index in order:
            segs = sorted((broker.data_dir / f"{TOPIC}-{index}").glob("*.meta"))
            if not segs:
                continue
            seg = segs[-1]
            data = bytearray(seg.read_bytes())
            valid, _n, _problem = scan_messages(data)
            msgs = list(iter_messages(bytes(data[:valid]), 0))
            if not msgs:
                continue
            # the newest message (likely not delivered yet: the damage is met) or any
            m = msgs[-1] if self._rng.random() < 0.5 else self._rng.choice(msgs)
            at = m.offset + 20 if m.next_offset - m.offset > 20 else m.offset + 4
            data[at] ^= 0x5A  # payload (or, for an empty one, the checksum)
            seg.write_bytes(bytes(data))
            start = int(seg.name[:20])
            return [f"{broker.broker_id}-{index}", start + m.offset, start + m.next_offset]
        return None

    def _restart_broker(self, broker: BrokerProc, deadline: float = 90.0) -> None:
        """Start a killed broker again; until it registers, ask again through elections.

        ``BrokerProc.start`` waits for the killed process's session to end first (a
        broker refuses to start while its id is held by another session).  Should it
        exit while starting anyway, it is started again, as a supervisor would.
        """
        end = time.monotonic() + deadline
        while True:
            try:
                if not broker.alive:
                    broker.start(wait=False)
                broker.wait_serving()
                broker.wait_registered(max(1.0, end - time.monotonic()))
                return
            except KazooException:  # ZooKeeper electing a leader: ask again
                if time.monotonic() > end:
                    raise
            except AssertionError:  # exited while starting
                if broker.alive or time.monotonic() > end:
                    raise
                self.broker_refusals += 1

    # -- helpers ---------------------------------------------------------------------------

    def _consumed(self) -> set[tuple[str, int]]:
        with self.events_lock:
            return {(e.part, e.offset) for e in self.events if e.kind == "M"}

    def _unaccounted(self, acked: set[tuple[str, int]]) -> set[tuple[str, int]]:
        """Acknowledged messages neither delivered nor inside reported damage."""
        with self.events_lock:
            damage = [(e.part, e.offset, int(e.body)) for e in self.events if e.kind == "D"]
        left = acked - self._consumed()
        return {(p, off) for p, off in left
                if not any(p == dp and a <= off < b for dp, a, b in damage)}

    def _wait(self, what: str, cond, timeout: float) -> bool:  # noqa: ANN001
        try:
            wait_until(cond, timeout=timeout, interval=0.2, what=what)
            return True
        except WaitTimeout as e:
            self.problems.append(str(e))
            return False

    def _settled(self, client: KazooClient) -> bool:
        try:
            report = describe_group(client, Layout(), GROUP, timeout=2.0)
        except (MetaqError, KazooException):
            return False  # no group yet, or ZooKeeper busy electing: ask again
        expected = {m.consumer_id for m in self.members}
        owners = Counter(p.owner for p in report.partitions)
        self._last_group = report
        return (set(report.members) == expected and len(report.partitions) == len(
            self.partitions) and set(owners) == expected
                and all(n == len(self.partitions) // MEMBERS for n in owners.values())
                and all(p.lag == 0 for p in report.partitions))

    def _group_summary(self) -> str:
        report = getattr(self, "_last_group", None)
        if report is None:
            return "(never read)"
        parts = ", ".join(f"{p.partition}:{p.owner or '-'}/lag {p.lag}"
                          for p in report.partitions)
        return f"members {sorted(report.members)}; {parts}"

    # -- the run ---------------------------------------------------------------------------

    def execute(self) -> None:
        t_start = time.monotonic()
        threads_before = {t.ident for t in threading.enumerate()}
        children_before = child_pids()
        chroot = f"/chaos-{self.seed}-{uuid.uuid4().hex[:6]}"
        admin = KazooClient(hosts=self.ensemble.hosts, timeout=30.0)
        admin.start(timeout=30)
        admin.ensure_path(chroot)
        zk = self._zk_connect = self.ensemble.hosts + chroot
        group_client = self._zk = KazooClient(hosts=zk, timeout=30.0)
        runner: FaultRunner | None = None
        try:
            group_client.start(timeout=30)
            if self.s.replicated:
                self._start_replicas(zk)
            else:
                self.brokers = [BrokerProc(zk, b, self.workdir / f"broker{b}",
                                           {TOPIC: PARTS_PER_BROKER}) for b in range(BROKERS)]
                for b in self.brokers:
                    b.start(wait=False)
                for b in self.brokers:
                    b.wait_serving()
                    b.wait_registered()
            self.audit = ZkAudit(zk, GROUP, TOPIC, self.partitions).start()
            node_hosts = [self.ensemble.node_hosts(i) for i in range(3)]
            self.members = [
                Member(i, group=GROUP, topic=TOPIC, node_hosts=node_hosts, chroot=chroot,
                       log_dir=self.workdir, session_timeout=self.s.session_timeout,
                       commit_period=self.s.commit_period, max_size=self.s.max_size,
                       sink=self.events, sink_lock=self.events_lock,
                       static_grace=self.s.static_grace if i in self.static_slots else None)
                for i in range(MEMBERS)]
            for m in self.members:
                m.start()
            if not self._wait("the group to settle before the faults",
                              lambda: self._settled(group_client), 60):
                return
            self.audit.start_sampling()
            self.producer = ProducerLoop(zk, TOPIC, self.s.rate,
                                         idempotent=self.s.replicated).start()
            self.timings["setup"] = time.monotonic() - t_start
            t_faults = time.monotonic()
            runner = FaultRunner(self.plan, self._inject, self._repair).start()
            if not runner.wait(self.s.window + 180):
                self.problems.append("faults still running long after the window")
                runner.abort()
                runner.wait(60)
            self.problems.extend(f"fault failed: {e}" for e in runner.errors)
            self.timings["faults"] = time.monotonic() - t_faults
            self._restore()
            self.producer.stop()
            t_settle = time.monotonic()
            acked = set(self.producer.acked.values())
            self._wait(f"all {len(acked)} acknowledged messages consumed (or reported "
                       f"damaged)", lambda: not self._unaccounted(acked),
                       self.s.settle_timeout)
            if not self._wait("the group settled: 4 members, 3 partitions each, lag 0",
                              lambda: self._settled(group_client), self.s.settle_timeout):
                self.problems.append(f"last group state: {self._group_summary()}")
            self.timings["settle"] = time.monotonic() - t_settle
            self.audit.stop_sampling()
            self._stop_members(group_client)
            if self.s.replicated:
                self._read_replicas()
        finally:
            if runner is not None:
                runner.abort()
                runner.wait(120)
            self._teardown(admin, group_client, chroot)
        self._leaks(threads_before, children_before)
        self.verdict = check(
            acked=self.producer.acked if self.producer else {}, events=list(self.events),
            commits=self.audit.commits if self.audit else {},
            samples=self.audit.samples if self.audit else [], faults=self.plan,
            partitions=self.partitions, group=GROUP, late_bytes=2 * self.s.max_size,
            idle_bound=self.s.idle_bound, unowned_bound=self.s.unowned_bound,
            static={f"{GROUP}_c{i}": self.s.static_grace for i in self.static_slots})
        if self.s.replicated:
            check_replicas(self.verdict, acked=self.producer.acked if self.producer else {},
                           logs=self.logs, masters=self.final_masters)
        for f in self.plan:
            if f.started is not None and f.error is None and f.effective is False:
                self.problems.append(f"fault had no effect: {f.describe()}")
        self.timings["total"] = time.monotonic() - t_start

    def _start_replicas(self, zk: str) -> None:
        """Each broker id: replica 0 starts as its master, then replica 1 as its slave;
        both sync, with group commit and ``--auto-promote``; the slaves in sync."""
        for b in range(self.broker_ids):
            self.replicas[b] = [
                BrokerProc(zk, b, self.workdir / f"broker{b}r0", {TOPIC: PARTS_PER_BROKER},
                           group_commit=True, zk_session_timeout=BROKER_SESSION,
                           extra_args=_REPLICA_ARGS),
                BrokerProc(zk, b, self.workdir / f"broker{b}r1", {}, group_commit=True,
                           zk_session_timeout=BROKER_SESSION,
                           extra_args=("--slave-of", str(b), "--slave-id", "1",
                                       *_REPLICA_ARGS))]
        self.brokers = [p for b in sorted(self.replicas) for p in self.replicas[b]]
        for p in self.brokers:  # INFO lines: every role change and cut is in the log
            p.args[3:3] = ["-v"]
        for r in (0, 1):  # the masters registered before their slaves look for them
            for b in self.replicas:
                self.replicas[b][r].start(wait=False)
            for b in self.replicas:
                self.replicas[b][r].wait_serving()
                self.replicas[b][r].wait_registered()
        for b in self.replicas:
            self._in_sync(b)

    def _read_log(self, proc: BrokerProc, b: int) -> dict[str, list] | None:
        """Every message of broker id ``b``'s partitions as ``proc`` serves them
        (None: it could not be read now)."""
        try:
            with proc.connection() as conn:
                return {f"{b}-{i}": [tuple(m) for m in read_partition(conn, TOPIC, i)]
                        for i in range(PARTS_PER_BROKER)}
        except Exception:  # noqa: BLE001 - not serving yet: read again
            return None

    def _read_replicas(self) -> None:
        """The final logs of both replicas of every broker id, once the slave is in sync
        and both hold the same messages (or the last ones read, when they never do: the
        audit names the difference)."""
        for b, procs in self.replicas.items():
            try:
                st = self._in_sync(b)
            except WaitTimeout as e:
                self.problems.append(str(e))
                st = self._state(b)
                if st is None:
                    continue
            self.final_masters[b] = st.master
            last: dict[int, dict[str, list] | None] = {}

            def same(procs: list[BrokerProc] = procs, b: int = b,
                     last: dict = last) -> bool:
                for r, p in enumerate(procs):
                    last[r] = self._read_log(p, b)
                return last[0] is not None and last[0] == last[1]
            try:
                wait_until(same, timeout=30, interval=0.5,
                           what=f"both replicas of broker {b} to hold the same log")
            except WaitTimeout:
                pass  # judged by check_replicas
            self.logs[b] = {r: log for r, log in last.items() if log is not None}

    def dump(self) -> Path:
        """Everything the audit saw, as JSON lines in the run's directory (for failures)."""
        path = self.workdir / "chaos-data.jsonl"
        with open(path, "w") as f:
            for e in self.events:
                f.write(json.dumps({"event": dataclasses.asdict(e)}) + "\n")
            for seq, (p, off) in sorted((self.producer.acked if self.producer else {}).items()):
                f.write(json.dumps({"acked": [seq, p, off]}) + "\n")
            for p, hist in (self.audit.commits if self.audit else {}).items():
                for c in hist:
                    f.write(json.dumps({"commit": [p, *dataclasses.astuple(c)]}) + "\n")
            for smp in (self.audit.samples if self.audit else []):
                f.write(json.dumps({"sample": dataclasses.asdict(smp)}, default=sorted) + "\n")
            for fault in self.plan:
                f.write(json.dumps({"fault": dataclasses.asdict(fault)}) + "\n")
        return path

    def _restore(self) -> None:
        """After the faults: everything running and reachable again."""
        for i in range(3):
            if self.ensemble.mode(i) is None:
                self.problems.append(f"ZooKeeper node {i} was still down after the faults")
                self.ensemble.start_node(i)
        self.ensemble.wait_quorum(timeout=60)
        for m in self.members:
            m.unblock_zk()
            m.resume()
            if m.duplicate is not None:
                self.problems.append(f"a duplicate of {m.name} was still running after "
                                     f"the faults")
                m.stop_duplicate(60)
            if not m.alive:
                self.problems.append(f"member {m.name} was still down after the faults")
                m.start()
        for b in self.brokers:
            if not b.alive:
                self.problems.append(f"broker {b.broker_id} was still down after the faults")
                self._restart_broker(b)

    def _stop_members(self, client: KazooClient) -> None:
        for m in self.members:
            code = m.stop(60)
            self.exit_codes.append(code)
            if code != 0:
                self.problems.append(f"member {m.name} exited with {code}:\n{m.log_tail()}")
        with self.events_lock:
            finals = [e for e in self.events if e.kind == "T"]
        for m in self.members:
            mine = [e for e in finals if e.who == m.who]
            if not mine:
                self.problems.append(f"member {m.who} printed no thread census at exit")
            elif not mine[-1].body.startswith("0 "):
                self.problems.append(f"member {m.who} left threads running: {mine[-1].body}")
        lay = Layout()
        ids = client.get_children(lay.consumer_ids(GROUP))
        owners = client.get_children(lay.owners_dir(GROUP, TOPIC))
        if ids or owners:
            self.problems.append(f"after a clean stop ZooKeeper still lists members {ids} "
                                 f"and owners {owners}")

    def _teardown(self, admin: KazooClient, group_client: KazooClient, chroot: str) -> None:
        for m in self.members:
            m.close()
        if self.producer is not None:
            try:
                self.producer.stop()
            except AssertionError as e:
                self.problems.append(str(e))
        stop_all(self.brokers)
        for i in range(3):  # the ensemble is shared with other tests: leave it whole
            if self.ensemble.mode(i) is None:
                self.ensemble.start_node(i)
        self.ensemble.wait_quorum(timeout=60)
        if self.audit is not None:
            try:
                self.audit.stop()
            except Exception as e:  # noqa: BLE001 - reported
                self.problems.append(f"stopping the ZooKeeper audit: {e!r}")
        for c in (group_client, admin):
            if c is admin:
                try:
                    admin.delete(chroot, recursive=True)
                except Exception:  # noqa: BLE001 - a unique chroot: harmless if left
                    pass
            c.stop()
            c.close()

    def _leaks(self, threads_before: set[int | None], children_before: set[int]) -> None:
        def new_threads() -> list[str]:
            return [t.name for t in threading.enumerate()
                    if t.ident not in threads_before and t.is_alive()]

        def new_children() -> set[int]:  # ZooKeeper nodes restarted by faults are not ours
            zk = {s.pid for s in self.ensemble.servers}
            return child_pids() - children_before - zk

        if not self._wait("threads of the run to end", lambda: not new_threads(), 15):
            self.problems.append(f"threads leaked: {sorted(new_threads())}")
        if not self._wait("child processes of the run to end", lambda: not new_children(), 15):
            self.problems.append(f"processes leaked: {sorted(new_children())}")

    # -- the report --------------------------------------------------------------------------

    def report(self) -> str:
        m = self.verdict.metrics
        executed = [f for f in self.plan if f.started is not None]
        kinds = KINDS + STATIC_KINDS if self.static_slots else KINDS
        if self.s.replicated:
            kinds = tuple(k for k in kinds if k != "disk_flip") + REPLICA_KINDS
        by_kind = Counter(f.kind for f in executed)
        effective = Counter(f.kind for f in executed if f.effective)
        masked = sum(1 for f in executed if f.effective is None)
        leader_stops = sum(1 for f in executed if f.kind == "zk_stop" and f.target == "leader")
        p = self.producer
        lines = [
            f"chaos seed={self.seed} window={self.s.window:g}s " + (
                f"replicated (reproduce: METAQ_CHAOS_REPLICA_SEEDS={self.seed} pytest "
                f"tests/chaos -k replicated)" if self.s.replicated else
                f"static members={self.s.static_members} (reproduce: "
                f"METAQ_CHAOS_STATIC_SEEDS={self.seed} pytest tests/chaos -k static)"
                if self.static_slots else f"(reproduce: METAQ_CHAOS_SEEDS={self.seed})"),
            f"  faults injected: {len(executed)} of {len(self.plan)} planned; " + ", ".join(
                f"{k}={by_kind[k]} ({effective[k]} effective)" for k in kinds)
            + f"; zk leader stops={leader_stops}; member faults masked by an election="
            f"{masked}",
            f"  messages: produced={p.sent if p else 0} acknowledged="
            f"{len(p.acked) if p else 0} failed={len(p.failed) if p else 0} "
            f"delivered={m.get('delivered')} distinct={m.get('distinct')} "
            f"duplicates={m.get('duplicates')} missing={m.get('missing')}",
            f"  ownership: runs={m.get('runs')} sessions lost={m.get('sessions_lost')} "
            f"max unowned={m.get('max_unowned_s')}s max idle-while-unowned="
            f"{m.get('max_idle_s')}s",
            f"  zombies (after the server ended their session): deliveries="
            f"{m.get('zombie_deliveries')} of committed offsets={m.get('zombie_committed')} "
            f"(up to {m.get('zombie_max_s')}s after)",
            f"  brokers: start-ups refused while the old session lived={self.broker_refusals}",
            f"  data faults: damaged messages reported={m.get('damaged_reported')} "
            f"(flipped={m.get('flipped')}, read after the flip={m.get('flipped_read')}) "
            f"offset resets={m.get('resets')} offsets reused={m.get('offsets_reused')}",
            f"  audit: commits seen={m.get('commits_seen')} samples={m.get('samples')} "
            f"lenient run starts={m.get('lenient_starts')}",
        ]
        if self.static_slots:
            lines.append(
                f"  static members: {', '.join(f'c{i}' for i in self.static_slots)} (grace "
                f"{self.s.static_grace:g}s): away={m.get('static_away')} (back within the "
                f"grace={m.get('static_returned')}, grace ran out={m.get('static_ran_out')}) "
                f"max unowned while held={m.get('max_unowned_held_s')}s max gone unmarked="
                f"{m.get('max_unmarked_s')}s claims checked "
                f"against holds={m.get('held_claims_checked')} duplicates refused="
                f"{m.get('duplicates_refused')} of {m.get('duplicate_procs')}")
        if p is not None and p.failed:  # not acknowledged: no promise to check, but shown
            why = Counter(e.split("(", 1)[0] + ": " + e.split("(", 1)[-1][:200]
                          for e in p.failed.values())
            lines.append("  failed sends: " + "; ".join(f"{n} x {e}"
                                                         for e, n in why.most_common(3)))
        if self.s.replicated:
            by_role = Counter(f.role for f in executed if f.kind == "broker_kill")
            lines.append(
                f"  replicas: {self.broker_ids} broker ids x (master + slave), sync, group "
                f"commit, auto-promote; broker kills of a master={by_role['master']} of a "
                f"slave={by_role['slave']}; takeovers={self.takeovers}; final masters "
                f"{self.final_masters}; log messages={m.get('log_messages')} acked lost="
                f"{m.get('acked_lost')} duplicates in logs={m.get('log_duplicates')} "
                f"(across partitions={m.get('cross_partition_duplicates')}) replicas "
                f"identical={m.get('replicas_identical')}")
        lines.append("  time: " + " ".join(f"{k}={v:.1f}s" for k, v in self.timings.items()))
        if self.problems or self.verdict.violations:
            lines.append("  FAILED:")
            lines += [f"    {x}" for x in self.problems + self.verdict.violations]
            lines.append("  plan:")
            lines += [f"    {f.describe()} started={f.started and round(f.started, 3)} "
                      f"effective={f.effective} error={f.error}"
                      + (f" duplicate={f.who}" if f.who else "")
                      + ("" if f.held_out is None else f" grace ran out={f.held_out}")
                      for f in self.plan]
        return "\n".join(lines)
