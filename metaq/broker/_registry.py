"""A broker's place in ZooKeeper (reference section 1), via ``zk_layout``: its
registration, and, for replicated brokers, the decisions of who leads.

Nodes written (``<id>`` = broker id, ``<N>`` = this broker's replica number)::

    as master:
    brokers/ids/<id>                      persistent  meta://host:port (for old clients)
    brokers/ids/<id>/master               ephemeral   meta://host:port
    brokers/topics/<topic>/<id>-m         ephemeral   numParts as text
    brokers/topics-pub/<topic>/<id>-m     ephemeral   {"numParts":N,"broker":"<id>-m"}
    brokers/topics-sub/<topic>/<id>-m     ephemeral   same JSON
    as slave (as Java Metaq's slaves register):
    brokers/ids/<id>/slave<N>             ephemeral   meta://host:port
    brokers/topics-sub/<topic>/<id>-s<N>  ephemeral   {"numParts":N,"broker":"<id>-s<N>"}
    replication (metaq-py only, zk_layout._replication):
    brokers/replication/<id>              persistent  epoch, master replica, in-sync set
    brokers/replication/<id>/epoch-<E>    persistent  the new master's log ends at E's start

All ZooKeeper work runs on one named thread fed by a queue (watch callbacks and
the kazoo state listener only queue work).  That thread also decides the role
(``_role`` carries it out in the event loop, :meth:`Role.run`):

- **at start**: no replication node yet and started as master: create it (epoch
  0) and lead; the node names this replica master: lead (unless this data
  directory is new while the node lists in-sync slaves: then it would lead with
  nothing; it waits as a slave instead); it names another replica: be its slave;
- **as master**: every ``heartbeat`` seconds read the node; while it names us at
  our epoch, the read renews the lease (``_role``); when it names another
  replica (a promotion), fence at once, drop the master nodes, cut the logs back
  to the new epoch's ends and follow the new master; in-sync set changes are
  written conditionally on the node's version (``write_in_sync``);
- **as slave**: follow the master node's address; copy the master's topics
  (``topics-pub/<topic>/<id>-m``, read every ``heartbeat``); when the node names
  this replica (``metaq broker promote``, or our own promotion): stop copying,
  write the epoch node with our log ends, take the master node once it is free,
  lead.  With ``auto_promote``, when the master node goes away (its session
  ended) and the node lists this replica in sync, name ourselves, conditionally
  on the version read: of two slaves, one wins.

Failures are retried and kept in :attr:`BrokerRegistry.error` so the broker can
report them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from kazoo.client import KazooClient
from kazoo.exceptions import (
    BadVersionError,
    KazooException,
    NoAuthError,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
)
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.states import KazooState

import zk_layout
from metaq._errors import CoordinationError
from metaq._zkclient import ZkSecurity, make_client

if TYPE_CHECKING:
    from metaq.broker._role import Role

__all__ = ["BrokerRegistry", "FencedError"]

log = logging.getLogger(__name__)

_RETRY_SECONDS = 2.0


class _Conflict(CoordinationError):
    pass


class FencedError(CoordinationError):
    """ZooKeeper names another replica master: this broker may not lead."""


class BrokerRegistry:
    """Registers one broker and its topics; re-registers after session loss; decides
    and follows its replication role (see the module docstring)."""

    def __init__(self, *, zk_connect: str, zk_root: str, broker_id: int, host: str, port: int,
                 topics: Callable[[], dict[str, int]], session_timeout: float = 10.0,
                 security: ZkSecurity | None = None, role: Role | None = None,
                 started_as_slave: bool = False, mode: str = "async",
                 auto_promote: bool = False) -> None:
        self.layout = zk_layout.Layout(zk_root)
        self.broker_id = broker_id
        self.uri = zk_layout.encode_broker_uri(zk_layout.BrokerUri(host, port))
        self._topics = topics
        self._session_timeout = session_timeout
        self._client = make_client(zk_connect, timeout=session_timeout, security=security)
        self._shared_acl = security.shared_acl() if security is not None and \
            security.acl != "open" else None
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._was_lost = False
        self.role = role
        self.replica = role.replica if role is not None else 0
        self.started_as_slave = started_as_slave
        self.mode = mode
        self.auto_promote = auto_promote
        #: seconds between a master's lease renewals and a slave's reads of its topics
        self.heartbeat = max(0.05, min(1.0, session_timeout / 5))
        self.leading = not started_as_slave   # which nodes we hold (master's or slave's)
        self.epoch: int | None = None
        self._version = -1                    # the replication node's version we know
        self._master_uri: bytes | None = None
        self._state: zk_layout.ReplicationState | None = None
        self._pending: str | None = None      # a step waiting for ZooKeeper ("take-over", ...)
        self._watches: dict[str, Callable[..., None]] = {}
        self.beats = 0                        # heartbeats done (lease renewals, topic reads)
        self.registrations = 0            # completed full registrations (1 after start)
        self.error: Exception | None = None  # last failure, None once registered again

    @property
    def client(self) -> KazooClient:
        return self._client

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 15.0) -> None:
        """Connect and register everything; raises CoordinationError on failure."""
        try:
            self._client.start(timeout=timeout)
        except (KazooTimeoutError, KazooException) as e:
            self._client.close()
            raise CoordinationError(f"cannot connect to ZooKeeper: {e}") from e
        try:
            self._register_first(timeout)
        except Exception as e:
            self._client.stop()
            self._client.close()
            if isinstance(e, CoordinationError):
                raise
            raise CoordinationError(f"cannot register broker {self.broker_id}: {e}") from e
        self._client.add_listener(self._on_state)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"metaq-broker-{self.broker_id}-zk")
        self._thread.start()

    def _register_first(self, timeout: float) -> None:
        """Register; while a node is still held by another session, wait for it to go.

        After a crash (kill -9) and a quick restart, the old process's ephemeral nodes
        live until its session expires.  Waiting out one session timeout (plus the
        start timeout) tells a dead predecessor from a live broker with our id.
        """
        deadline = time.monotonic() + self._session_timeout + timeout
        while True:
            try:
                self._register_all()
                return
            except _Conflict as e:
                if time.monotonic() >= deadline:
                    raise
                log.warning("broker %d: %s; waiting for the old session to expire",
                            self.broker_id, e)
                time.sleep(min(0.25, max(0.0, deadline - time.monotonic())))

    def stop(self) -> None:
        """Delete this broker's nodes and close the session."""
        if self._thread is not None:
            self._queue.put(("stop", None))
            self._thread.join()
            self._thread = None
        try:
            self._client.remove_listener(self._on_state)
            if self._client.connected:
                self._unregister_all()
        except (KazooException, KazooTimeoutError) as e:
            log.warning("broker %d: unregistering failed (%s); nodes go with the session",
                        self.broker_id, e)
        finally:
            self._client.stop()
            self._client.close()

    def add_topic(self, topic: str, partitions: int) -> Future:
        """Queue the registration of a (new or grown) topic; the future ends when done."""
        fut: Future = Future()
        self._queue.put(("topic", (topic, partitions, fut)))
        return fut

    def write_in_sync(self, in_sync: tuple[int, ...]) -> Future:
        """(Master) queue a write of the in-sync set; the future ends when written, or
        fails (FencedError when another replica leads now)."""
        fut: Future = Future()
        self._queue.put(("in-sync", (tuple(in_sync), fut)))
        return fut

    def promote(self, replica: int, *, force: bool = False) -> zk_layout.ReplicationState:
        """Name ``replica`` master of the next epoch (``metaq broker promote`` does the
        same from outside a broker)."""
        return promote(self._client, self.layout, self.broker_id, replica, force=force)

    # -- the worker ------------------------------------------------------------------------
    def _on_state(self, state: str) -> None:
        # kazoo's connection thread: never block here, only queue work
        if state == KazooState.LOST:
            self._was_lost = True
            log.warning("broker %d: ZooKeeper session lost", self.broker_id)
        elif state == KazooState.CONNECTED and self._was_lost:
            self._was_lost = False
            self._queue.put(("register", None))

    def _watch(self, kind: str) -> Callable[..., None]:
        """The watch that queues ``kind``: one function per kind, so that re-arming it
        (every heartbeat reads the node again) adds nothing to kazoo's watcher set."""
        w = self._watches.get(kind)
        if w is None:
            def w(event: object = None) -> None:  # kazoo's event thread: only queue
                self._queue.put((kind, None))
            self._watches[kind] = w
        return w

    def _run(self) -> None:
        pending_register = False
        next_beat = time.monotonic()
        while True:
            now = time.monotonic()
            wait = next_beat - now
            if pending_register:
                wait = min(wait, _RETRY_SECONDS)
            try:
                kind, arg = self._queue.get(timeout=max(0.0, wait) if self.role else
                                            (_RETRY_SECONDS if pending_register else None))
            except queue.Empty:
                kind, arg = ("register", None) if pending_register and not self.role \
                    else ("tick", None)
            if kind == "stop":
                return
            try:
                if kind == "register":
                    self._register_all()
                    pending_register = False
                elif kind == "topic":
                    topic, partitions, fut = arg
                    try:
                        self._register_topic(topic, partitions)
                    except Exception as e:
                        fut.set_exception(e)
                        raise
                    fut.set_result(None)
                elif kind == "in-sync":
                    self._write_in_sync(*arg)
                elif kind in ("state", "master"):
                    self._replication_changed()
                if self.role is not None and (kind == "tick" or time.monotonic() >= next_beat):
                    next_beat = time.monotonic() + self.heartbeat
                    if pending_register:
                        self._register_all()
                        pending_register = False
                    else:
                        self._beat()
            except (KazooException, KazooTimeoutError, CoordinationError) as e:
                self.error = e
                pending_register = True
                log.error("broker %d: ZooKeeper registration failed, retrying in %gs: %s%s",
                          self.broker_id, _RETRY_SECONDS, type(e).__name__,
                          f": {e}" if str(e) else "")
            except Exception as e:  # a bug; keep serving, keep retrying
                self.error = e
                pending_register = True
                log.exception("broker %d: unexpected registration failure", self.broker_id)

    # -- nodes -----------------------------------------------------------------------------
    def _session(self) -> int:
        cid = self._client.client_id
        if cid is None:
            raise CoordinationError("no ZooKeeper session")
        return cid[0]

    def _ensure_ephemeral(self, path: str, data: bytes) -> None:
        zk = self._client
        try:
            zk.create(path, data, ephemeral=True, makepath=True)
            return
        except NodeExistsError:
            pass
        try:
            old, stat = zk.get(path)
        except NoNodeError:  # went away meanwhile (an old session ending): try again
            zk.create(path, data, ephemeral=True, makepath=True)
            return
        if stat.ephemeralOwner != self._session():
            raise _Conflict(
                f"{path} is held by another ZooKeeper session ({old!r}): is another broker "
                f"running with id {self.broker_id}?")
        if old != data:
            zk.set(path, data, version=stat.version)

    def _open_parents(self, *paths: str) -> None:
        """Directories shared with other brokers stay open to them; our nodes below
        carry the client's ACL (see metaq.ZkSecurity)."""
        if self._shared_acl is not None:
            for path in paths:
                self._client.ensure_path(path, acl=self._shared_acl)

    def _register_all(self) -> None:
        if self.role is not None:
            self._establish()
        else:
            self._register_master()
        self.registrations += 1
        self.error = None

    def _register_master(self) -> None:
        zk = self._client
        lay = self.layout
        self._open_parents(lay.broker_ids())
        id_path = lay.broker_id(self.broker_id)
        try:
            zk.create(id_path, self.uri, makepath=True)
        except NodeExistsError:
            old, stat = zk.get(id_path)
            if old != self.uri:
                zk.set(id_path, self.uri, version=stat.version)
        self._ensure_ephemeral(lay.broker_master(self.broker_id), self.uri)
        for topic, partitions in sorted(self._topics().items()):
            self._register_topic(topic, partitions)
        log.info("broker %d registered in ZooKeeper as %s", self.broker_id, self.uri.decode())

    def _register_slave(self) -> None:
        lay = self.layout
        self._open_parents(lay.broker_ids())
        self._ensure_ephemeral(lay.broker_slave(self.broker_id, self.replica), self.uri)
        for topic, partitions in sorted(self._topics().items()):
            self._register_topic(topic, partitions)
        log.info("broker %d registered in ZooKeeper as slave%d at %s", self.broker_id,
                 self.replica, self.uri.decode())

    def _register_topic(self, topic: str, partitions: int) -> None:
        lay = self.layout
        b = self.broker_id
        if not self.leading:
            self._open_parents(lay.topic_sub_dir(topic))
            json = zk_layout.encode_topic_broker(
                zk_layout.TopicBroker(partitions, b, self.replica))
            self._ensure_ephemeral(lay.topic_sub(topic, b, self.replica), json)
            return
        self._open_parents(lay.topic_legacy_dir(topic), lay.topic_pub_dir(topic),
                           lay.topic_sub_dir(topic))
        self._ensure_ephemeral(lay.topic_legacy(topic, b), zk_layout.encode_num_parts(partitions))
        json = zk_layout.encode_topic_broker(zk_layout.TopicBroker(partitions, b))
        self._ensure_ephemeral(lay.topic_pub(topic, b), json)
        self._ensure_ephemeral(lay.topic_sub(topic, b), json)

    def _delete_own(self, path: str) -> None:
        try:
            _data, stat = self._client.get(path)
            if stat.ephemeralOwner == self._session():
                self._client.delete(path, version=stat.version)
        except (NoNodeError, NoAuthError):
            pass  # NoAuth: a shared directory refuses deletes; the session end removes it

    def _unregister_master(self) -> None:
        lay = self.layout
        b = self.broker_id
        for topic in sorted(self._topics()):
            self._delete_own(lay.topic_pub(topic, b))
            self._delete_own(lay.topic_sub(topic, b))
            self._delete_own(lay.topic_legacy(topic, b))
        self._delete_own(lay.broker_master(b))

    def _unregister_slave(self) -> None:
        lay = self.layout
        for topic in sorted(self._topics()):
            self._delete_own(lay.topic_sub(topic, self.broker_id, self.replica))
        self._delete_own(lay.broker_slave(self.broker_id, self.replica))

    def _unregister_all(self) -> None:
        b = self.broker_id
        if self.leading:
            self._unregister_master()
            id_path = self.layout.broker_id(b)
            try:
                data, _stat = self._client.get(id_path)
                if data == self.uri:
                    self._client.delete(id_path)  # fails if a slave is still registered
            except (NoNodeError, NotEmptyError, NoAuthError):
                pass
        else:
            self._unregister_slave()
        log.info("broker %d unregistered from ZooKeeper", b)

    # -- replication: deciding the role ---------------------------------------------------
    def _read_state(self) -> zk_layout.ReplicationState | None:
        got = zk_layout.read_replication(self._client, self.layout, self.broker_id,
                                         watch=self._watch("state"))
        if got is None:
            self._state, self._version = None, -1
            return None
        self._state, self._version = got
        return self._state

    def _establish(self) -> None:
        """Decide the role from the replication node and register accordingly."""
        role = self.role
        me = self.replica
        state = self._read_state()
        if state is None and not self.started_as_slave:
            new = zk_layout.ReplicationState(epoch=0, master=me, mode=self.mode)
            lay = self.layout
            self._open_parents(lay.brokers(), lay.replication_root())
            self._client.ensure_path(lay.replication_root())
            try:
                self._client.create(lay.replication(self.broker_id),
                                    zk_layout.encode_replication_state(new))
            except NodeExistsError:
                return self._establish()
            state = self._read_state()
        if state is not None and state.master == me:
            if role.marker.fresh and state.in_sync:
                log.error(
                    "broker %d replica %d: ZooKeeper names this replica master of epoch %d "
                    "with in-sync slaves %s, but this data directory is new: it would lead "
                    "with nothing, so it waits as a slave; promote an in-sync slave "
                    "(metaq broker promote %d --replica N) or let one take over",
                    self.broker_id, me, state.epoch, list(state.in_sync), self.broker_id)
            elif role.marker.epoch is not None and role.marker.epoch < state.epoch:
                return self._take_over(state)
            else:
                return self._lead(state)
        self._serve_as_slave(state)

    def _lead(self, state: zk_layout.ReplicationState) -> None:
        """Take the master node (conditional on the replication node's version) and
        register as master; then the event loop leads ``state.epoch``."""
        zk = self._client
        lay = self.layout
        b = self.broker_id
        if not self.leading:
            self._unregister_slave()
            self.leading = True
        self._open_parents(lay.broker_ids())
        try:
            zk.create(lay.broker_id(b), self.uri, makepath=True)
        except NodeExistsError:
            old, stat = zk.get(lay.broker_id(b))
            if old != self.uri:
                zk.set(lay.broker_id(b), self.uri, version=stat.version)
        master = lay.broker_master(b)
        try:
            old, stat = zk.get(master)
        except NoNodeError:
            old = stat = None
        if stat is not None and stat.ephemeralOwner != self._session():
            raise _Conflict(f"{master} is held by another ZooKeeper session ({old!r}): "
                            f"is another broker running with id {b}?")
        if stat is None:
            tx = zk.transaction()
            tx.check(lay.replication(b), self._version)
            tx.create(master, self.uri, ephemeral=True)
            results = tx.commit()
            if isinstance(results[0], BadVersionError):
                self._replication_changed()
                return
            if isinstance(results[1], NodeExistsError):
                raise _Conflict(f"{master} was taken meanwhile by another session")
            for r in results:
                if isinstance(r, Exception):
                    raise r
        for topic, partitions in sorted(self._topics().items()):
            self._register_topic(topic, partitions)
        self.epoch = state.epoch
        self._pending = None
        self.role.run(lambda: self.role.become_master(state.epoch, state.in_sync, self.mode))
        self.role.renewed(time.monotonic(), state.epoch, state.in_sync)
        log.info("broker %d replica %d registered in ZooKeeper as master of epoch %d (%s)",
                 b, self.replica, state.epoch, self.uri.decode())

    def _serve_as_slave(self, state: zk_layout.ReplicationState | None) -> None:
        role = self.role
        if self.leading:
            self.role.run(lambda: role.fence("ZooKeeper names another replica master"))
            self._unregister_master()
            self.leading = False
        if state is not None and (role.marker.epoch is None or role.marker.epoch < state.epoch):
            starts = zk_layout.read_epoch_starts(self._client, self.layout, self.broker_id,
                                                 after=-1 if role.marker.epoch is None
                                                 else role.marker.epoch)
            if state.epoch > 0 and not any(s.epoch == state.epoch for s in starts):
                self._pending = "epoch-node"  # the new master has not written it yet
                self.role.run(lambda: role.become_slave(None, "waiting for the new master"))
                self._register_slave()
                return
            cut: dict[tuple[str, int], int] = {}
            for s in starts:
                for topic, ends in s.ends.items():
                    for p, end in enumerate(ends):
                        key = (topic, p)
                        cut[key] = min(end, cut.get(key, end))
            self.role.run(lambda: role.truncate(cut, state.epoch))
        self._pending = None
        epoch = None if state is None else state.epoch
        self.role.run(lambda: role.become_slave(epoch, "following the master"))
        self._register_slave()
        self._follow_master()

    def _follow_master(self) -> None:
        path = self.layout.broker_master(self.broker_id)
        try:
            data, _stat = self._client.get(path, watch=self._watch("master"))
        except NoNodeError:
            self._client.exists(path, watch=self._watch("master"))
            data = None
        self._master_uri = data
        address = None
        if data is not None:
            try:
                uri = zk_layout.decode_broker_uri(data, path)
                address = (uri.host, uri.port)
            except zk_layout.NodeDataError as e:
                log.error("broker %d: cannot follow the master: %s", self.broker_id, e)
        if address is not None and data == self.uri:
            address = None  # our own old node, going away with its session
        self.role.run(lambda: self.role.follow(address))
        if address is None and self.auto_promote:
            self._maybe_promote()

    def _maybe_promote(self) -> None:
        state = self._state
        if state is None or self.replica not in state.in_sync or state.master == self.replica:
            return
        if self._client.exists(self.layout.broker_master(self.broker_id)) is not None:
            return
        log.warning("broker %d: the master (replica %d) is gone and replica %d is in sync: "
                    "promoting it to master of epoch %d", self.broker_id, state.master,
                    self.replica, state.epoch + 1)
        new = zk_layout.ReplicationState(epoch=state.epoch + 1, master=self.replica,
                                         mode=self.mode)
        try:
            self._client.set(self.layout.replication(self.broker_id),
                             zk_layout.encode_replication_state(new), version=self._version)
        except BadVersionError:
            log.info("broker %d: the replication node changed meanwhile; not promoting",
                     self.broker_id)
        self._replication_changed()

    def _take_over(self, state: zk_layout.ReplicationState) -> None:
        """ZooKeeper names us master of a new epoch: stop copying, record our log ends
        as the epoch's start, take the master node once it is free, lead."""
        role = self.role
        zk = self._client
        lay = self.layout
        ends = role.run(role.stop_following)
        path = lay.replication_epoch(self.broker_id, state.epoch)
        data = zk_layout.encode_epoch_start(zk_layout.EpochStart(
            epoch=state.epoch, master=self.replica, ends=ends))
        try:
            old, _stat = zk.get(path)
            start = zk_layout.decode_epoch_start(old, path)
            if start.master != self.replica:
                raise FencedError(f"{path} was written by replica {start.master}")
        except NoNodeError:
            zk.create(path, data, makepath=True)
        if zk.exists(lay.broker_master(self.broker_id)) is not None:
            self._pending = "take-over"  # the old master has not let go yet
            zk.exists(lay.broker_master(self.broker_id), watch=self._watch("master"))
            return
        role.marker.save(state.epoch)
        self._lead(state)

    def _replication_changed(self) -> None:
        """The replication node or the master node changed (or a step is pending)."""
        if self.role is None:
            return
        state = self._read_state()
        me = self.replica
        if self.leading:
            if state is None or state.master != me or state.epoch != self.epoch:
                log.warning("broker %d replica %d: ZooKeeper now names %s: stepping down",
                            self.broker_id, me, "nobody" if state is None else
                            f"replica {state.master} master of epoch {state.epoch}")
                if state is not None and state.master == me:
                    return self._take_over(state)
                self._serve_as_slave(state)
            return
        if state is not None and state.master == me:
            if self.role.marker.fresh and state.in_sync:
                self._follow_master()
                return
            return self._take_over(state)
        if state is not None and (self.role.epoch is None or state.epoch != self.role.epoch
                                  or self._pending == "epoch-node"):
            self._serve_as_slave(state)
            return
        self._follow_master()

    def _beat(self) -> None:
        self.beats += 1
        if self._pending is not None:
            self._replication_changed()
            return
        if self.leading:
            sent = time.monotonic()
            state = self._read_state()
            if state is not None and state.master == self.replica and state.epoch == self.epoch:
                self.role.renewed(sent, state.epoch, state.in_sync)
            else:
                self._replication_changed()
        elif self._master_uri is not None:
            self.role.run(lambda: self.role.set_partitions(self._master_topics()))

    def _master_topics(self) -> dict[str, int]:
        """The master's topics and partition counts (``topics-pub/<t>/<id>-m``)."""
        lay = self.layout
        zk = self._client
        out = {}
        try:
            topics = zk.get_children(lay.topics_pub())
        except NoNodeError:
            return out
        for topic in topics:
            try:
                path = lay.topic_pub(topic, self.broker_id)
                data, _stat = zk.get(path)
                out[topic] = zk_layout.decode_topic_broker(data, path).num_parts
            except NoNodeError:
                continue
            except (zk_layout.NodeDataError, zk_layout.InvalidNameError) as e:
                log.warning("broker %d: skipping topic %r of the master: %s",
                            self.broker_id, topic, e)
        return out

    def _write_in_sync(self, in_sync: tuple[int, ...], fut: Future) -> None:
        sent = time.monotonic()
        try:
            while True:
                state = self._state
                if not self.leading or state is None or state.master != self.replica \
                        or state.epoch != self.epoch:
                    raise FencedError(f"broker {self.broker_id} replica {self.replica} does "
                                      f"not lead any more")
                new = state.with_in_sync(in_sync)
                try:
                    stat = self._client.set(self.layout.replication(self.broker_id),
                                            zk_layout.encode_replication_state(new),
                                            version=self._version)
                except BadVersionError:
                    self._read_state()
                    continue
                self._state, self._version = new, stat.version
                break
        except BaseException as e:
            fut.set_exception(e)
            if isinstance(e, FencedError):
                self._replication_changed()
                return
            raise
        fut.set_result(None)
        self.role.renewed(sent, self.epoch, in_sync)
        log.info("broker %d: in-sync slaves now %s (epoch %d)", self.broker_id,
                 list(in_sync) or "none", self.epoch)


def promote(client: KazooClient, layout: zk_layout.Layout, broker_id: int, replica: int, *,
            force: bool = False) -> zk_layout.ReplicationState:
    """Name ``replica`` master of broker ``broker_id``'s next epoch (conditional write).

    Refused (CoordinationError) for a replica that is not in the in-sync set, unless
    ``force``: a slave that is behind would lose what it lacks."""
    got = zk_layout.read_replication(client, layout, broker_id)
    if got is None:
        raise CoordinationError(f"broker {broker_id} has no replication node: it was never "
                                f"run by a metaq-py broker with ZooKeeper")
    state, version = got
    if state.master == replica:
        raise CoordinationError(f"replica {replica} already leads broker {broker_id} "
                                f"(epoch {state.epoch})")
    if replica not in state.in_sync and not force:
        raise CoordinationError(
            f"replica {replica} of broker {broker_id} is not in sync (in sync: "
            f"{list(state.in_sync) or 'none'}): promoting it would lose what it has not "
            f"copied; use force to do it anyway")
    new = zk_layout.ReplicationState(epoch=state.epoch + 1, master=replica, mode=state.mode)
    try:
        client.set(layout.replication(broker_id), zk_layout.encode_replication_state(new),
                   version=version)
    except BadVersionError:
        raise CoordinationError(f"the replication node of broker {broker_id} changed "
                                f"meanwhile; try again") from None
    return new
