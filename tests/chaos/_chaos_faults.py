"""A seeded fault plan and the threads that carry it out.

:func:`make_plan` turns a seed into a list of :class:`Fault` (start time,
kind, target, how long): rounds of the seven kinds (the two data faults:
``zk_garbage`` writes garbage into a partition's offset node, ``disk_flip``
kills a broker, flips bytes of one message in a partition's writable segment
and restarts it) in a seeded order (so every
run injects every kind), the first ZooKeeper fault stopping the leader, until
the chaos window ends.

With static slots (issue 15), three more kinds join the rounds
(:data:`STATIC_KINDS`): ``consumer_restart`` (SIGTERM, a graceful close, and a
restart: a static member marks itself away), ``static_away`` (kill -9 a static
member and keep it down past its session and its grace: the others must plan
without it once the grace runs out) and ``duplicate_instance`` (a second
process with a live static member's instance id, run until it is refused, then
stopped).  Plans without static slots are what they were (same draws).

With replicas (issue 26: each broker id a master and a slave, sync replication,
``--auto-promote``), three more kinds join the rounds (:data:`REPLICA_KINDS`):
``master_kill`` (SIGKILL the current master of a broker id: its in-sync slave
takes over; the killed one is restarted and must rejoin as a slave),
``master_pause`` (SIGSTOP the master past its ZooKeeper session, then SIGCONT:
it must step down and follow) and ``promote`` (``metaq broker promote`` names
the in-sync slave while the master lives).  A ``broker_kill`` then hits either
role (:attr:`Fault.role`, drawn only in these plans), and ``disk_flip`` leaves
the rounds: a replica whose own disk is damaged is not repaired by copying (its
slave reports the damage and stops), which is not what this variant audits.
Broker faults of different broker ids may overlap (each id keeps one replica
serving); faults of one id never do.  Plans without replicas draw what they did.

:class:`FaultRunner` starts each fault on its own thread at its time.  A
fault first takes its target's lock (one fault per member, broker or the
ensemble at a time) and, for member faults, one of two "impaired member"
slots, so the group always keeps two healthy members and the ensemble keeps
a quorum (a duplicate takes its slot's lock, not an impaired slot: the member
it duplicates goes on).
Each executed fault records when it really started and ended.
"""

from __future__ import annotations

import logging
import random
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

KINDS = ("consumer_kill", "broker_kill", "zk_stop", "session_expire", "consumer_sigstop",
         "zk_garbage", "disk_flip")
#: with static slots only (see the module doc)
STATIC_KINDS = ("consumer_restart", "static_away", "duplicate_instance")
#: with replicas only (see the module doc)
REPLICA_KINDS = ("master_kill", "master_pause", "promote")
#: faults of a broker id (one at a time per id)
BROKER_KINDS = ("broker_kill", "disk_flip", *REPLICA_KINDS)
#: faults that impair their member (one of the impaired slots, a new session after)
MEMBER_KINDS = ("consumer_kill", "session_expire", "consumer_sigstop", "consumer_restart",
                "static_away")
#: how long a duplicate runs, planned: its refusal takes about 6-13 s (it waits out
#: the session timeout plus 2 s of conflict, asking again with backoff) plus its start
DUPLICATE_RUN = 12.0


@dataclass
class Fault:
    at: float              # seconds after the chaos window opens
    kind: str
    target: int | str      # member slot, broker id, or "leader"/"follower"
    hold: float            # how long the fault lasts before the repair starts
    started: float | None = None   # time.time() when injected
    repaired: float | None = None  # time.time() when the repair finished
    node: int | None = None        # the ZooKeeper node actually stopped
    session: int | None = None     # member faults: the member's session when injected
    error: str | None = None
    # True: had its effect (member faults: a new session replaced ``session``); None:
    # masked (a leader election during the hold restarted the session timers)
    effective: bool | None = None
    # disk_flip: the message whose bytes were flipped, [partition, offset, next offset]
    damaged: list | None = None
    # duplicate_instance: the duplicate process's ``who`` (``<slot>#d<n>``)
    who: str | None = None
    # static_away: whether the member's grace had run out when it was restarted
    held_out: bool | None = None
    # replicated broker_kill: the role hit ("master" or "slave"); replica faults: the
    # replica id hit (promote: the one promoted) and the epoch before the fault
    role: str | None = None
    replica: int | None = None
    epoch: int | None = None

    def describe(self) -> str:
        target = self.target if self.node is None else f"{self.target}=node{self.node}"
        if self.role is not None or self.replica is not None:
            target = f"{target}/{self.role or 'r'}" + (
                "" if self.replica is None else f"{self.replica}")
        return f"t+{self.at:5.1f}s {self.kind:<18} {target!s:<12} hold {self.hold:.1f}s"


def make_plan(seed: int, window: float, *, members: int, brokers: int,
              session_timeout: float, max_impaired_members: int = 2,
              static_slots: tuple[int, ...] = (), static_grace: float = 8.0,
              replicas: bool = False, broker_session_timeout: float = 3.0) -> list[Fault]:
    """A seeded plan whose faults fit the window.

    Rounds of the kinds in a seeded order; each fault starts at the first moment
    (after the previous one) when a target of its kind is free.  A target stays busy
    for its fault plus a rough estimate of its recovery.  At most one broker is down,
    at most ``max_impaired_members`` members are impaired, and ZooKeeper stops never
    overlap session faults or duplicates (a leader election restarts session timers,
    so it could save a session held past its timeout).  ``static_slots``: the members
    run as static members with ``static_grace``; the static kinds join the rounds.
    ``replicas``: every broker id has a slave (see the module doc); ``master_pause``
    holds past ``broker_session_timeout``.
    """
    rng = random.Random(seed)
    all_kinds = KINDS + STATIC_KINDS if static_slots else KINDS
    if replicas:
        all_kinds = tuple(k for k in all_kinds if k != "disk_flip") + REPLICA_KINDS
    busy: dict[tuple, float] = {}  # target key -> planned free again at
    plan: list[Fault] = []
    t = 1.0
    first_zk = True

    def free(kind: str, at: float) -> list[int] | list[str]:
        def is_busy(key: tuple) -> bool:
            return busy.get(key, 0.0) > at
        if kind in MEMBER_KINDS:
            impaired = sum(1 for k, until in busy.items() if k[0] == "member" and until > at)
            if impaired >= max_impaired_members or (
                    kind != "consumer_kill" and is_busy(("zk",))):
                return []
            slots = static_slots if kind == "static_away" else range(members)
            return [i for i in slots if not is_busy(("member", i)) and not is_busy(("dup", i))]
        if kind == "duplicate_instance":
            if is_busy(("zk",)):
                return []
            return [i for i in static_slots
                    if not is_busy(("member", i)) and not is_busy(("dup", i))]
        if replicas and kind in BROKER_KINDS:  # one fault per broker id at a time
            if kind == "master_pause" and is_busy(("zk",)):
                return []  # an election restarts session timers: it could save the master
            return [b for b in range(brokers) if not is_busy(("broker", b))]
        if kind in ("broker_kill", "disk_flip"):
            down = any(k[0] == "broker" and until > at for k, until in busy.items())
            return [] if down else list(range(brokers))
        if kind == "zk_garbage":  # any partition's offset node, at any time
            return list(range(brokers * 4))
        if replicas and is_busy(("broker-session",)):
            return []  # nor a broker held past its session
        return [] if is_busy(("zk",)) or is_busy(("session",)) else ["zk"]

    while True:
        kinds = list(all_kinds)
        rng.shuffle(kinds)
        for kind in kinds:
            while not free(kind, t) and t < window:
                t += 0.25
            if t >= window:
                return plan
            choices = free(kind, t)
            hold = {
                "consumer_kill": rng.uniform(0.0, 1.5),  # down before the restart
                "broker_kill": rng.uniform(0.5, 2.0),
                "disk_flip": rng.uniform(0.5, 2.0),  # down, bytes flipped, restarted
                "zk_garbage": 0.0,
                "zk_stop": rng.uniform(1.5, 4.0),
                # held beyond the session timeout: the server expires the session
                "session_expire": session_timeout + rng.uniform(1.0, 2.0),
                "consumer_sigstop": session_timeout + rng.uniform(1.0, 2.0),
            }.get(kind, 0.0)
            recovery = {  # rough: the old session to expire, a start, a new registration
                "consumer_kill": session_timeout + 3.0, "broker_kill": 7.0, "zk_stop": 3.0,
                "session_expire": 2.0, "consumer_sigstop": 2.0, "disk_flip": 7.0,
                "zk_garbage": 0.0}.get(kind, 3.0)
            if kind in STATIC_KINDS:  # (drawn only here: plans without them stay the same)
                hold = {
                    "consumer_restart": rng.uniform(0.0, 2.0),  # closed, down, restarted
                    # down past its session and its grace
                    "static_away": session_timeout + static_grace + rng.uniform(2.0, 4.0),
                    "duplicate_instance": rng.uniform(1.0, 3.0),  # runs on once refused
                }[kind]
            if kind in REPLICA_KINDS:  # (drawn only here: plans without them stay the same)
                hold = {
                    "master_kill": rng.uniform(0.5, 2.0),  # down before the restart
                    # stopped past its session: its slave takes over meanwhile
                    "master_pause": broker_session_timeout + rng.uniform(1.0, 2.0),
                    "promote": 0.0,
                }[kind]
                # the session to end, a takeover, a restart, the rejoin in sync
                recovery = {"master_kill": broker_session_timeout + 7.0,
                            "master_pause": 6.0, "promote": 5.0}[kind]
            elif replicas and kind == "broker_kill":
                recovery = broker_session_timeout + 7.0
            if kind == "zk_stop":
                target: int | str = "leader" if first_zk or rng.random() < 0.5 else "follower"
                first_zk = False
                busy[("zk",)] = t + hold + recovery
            elif kind == "zk_garbage":
                target = rng.choice(choices)
            elif kind == "duplicate_instance":
                target = rng.choice(choices)
                busy[("dup", target)] = t + DUPLICATE_RUN + hold
                busy[("session",)] = max(busy.get(("session",), 0.0), t + DUPLICATE_RUN + hold)
            else:
                target = rng.choice(choices)
                busy[("member" if kind in MEMBER_KINDS else "broker", target)] = (
                    t + hold + recovery)
            if kind in ("session_expire", "consumer_sigstop"):
                busy[("session",)] = max(busy.get(("session",), 0.0), t + hold + 1.0)
            fault = Fault(round(t, 2), kind, target, round(hold, 2))
            if replicas and kind == "broker_kill":
                fault.role = rng.choice(("master", "slave"))
            if kind == "master_pause":
                busy[("broker-session",)] = max(busy.get(("broker-session",), 0.0),
                                                t + hold + 1.0)
            plan.append(fault)
            t += rng.uniform(0.8, 2.0)


@dataclass
class FaultRunner:
    """Runs ``plan``; ``inject(fault)`` and ``repair(fault)`` do the work per kind."""

    plan: list[Fault]
    inject: Callable[[Fault], None]
    repair: Callable[[Fault], None]
    max_impaired_members: int = 2
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._locks: dict[object, threading.Lock] = {}
        self._impaired = threading.Semaphore(self.max_impaired_members)
        self._threads: list[threading.Thread] = []
        self._scheduler = threading.Thread(target=self._schedule, name="chaos-scheduler",
                                           daemon=True)

    def _lock_for(self, fault: Fault) -> threading.Lock:
        if fault.kind == "zk_stop":
            key: object = "zk"
        elif fault.kind in BROKER_KINDS:
            key = ("broker", fault.target)
        elif fault.kind == "zk_garbage":
            key = ("offsets", fault.target)
        else:
            key = ("member", fault.target)
        return self._locks.setdefault(key, threading.Lock())

    def start(self) -> FaultRunner:
        for f in self.plan:
            self._lock_for(f)
        self.t0 = time.monotonic()
        self._scheduler.start()
        return self

    def _schedule(self) -> None:
        for i, fault in enumerate(self.plan):
            if self._stop.wait(max(0.0, self.t0 + fault.at - time.monotonic())):
                return
            t = threading.Thread(target=self._run, args=(fault,), daemon=True,
                                 name=f"chaos-fault-{i}-{fault.kind}")
            self._threads.append(t)
            t.start()

    def _run(self, fault: Fault) -> None:
        member = fault.kind in MEMBER_KINDS
        with self._lock_for(fault):
            if member:
                self._impaired.acquire()
            try:
                if self._stop.is_set():
                    return
                fault.started = time.time()
                try:
                    self.inject(fault)
                    self._stop.wait(fault.hold)  # the fault's duration, not a sync
                finally:
                    try:
                        self.repair(fault)
                    finally:
                        fault.repaired = time.time()
            except Exception as e:  # noqa: BLE001 - collected, fails the run
                where = traceback.extract_tb(e.__traceback__)
                fault.error = f"{e!r} at " + " <- ".join(f"{fr.name}:{fr.lineno}"
                                                         for fr in reversed(where))
                self.errors.append(f"{fault.describe()}: {fault.error}")
                log.exception("fault %s failed", fault.describe())
            finally:
                if member:
                    self._impaired.release()

    def wait(self, timeout: float) -> bool:
        """Wait for the scheduler and every fault (each repaired); True when all ended."""
        deadline = time.monotonic() + timeout
        self._scheduler.join(max(0.0, deadline - time.monotonic()))
        for t in list(self._threads):
            t.join(max(0.0, deadline - time.monotonic()))
        return not self._scheduler.is_alive() and not any(t.is_alive() for t in self._threads)

    def abort(self) -> None:
        """Cut every hold short (repairs still run) and start no more faults."""
        self._stop.set()
