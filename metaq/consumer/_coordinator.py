"""The coordinator: the one thread per consumer that runs the member's state machine
and does every ZooKeeper write.

Other threads only ask: ZooKeeper watch callbacks and the kazoo state listener
set a flag and notify (they never block, as they run in kazoo's event thread);
each turn this thread takes everything asked at once, so a burst of events
makes one rebalance.  What it drives, one concept a part:

==================  ==========================================================
``Lifecycle``       the state, its transitions and the generation
                    (``_lifecycle``): every change through its one writer,
                    each one numbered and waitable
``Membership``      our id node, its static record, the heartbeat that renews
                    the delivery lease (``_membership``)
``GroupView``       the group as read, re-read only where a watch fired
                    (``_view``)
``make_plan``       this member's share of a generation, pure (``_plan``)
``OwnerNodes``      claims, waits for partitions still held, fenced releases
                    (``_owners``)
``Handoff``         partitions in and out of the fetcher and the subscription
                    state as a plan says, with the user's callbacks
                    (``_handoff``)
``Committer``       the commit timer (``_commits``)
``Backoff``         retry timing of a failed step and of rejoining
                    (``_backoff``)
``RebalanceHistory``  each rebalance recorded, with why, in ZooKeeper after it
                    (``_history``): written asynchronously, never waited for
==================  ==========================================================

Each rebalance is a *generation*; its decisions are logged at INFO with the
group, the consumer id and the generation.  A rebalance is incremental:
partitions that stay keep fetching; leaving partitions are stopped together,
then each one's offset is committed and its owner node deleted in one fenced
transaction, all pipelined; an arriving one is claimed with an ephemeral owner
node.  A claim that finds the old owner still there waits for that node, against
the same plan (no re-read), until it succeeds or the assignment changes: no
partition stays unowned while this member could take it.

A ZooKeeper step that fails is tried again with backoff.  An unexpected
exception makes the member leave the group cleanly (fetchers stopped, owner
nodes and the id node deleted: the group rebalances without it) and rejoin
after a backoff or, after :data:`MAX_FAILURES` in a row, close with the error.

Its collaborators are passed in, each for what the coordinator needs of it:
the :class:`~metaq.consumer._subscription.SubscriptionState` (the topics, and
the assignment the handoff changes), the fetch manager as
:class:`~metaq.consumer._handoff.Fetching` (partitions in and out, all
suspended or resumed), the offset store, the delivery lease, an error sink and
the user's ``on_assigned``/``on_revoked`` callbacks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import KazooException

from metaq._errors import (
    CoordinationError,
    DuplicateInstanceError,
    MemberFailedError,
    MetaqError,
)
from metaq._types import PartitionKey
from metaq.consumer._assignors import get_strategy
from metaq.consumer._backoff import Backoff
from metaq.consumer._commits import Committer
from metaq.consumer._config import ConsumerConfig
from metaq.consumer._handoff import Fetching, Handoff, names
from metaq.consumer._history import RebalanceHistory
from metaq.consumer._lease import Lease
from metaq.consumer._lifecycle import Lifecycle, State, Transition, Want
from metaq.consumer._membership import Membership
from metaq.consumer._offsets import OffsetStore, SessionFence, ZkOffsetStore
from metaq.consumer._owners import OwnerNodes
from metaq.consumer._plan import make_plan
from metaq.consumer._subscription import PartitionState, SubscriptionState
from metaq.consumer._view import GroupView
from zk_layout import Layout

__all__ = ["Coordinator", "MAX_FAILURES"]

log = logging.getLogger(__name__)

#: Unexpected coordinator failures in a row (no settled rebalance between them) after
#: which the member closes with the error instead of rejoining.
MAX_FAILURES = 5


@dataclass
class _Asked:
    """What other threads asked of the coordinator thread since its last turn."""

    rebalance: bool = False  # a watch saw the group change (or start)
    claims: bool = False  # an owner node we wait for changed
    lost: bool = False  # the session ended
    suspended: bool = False  # the connection dropped
    reconnected: bool = False  # the connection is back
    closing: bool = False
    leave: bool = False  # closing for good: a static member's partitions are not held

    def any(self) -> bool:
        return (self.rebalance or self.claims or self.lost or self.suspended
                or self.reconnected or self.closing)


class Coordinator:
    """One consumer's coordinator thread: the state machine and its parts."""

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
        self.consumer_id = consumer_id
        self._subs = subscriptions
        self._fetcher = fetcher
        self._on_error = on_error
        self._strategy = get_strategy(config.strategy)
        self.fence = SessionFence()
        self.lease = lease
        self.store = store or ZkOffsetStore(client, layout, group, self.fence)
        self.life = Lifecycle(group, consumer_id)
        self._view = GroupView(client, layout, group, on_change=self.request_rebalance,
                               with_owners=self._strategy.uses_previous)
        self._membership = Membership(client, layout, group, consumer_id, config,
                                      view=self._view, topics=subscriptions.topics,
                                      lease=lease, on_freed=self.request_rebalance)
        self._owners = OwnerNodes(client, layout, group, consumer_id, fence=self.fence,
                                  store=self.store, config=config, life=self.life,
                                  on_owner_event=self._on_owner_event)
        self._commits = Committer(self.store, subscriptions, config.commit_period,
                                  life=self.life, on_stale=self.request_rebalance)
        self._handoff = Handoff(subscriptions, fetcher, owners=self._owners,
                                commits=self._commits, store=self.store, config=config,
                                life=self.life, on_error=on_error, on_assigned=on_assigned,
                                on_revoked=on_revoked)
        self.history = RebalanceHistory(client, layout, group, consumer_id, config)
        self._cond = threading.Condition()
        self._asked = _Asked()
        #: a rebalance asked for while disconnected: run once connected again
        self._rebalance_pending = False
        #: a failed ZooKeeper step of a rebalance, tried again
        self._retry = Backoff(0.1, 5.0, max_doublings=6)
        #: unexpected failures in a row; no rebalance before its next time
        self._rejoin = Backoff(0.5, 30.0)
        #: the error that made this member give up for good (then CLOSED)
        self.failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"metaq-coordinator-{self.consumer_id}")

    # -- called from other threads (never block) ----------------------------

    def start(self) -> None:
        self.life.set_state(State.CONNECTING, "started")
        self._client.add_listener(self._on_state)
        self._thread.start()
        self.request_rebalance()

    def request_rebalance(self, *_: object) -> None:
        """Watch callback: queue a rebalance (safe in the ZooKeeper event thread)."""
        with self._cond:
            self._asked.rebalance = True
            self._cond.notify()

    def request_commit(self) -> None:
        with self._cond:
            self._commits.request()
            self._cond.notify()

    def _on_owner_event(self, *_: object) -> None:
        """Watch on an owner node we wait for: try the claims now (no re-plan: the
        plan changes only when the group does, and the group's watches say so)."""
        with self._cond:
            self._asked.claims = True
            self._cond.notify()

    def _on_state(self, state: str) -> None:
        if state == KazooState.LOST:
            self.fence.lost()
            self.lease.revoke()
            self._fetcher.suspend()
        elif state == KazooState.SUSPENDED:
            self.lease.revoke()
            self._fetcher.suspend()
        with self._cond:
            if state == KazooState.LOST:
                self._asked.lost = True
            elif state == KazooState.SUSPENDED:
                self._asked.suspended = True
            else:
                self._asked.reconnected = True
            self._cond.notify()

    def close(self, timeout: float, *, leave: bool = False) -> None:
        """Release everything and unregister.  A static member's partitions stay held
        for it for ``static_grace`` unless ``leave`` (then it leaves for good)."""
        with self._cond:
            self._asked.closing = True
            self._asked.leave = leave
            self._cond.notify()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._client.remove_listener(self._on_state)

    # -- reading (any thread) -------------------------------------------------

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def state(self) -> State:
        return self.life.state

    @property
    def generation(self) -> int:
        return self.life.generation

    @property
    def rebalances(self) -> int:
        return self.life.rebalances

    @property
    def state_id(self) -> int:
        """The id of the last state transition: one more after each."""
        return self.life.state_id

    def wait_for(self, want: Want, timeout: float | None, *,
                 after: int | None = None) -> Transition | None:
        """See :meth:`Lifecycle.wait_for`: a state (or states, or a condition) reached,
        now or after transition ``after``; None on timeout."""
        return self.life.wait_for(want, timeout, after=after)

    def wait_transition(self, after_id: int, timeout: float | None) -> Transition | None:
        """The next transition after ``after_id``; None on timeout."""
        return self.life.wait_transition(after_id, timeout)

    def fetch_state(self, topic: str, partition: str) -> PartitionState | None:
        return self._subs.partition(topic, partition)

    def owned(self) -> list[tuple[PartitionKey, PartitionState, tuple[int, int]]]:
        """(key, state, last committed (msg_id, offset)) of every owned partition."""
        return [(pf.key, pf, pf.committed) for pf in self._subs.assigned()]

    def waiting(self) -> dict[PartitionKey, str | None]:
        return self._owners.waiting()

    # -- the coordinator thread ---------------------------------------------

    def _run(self) -> None:
        try:
            while not self._step():
                pass
        except BaseException as e:  # noqa: BLE001 - must reach the user
            log.exception("coordinator of %s died", self.consumer_id)
            self._on_error(e)

    def _step(self) -> bool:
        """One turn, its failures handled; True when the thread is done."""
        try:
            return self._turn()
        except DuplicateInstanceError as e:
            self._refuse(e)
            return True
        except Exception as e:  # noqa: BLE001 - never a live session owning partitions
            return self._give_up(e)  # with nobody behind them

    def _turn(self) -> bool:
        """One turn of the coordinator loop; True when closed."""
        with self._cond:
            while not self._asked.any() and (wait := self._wait_time()) > 0:
                self._cond.wait(wait)
            asked, self._asked = self._asked, _Asked()
        if asked.claims:
            self._owners.wake()
        if asked.closing:
            self._shutdown(leave_for_good=asked.leave)
            return True
        if asked.lost:
            self._on_lost()
        if asked.suspended and not asked.reconnected:
            self.life.set_state(State.SUSPENDED, "ZooKeeper connection suspended")
        rebalance, why = asked.rebalance, "requested"
        if asked.reconnected and self._client.connected:
            self._membership.heartbeat_now()
            self._fetcher.resume()
            if self._membership.registered():
                self._resume_after_reconnect()  # same session: our nodes are intact
            # Either way the group is read again: kazoo drops every watch when the connection
            # drops (calling each with a NONE event), so only a fresh read re-arms them.  With
            # nothing changed meanwhile the plan is the same and no partition stops.
            rebalance, why = True, "connection back"
        if self._rebalance_pending and self._client.connected:
            self._rebalance_pending, rebalance = False, True
        if self._client.connected and self._membership.heartbeat_due(time.monotonic()):
            self._membership.heartbeat()
        now = time.monotonic()
        if now >= self._membership.static.next_check > 0 and not self._retry.waiting(now):
            rebalance, why = True, "a static member's hold ended"  # plan without it
        if rebalance and not self._client.connected:
            self._rebalance_pending = True  # done once connected, never dropped
        if self._client.connected and not self._rejoin.waiting(now) and (
                rebalance or self._retry.due(now)):
            self._guarded(lambda: self._rebalance(why if rebalance else "retry"), "rebalance")
        elif self._client.connected and self.life.state is State.CLAIMING \
                and self._owners.due(now):
            self._guarded(self._retry_claims, "claim retry")
        if self._commits.expired(time.monotonic()) and self._client.connected:
            self._guarded(self._commits.tick, "commit", retry=False)
        if self.life.state is State.STABLE:
            self._rejoin.reset()
        return False

    def _wait_time(self) -> float:
        """Seconds until a timer of this thread is due (0: now).  While disconnected
        only the commit timer counts (its tick is then skipped): the others talk to
        ZooKeeper, and the reconnection wakes the thread."""
        now = time.monotonic()
        due = [self._commits.next_at]
        if self._client.connected:
            due.append(self._membership.next_heartbeat)
            if self._retry.next_at is not None:
                due.append(self._retry.next_at)
            check = self._membership.static.next_check
            if check > 0 and not self._retry.waiting(now) and not self._rejoin.waiting(now):
                due.append(check)
            if self.life.state is State.CLAIMING and (t := self._owners.next_try()) is not None:
                due.append(t)
        return max(0.0, min(due) - now)

    def _guarded(self, step: Callable[[], None], what: str, *, retry: bool = True) -> None:
        """Run a ZooKeeper step.  A failed rebalance (``retry``) is retried with backoff;
        only its own success clears that retry (a commit tick succeeding says nothing
        about a registration that failed).  A failed commit waits for the next tick."""
        try:
            step()
            if retry:
                self._retry.reset()
        except DuplicateInstanceError:
            raise
        except (KazooException, CoordinationError, MetaqError, OSError) as e:
            if not retry:
                log.warning("%s: %s failed (%r); next period retries", self.life.label,
                            what, e)
                return
            wait = self._retry.failed()
            log.warning("%s: %s failed (%r); retrying in %.2fs", self.life.label, what, e,
                        wait)

    # -- leaving: a failure, a duplicate, a lost session, close() -------------------------

    def _give_up(self, error: Exception) -> bool:
        """An unexpected failure: leave the group cleanly (stop fetching, delete our owner
        nodes and id node so the others take the partitions) and rejoin after a backoff,
        or close for good after MAX_FAILURES in a row.  True when closed."""
        wait = self._rejoin.failed()  # counted now, timed from when we have left
        failures = self._rejoin.attempts
        final = failures >= MAX_FAILURES
        log.error("%s: coordinator failed (%d in a row): %r; %s", self.life.label, failures,
                  error, "closing" if final else "leaving the group and rejoining")
        log.debug("the failure of consumer %s", self.consumer_id, exc_info=error)
        err = MemberFailedError(
            f"consumer {self.consumer_id} of group {self.life.group}: coordinator failed "
            f"({error!r}); " + (f"closed after {failures} failures in a row"
                                if final else "left the group, rejoining"))
        err.__cause__ = error
        dropped = self._subs.assigned_keys()
        self._handoff.stop_all()
        self._view.reset()
        try:
            self._leave()
        except Exception as e:  # noqa: BLE001 - the session may be the problem too
            log.warning("leaving group %s after a failure: %r", self.life.group, e)
        if final:
            self.failed = err
            self.life.set_state(State.CLOSED, f"failed {failures} times in a row",
                                new_generation=True)
        else:
            rejoin_at = time.monotonic() + wait
            self._rejoin.defer(rejoin_at)
            self._retry.defer(rejoin_at)  # the rejoin's rebalance
            self.life.set_state(State.CONNECTING, f"left after a failure; rejoining in "
                                f"{wait:.1f}s", new_generation=True)
        self.history.dropped("failed", f"{error!r}"[:200], self.life.generation,
                             released=dropped, state=self.life.state.value,
                             then=None if final else ("rejoined", "after a failure"))
        self._on_error(err)
        return final

    def _leave(self) -> None:
        """Give up every partition and the registration, committing nothing (our
        progress may be what failed); owner nodes go in this session, fenced."""
        dropped = self._handoff.drop_all()
        session = self._membership.forget()
        self._owners.abandon(pf.ownership for pf in dropped)
        if session is not None and self._client.connected:
            self._membership.delete(session)

    def _refuse(self, error: DuplicateInstanceError) -> None:
        """A duplicate static member: own nothing, touch nothing of the other's, close."""
        log.error("group %s consumer %s: %s", self.life.group, self.consumer_id, error)
        self._handoff.drop_all()
        self._owners.clear()
        self.failed = error
        self.life.set_state(State.CLOSED, "another live process has this instance_id")
        self._on_error(error)

    def _on_lost(self) -> None:
        """The session ended: stop everything, keep nothing from it, commit nothing."""
        owned = self._handoff.drop_all()
        self._view.reset()  # the session's watches ended with it
        self._owners.clear()  # the orphans are ephemeral: they ended with the session
        self._membership.forget()
        self.life.set_state(State.CONNECTING, "ZooKeeper session lost", new_generation=True)
        self.history.dropped("session_expired", f"dropped {len(owned)} partition(s) without "
                             "committing", self.life.generation,
                             released=[pf.key for pf in owned], state=self.life.state.value,
                             then=("session_expired", "rejoined in a new session"))
        log.warning("%s: ZooKeeper session lost; dropped %d partitions without committing",
                    self.life.label, len(owned))
        self._fetcher.resume()
        self.request_rebalance()

    def _resume_after_reconnect(self) -> None:
        if self.life.state is not State.SUSPENDED:
            return  # the drop and the return came in one turn: nothing was suspended
        self._settle("connection back in the same session")
        log.info("%s: ZooKeeper connection back in the same session; fetching resumes "
                 "(the group is read again to re-arm its watches)", self.life.label)

    def _shutdown(self, *, leave_for_good: bool) -> None:
        """Metaq's order: stop fetchers, commit, delete owner nodes, delete the id node.

        A static member leaving for a while writes its away time first, so the others
        hold its partitions from the moment they see it go; leaving for good, it
        deletes its record, and the others rebalance at once."""
        session = self._membership.session
        owned = self._subs.assigned_keys()
        self._handoff.stop_all()
        if self._client.connected and session is not None:
            try:
                self._membership.static.leaving(for_good=leave_for_good)
            except KazooException as e:
                log.warning("updating the static member record at close: %r", e)
            try:
                self._handoff.release_all()
            except (KazooException, MetaqError) as e:
                log.warning("releasing partitions at close failed: %r", e)
            try:
                self._owners.delete_orphans()
            except KazooException as e:
                log.warning("deleting owner nodes left by failed releases at close: %r", e)
            self.history.dropped("closing", "left for good" if leave_for_good else "closed",
                                 self.life.generation, released=owned, state="closed")
            self.history.flush(min(self._cfg.close_timeout, 5.0))
            self._membership.delete(session)
        self._subs.drop_all()
        self.life.set_state(State.CLOSED, "closed")

    # -- rebalance --------------------------------------------------------------

    def _rebalance(self, why: str) -> None:
        """A new generation: registered, the group read, a plan made and followed."""
        self._membership.register()
        self._owners.delete_orphans()
        self.life.set_state(State.REBALANCING, why, new_generation=True)
        self.history.begin()
        topics = self._subs.topics()
        topo = self._view.read(topics)
        held = self._membership.static.holds(topo, self.life.generation)
        plan = make_plan(topics, topo, held, self._strategy, me=self.consumer_id,
                         broadcast=self._cfg.broadcast, replicas=topo.replicas)
        release, claim = self._handoff.apply(plan)
        self._settle("rebalanced")
        self.history.rebalanced(
            why, topo, held, self.life.generation, plan=plan.target, released=release,
            claimed=[k for k in claim if self._subs.partition(*k) is not None],
            waiting=self._owners.waiting(), state=self.life.state.value)
        self.history.prune(topo)
        if release or claim:
            log.info("%s: owns %d, released %s, claimed %s, waiting for %s", self.life.label,
                     len(self._subs.assigned_keys()), names(release),
                     names(k for k in claim if self._subs.partition(*k) is not None),
                     names(self._owners.waiting()))

    def _settle(self, reason: str) -> None:
        """STABLE when every planned partition is ours, else CLAIMING."""
        if self._owners.waiting():
            self.life.set_state(State.CLAIMING, f"{reason}; waiting for partitions still held")
        else:
            self.life.set_state(State.STABLE, reason)

    def _retry_claims(self) -> None:
        """Claims whose time came (or whose holder's node went), against the last plan:
        no re-read of the group, which has not changed (its watches would have said)."""
        won = self._handoff.retry_claims()
        self._settle("claims retried")
        self.history.claimed_late(self.life.generation, plan=self._handoff.plan.target,
                                  won=won, waiting=self._owners.waiting(),
                                  state=self.life.state.value)
        if won:
            log.info("%s: claimed %s, waiting for %s", self.life.label, names(won),
                     names(self._owners.waiting()))
