"""A seeded fault plan and the threads that carry it out.

:func:`make_plan` turns a seed into a list of :class:`Fault` (start time,
kind, target, how long): rounds of the seven kinds (the two data faults:
``zk_garbage`` writes garbage into a partition's offset node, ``disk_flip``
kills a broker, flips bytes of one message in a partition's writable segment
and restarts it) in a seeded order (so every
run injects every kind), the first ZooKeeper fault stopping the leader, until
the chaos window ends.

:class:`FaultRunner` starts each fault on its own thread at its time.  A
fault first takes its target's lock (one fault per member, broker or the
ensemble at a time) and, for member faults, one of two "impaired member"
slots, so the group always keeps two healthy members and the ensemble keeps
a quorum.
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
MEMBER_KINDS = ("consumer_kill", "session_expire", "consumer_sigstop")


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

    def describe(self) -> str:
        target = self.target if self.node is None else f"{self.target}=node{self.node}"
        return f"t+{self.at:5.1f}s {self.kind:<16} {target!s:<12} hold {self.hold:.1f}s"


def make_plan(seed: int, window: float, *, members: int, brokers: int,
              session_timeout: float, max_impaired_members: int = 2) -> list[Fault]:
    """A seeded plan whose faults fit the window.

    Rounds of the five kinds in a seeded order; each fault starts at the first moment
    (after the previous one) when a target of its kind is free.  A target stays busy
    for its fault plus a rough estimate of its recovery.  At most one broker is down,
    at most ``max_impaired_members`` members are impaired, and ZooKeeper stops never
    overlap session faults (a leader election restarts session timers, so it could
    save a session held past its timeout).
    """
    rng = random.Random(seed)
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
            return [i for i in range(members) if not is_busy(("member", i))]
        if kind in ("broker_kill", "disk_flip"):
            down = any(k[0] == "broker" and until > at for k, until in busy.items())
            return [] if down else list(range(brokers))
        if kind == "zk_garbage":  # any partition's offset node, at any time
            return list(range(brokers * 4))
        return [] if is_busy(("zk",)) or is_busy(("session",)) else ["zk"]

    while True:
        kinds = list(KINDS)
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
            }[kind]
            recovery = {  # rough: the old session to expire, a start, a new registration
                "consumer_kill": session_timeout + 3.0, "broker_kill": 7.0, "zk_stop": 3.0,
                "session_expire": 2.0, "consumer_sigstop": 2.0, "disk_flip": 7.0,
                "zk_garbage": 0.0}[kind]
            if kind == "zk_stop":
                target: int | str = "leader" if first_zk or rng.random() < 0.5 else "follower"
                first_zk = False
                busy[("zk",)] = t + hold + recovery
            elif kind == "zk_garbage":
                target = rng.choice(choices)
            else:
                target = rng.choice(choices)
                busy[("member" if kind in MEMBER_KINDS else "broker", target)] = (
                    t + hold + recovery)
            if kind in ("session_expire", "consumer_sigstop"):
                busy[("session",)] = max(busy.get(("session",), 0.0), t + hold + 1.0)
            plan.append(Fault(round(t, 2), kind, target, round(hold, 2)))
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
        elif fault.kind in ("broker_kill", "disk_flip"):
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
