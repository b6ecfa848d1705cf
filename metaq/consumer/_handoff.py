"""Handing partitions over: what a plan changes in this member.

The coordinator decides when; :class:`Handoff` moves the partitions.  Given a
new :class:`~metaq.consumer._plan.Plan`, partitions that leave are stopped
together (until no fetch runner holds one, so their progress is final), the
user's ``on_revoked`` runs for each, their final offsets are committed and
their owner nodes deleted (:meth:`OwnerNodes.release
<metaq.consumer._owners.OwnerNodes.release>`), and they leave the
subscription state.  Partitions that arrive are claimed (in broadcast mode
nothing is owned), their committed offsets loaded, put in the subscription
state, announced to ``on_assigned`` and handed to the fetcher.  Partitions that
stay keep fetching; only their broker's address is brought up to date (a broker
restarted on another port), and the fetcher is told each broker id's master and
slaves (it moves a partition between them keeping its position).  A user
callback that fails is reported, never stops a rebalance.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

from metaq._errors import CoordinationError
from metaq._types import PartitionKey
from metaq.consumer._commits import Committer
from metaq.consumer._config import ConsumerConfig
from metaq.consumer._lifecycle import Lifecycle
from metaq.consumer._offsets import OffsetStore, Ownership
from metaq.consumer._owners import OwnerNodes
from metaq.consumer._plan import Plan
from metaq.consumer._subscription import PartitionState, SubscriptionState
from zk_layout import BrokerReplicas

__all__ = ["Fetching", "Handoff", "names"]

log = logging.getLogger(__name__)


class Fetching(Protocol):
    """What the coordinator needs of the fetch manager."""

    def add(self, pf: PartitionState) -> None:
        """Start fetching a partition just claimed."""

    def remove(self, pf: PartitionState, timeout: float | None = None) -> bool:
        """Stop fetching it; True once no runner holds it (its progress is final)."""

    def remove_many(self, pfs: list[PartitionState], timeout: float | None = None) -> bool:
        """Stop fetching all of them at once; True once no runner holds any."""

    def route(self, brokers: Mapping[int, BrokerReplicas]) -> None:
        """Each broker id's master and slaves as just read (which one a partition is
        read from is the fetcher's choice)."""

    def suspend(self) -> None:
        """Hand out no partition (the ZooKeeper connection is uncertain)."""

    def resume(self) -> None:
        """Hand them out again."""


class Handoff:
    """Partitions in and out of this member, following the last plan."""

    def __init__(self, subscriptions: SubscriptionState, fetcher: Fetching, *,
                 owners: OwnerNodes, commits: Committer, store: OffsetStore,
                 config: ConsumerConfig, life: Lifecycle,
                 on_error: Callable[[BaseException], None],
                 on_assigned: Callable[[str, str], None] | None,
                 on_revoked: Callable[[str, str], None] | None) -> None:
        self._subs = subscriptions
        self._fetcher = fetcher
        self._owners = owners
        self._commits = commits
        self._store = store
        self._cfg = config
        self._life = life
        self._on_error = on_error
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked
        #: the last plan (claim retries between rebalances use it; only a watch on the
        #: group changes it)
        self.plan = Plan()

    def apply(self, plan: Plan) -> tuple[list[PartitionKey], list[PartitionKey]]:
        """Follow a new plan: release what left it, claim what came (but claims still
        backing off for a known holder, which wait for their time or their holder's
        node); returns (released, to claim)."""
        self.plan = plan
        self._fetcher.route(plan.replicas)  # first: partitions claimed below start right
        release, claim = plan.moves(PartitionKey(*k) for k in self._subs.assigned_keys())
        self.release(release)
        self._owners.keep_only(plan.target)
        self._claim(self._owners.not_backing_off(claim, time.monotonic()))
        for pf in self._subs.assigned():  # brokers may move (restart on a new port)
            addr = plan.brokers.get(pf.broker_id)
            if addr != pf.broker_address:
                pf.broker_moved(addr)
        return release, claim

    def retry_claims(self) -> list[PartitionKey]:
        """Claims whose time came (or whose holder's node went), against the last plan;
        returns those won."""
        due = self._owners.due(time.monotonic())
        self._claim(due)
        waiting = self._owners.waiting()
        return [k for k in due if k not in waiting]

    def release(self, keys: list[PartitionKey]) -> None:
        """Give partitions up: stop them all, then commit each one's final offset and
        delete its owner node (one fenced transaction per partition, all pipelined)."""
        if not keys:
            return
        pfs = [pf for k in keys if (pf := self._subs.partition(*k)) is not None]
        if not self._fetcher.remove_many(pfs, timeout=self._cfg.close_timeout):
            busy = [pf.key for pf in pfs if pf.busy]
            raise CoordinationError(f"partitions {names(busy)} still busy after close_timeout")
        for pf in pfs:
            self._callback(self._on_revoked, pf.key)
            pf.drain()
        failed = self._owners.release(pfs, self._commits.commit)
        for pf in pfs:
            self._subs.revoke(pf.key)
        log.debug("%s: released %s", self._life.label, names(keys))
        if failed is not None:
            raise failed

    def release_all(self) -> None:
        self.release([PartitionKey(*k) for k in self._subs.assigned_keys()])

    def stop_all(self) -> list[PartitionState]:
        """Stop fetching every owned partition (they stay owned); returns them."""
        owned = self._subs.assigned()
        self._fetcher.remove_many(owned, timeout=self._cfg.close_timeout)
        return owned

    def drop_all(self) -> list[PartitionState]:
        """Stop and forget every partition, releasing nothing and committing nothing
        (the session ended, the member failed or was refused); returns them."""
        self.stop_all()
        return self._subs.drop_all()

    def _claim(self, keys: list[PartitionKey]) -> None:
        """Claim partitions (owner nodes; none in broadcast mode) and fetch those won."""
        if not keys:
            return
        won: dict[PartitionKey, Ownership | None]
        won = {k: None for k in keys} if self._cfg.broadcast else dict(self._owners.claim(keys))
        keys = [k for k in keys if k in won]
        if not keys:
            return
        stored = self._store.load_many(keys)
        for k in keys:
            broker_id = self.plan.target[k]
            pf = self._subs.assign(k[0], k[1], broker_id, self.plan.brokers.get(broker_id),
                                   stored.get(k), won[k])
            self._callback(self._on_assigned, k)
            self._fetcher.add(pf)

    def _callback(self, fn: Callable[[str, str], None] | None, key: PartitionKey) -> None:
        """Run a user's on_assigned/on_revoked: its failure is reported, never stops a
        rebalance."""
        if fn is None:
            return
        try:
            fn(*key)
        except Exception as e:  # noqa: BLE001 - a user callback must not stop a rebalance
            log.exception("callback %r failed for %s/%s", fn, *key)
            self._on_error(e)


def names(keys: Iterable[PartitionKey]) -> str:
    """``[topic/partition, ...]`` for a log line."""
    return "[" + ", ".join(f"{t}/{p}" for t, p in keys) + "]"
