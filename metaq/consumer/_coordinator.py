"""The coordinator: one thread per consumer that does every ZooKeeper write.

States and transitions (``Coordinator.state``)::

    INIT --start--> CONNECTING --session up--> REBALANCING
    REBALANCING --every assigned partition claimed--> STABLE
    REBALANCING --some still held by their old owner--> CLAIMING
    CLAIMING --claim retry succeeds--> STABLE
    STABLE | CLAIMING --member/topic/broker change--> REBALANCING
    any live state --connection SUSPENDED--> SUSPENDED   (fetching stops)
    SUSPENDED --CONNECTED, same session--> STABLE | CLAIMING (fetching resumes; the
                                       group is read again, as kazoo dropped every
                                       watch: nothing moves unless the group changed)
    any --session LOST--> CONNECTING  (fetchers stopped, progress dropped,
                                       nothing committed, generation bumped)
    any --close()--> CLOSED
    any --unexpected exception--> CONNECTING  (fetchers stopped, owner nodes and the
                                       id node deleted: the group rebalances without
                                       us; we rejoin after a backoff) or, after
                                       MAX_FAILURES in a row, CLOSED with the error

ZooKeeper watch callbacks and the kazoo state listener only set a flag and
notify (they never block); this thread coalesces bursts of events into one
rebalance.  Each rebalance is a *generation*; its decisions are logged at INFO
with the group, the consumer id and the generation.

A rebalance is incremental: partitions that stay keep fetching; leaving
partitions are stopped together, then each one's offset is committed and its
owner node deleted in one fenced transaction, all pipelined; an arriving one is
claimed with an ephemeral owner node.  The group is read through a
:class:`~metaq.consumer._view.GroupView` that re-reads only what its watches
name.  A claim that finds the old owner still there watches that node and is
retried (against the same plan, no re-read) the moment it goes, with backoff
and jitter as a safety net, forever, until it succeeds or the assignment
changes: no partition stays unowned while this member could take it.  Static
members' holds come from :class:`~metaq.consumer._static.StaticMembership`.

Its collaborators are passed in, each for what the coordinator needs of it:
the :class:`~metaq.consumer._subscription.SubscriptionState` (the topics, and
the assignment it changes: ``assign``/``revoke``/``drop_all``), the fetch
manager as :class:`Fetching` (partitions in and out, all suspended or resumed),
the offset store, the delivery lease, an error sink and the user's
``on_assigned``/``on_revoked`` callbacks.
"""

from __future__ import annotations

import enum
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import BadVersionError, KazooException, NodeExistsError, NoNodeError
from kazoo.security import OPEN_ACL_UNSAFE

from metaq._errors import (
    CoordinationError,
    DuplicateInstanceError,
    MemberFailedError,
    MetaqError,
)
from metaq.consumer._assignors import get_strategy
from metaq.consumer._config import ConsumerConfig
from metaq.consumer._lease import Lease
from metaq.consumer._offsets import (
    OffsetStore,
    Ownership,
    SessionFence,
    StaleOwnershipError,
    ZkOffsetStore,
)
from metaq.consumer._static import StaticMembership
from metaq.consumer._subscription import PartitionState, SubscriptionState
from metaq.consumer._view import GroupView
from zk_layout import (
    Layout,
    encode_topic_list,
    partition_broker_id,
)

__all__ = ["Coordinator", "Fetching", "State", "MAX_FAILURES"]

log = logging.getLogger(__name__)

#: Unexpected coordinator failures in a row (no settled rebalance between them) after
#: which the member closes with the error instead of rejoining.
MAX_FAILURES = 5
#: Every this many commit periods, every owned offset is written even if unchanged.
REWRITE_EVERY = 10


class State(enum.Enum):
    INIT = "init"
    CONNECTING = "connecting"
    REBALANCING = "rebalancing"
    CLAIMING = "claiming"
    STABLE = "stable"
    SUSPENDED = "suspended"
    CLOSED = "closed"


class Fetching(Protocol):
    """What the coordinator needs of the fetch manager."""

    def add(self, pf: PartitionState) -> None:
        """Start fetching a partition just claimed."""

    def remove(self, pf: PartitionState, timeout: float | None = None) -> bool:
        """Stop fetching it; True once no runner holds it (its progress is final)."""

    def remove_many(self, pfs: list[PartitionState], timeout: float | None = None) -> bool:
        """Stop fetching all of them at once; True once no runner holds any."""

    def suspend(self) -> None:
        """Hand out no partition (the ZooKeeper connection is uncertain)."""

    def resume(self) -> None:
        """Hand them out again."""


@dataclass
class _Claim:
    attempts: int = 0
    next_try: float = 0.0
    holder: str | None = None
    since: float = field(default_factory=time.monotonic)


class Coordinator:
    """Membership, rebalance, ownership and commits for one consumer."""

    def __init__(self, client: KazooClient, *, config: ConsumerConfig, layout: Layout,
                 group: str, consumer_id: str, subscriptions: SubscriptionState,
                 fetcher: Fetching, lease: Lease, store: OffsetStore | None,
                 on_error: Callable[[BaseException], None],
                 on_assigned: Callable[[str, str], None] | None = None,
                 on_revoked: Callable[[str, str], None] | None = None) -> None:
        """``group``: as registered in ZooKeeper (``<group>-<ip>`` in broadcast mode, as
        Metaq names it); ``store``: None for ZooKeeper's (fenced by this coordinator's
        session fence); ``on_error``: where failures go (never raised to a caller)."""
        self._cfg = config
        self._client = client
        self._layout = layout
        self._group = group
        self._broadcast = config.broadcast
        self.consumer_id = consumer_id
        self._subs = subscriptions
        self._fetcher = fetcher
        self._on_error = on_error
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked
        self._strategy = get_strategy(config.strategy)
        self.fence = SessionFence()
        self.lease = lease
        self.store = store or ZkOffsetStore(client, layout, group, self.fence)
        self.state = State.INIT
        self.generation = 0
        self.rebalances = 0
        self._claims: dict[tuple[str, str], _Claim] = {}
        self._view = GroupView(client, layout, group, on_change=self.request_rebalance,
                               with_owners=self._strategy.uses_previous)
        #: the last plan: partition -> broker id, and the brokers' addresses (claim retries
        #: between rebalances use them; only a watch on the group changes them)
        self._target: dict[tuple[str, str], int] = {}
        self._brokers: dict[int, tuple[str, int] | None] = {}
        #: static membership (config.instance_id): our record, the away members whose
        #: partitions we hold back, and when the first of those holds ends (monotonic)
        self._static = StaticMembership(client, layout, group, consumer_id, config,
                                        self._view, subscriptions.topics)
        self._leave_for_good = False
        #: owner nodes of partitions released locally whose delete did not get through
        #: (the connection dropped mid-release, in a session that then went on): deleted
        #: at the next rebalance, or another member would wait for them for good
        self._orphans: dict[tuple[str, str], Ownership] = {}
        self._cond = threading.Condition()
        self._want_rebalance = False
        #: a rebalance asked for while disconnected: run once connected again
        self._rebalance_pending = False
        self._lost = False
        self._suspended = False
        self._reconnected = False
        self._claims_due = False
        self._closing = False
        self._registered_session: int | None = None
        self._next_commit = time.monotonic() + self._cfg.commit_period
        self._next_heartbeat = 0.0
        self._next_zk_retry = 0.0
        self._zk_failures = 0
        self._commit_ticks = 0
        self._failures = 0  # unexpected failures in a row
        self._rejoin_at = 0.0  # after one: no rebalance before this time
        #: the error that made this member give up for good (then CLOSED)
        self.failed: BaseException | None = None
        self.settled = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"metaq-coordinator-{self.consumer_id}")

    # -- called from other threads (never block) ----------------------------

    def start(self) -> None:
        self.state = State.CONNECTING
        self._client.add_listener(self._on_state)
        self._thread.start()
        self.request_rebalance()

    def request_rebalance(self, *_: object) -> None:
        """Watch callback: queue a rebalance (safe in the ZooKeeper event thread)."""
        with self._cond:
            self._want_rebalance = True
            self._cond.notify()

    def request_commit(self) -> None:
        with self._cond:
            self._next_commit = 0.0
            self._cond.notify()

    def _on_owner_event(self, *_: object) -> None:
        """Watch on an owner node we wait for: try the claims now (no re-plan: the
        plan changes only when the group does, and the group's watches say so)."""
        with self._cond:
            self._claims_due = True
            self._cond.notify()

    def _on_state(self, state: str) -> None:
        if state == KazooState.LOST:
            self.fence.lost()
            self.lease.revoke()
            self._fetcher.suspend()
            flag = "_lost"
        elif state == KazooState.SUSPENDED:
            self.lease.revoke()
            self._fetcher.suspend()
            flag = "_suspended"
        else:
            flag = "_reconnected"
        with self._cond:
            setattr(self, flag, True)
            self._cond.notify()

    def close(self, timeout: float, *, leave: bool = False) -> None:
        """Release everything and unregister.  A static member's partitions stay held
        for it for ``static_grace`` unless ``leave`` (then it leaves for good)."""
        with self._cond:
            self._closing = True
            self._leave_for_good = leave
            self._cond.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._client.remove_listener(self._on_state)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def fetch_state(self, topic: str, partition: str) -> PartitionState | None:
        return self._subs.partition(topic, partition)

    def owned(self) -> list[tuple[tuple[str, str], PartitionState, tuple[int, int]]]:
        """(key, state, last committed (msg_id, offset)) of every owned partition."""
        return [(pf.key, pf, pf.committed) for pf in self._subs.assigned()]

    def waiting(self) -> dict[tuple[str, str], str | None]:
        return {k: c.holder for k, c in self._claims.items()}

    # -- the coordinator thread ---------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                if self._turn():
                    return
            except DuplicateInstanceError as e:
                self._refuse(e)
                return
            except Exception as e:  # noqa: BLE001 - never a live session owning partitions
                if self._give_up(e):  # with nobody behind them
                    return
            except BaseException as e:  # noqa: BLE001 - must reach the user
                log.exception("coordinator of %s died", self.consumer_id)
                self._on_error(e)
                return

    def _turn(self) -> bool:
        """One turn of the coordinator loop; True when closed."""
        with self._cond:
            while not self._has_work():
                self._cond.wait(self._timeout())
            closing, lost = self._closing, self._lost
            suspended, reconnected = self._suspended, self._reconnected
            self._lost = self._suspended = self._reconnected = False
            rebalance = self._want_rebalance
            self._want_rebalance = False
            if self._claims_due:
                self._claims_due = False
                for c in self._claims.values():
                    c.next_try = 0.0
        if closing:
            self._shutdown()
            return True
        if lost:
            self._on_lost()
        if suspended and not reconnected:
            self._set_state(State.SUSPENDED)
            self.settled.clear()
        if reconnected and self._client.connected:
            self._next_heartbeat = 0.0
            self._fetcher.resume()
            session = self._client.client_id[0] if self._client.client_id else None
            if session is not None and session == self._registered_session:
                self._resume_after_reconnect()  # same session: our nodes are intact
            # Either way the group is read again: kazoo drops every watch when the connection
            # drops (calling each with a NONE event), so only a fresh read re-arms them.  With
            # nothing changed meanwhile the plan is the same and no partition stops.
            rebalance = True
        if self._rebalance_pending and self._client.connected:
            self._rebalance_pending, rebalance = False, True
        if time.monotonic() >= self._next_heartbeat and self._client.connected:
            self._heartbeat()
        now = time.monotonic()
        if now >= self._static.next_check > 0:
            rebalance = True  # a static member's hold ends: plan without it
        if rebalance and not self._client.connected:
            self._rebalance_pending = True  # done once connected, never dropped
        if (rebalance or now >= self._next_zk_retry > 0) and self._client.connected \
                and now >= self._rejoin_at:
            self._guarded(self._rebalance)
        elif any(c.next_try <= now for c in self._claims.values()) \
                and self._client.connected and self.state is State.CLAIMING:
            self._guarded(self._retry_claims)
        if time.monotonic() >= self._next_commit:
            self._next_commit = time.monotonic() + self._cfg.commit_period
            if self._client.connected:
                self._commit_ticks += 1
                self._guarded(self._commit_tick, retry=False)
        if self.state is State.STABLE:
            self._failures = 0
        return False

    def _give_up(self, error: Exception) -> bool:
        """An unexpected failure: leave the group cleanly (stop fetching, delete our owner
        nodes and id node so the others take the partitions) and rejoin after a backoff,
        or close for good after MAX_FAILURES in a row.  True when closed."""
        self._failures += 1
        final = self._failures >= MAX_FAILURES
        log.error("group %s consumer %s gen %d: coordinator failed (%d in a row): %r; %s",
                  self._group, self.consumer_id, self.generation, self._failures, error,
                  "closing" if final else "leaving the group and rejoining")
        log.debug("the failure of consumer %s", self.consumer_id, exc_info=error)
        err = MemberFailedError(
            f"consumer {self.consumer_id} of group {self._group}: coordinator failed "
            f"({error!r}); " + (f"closed after {self._failures} failures in a row"
                                if final else "left the group, rejoining"))
        err.__cause__ = error
        self._fetcher.remove_many(self._subs.assigned(), timeout=self._cfg.close_timeout)
        self._view.reset()
        try:
            self._leave()
        except Exception as e:  # noqa: BLE001 - the session may be the problem too
            log.warning("leaving group %s after a failure: %r", self._group, e)
        self.generation += 1
        self.settled.clear()
        if final:
            self.failed = err
            self._set_state(State.CLOSED)
        else:
            self._set_state(State.CONNECTING)
            wait = min(30.0, 0.5 * 2 ** (self._failures - 1)) * (0.5 + random.random())
            self._rejoin_at = self._next_zk_retry = time.monotonic() + wait
        self._on_error(err)
        return final

    def _leave(self) -> None:
        """Give up every partition and the registration, committing nothing (our
        progress may be what failed); owner nodes go in this session, fenced."""
        owned = [pf.ownership for pf in self._subs.drop_all()] + list(self._orphans.values())
        self._orphans.clear()
        self._claims.clear()
        registered, self._registered_session = self._registered_session, None
        if not self._client.connected:
            return
        for ownership in owned:
            with self.fence.lock:
                if ownership is None or self.fence.epoch != ownership.epoch:
                    continue
                pending = self._client.delete_async(ownership.owner_path, ownership.version)
            try:
                pending.get(timeout=self._cfg.zk_connect_timeout)
            except (NoNodeError, KazooException):
                pass
        if registered is not None:
            self._delete_own_id(registered)

    def _delete_own_id(self, session: int | None) -> None:
        """Delete our id node if this session holds it (never a duplicate's, nor a
        predecessor's still alive)."""
        path = self._layout.consumer_id(self._group, self.consumer_id)
        try:
            _, stat = self._client.get(path)
            if session is not None and stat.ephemeralOwner == session:
                self._client.delete(path, stat.version)
        except (NoNodeError, BadVersionError, KazooException):
            pass

    def _resume_after_reconnect(self) -> None:
        if self._claims:
            self._set_state(State.CLAIMING)
        else:
            self._set_state(State.STABLE)
            self.settled.set()
        log.info("group %s consumer %s gen %d: ZooKeeper connection back in the same session; "
                 "fetching resumes (the group is read again to re-arm its watches)",
                 self._group, self.consumer_id, self.generation)

    def _has_work(self) -> bool:
        if self._closing or self._lost or self._suspended or self._reconnected:
            return True
        if self._want_rebalance or self._claims_due:
            return True
        return self._timeout() <= 0

    def _heartbeat(self) -> None:
        """Renew the delivery lease with a ZooKeeper round trip (see _lease.py)."""
        self._next_heartbeat = time.monotonic() + self._cfg.zk_session_timeout / 6.0
        sent = time.monotonic()
        try:
            self._client.exists(self._layout.consumer_id(self._group, self.consumer_id))
        except KazooException as e:
            log.debug("heartbeat of %s failed: %r", self.consumer_id, e)
            return
        self.lease.renewed(sent)

    def _timeout(self) -> float:
        now = time.monotonic()
        due = [self._next_commit, self._next_heartbeat]
        due.extend(c.next_try for c in self._claims.values())
        if self._next_zk_retry > 0:
            due.append(self._next_zk_retry)
        if self._static.next_check > 0:
            due.append(self._static.next_check)
        return max(0.0, min(due) - now)

    def _guarded(self, step: Callable[[], None], *, retry: bool = True) -> None:
        """Run a ZooKeeper step.  A failed rebalance (``retry``) is retried with backoff;
        only its own success clears that retry (a commit tick succeeding says nothing
        about a registration that failed).  A failed commit waits for the next tick."""
        try:
            step()
            if retry:
                self._zk_failures = 0
                self._next_zk_retry = 0.0
        except DuplicateInstanceError:
            raise
        except (KazooException, CoordinationError, MetaqError, OSError) as e:
            if not retry:
                log.warning("group %s consumer %s gen %d: %s failed (%r); next period retries",
                            self._group, self.consumer_id, self.generation,
                            getattr(step, "__name__", step), e)
                return
            self._zk_failures += 1
            wait = min(5.0, 0.05 * 2 ** min(self._zk_failures, 7)) * (0.5 + random.random())
            self._next_zk_retry = time.monotonic() + wait
            log.warning("group %s consumer %s gen %d: %s failed (%r); retrying in %.2fs",
                        self._group, self.consumer_id, self.generation,
                        getattr(step, "__name__", step), e, wait)

    def _set_state(self, state: State) -> None:
        if state is not self.state:
            log.debug("consumer %s: %s -> %s", self.consumer_id, self.state.value, state.value)
            self.state = state

    # -- session events -------------------------------------------------------

    def _on_lost(self) -> None:
        """The session ended: stop everything, keep nothing from it, commit nothing."""
        self.generation += 1
        owned = self._subs.assigned()
        log.warning("group %s consumer %s gen %d: ZooKeeper session lost; dropping %d "
                    "partitions without committing", self._group, self.consumer_id,
                    self.generation, len(owned))
        self._fetcher.remove_many(owned, timeout=self._cfg.close_timeout)
        self._subs.drop_all()
        self._view.reset()  # the session's watches ended with it
        self._orphans.clear()  # ephemeral: they ended with the session
        self._claims.clear()
        self._registered_session = None
        self.settled.clear()
        self._set_state(State.CONNECTING)
        self._fetcher.resume()
        self.request_rebalance()

    # -- rebalance --------------------------------------------------------------

    def _register(self) -> None:
        session = self._client.client_id[0] if self._client.client_id else None
        if session is not None and session == self._registered_session:
            return
        path = self._layout.consumer_id(self._group, self.consumer_id)
        data = encode_topic_list(self._subs.topics())
        # Parents shared with other components stay open; with an ACL mode, the group's
        # own nodes (created below with the client's default ACL) are protected.
        security = self._cfg.zk_security
        self._client.ensure_path(self._layout.consumer_groups(),
                                 acl=security.shared_acl() if security else OPEN_ACL_UNSAFE)
        try:
            self._client.create(path, data, ephemeral=True, makepath=True)
        except NodeExistsError:
            _, stat = self._client.get(path)
            if stat.ephemeralOwner != session:
                # a predecessor's session (e.g. this process restarted after kill -9) still
                # holds our id: rebalance the moment its node goes, backoff retries meanwhile
                self._client.exists(path, watch=self.request_rebalance)
                self._static.conflict(stat.ephemeralOwner)
                raise CoordinationError(
                    f"consumer id {self.consumer_id} is registered by another session "
                    f"(0x{stat.ephemeralOwner:x}); waiting for it to expire") from None
            self._client.set(path, data)
        self._registered_session = session
        self._static.registered()
        log.info("group %s consumer %s: registered in session 0x%x%s", self._group,
                 self.consumer_id, session or 0,
                 f" (static member {self._cfg.instance_id})" if self._static.enabled else "")

    def _refuse(self, error: DuplicateInstanceError) -> None:
        """A duplicate static member: own nothing, touch nothing of the other's, close."""
        log.error("group %s consumer %s: %s", self._group, self.consumer_id, error)
        self._fetcher.remove_many(self._subs.assigned(), timeout=self._cfg.close_timeout)
        self._subs.drop_all()
        self._claims.clear()
        self.failed = error
        self.settled.clear()
        self._set_state(State.CLOSED)
        self._on_error(error)

    # -- rebalance ----------------------------------------------------------------

    def _delete_orphans(self) -> None:
        """Delete the owner nodes a failed release left behind, in the session that
        made them (fenced by its epoch: after a session loss they are gone already)."""
        for key, ownership in list(self._orphans.items()):
            with self.fence.lock:
                if self.fence.epoch != ownership.epoch:
                    pending = None
                else:
                    pending = self._client.delete_async(ownership.owner_path,
                                                        ownership.version)
            if pending is not None:
                try:
                    pending.get(timeout=self._cfg.zk_connect_timeout)
                except (NoNodeError, BadVersionError):
                    pass  # gone, or no longer the node we made
            del self._orphans[key]
            log.info("group %s consumer %s gen %d: released %s/%s (its owner node, left by "
                     "a release cut short)", self._group, self.consumer_id, self.generation,
                     *key)

    def _rebalance(self) -> None:
        self._register()
        self._delete_orphans()
        self.generation += 1
        self.rebalances += 1
        gen = self.generation
        self._set_state(State.REBALANCING)
        topics = self._subs.topics()
        topo = self._view.read(self._subs.topics())
        held = self._static.holds(topo, gen)
        target: dict[tuple[str, str], int] = {}  # (topic, partition) -> broker id
        for topic in topics:
            members = topo.members.get(topic, [])
            members = members + [c for c, rec in held.items() if topic in rec.topics]
            parts = topo.partitions.get(topic, [])
            if self._broadcast:
                share = parts  # every member consumes every partition, owning none
            else:
                share = self._strategy(members, parts, me=self.consumer_id,
                                       previous=topo.owners.get(topic) or None)
            for p in share:
                target[(topic, p)] = partition_broker_id(p)
        self._target, self._brokers = target, topo.brokers
        owned = self._subs.assigned_keys()
        release = [k for k in owned if k not in target]
        owning = set(owned)
        claim = [k for k in target if k not in owning]
        self._release_many(release, gen)
        for key in list(self._claims):
            if key not in target:
                del self._claims[key]
        now = time.monotonic()
        due = [k for k in claim if not ((c := self._claims.get(k)) is not None
                                        and c.next_try > now and c.holder is not None)]
        self._claim_many(due, target, topo.brokers)
        assigned = self._subs.assigned()
        for pf in assigned:  # brokers may move (restart on a new port)
            addr = topo.brokers.get(pf.broker_id)
            if addr != pf.broker_address:
                pf.broker_moved(addr)
        self._settle_state()
        if release or claim:
            log.info("group %s consumer %s gen %d: owns %d, released %s, claimed %s, "
                     "waiting for %s", self._group, self.consumer_id, gen, len(assigned),
                     _names(release), _names([k for k in claim
                                              if self._subs.partition(*k) is not None]),
                     _names(list(self._claims)))

    def _settle_state(self) -> None:
        if self._claims:
            self._set_state(State.CLAIMING)
            self.settled.clear()
        else:
            self._set_state(State.STABLE)
            self.settled.set()

    def _retry_claims(self) -> None:
        """Claims whose time came (or whose holder's node went), against the last plan:
        no re-read of the group, which has not changed (its watches would have said)."""
        now = time.monotonic()
        due = [k for k, c in self._claims.items() if c.next_try <= now]
        before = set(self._claims)
        self._claim_many(due, self._target, self._brokers)
        self._settle_state()
        won = [k for k in due if k in before and k not in self._claims]
        if won:
            log.info("group %s consumer %s gen %d: claimed %s, waiting for %s", self._group,
                     self.consumer_id, self.generation, _names(won),
                     _names(list(self._claims)))

    def _release_many(self, keys: list[tuple[str, str]], gen: int) -> None:
        """Give partitions up: stop them all, then commit each one's final offset and
        delete its owner node (one fenced transaction per partition, all pipelined)."""
        if not keys:
            return
        pfs = [pf for k in keys if (pf := self._subs.partition(*k)) is not None]
        if not self._fetcher.remove_many(pfs, timeout=self._cfg.close_timeout):
            busy = [pf.key for pf in pfs if pf.busy]
            raise CoordinationError(f"partitions {_names(busy)} still busy after close_timeout")
        for pf in pfs:
            self._callback(self._on_revoked, pf.key)
            pf.drain()
        finals: dict[tuple[str, str], tuple[int, int] | None] = {}
        for pf in pfs:
            now = pf.commit_position()
            finals[pf.key] = now if now != pf.committed and now[1] >= 0 else None
        owned = {pf.key: pf.ownership for pf in pfs}
        outcome: dict[tuple[str, str], BaseException | None] = {}
        if isinstance(self.store, ZkOffsetStore):
            items = [(k[0], k[1], finals[k], o) for k, o in owned.items() if o is not None]
            outcome = self.store.commit_and_release(items) if items else {}
        else:
            for pf in pfs:
                self._commit_one(pf)
            pending = {}
            with self.fence.lock:
                for k, o in owned.items():
                    if o is not None and self.fence.epoch == o.epoch:
                        pending[k] = self._client.delete_async(o.owner_path, o.version)
            for k, r in pending.items():
                try:
                    r.get(timeout=self._cfg.zk_connect_timeout)
                    outcome[k] = None
                except (NoNodeError, BadVersionError):
                    outcome[k] = None
                except Exception as e:  # noqa: BLE001 - unknown outcome: kept as an orphan
                    outcome[k] = e
        failed: BaseException | None = None
        for pf in pfs:
            self._subs.revoke(pf.key)
            err = outcome.get(pf.key)
            if isinstance(err, StaleOwnershipError):
                log.warning("group %s consumer %s gen %d: %s", self._group, self.consumer_id,
                            gen, err)
            elif err is not None:
                ownership = owned[pf.key]
                assert ownership is not None
                self._orphans[pf.key] = ownership  # retried by the next rebalance
                failed = err
            elif finals[pf.key] is not None:
                pf.mark_committed(finals[pf.key])
        log.debug("group %s consumer %s gen %d: released %s", self._group, self.consumer_id,
                  gen, _names(keys))
        if failed is not None:
            raise failed

    def _claim_many(self, keys: list[tuple[str, str]], target: dict[tuple[str, str], int],
                    brokers: dict[int, tuple[str, int] | None]) -> None:
        """Claim partitions with ephemeral owner nodes, pipelined on the one connection.
        One still held arms a watch on its owner node: the claim is retried the moment
        that node goes (backoff retries only as a safety net)."""
        if not keys:
            return
        if self._broadcast:
            self._start_fetching(keys, target, brokers, {k: None for k in keys})
            return
        epoch = self.fence.epoch
        session = self._client.client_id[0]
        data = self.consumer_id.encode("utf-8")
        paths = {k: self._layout.owner(self._group, *k) for k in keys}
        won: dict[tuple[str, str], int] = {}
        todo = list(keys)
        for _ in range(3):  # a node released between our create and our get: at once again
            creates = {k: self._client.create_async(paths[k], data, ephemeral=True,
                                                    makepath=True) for k in todo}
            held: dict[tuple[str, str], object] = {}
            for k, pending in creates.items():
                try:
                    pending.get()
                    won[k] = 0
                except NodeExistsError:
                    held[k] = self._client.get_async(paths[k], watch=self._on_owner_event)
            todo = []
            for k, pending in held.items():
                try:
                    holder, stat = pending.get()
                except NoNodeError:
                    todo.append(k)  # released meanwhile: create again now
                    continue
                if holder == data and stat.ephemeralOwner == session:
                    won[k] = stat.version  # ours already (a rebalance retried after a failure)
                else:
                    self._retry_claim(k, holder.decode("utf-8", "replace"))
            if not todo:
                break
        for k in todo:
            self._retry_claim(k, None)
        self._start_fetching([k for k in keys if k in won], target, brokers,
                             {k: Ownership(owner_path=paths[k], version=v, epoch=epoch)
                              for k, v in won.items()})

    def _start_fetching(self, keys: list[tuple[str, str]], target: dict[tuple[str, str], int],
                        brokers: dict[int, tuple[str, int] | None],
                        ownership: dict[tuple[str, str], Ownership | None]) -> None:
        stored = self.store.load_many(keys)
        for k in keys:
            self._claims.pop(k, None)
            broker_id = target[k]
            pf = self._subs.assign(k[0], k[1], broker_id, brokers.get(broker_id),
                                   stored.get(k), ownership[k])
            self._callback(self._on_assigned, k)
            self._fetcher.add(pf)

    def _callback(self, fn: Callable[[str, str], None] | None, key: tuple[str, str]) -> None:
        """Run a user's on_assigned/on_revoked: its failure is reported, never stops a
        rebalance."""
        if fn is None:
            return
        try:
            fn(*key)
        except Exception as e:  # noqa: BLE001 - a user callback must not stop a rebalance
            log.exception("callback %r failed for %s/%s", fn, *key)
            self._on_error(e)

    def _retry_claim(self, key: tuple[str, str], holder: str | None) -> None:
        c = self._claims.setdefault(key, _Claim())
        c.attempts += 1
        c.holder = holder
        base = min(self._cfg.claim_backoff_max,
                   self._cfg.claim_backoff * 2 ** min(c.attempts - 1, 10))
        c.next_try = time.monotonic() + base * (0.5 + random.random() / 2)
        if c.attempts in (1, 10) or c.attempts % 50 == 0:
            log.info("group %s consumer %s gen %d: %s/%s still owned by %s (attempt %d); "
                     "waiting for its release", self._group, self.consumer_id,
                     self.generation, key[0], key[1], holder, c.attempts)

    # -- commits ----------------------------------------------------------------

    def _commit_tick(self) -> None:
        """The commit timer: changed offsets, and every REWRITE_EVERY-th tick all of
        them, so an offset node damaged under an owner (garbage written while the
        partition sat idle) is repaired within that many periods."""
        self.commit_all(force=self._commit_ticks % REWRITE_EVERY == 0)

    def commit_all(self, force: bool = False) -> None:
        for pf in self._subs.assigned():
            self._commit_one(pf, force)

    def _commit_one(self, pf: PartitionState, force: bool = False) -> None:
        now = pf.commit_position()
        if (now == pf.committed and not force) or now[1] < 0:
            return
        try:
            self.store.commit(pf.topic, pf.partition, now[0], now[1], pf.ownership)
        except StaleOwnershipError as e:
            log.warning("group %s consumer %s: %s", self._group, self.consumer_id, e)
            self.request_rebalance()
            return
        pf.mark_committed(now)

    # -- shutdown ---------------------------------------------------------------

    def _shutdown(self) -> None:
        """Metaq's order: stop fetchers, commit, delete owner nodes, delete the id node.

        A static member leaving for a while writes its away time first, so the others
        hold its partitions from the moment they see it go; leaving for good, it
        deletes its record, and the others rebalance at once."""
        registered = self._registered_session
        self._fetcher.remove_many(self._subs.assigned(), timeout=self._cfg.close_timeout)
        if self._client.connected and registered is not None:
            try:
                self._static.leaving(for_good=self._leave_for_good)
            except KazooException as e:
                log.warning("updating the static member record at close: %r", e)
            try:
                self._release_many(self._subs.assigned_keys(), self.generation)
            except (KazooException, MetaqError) as e:
                log.warning("releasing partitions at close failed: %r", e)
            try:
                self._delete_orphans()
            except KazooException as e:
                log.warning("deleting owner nodes left by failed releases at close: %r", e)
            self._delete_own_id(registered)
        self._subs.drop_all()
        self._set_state(State.CLOSED)
        self.settled.clear()


def _names(keys: list[tuple[str, str]]) -> str:
    return "[" + ", ".join(f"{t}/{p}" for t, p in keys) + "]" if keys else "[]"
