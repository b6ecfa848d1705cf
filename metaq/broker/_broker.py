"""The broker facade: one :class:`Broker` runs a storage, its server and its
ZooKeeper registration on an event loop, and offers the run-time operations.

::

    from metaq.broker import Broker, BrokerConfig

    cfg = BrokerConfig(broker_id=0, data_dir="/var/lib/metaq", port=0,
                       topics={"orders": 4}, zk_connect="127.0.0.1:2181")
    with Broker(cfg) as broker:          # event loop on a named thread
        print(broker.port)

``Broker.run_forever()`` runs in the calling thread until SIGTERM/SIGINT (the CLI).
Besides the server, the loop runs the broker's timers: interval flushes,
retention, and the idle and slow-client limits.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from metaq._errors import ConfigError, MetaqError, ProtocolError, StorageError
from metaq.broker._config import BrokerConfig
from metaq.broker._registry import BrokerRegistry
from metaq.broker._role import MARKER, Role
from metaq.broker._server import VERSION, BrokerServer
from metaq.broker._spin import SpinSelector, new_loop
from metaq.broker._storage import Storage
from metaq.protocol import MsgIdGenerator, ProducerRecord, check_topic

__all__ = ["Broker"]

log = logging.getLogger(__name__)

_WILDCARDS = {"0.0.0.0", "::", ""}


def _advertised_host(config: BrokerConfig) -> str:
    if config.advertised_host:
        return config.advertised_host
    if config.host not in _WILDCARDS:
        return config.host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return socket.gethostname()


class Broker:
    """One broker.  ``start()``/``stop()`` (or ``with``) run it on a named thread;
    :meth:`run_forever` runs it in the calling thread until a signal."""

    def __init__(self, config: BrokerConfig) -> None:
        if not isinstance(config, BrokerConfig):
            raise ConfigError(f"Broker needs a BrokerConfig, got {type(config).__name__}")
        self.config = config
        self.ids = MsgIdGenerator(config.broker_id)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop_event: asyncio.Event | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self._storage: Storage | None = None
        self._server: BrokerServer | None = None
        self._registry: BrokerRegistry | None = None
        self._role: Role | None = None
        #: the event loop's selector (``_spin``), made when the loop is
        self._selector: SpinSelector | None = None
        self._topics: dict[str, int] = {}   # copy-on-write snapshot for the ZK thread
        self._running = False
        self._last_topic_registration = None
        self.port = 0

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, timeout: float = 60.0) -> Broker:
        """Open the storage, listen, register in ZooKeeper; return when serving.

        Raises the startup error (StorageError, CoordinationError, OSError...)."""
        if self._thread is not None:
            raise MetaqError("broker already started")
        self._ready.clear()
        self._thread = threading.Thread(target=self._thread_main, daemon=True,
                                        name=f"metaq-broker-{self.config.broker_id}")
        self._thread.start()
        if not self._ready.wait(timeout):
            raise MetaqError(f"broker {self.config.broker_id} did not start within {timeout}s")
        if self._start_error is not None:
            self._thread.join()
            self._thread = None
            err, self._start_error = self._start_error, None
            raise err
        return self

    def stop(self, timeout: float = 60.0) -> None:
        """Unregister from ZooKeeper, close connections, fsync and close the logs."""
        thread = self._thread
        if thread is None:
            return
        loop = self._loop
        if loop is not None and self._stop_event is not None:
            try:
                loop.call_soon_threadsafe(self._stop_event.set)
            except RuntimeError:
                pass  # loop already gone
        thread.join(timeout)
        if thread.is_alive():
            raise MetaqError(f"broker {self.config.broker_id} did not stop within {timeout}s")
        self._thread = None

    def __enter__(self) -> Broker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _thread_main(self) -> None:
        try:
            self._run(self._main())
        except BaseException as e:
            if not self._ready.is_set():
                self._start_error = e
            else:
                log.exception("broker %d stopped on an error", self.config.broker_id)
        finally:
            self._ready.set()

    def run_forever(self, on_ready: Callable[[Broker], None] | None = None) -> None:
        """Serve in this thread until SIGTERM or SIGINT, then shut down cleanly."""
        async def main() -> None:
            loop = asyncio.get_running_loop()
            stop = self._stop_event = asyncio.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await self._main(on_ready)

        self._run(main())

    def _run(self, main: Coroutine[Any, Any, None]) -> None:
        """``asyncio.run(main)`` on a loop whose selector polls a moment for a slave's
        answer before it sleeps, while puts wait for one (``_spin``)."""
        selector = self._selector = SpinSelector(self.config.replication_poll_us / 1e6)
        with asyncio.Runner(loop_factory=lambda: new_loop(selector)) as runner:
            runner.run(main)

    def _spin_wanted(self) -> bool:
        role = self._role
        if role is None:
            return False
        replicas = role.replicas
        if replicas is not None:
            return replicas.waiting()
        # a slave configured for synchronous replication (its master's mode, as a
        # rule): right after it copied a lone put, the next one is on its way
        follower = role.follower
        return follower is not None and self.config.replication == "sync" \
            and follower.expecting()

    @property
    def running(self) -> bool:
        return self._running

    # -- the loop --------------------------------------------------------------------------
    async def _main(self, on_ready: Callable[[Broker], None] | None = None) -> None:
        cfg = self.config
        loop = self._loop = asyncio.get_running_loop()
        if self._stop_event is None:
            self._stop_event = asyncio.Event()
        storage = self._storage = Storage(cfg.data_dir, max_segment_size=cfg.max_segment_size,
                                          unflush_threshold=cfg.unflush_threshold)
        tasks: list[asyncio.Task] = []
        try:
            for topic, n in cfg.topics.items():
                storage.open_topic(topic, n)
            if cfg.zk_connect is not None and (cfg.slave_of is not None
                                               or (Path(cfg.data_dir) / MARKER).exists()):
                # a replica serves what it holds from the start (a slave learns its
                # master's topics later; a promoted slave was started without --topic)
                for topic, n in storage.on_disk().items():
                    if storage.topics.get(topic, 0) < n:
                        storage.open_topic(topic, n)
            self._topics = dict(storage.topics)
            server = self._server = BrokerServer(cfg, storage, self.ids,
                                                 on_topic_added=self._topic_added,
                                                 status=self._status_lines)
            self.port = await server.start()
            if cfg.zk_connect is not None:
                role = self._role = Role(
                    cfg, storage, add_topic=server.add_topic, stats=server.stats,
                    write_in_sync=lambda want: self._registry.write_in_sync(want),
                    accept_sync=lambda on: setattr(server, "accepts_sync", on),
                    on_master=self._continue_ids, producers=server.producers,
                    transactions=server.tx)
                role.loop = loop
                server.role = role
                if self._selector is not None:
                    self._selector.wanted = self._spin_wanted
                reg = self._registry = BrokerRegistry(
                    zk_connect=cfg.zk_connect, zk_root=cfg.zk_root, broker_id=cfg.broker_id,
                    host=_advertised_host(cfg), port=self.port, topics=lambda: self._topics,
                    session_timeout=cfg.zk_session_timeout, security=cfg.zk_security,
                    role=role, started_as_slave=cfg.slave_of is not None,
                    mode=cfg.replication, auto_promote=cfg.auto_promote)
                try:
                    await loop.run_in_executor(None, reg.start, cfg.zk_connect_timeout)
                except BaseException:
                    self._registry = None
                    raise
                tasks.append(loop.create_task(self._replication_loop(),
                                              name="metaq-broker-replication"))
            tasks.append(loop.create_task(self._flush_loop(), name="metaq-broker-flush"))
            tasks.append(loop.create_task(self._retention_loop(), name="metaq-broker-retention"))
            if cfg.idle_timeout > 0:
                tasks.append(loop.create_task(self._idle_loop(), name="metaq-broker-idle"))
            self._running = True
            log.info("broker %d serving on %s:%d (%s)", cfg.broker_id, cfg.host, self.port,
                     VERSION)
            self._ready.set()
            if on_ready is not None:
                on_ready(self)
            await self._stop_event.wait()
        finally:
            self._running = False
            for t in tasks:
                t.cancel()
            if self._registry is not None:
                await loop.run_in_executor(None, self._registry.stop)
                self._registry = None
            if self._role is not None:
                await self._role.close()
            if self._server is not None:
                await self._server.close()
            storage.close()
            log.info("broker %d stopped", cfg.broker_id)

    def _continue_ids(self) -> None:
        """Before leading: msgIds continue after every message in the logs, copied ones
        included (a promoted slave's clock may be behind its old master's)."""
        times = [t for plog in self._storage.logs() if (t := plog.last_time()) is not None]
        if times:
            self.ids.continue_after(max(times))

    async def _replication_loop(self) -> None:
        """A master's check of its slaves' lag (``_replicas.ReplicaSet.check``)."""
        while True:
            await asyncio.sleep(min(0.25, self.config.replication_max_lag / 4))
            replicas = self._role.replicas
            if replicas is not None:
                try:
                    replicas.check()
                except Exception:
                    log.exception("checking the slaves failed")

    async def _flush_loop(self) -> None:
        interval = self.config.unflush_interval
        tick = min(interval / 2, 1.0)
        while True:
            await asyncio.sleep(tick)
            try:
                self._storage.flush_due(interval)
            except Exception:
                log.exception("interval flush failed")

    async def _idle_loop(self) -> None:
        """Close idle connections (``idle_timeout``; a slow request's and a missing first
        request's deadlines are each connection's own timer)."""
        limit = self.config.idle_timeout
        while True:
            await asyncio.sleep(min(limit / 4, 30.0))
            self._server.close_idle(time.monotonic(), limit)

    async def _retention_loop(self) -> None:
        while True:  # once at start, then every retention_check_interval
            try:
                self._storage.delete_expired(self.config.retention_hours * 3600)
            except Exception:
                log.exception("retention check failed")
            await asyncio.sleep(self.config.retention_check_interval)

    # -- run-time operations (any thread) --------------------------------------------------
    def _call(self, fn: Callable[[], Any], timeout: float = 30.0) -> Any:
        loop = self._loop
        if loop is None or not self._running:
            raise MetaqError("broker is not running")
        if threading.current_thread() is self._thread:
            return fn()

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), loop).result(timeout)

    def _status_lines(self) -> list[str]:
        reg = self._registry
        if self.config.zk_connect is None:
            return ["zk_registered none"]
        if reg is None:
            return ["zk_registered false"]
        err = reg.error
        lines = [f"zk_registered {str(err is None).lower()}",
                 f"zk_registrations {reg.registrations}"]
        if err is not None:
            lines.append(f"zk_error {str(err).splitlines()[0]}")
        if self._role is not None:
            lines += self._role.status_lines()
        return lines

    def _topic_added(self, topic: str, partitions: int) -> None:
        # event loop thread; registration happens on the ZooKeeper thread
        self._topics = dict(self._storage.topics)
        if self._registry is not None:
            fut = self._registry.add_topic(topic, partitions)
            fut.add_done_callback(lambda f: f.exception() and log.error(
                "registering topic %r failed: %s", topic, f.exception()))
            self._last_topic_registration = fut

    def add_topic(self, name: str, partitions: int | None = None,
                  timeout: float = 30.0) -> None:
        """Serve a new topic (or more partitions of one) and register it in ZooKeeper."""
        try:
            check_topic(name)
        except ProtocolError as e:
            raise ConfigError(str(e)) from None
        n = self.config.num_partitions if partitions is None else partitions
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1024:
            raise ConfigError(f"partitions must be an int in 1..1024, got {partitions!r}")
        self._last_topic_registration = None
        self._call(lambda: self._server.add_topic(name, n), timeout)
        fut = self._last_topic_registration
        if fut is not None:
            fut.result(timeout)

    def set_partition_closed(self, topic: str, partition: int, closed: bool = True) -> None:
        """Close (puts and gets answer 403) or reopen one partition."""
        def do() -> None:
            plog = self._storage.get(topic, partition)
            if plog is None:
                raise StorageError(f"no partition {topic}-{partition}")
            plog.closed = closed
        self._call(do)

    def run_retention(self, now: float | None = None) -> list:
        """Run the retention check now; return the deleted segment paths."""
        return self._call(lambda: self._storage.delete_expired(
            self.config.retention_hours * 3600, now))

    def offsets(self, topic: str, partition: int) -> tuple[int, int]:
        """``(min_offset, end)`` of one partition."""
        def do() -> tuple[int, int]:
            plog = self._storage.get(topic, partition)
            if plog is None:
                raise StorageError(f"no partition {topic}-{partition}")
            return plog.min_offset, plog.end
        return self._call(do)

    def stats(self, item: str | None = None) -> str:
        return self._call(lambda: self._server.stats_text(item))

    def connection_stats(self) -> dict[str, int]:
        """Connections open now (and of them unused: no whole request yet), and the
        counts of those accepted, refused at a limit, evicted for a newcomer, and
        closed idle, slow or unused (``BrokerServer.connection_stats``)."""
        return self._call(self._server.connection_stats)

    # -- the idempotent producers' table (``_producers``; for replication) -----------------
    def producer_records(self, topic: str, partition: int,
                         from_offset: int) -> list[ProducerRecord]:
        """The producer records of ``topic``-``partition``'s runs starting at or after
        log offset ``from_offset`` (what ``producers`` answers; StorageError when the
        partition is not served)."""
        return self._call(lambda: self._server.producers.producer_records(
            topic, partition, from_offset))

    def apply_producer_records(self, topic: str, partition: int,
                               records: list[ProducerRecord]) -> int:
        """Store another broker's producer records (a slave copying its master's, once
        its log holds their messages); how many were new."""
        return self._call(lambda: self._server.producers.apply_producer_records(
            topic, partition, records))

    def truncate_producers(self, topic: str, partition: int, offset: int) -> None:
        """Forget the producer runs past ``offset`` (a log cut there)."""
        self._call(lambda: self._server.producers.truncate(topic, partition, offset))

    @property
    def topics(self) -> dict[str, int]:
        return dict(self._topics)

    @property
    def role(self) -> str | None:
        """``master``, ``slave`` or ``fenced`` (None without ZooKeeper: a lone master)."""
        return None if self._role is None else self._role.name.value

    @property
    def epoch(self) -> int | None:
        """The replication epoch this broker serves in (None without ZooKeeper)."""
        return None if self._role is None else self._role.epoch

    def replication_status(self) -> dict:
        """Role, epoch, and per slave (master) or per partition (slave) progress."""
        role = self._role
        if role is None:
            return {"role": None}
        return self._call(role.status)

    def promote(self, replica: int, *, force: bool = False) -> None:
        """Name ``replica`` of this broker id master of the next epoch."""
        if self._registry is None:
            raise MetaqError("promotion needs ZooKeeper (zk_connect)")
        self._registry.promote(replica, force=force)

    @property
    def registry(self) -> BrokerRegistry | None:
        return self._registry

    @property
    def registration_error(self) -> Exception | None:
        """The last ZooKeeper registration failure still unresolved, if any."""
        reg = self._registry
        return None if reg is None else reg.error
