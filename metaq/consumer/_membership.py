"""Membership: this member's place in its group, its ephemeral id node.

:class:`Membership` registers the id node (``consumers/<group>/ids/<consumerId>``,
holding the subscribed topics) once per ZooKeeper session, knows in which
session it did, deletes it on leaving (only if that session holds it: never a
duplicate's, nor a predecessor's still alive), and pings it as the heartbeat
that renews the delivery lease (see :mod:`~metaq.consumer._lease`).  A static
member's record (:class:`~metaq.consumer._static.StaticMembership`) goes with
it: written when registered, consulted when the id is held by another session.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, KazooException, NodeExistsError, NoNodeError
from kazoo.security import OPEN_ACL_UNSAFE

from metaq._errors import CoordinationError
from metaq.consumer._config import ConsumerConfig
from metaq.consumer._lease import Lease
from metaq.consumer._static import StaticMembership
from metaq.consumer._view import GroupView
from zk_layout import Layout, encode_topic_list

__all__ = ["Membership"]

log = logging.getLogger(__name__)


class Membership:
    """Our id node: registered in which session, deleted on leaving, pinged as the
    lease's heartbeat; and the static record that goes with it (:attr:`static`)."""

    def __init__(self, client: KazooClient, layout: Layout, group: str, consumer_id: str,
                 config: ConsumerConfig, *, view: GroupView, topics: Callable[[], list[str]],
                 lease: Lease, on_freed: Callable[..., object]) -> None:
        """``on_freed``: a watch callback, called when an id node held by another
        session goes (register again then)."""
        self._client = client
        self._layout = layout
        self._group = group
        self._cid = consumer_id
        self._cfg = config
        self._topics = topics
        self._lease = lease
        self._on_freed = on_freed
        self.path = layout.consumer_id(group, consumer_id)
        self.static = StaticMembership(client, layout, group, consumer_id, config, view,
                                       topics)
        #: the ZooKeeper session our id node was registered in (None: not registered)
        self.session: int | None = None
        #: when the next heartbeat is due (time.monotonic); 0.0: at once
        self.next_heartbeat = 0.0

    def current_session(self) -> int | None:
        return self._client.client_id[0] if self._client.client_id else None

    def registered(self) -> bool:
        """Our id node is registered in the session we are in now."""
        session = self.current_session()
        return session is not None and session == self.session

    def register(self) -> None:
        """Register the id node in the current session (nothing if done already).

        Raises :class:`~metaq.CoordinationError` while another session holds our id
        (a predecessor killed and restarted: its node goes within its session timeout;
        ``on_freed`` is called when it does), or
        :class:`~metaq.DuplicateInstanceError` when a static member's id has been held
        for longer than any session timeout (a live duplicate)."""
        session = self.current_session()
        if session is not None and session == self.session:
            return
        data = encode_topic_list(self._topics())
        # Parents shared with other components stay open; with an ACL mode, the group's
        # own nodes (created below with the client's default ACL) are protected.
        security = self._cfg.zk_security
        self._client.ensure_path(self._layout.consumer_groups(),
                                 acl=security.shared_acl() if security else OPEN_ACL_UNSAFE)
        try:
            self._client.create(self.path, data, ephemeral=True, makepath=True)
        except NodeExistsError:
            _, stat = self._client.get(self.path)
            if stat.ephemeralOwner != session:
                # a predecessor's session (e.g. this process restarted after kill -9) still
                # holds our id: register the moment its node goes, backoff retries meanwhile
                self._client.exists(self.path, watch=self._on_freed)
                self.static.conflict(stat.ephemeralOwner)
                raise CoordinationError(
                    f"consumer id {self._cid} is registered by another session "
                    f"(0x{stat.ephemeralOwner:x}); waiting for it to expire") from None
            self._client.set(self.path, data)
        self.session = session
        self.static.registered()
        log.info("group %s consumer %s: registered in session 0x%x%s", self._group,
                 self._cid, session or 0,
                 f" (static member {self._cfg.instance_id})" if self.static.enabled else "")

    def forget(self) -> int | None:
        """No longer registered (the session ended, or we are leaving); returns the
        session the id node was registered in, for :meth:`delete`."""
        session, self.session = self.session, None
        return session

    def delete(self, session: int | None) -> None:
        """Delete our id node if ``session`` holds it (never a duplicate's, nor a
        predecessor's still alive)."""
        try:
            _, stat = self._client.get(self.path)
            if session is not None and stat.ephemeralOwner == session:
                self._client.delete(self.path, stat.version)
        except (NoNodeError, BadVersionError, KazooException):
            pass

    # -- the heartbeat ----------------------------------------------------------------

    def heartbeat_due(self, now: float) -> bool:
        return now >= self.next_heartbeat

    def heartbeat_now(self) -> None:
        """Beat at the next turn (the connection came back)."""
        self.next_heartbeat = 0.0

    def heartbeat(self) -> None:
        """Renew the delivery lease with a ZooKeeper round trip (see _lease.py)."""
        self.next_heartbeat = time.monotonic() + self._cfg.zk_session_timeout / 6.0
        sent = time.monotonic()
        try:
            self._client.exists(self.path)
        except KazooException as e:
            log.debug("heartbeat of %s failed: %r", self._cid, e)
            return
        self._lease.renewed(sent)
