"""The rebalance history this member writes: each rebalance it takes part in, kept in
ZooKeeper after it is gone (``consumers/<group>/history/<consumerId>``; the node, its
codec, its bound and why it lives there: :mod:`zk_layout._history`).

:class:`RebalanceHistory` is told by the coordinator thread what each rebalance
planned and moved, and works out *why* it happened from what changed since the
one before (members that joined or left, a topic's partitions, a broker's
address, the owners a sticky plan reads) or from what the coordinator says
happened to this member itself (started, session expired, failed, closing, a
static member's hold ended, the connection back).  It keeps the last
``history_records`` records and, after each, rewrites its node with one
asynchronous ``set`` (``create`` the first time): nothing waits for ZooKeeper
on the rebalance's path, and the completion, run in kazoo's callback thread,
only sends the newest data once more if records came meanwhile.  The first
rebalance also reads the node once (asynchronously, from its start to its end):
a member restarted with the same consumer id (a static member, a fixed
``consumer_id``) goes on with the records of the one before, rather than erasing
what explains its restart.  A write that
fails (the connection dropped) is repaired by the next one, which carries every
kept record.  Only the close waits for its write (briefly), since the client may
be stopped right after.

The group's bound (nodes and bytes, ``history_max_members`` /
``history_max_bytes``) is kept by one member: the first live one in Metaq's
order, after its own rebalances (:func:`zk_layout.prune_history`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException, NodeExistsError, NoNodeError

from metaq._types import PartitionKey
from metaq.consumer._config import ConsumerConfig
from zk_layout import (
    Layout,
    RebalanceRecord,
    Topology,
    decode_history,
    encode_history,
    prune_history,
    sort_consumer_ids,
)

__all__ = ["RebalanceHistory", "HOLD_ENDED", "CONNECTION_BACK"]

log = logging.getLogger(__name__)

#: The coordinator's reasons that are triggers of their own.
HOLD_ENDED = "a static member's hold ended"
CONNECTION_BACK = "connection back"
_WHY = {HOLD_ENDED: "static_hold_ended", CONNECTION_BACK: "connection_back", "retry": "retry"}


@dataclass
class _Seen:
    """What one rebalance planned with, to tell the next one what changed."""

    live: frozenset[str]  # members with an id node
    held: frozenset[str]  # away static members whose partitions are held for them
    partitions: dict[str, tuple[str, ...]]
    brokers: dict[int, object]
    owners: dict[str, dict[str, str]] = field(default_factory=dict)

    @classmethod
    def of(cls, topo: Topology, held: Iterable[str]) -> _Seen:
        return cls(live=frozenset(topo.member_topics), held=frozenset(held),
                   partitions={t: tuple(p) for t, p in topo.partitions.items()},
                   brokers=dict(getattr(topo, "replicas", None) or topo.brokers),
                   owners={t: dict(o) for t, o in topo.owners.items()})


def _names(keys: Iterable[PartitionKey | tuple[str, str]]) -> tuple[str, ...]:
    return tuple(f"{t}/{p}" for t, p in keys)


def _list(ids: Iterable[str], limit: int = 8) -> str:
    ids = list(ids)
    return ", ".join(ids[:limit]) + (f" and {len(ids) - limit} more" if len(ids) > limit else "")


def _where(replicas: object) -> str:
    """A broker id's master (and how many slaves) for a detail line."""
    if replicas is None:
        return "absent"
    master = getattr(replicas, "master", replicas)
    slaves = getattr(replicas, "slaves", ())
    text = "no master" if not master else f"{master[0]}:{master[1]}"
    return text + (f" +{len(slaves)} slave(s)" if slaves else "")


class RebalanceHistory:
    """This member's rebalance records and the writes of its history node."""

    def __init__(self, client: KazooClient, layout: Layout, group: str, consumer_id: str,
                 config: ConsumerConfig) -> None:
        self._client = client
        self._layout = layout
        self._group = group
        self._cid = consumer_id
        self._cfg = config
        self._strategy = config.strategy
        self.enabled = config.history_records > 0
        self._path = layout.history_member(group, consumer_id)
        self._records: deque[RebalanceRecord] = deque(maxlen=max(1, config.history_records))
        self._seen: _Seen | None = None
        #: what happened to this member that the next rebalance is the answer to
        self._cause: tuple[str, str] | None = None
        self._start = (time.monotonic(), int(time.time() * 1000))
        self._lock = threading.Condition()
        #: the newest encoding not yet sent, numbered (a failed older one is not resent)
        self._data: tuple[int, bytes] | None = None
        self._seq = 0
        self._inflight = False
        self._closed = False  # flushed at close: nothing sent after
        #: the read of the node as a previous process with our id left it (first rebalance)
        self._previous: object | None = None
        self._loaded = False
        #: writes that did not get through (for tests and logs)
        self.failed_writes = 0

    # -- what the coordinator tells ---------------------------------------------------

    def begin(self) -> None:
        """A rebalance begins now."""
        self._start = (time.monotonic(), int(time.time() * 1000))
        if self.enabled and self._previous is None and self._client.connected:
            try:
                self._previous = self._client.get_async(self._path)
            except Exception:  # noqa: BLE001 - read it next time
                self._previous = None

    def _take_previous(self) -> None:
        """The records a previous process with our consumer id left, kept before ours
        (read once; garbage, or a failed read, starts afresh)."""
        if self._loaded or self._previous is None:
            return
        self._loaded = True
        try:
            data, stat = self._previous.get(timeout=2.0)  # type: ignore[attr-defined]
            old = [r for r in decode_history(data, self._path, stat.mtime) if not r.damaged]
        except NoNodeError:
            return
        except Exception as e:  # noqa: BLE001 - garbage or no answer: overwritten
            log.info("group %s consumer %s: the rebalance history left by a previous "
                     "process is not kept: %r", self._group, self._cid, e)
            return
        with self._lock:
            self._records = deque(old + list(self._records), maxlen=self._records.maxlen)

    def rebalanced(self, why: str, topo: Topology, held: Iterable[str], generation: int, *,
                   plan: Iterable[PartitionKey], released: Iterable[PartitionKey],
                   claimed: Iterable[PartitionKey], waiting: Iterable[PartitionKey],
                   state: str) -> RebalanceRecord | None:
        """A rebalance (begun at :meth:`begin`) ended: record it and why it happened."""
        if not self.enabled:
            return None
        seen = _Seen.of(topo, held)
        trigger, detail = self._why(why, seen)
        self._seen = seen
        return self._add(generation, trigger, detail, state=state, plan=_names(plan),
                         released=_names(released), claimed=_names(claimed),
                         waiting=_names(waiting))

    def claimed_late(self, generation: int, *, plan: Iterable[PartitionKey],
                     won: Iterable[PartitionKey], waiting: Iterable[PartitionKey],
                     state: str) -> RebalanceRecord | None:
        """Claims waiting for an old owner were won (its owner node went)."""
        won = _names(won)
        if not self.enabled or not won:
            return None
        self.begin()
        return self._add(generation, "owner_vanished",
                         f"claimed {_list(won)} once the old owner's node went", state=state,
                         plan=_names(plan), claimed=won, waiting=_names(waiting))

    def dropped(self, trigger: str, detail: str, generation: int, *,
                released: Iterable[PartitionKey], state: str,
                then: tuple[str, str] | None = None) -> RebalanceRecord | None:
        """This member let go of everything (``session_expired``, ``failed``,
        ``closing``); ``then``: the trigger and detail of its next rebalance."""
        if not self.enabled:
            return None
        self.begin()
        self._cause = then
        self._seen = None if then is not None else self._seen
        return self._add(generation, trigger, detail, state=state, released=_names(released))

    def records(self) -> list[RebalanceRecord]:
        """The records kept in memory, oldest first."""
        with self._lock:
            return list(self._records)

    def flush(self, timeout: float) -> bool:
        """Write the node now and wait for it (the close: the client may stop next);
        True when written.  A write under way is waited for first (it carries older
        records), and no other is sent after this one."""
        if not self.enabled or not self._client.connected:
            return False
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closed = True
            self._data = None
            data = encode_history(self._cid, list(self._records),
                                  max_records=self._cfg.history_records,
                                  max_bytes=self._cfg.history_node_bytes)
            while self._inflight and (left := deadline - time.monotonic()) > 0:
                self._lock.wait(left)
        try:
            left = max(0.1, deadline - time.monotonic())
            try:
                self._client.set_async(self._path, data).get(timeout=left)
            except NoNodeError:
                try:
                    self._client.create_async(self._path, data, makepath=True).get(
                        timeout=left)
                except NodeExistsError:
                    self._client.set_async(self._path, data).get(timeout=left)
            return True
        except Exception as e:  # noqa: BLE001 - never fail a close for the history
            self.failed_writes += 1
            log.warning("group %s consumer %s: writing the rebalance history at close "
                        "failed: %r", self._group, self._cid, e)
            return False

    def prune(self, topo: Topology) -> None:
        """Keep the group's history within its bound, when this member is the first live
        one in Metaq's order (one member does it, not all)."""
        if not self.enabled:
            return
        live = sort_consumer_ids(topo.member_topics)
        if not live or live[0] != self._cid:
            return
        try:
            gone = prune_history(self._client, self._layout, self._group, keep=live,
                                 protect=self._cid, max_members=self._cfg.history_max_members,
                                 max_total_bytes=self._cfg.history_max_bytes,
                                 node_bytes=self._cfg.history_node_bytes)
        except KazooException as e:
            log.info("group %s consumer %s: pruning the rebalance history failed (%r); "
                     "next rebalance tries again", self._group, self._cid, e)
            return
        if gone:
            log.info("group %s consumer %s: deleted the rebalance history of %s (the "
                     "group's bound: %d nodes, %d bytes)", self._group, self._cid,
                     _list(gone), self._cfg.history_max_members, self._cfg.history_max_bytes)

    # -- why -------------------------------------------------------------------------

    def _why(self, why: str, seen: _Seen) -> tuple[str, str]:
        """The trigger (the first cause found, most telling first) and every cause's
        detail."""
        causes: list[tuple[str, str]] = []
        if self._cause is not None:
            causes.append(self._cause)
            self._cause = None
        prev = self._seen
        if prev is None:
            if not causes:
                causes.append(("started", f"joined with {len(seen.live)} member(s) seen"))
        else:
            left = sort_consumer_ids(prev.live - seen.live - {self._cid})
            joined = sort_consumer_ids(seen.live - prev.live - {self._cid})
            ended = sort_consumer_ids(prev.held - seen.held - seen.live)
            if left:
                causes.append(("member_left", "left: " + _list(
                    f"{c} (static: its partitions held for it)" if c in seen.held else c
                    for c in left)))
            if joined:
                causes.append(("member_joined", f"joined: {_list(joined)}"))
            if ended:
                causes.append(("static_hold_ended", f"hold ended: {_list(ended)}"))
            parts = [f"{t}: {len(prev.partitions.get(t, ()))} -> {len(p)} partitions"
                     for t, p in sorted(seen.partitions.items())
                     if t in prev.partitions and prev.partitions[t] != p]
            if parts:
                causes.append(("partitions_changed", "; ".join(parts)))
            moved = sorted(b for b in set(prev.brokers) | set(seen.brokers)
                           if prev.brokers.get(b) != seen.brokers.get(b))
            if moved:
                causes.append(("broker_changed", "; ".join(
                    f"broker {b}: {_where(prev.brokers.get(b))} -> {_where(seen.brokers.get(b))}"
                    for b in moved[:8])))
            if prev.owners != seen.owners and seen.owners:
                causes.append(("owners_changed", "owner nodes changed"))
        if why in _WHY and all(t != _WHY[why] for t, _ in causes):
            causes.append((_WHY[why], why))
        if not causes:
            causes.append(("unchanged", why))
        return causes[0][0], "; ".join(d for _, d in causes if d)

    # -- the record and its write ------------------------------------------------------

    def _add(self, generation: int, trigger: str, detail: str, *, state: str,
             plan: tuple[str, ...] = (), released: tuple[str, ...] = (),
             claimed: tuple[str, ...] = (), waiting: tuple[str, ...] = ()) -> RebalanceRecord:
        began, at_ms = self._start
        record = RebalanceRecord(
            consumer_id=self._cid, generation=generation, time_ms=at_ms,
            duration_ms=max(0, round((time.monotonic() - began) * 1000)), trigger=trigger,
            detail=detail, state=state, strategy=self._strategy, plan=plan,
            released=released, claimed=claimed, waiting=waiting, path=self._path)
        try:
            self._take_previous()
            with self._lock:
                self._records.append(record)
                self._seq += 1
                self._data = (self._seq, encode_history(
                    self._cid, list(self._records), max_records=self._cfg.history_records,
                    max_bytes=self._cfg.history_node_bytes))
            self._send()
        except Exception:  # noqa: BLE001 - the history never stops a rebalance
            log.exception("group %s consumer %s: recording a rebalance failed", self._group,
                          self._cid)
        return record

    def _send(self) -> None:
        """Send the newest encoding unless a write is under way (its completion sends
        it then); while disconnected it waits for the next record."""
        with self._lock:
            if (self._inflight or self._closed or self._data is None
                    or not self._client.connected):
                return
            (seq, data), self._data, self._inflight = self._data, None, True
        try:
            self._client.set_async(self._path, data).rawlink(
                lambda r: self._after_set(r, seq, data))
        except Exception as e:  # noqa: BLE001 - the connection went between check and send
            self._failed(e, seq, data)

    def _after_set(self, result: object, seq: int, data: bytes) -> None:
        """kazoo's callback thread: only sends, never waits."""
        try:
            result.get()  # type: ignore[attr-defined]
        except NoNodeError:
            try:
                self._client.create_async(self._path, data, makepath=True).rawlink(
                    lambda r: self._after_create(r, seq, data))
            except Exception as e:  # noqa: BLE001
                self._failed(e, seq, data)
            return
        except Exception as e:  # noqa: BLE001
            self._failed(e, seq, data)
            return
        self._done()

    def _after_create(self, result: object, seq: int, data: bytes) -> None:
        try:
            result.get()  # type: ignore[attr-defined]
        except NodeExistsError:  # made meanwhile: set it (now that it exists)
            self._failed(None, seq, data)
            return
        except Exception as e:  # noqa: BLE001
            self._failed(e, seq, data)
            return
        self._done()

    def _failed(self, error: BaseException | None, seq: int, data: bytes) -> None:
        """Keep ``data`` to send again, unless newer records replaced it meanwhile."""
        with self._lock:
            if error is not None:
                self.failed_writes += 1
            if self._data is None and seq == self._seq:
                self._data = (seq, data)  # sent again with the next record (or now)
        if error is not None:
            log.debug("group %s consumer %s: rebalance history write failed: %r",
                      self._group, self._cid, error)
        self._done(retry=error is None)

    def _done(self, retry: bool = True) -> None:
        with self._lock:
            self._inflight = False
            self._lock.notify_all()
        if retry:
            self._send()
