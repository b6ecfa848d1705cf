"""A broker's registration in ZooKeeper (reference section 1), via ``zk_layout``.

Nodes written (``<id>`` = broker id, master role)::

    brokers/ids/<id>                      persistent  meta://host:port (for old clients)
    brokers/ids/<id>/master               ephemeral   meta://host:port
    brokers/topics/<topic>/<id>-m         ephemeral   numParts as text
    brokers/topics-pub/<topic>/<id>-m     ephemeral   {"numParts":N,"broker":"<id>-m"}
    brokers/topics-sub/<topic>/<id>-m     ephemeral   same JSON

All ZooKeeper work runs on one named thread fed by a queue; the kazoo state
listener only queues a re-registration (after a lost session every
ephemeral node is gone and is written again).  Failures are retried and kept
in :attr:`BrokerRegistry.error` so the broker can report them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

from kazoo.client import KazooClient
from kazoo.exceptions import (
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

__all__ = ["BrokerRegistry"]

log = logging.getLogger(__name__)

_RETRY_SECONDS = 2.0


class _Conflict(CoordinationError):
    pass


class BrokerRegistry:
    """Registers one master broker and its topics; re-registers after session loss."""

    def __init__(self, *, zk_connect: str, zk_root: str, broker_id: int, host: str, port: int,
                 topics: Callable[[], dict[str, int]], session_timeout: float = 10.0,
                 security: ZkSecurity | None = None) -> None:
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

    # -- the worker ------------------------------------------------------------------------
    def _on_state(self, state: str) -> None:
        # kazoo's connection thread: never block here, only queue work
        if state == KazooState.LOST:
            self._was_lost = True
            log.warning("broker %d: ZooKeeper session lost", self.broker_id)
        elif state == KazooState.CONNECTED and self._was_lost:
            self._was_lost = False
            self._queue.put(("register", None))

    def _run(self) -> None:
        pending_register = False
        while True:
            try:
                kind, arg = self._queue.get(timeout=_RETRY_SECONDS if pending_register else None)
            except queue.Empty:
                kind, arg = "register", None
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
            except (KazooException, KazooTimeoutError, CoordinationError) as e:
                self.error = e
                pending_register = True
                log.error("broker %d: ZooKeeper registration failed, retrying in %gs: %s",
                          self.broker_id, _RETRY_SECONDS, e)
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
        self.registrations += 1
        self.error = None
        log.info("broker %d registered in ZooKeeper as %s", self.broker_id, self.uri.decode())

    def _register_topic(self, topic: str, partitions: int) -> None:
        lay = self.layout
        b = self.broker_id
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

    def _unregister_all(self) -> None:
        lay = self.layout
        b = self.broker_id
        for topic in sorted(self._topics()):
            self._delete_own(lay.topic_pub(topic, b))
            self._delete_own(lay.topic_sub(topic, b))
            self._delete_own(lay.topic_legacy(topic, b))
        self._delete_own(lay.broker_master(b))
        id_path = lay.broker_id(b)
        try:
            data, _stat = self._client.get(id_path)
            if data == self.uri:
                self._client.delete(id_path)  # fails if a slave is still registered
        except (NoNodeError, NotEmptyError, NoAuthError):
            pass
        log.info("broker %d unregistered from ZooKeeper", b)
