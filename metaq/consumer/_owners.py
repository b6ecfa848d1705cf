"""Owner nodes: this member's claims on partitions in ZooKeeper, and their release.

A claim creates the partition's ephemeral owner node
(``consumers/<group>/owners/<topic>/<partition>``, holding our consumer id),
pipelined for any number of partitions on the one connection, and returns the
:class:`~metaq.consumer._offsets.Ownership` that fences later writes.  A node
still held by its old owner is *waited for*: a watch on it retries the claim the
moment it goes (the coordinator's ``on_owner_event``), with backoff and jitter as
a safety net, until it succeeds or the plan no longer has the partition.

A release writes each partition's final offset and deletes its owner node in one
transaction (the delete, conditional on the node's version, fences the write),
all pipelined; with an offset store other than ZooKeeper's, the offsets are
committed first, then the nodes deleted, fenced by the session.  A node whose
delete did not get through (the connection dropped mid-release, in a session
that went on) is an *orphan*, deleted at the next rebalance: otherwise another
member would wait for it for good.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, KazooException, NodeExistsError, NoNodeError

from metaq._types import PartitionKey
from metaq.consumer._backoff import Backoff
from metaq.consumer._config import ConsumerConfig
from metaq.consumer._lifecycle import Lifecycle
from metaq.consumer._offsets import (
    OffsetStore,
    Ownership,
    SessionFence,
    StaleOwnershipError,
    ZkOffsetStore,
)
from metaq.consumer._subscription import PartitionState
from zk_layout import Layout

__all__ = ["OwnerNodes"]

log = logging.getLogger(__name__)


@dataclass
class _Wait:
    """A claim waiting for a partition's old owner to let go."""

    holder: str | None  # its consumer id, None when not known (released meanwhile)
    backoff: Backoff


class OwnerNodes:
    """Claims (and waits for partitions still held), releases and orphans."""

    def __init__(self, client: KazooClient, layout: Layout, group: str, consumer_id: str, *,
                 fence: SessionFence, store: OffsetStore, config: ConsumerConfig,
                 life: Lifecycle, on_owner_event: Callable[..., object]) -> None:
        """``on_owner_event``: the watch callback on an owner node we wait for (it must
        only queue a retry: it runs in kazoo's event thread)."""
        self._client = client
        self._layout = layout
        self._group = group
        self._data = consumer_id.encode("utf-8")
        self._fence = fence
        self._store = store
        self._cfg = config
        self._life = life
        self._on_owner_event = on_owner_event
        self._waits: dict[PartitionKey, _Wait] = {}
        self._orphans: dict[PartitionKey, Ownership] = {}

    # -- claims waiting for their old owner ---------------------------------------------

    def waiting(self) -> dict[PartitionKey, str | None]:
        """Partitions planned for us still held by another member: key -> holder."""
        return {k: w.holder for k, w in list(self._waits.items())}

    def due(self, now: float) -> list[PartitionKey]:
        """Waiting claims whose time came (or whose holder's node went)."""
        return [k for k, w in self._waits.items() if w.backoff.due(now)]

    def not_backing_off(self, keys: Iterable[PartitionKey], now: float) -> list[PartitionKey]:
        """Of ``keys``, those not waiting out a backoff for a known holder (a rebalance
        tries those at once; the others wait for their time or their holder's node)."""
        out = []
        for k in keys:
            w = self._waits.get(k)
            if w is None or w.holder is None or not w.backoff.waiting(now):
                out.append(k)
        return out

    def next_try(self) -> float | None:
        """When the first waiting claim is tried again (time.monotonic)."""
        times = [w.backoff.next_at for w in self._waits.values() if w.backoff.next_at is not None]
        return min(times) if times else None

    def wake(self) -> None:
        """An owner node we wait for changed: try every waiting claim at once."""
        for w in self._waits.values():
            w.backoff.now()

    def keep_only(self, planned: Iterable[PartitionKey]) -> None:
        """Stop waiting for partitions the plan no longer has."""
        planned = set(planned)
        for key in [k for k in self._waits if k not in planned]:
            del self._waits[key]

    def _wait_for(self, key: PartitionKey, holder: str | None) -> None:
        w = self._waits.get(key)
        if w is None:
            w = self._waits[key] = _Wait(holder, Backoff(
                self._cfg.claim_backoff, self._cfg.claim_backoff_max, jitter=(0.5, 1.0),
                max_doublings=10))
        w.holder = holder
        w.backoff.failed()
        n = w.backoff.attempts
        if n in (1, 10) or n % 50 == 0:
            log.info("%s: %s/%s still owned by %s (attempt %d); waiting for its release",
                     self._life.label, key[0], key[1], holder, n)

    # -- claiming -----------------------------------------------------------------------

    def claim(self, keys: list[PartitionKey]) -> dict[PartitionKey, Ownership]:
        """Create the owner nodes of ``keys``, pipelined; returns those won, with their
        ownership.  One still held arms a watch on its owner node and waits (see
        :meth:`waiting`); won ones stop waiting."""
        if not keys:
            return {}
        epoch = self._fence.epoch
        session = self._client.client_id[0]
        paths = {k: self._layout.owner(self._group, *k) for k in keys}
        won: dict[PartitionKey, int] = {}
        todo = list(keys)
        for _ in range(3):  # a node released between our create and our get: at once again
            creates = {k: self._client.create_async(paths[k], self._data, ephemeral=True,
                                                    makepath=True) for k in todo}
            held: dict[PartitionKey, object] = {}
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
                if holder == self._data and stat.ephemeralOwner == session:
                    won[k] = stat.version  # ours already (a rebalance retried after a failure)
                else:
                    self._wait_for(k, holder.decode("utf-8", "replace"))
            if not todo:
                break
        for k in todo:
            self._wait_for(k, None)
        for k in won:
            self._waits.pop(k, None)
        return {k: Ownership(owner_path=paths[k], version=v, epoch=epoch)
                for k, v in won.items()}

    # -- releasing ----------------------------------------------------------------------

    def release(self, pfs: list[PartitionState],
                commit: Callable[[PartitionState], None]) -> BaseException | None:
        """Hand back partitions whose fetching stopped: each one's final offset is
        written and its owner node deleted, fenced; the offsets written are marked
        committed.  ``commit`` commits one partition (an offset store other than
        ZooKeeper's).  Returns the failure that left some owner node's fate unknown
        (that node is kept as an orphan), or None."""
        finals: dict[PartitionKey, tuple[int, int] | None] = {}
        for pf in pfs:
            now = pf.commit_position()
            finals[pf.key] = now if now != pf.committed and now[1] >= 0 else None
        owned = {pf.key: pf.ownership for pf in pfs}
        outcome: dict[PartitionKey, BaseException | None] = {}
        if isinstance(self._store, ZkOffsetStore):
            items = [(k[0], k[1], finals[k], o) for k, o in owned.items() if o is not None]
            outcome = self._store.commit_and_release(items) if items else {}
        else:
            for pf in pfs:
                commit(pf)
            pending = {}
            with self._fence.lock:
                for k, o in owned.items():
                    if o is not None and self._fence.epoch == o.epoch:
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
            err = outcome.get(pf.key)
            if isinstance(err, StaleOwnershipError):
                log.warning("%s: %s", self._life.label, err)
            elif err is not None:
                ownership = owned[pf.key]
                assert ownership is not None
                self._orphans[pf.key] = ownership  # deleted by the next rebalance
                failed = err
            elif (final := finals[pf.key]) is not None:
                pf.mark_committed(final)
        return failed

    def delete_orphans(self) -> None:
        """Delete the owner nodes a failed release left behind, in the session that
        made them (fenced by its epoch: after a session loss they are gone already)."""
        for key, ownership in list(self._orphans.items()):
            with self._fence.lock:
                if self._fence.epoch != ownership.epoch:
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
            log.info("%s: released %s/%s (its owner node, left by a release cut short)",
                     self._life.label, *key)

    def abandon(self, ownerships: Iterable[Ownership | None]) -> None:
        """Leaving after a failure: delete these owner nodes and the orphans in this
        session (fenced), committing nothing; failures are ignored (ephemeral nodes go
        with the session anyway).  Nothing is waited for afterwards."""
        owned = [*ownerships, *self._orphans.values()]
        self.clear()
        if not self._client.connected:
            return
        for ownership in owned:
            with self._fence.lock:
                if ownership is None or self._fence.epoch != ownership.epoch:
                    continue
                pending = self._client.delete_async(ownership.owner_path, ownership.version)
            try:
                pending.get(timeout=self._cfg.zk_connect_timeout)
            except (NoNodeError, KazooException):
                pass

    def clear(self) -> None:
        """Forget the waiting claims and the orphans (the session that made the
        orphans ended, or they were deleted)."""
        self._waits.clear()
        self._orphans.clear()

