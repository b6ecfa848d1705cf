"""Static membership: a member's own record, and the holds every member honours.

A static member (``ConsumerConfig.instance_id``) keeps a persistent record at
``consumers/<group>/static/<consumerId>`` (zk_layout's :class:`StaticMember`).
When it goes away without leaving for good, every other member, static or not,
keeps counting it in its plan for ``grace`` seconds from the time the record
says it went: its partitions are *held*, fetched by nobody, and nobody else
moves.  Back within the grace it registers the same id and claims the same
share; after the grace the first member to see the deadline pass deletes the
record, and every member, watching the records, plans without it.

Transitions of one record (written by the member itself unless said)::

    (none) --register--> present (awaySinceMs null)
    present --close(leave=False)--> away since now
    present --id node gone (kill -9, pause past the session)--> away since now
                                    (written by the first member to see it)
    away --register within the grace--> present
    away --grace over--> (deleted by the first member to see it)
    present | away --close(leave=True)--> (deleted)

Writes by other members are conditional on the version they read, so the member
itself coming back always wins a race.  A second live process with the same
instance id finds the id node held by another session for longer than any
session timeout and is refused (:class:`~metaq.DuplicateInstanceError`).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError

from metaq._errors import DuplicateInstanceError
from metaq.consumer._config import ConsumerConfig
from metaq.consumer._view import GroupView
from zk_layout import Layout, StaticMember, Topology, encode_static_member, iso_ms

__all__ = ["StaticMembership"]

log = logging.getLogger(__name__)

_HOST = socket.gethostname()
#: ZooKeeper raises a session timeout below 2 ticks (4 s with its default tick) to that.
_ZK_MIN_SESSION = 4.0
#: Margin past the holder's session timeout before a held id means a live duplicate.
_DUPLICATE_MARGIN = 2.0


class StaticMembership:
    """This member's static record (when it has an ``instance_id``) and the holds it
    honours for the group's away static members (always)."""

    def __init__(self, client: KazooClient, layout: Layout, group: str, consumer_id: str,
                 config: ConsumerConfig, view: GroupView,
                 topics: Callable[[], list[str]]) -> None:
        self._client = client
        self._layout = layout
        self._group = group
        self._cid = consumer_id
        self._cfg = config
        self._view = view
        self._topics = topics
        #: this member is static
        self.enabled = config.instance_id is not None
        #: away members held now: consumer id -> held until (epoch ms)
        self.held: dict[str, int] = {}
        #: when the first hold ends (monotonic), 0 when none
        self.next_check = 0.0
        self._conflict_since: float | None = None

    # -- our own record ---------------------------------------------------------------

    def _record(self, away_since_ms: int | None) -> StaticMember:
        assert self._cfg.instance_id is not None
        return StaticMember(
            instance_id=self._cfg.instance_id, consumer_id=self._cid,
            topics=tuple(self._topics()), grace_ms=int(self._cfg.static_grace * 1000),
            session_timeout_ms=int(self._cfg.zk_session_timeout * 1000),
            away_since_ms=away_since_ms, host=_HOST)

    def _write(self, away_since_ms: int | None) -> None:
        """Create or overwrite our record (persistent)."""
        path = self._layout.static_member(self._group, self._cid)
        data = encode_static_member(self._record(away_since_ms))
        try:
            self._client.set(path, data)
        except NoNodeError:
            try:
                self._client.create(path, data, makepath=True)
            except NodeExistsError:
                self._client.set(path, data)
        self._view.forget_static(self._cid)

    def registered(self) -> None:
        """Our id node is ours (a new session): we are present."""
        self._conflict_since = None
        if self.enabled:
            self._write(away_since_ms=None)

    def leaving(self, *, for_good: bool) -> None:
        """Closing: hold our partitions for the grace from now, or leave for good."""
        if not self.enabled:
            return
        if for_good:
            try:
                self._client.delete(self._layout.static_member(self._group, self._cid))
            except NoNodeError:
                pass
        else:
            self._write(away_since_ms=int(time.time() * 1000))

    def conflict(self, holder_session: int) -> None:
        """Our id node is held by another session.  A predecessor (this instance killed
        and restarted) lets go within its session timeout; held longer, it is a live
        process with the same instance id: :class:`DuplicateInstanceError`."""
        if not self.enabled:
            return
        now = time.monotonic()
        if self._conflict_since is None:
            self._conflict_since = now
        record = self._view.read(self._topics()).static.get(self._cid)
        theirs = record[0].session_timeout_ms / 1000 if record else 0.0
        limit = max(theirs, self._cfg.zk_session_timeout, _ZK_MIN_SESSION) + _DUPLICATE_MARGIN
        if now - self._conflict_since > limit:
            raise DuplicateInstanceError(
                f"instance_id {self._cfg.instance_id!r} of group {self._group} is in use: "
                f"consumer id {self._cid} has been held by another live ZooKeeper session "
                f"(0x{holder_session:x}) for {now - self._conflict_since:.1f}s, longer than "
                f"its session timeout; this member stays out (it owns nothing). Give each "
                f"process its own instance_id.")

    # -- the holds --------------------------------------------------------------------

    def holds(self, topo: Topology, gen: int) -> dict[str, StaticMember]:
        """The away static members whose partitions stay held for them now.

        A record whose member has no id node is away: since the time written in it,
        or, when none is written yet (the member died), since now, which we write
        (conditional on the version we read).  Past its grace a record is deleted
        (also conditional).  Our own record, marked away while we are here (a race
        with a member that saw us gone), is put right."""
        now_ms = int(time.time() * 1000)
        held: dict[str, StaticMember] = {}
        until_min: int | None = None
        for cid, (rec, version) in topo.static.items():
            path = self._layout.static_member(self._group, cid)
            if cid in topo.member_topics:
                if cid == self._cid and self.enabled and rec.away_since_ms is not None:
                    self._write(away_since_ms=None)
                continue
            if cid == self._cid:
                continue  # our own, while we are not registered: nothing to hold for us
            if rec.away_since_ms is None:
                rec = StaticMember(**{**rec.__dict__, "away_since_ms": now_ms})
                self._client.set_async(path, encode_static_member(rec), version)
            until = rec.held_until_ms
            assert until is not None
            if now_ms < until:
                held[cid] = rec
                until_min = until if until_min is None else min(until_min, until)
                if self.held.get(cid) != until:
                    log.info("group %s consumer %s gen %d: static member %s is away; its "
                             "partitions are held for it until %s", self._group, self._cid,
                             gen, cid, iso_ms(until))
            else:
                if cid in self.held:
                    log.info("group %s consumer %s gen %d: static member %s did not come "
                             "back by %s; the group plans without it", self._group,
                             self._cid, gen, cid, iso_ms(until))
                self._client.delete_async(path, version)
        self.held = {cid: rec.held_until_ms or 0 for cid, rec in held.items()}
        self.next_check = 0.0 if until_min is None else \
            time.monotonic() + max(0.0, (until_min - now_ms) / 1000) + 0.005
        return held
