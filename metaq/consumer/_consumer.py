"""MessageConsumer: the public face of a consumer group member."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kazoo.client import KazooClient
from kazoo.handlers.threading import KazooTimeoutError

from metaq._errors import (
    ConfigError,
    ConsumerClosedError,
    ConsumerError,
    CoordinationError,
    MetaqError,
    OffsetOutOfRangeError,
)
from metaq._zkclient import make_client
from metaq.consumer._concurrent import ConcurrentDispatcher, InFlight
from metaq.consumer._config import MIB, ConsumerConfig
from metaq.consumer._coordinator import Coordinator, State
from metaq.consumer._fetcher import EARLIEST, LATEST, FetchManager
from metaq.consumer._lease import Lease
from metaq.consumer._message import Message
from metaq.consumer._offsets import LocalFileOffsetStore
from metaq.consumer._processor import PartitionFetch
from metaq.consumer._recover import RecoverStore
from metaq.consumer._reject import RejectHandler, default_recover_dir
from metaq.net import BrokerConnection
from metaq.protocol import get_codec
from zk_layout import (
    Layout,
    NodeDataError,
    StoredOffset,
    build_consumer_id,
    check_topic,
    encode_topic_list,
    local_ip,
)

__all__ = ["MessageConsumer"]


def _state_dir() -> Path:
    return default_recover_dir().parent


def _local_ip() -> str:
    return local_ip()

log = logging.getLogger(__name__)

Listener = Callable[[Message], Any]


@dataclass(frozen=True)
class _Subscription:
    topic: str
    listener: Listener | None
    batch_listener: Callable[[list[Message]], Any] | None
    max_size: int
    auto_ack: bool = True
    max_batch: int = 500


class MessageConsumer:
    """A member of a Metaq consumer group.

    ::

        with MessageConsumer("my-group", "127.0.0.1:2181") as consumer:
            consumer.subscribe("orders", lambda m: print(m.offset, m.body))
            consumer.start()
            ...

    ``subscribe`` takes a callable called once per message, or an object with
    ``on_messages(batch)`` called with the messages of one partition in offset order,
    a fetched batch at a time in slices of at most ``max_batch`` (500) messages and
    about 128 KiB (a slice ends with the message that reaches 128 KiB).
    ``start`` (Metaq's ``completeSubscribe``) joins the group.  ``close``
    commits, releases its partitions and leaves the group; ZooKeeper is left
    clean (no owner nodes, no id node).  Errors from background threads are
    passed to ``on_error`` when given, else kept and raised by :meth:`check`.
    ``on_assigned(topic, partition)`` runs after a partition is claimed and
    before it is fetched; ``on_revoked(topic, partition)`` after its fetching
    stopped and before its offset is committed and its owner node deleted
    (not after a lost session: then nothing of it is committed).
    """

    def __init__(self, group: str, zk_connect: str | KazooClient, *,
                 config: ConsumerConfig | None = None,
                 on_error: Callable[[BaseException], None] | None = None,
                 on_assigned: Callable[[str, str], None] | None = None,
                 on_revoked: Callable[[str, str], None] | None = None,
                 **options: Any) -> None:
        if config is not None and options:
            raise ConfigError("pass either config= or keyword options, not both")
        self.config = config if config is not None else ConsumerConfig.from_mapping(group,
                                                                                    options)
        if self.config.group != group:
            raise ConfigError(f"config.group {self.config.group!r} differs from {group!r}")
        self.layout = Layout(self.config.zk_root)
        #: the group as registered in ZooKeeper (``<group>-<ip>`` in broadcast mode)
        self.zk_group = f"{group}-{_local_ip()}" if self.config.broadcast else group
        self.consumer_id = build_consumer_id(self.zk_group, self.config.consumer_id)
        self.offset_store = self.config.offset_store
        if self.config.broadcast and self.offset_store is None:
            path = self.config.offset_file or str(
                _state_dir() / "broadcast" / self.zk_group / f"{self.consumer_id}.json")
            self.offset_store = LocalFileOffsetStore(path)
        self._dispatcher: ConcurrentDispatcher | None = None
        if self.config.consume_mode == "concurrent":
            self._dispatcher = ConcurrentDispatcher(
                workers=self.config.consume_threads, name=f"metaq-consume-{self.consumer_id}")
        self._codec = get_codec(self.config.codec)
        self._subs: dict[str, _Subscription] = {}
        self._on_error = on_error
        self._on_assigned = on_assigned
        self._on_revoked = on_revoked
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._metrics_mark = (time.monotonic(), 0)
        self._consumed_released = 0  # messages of partitions no longer owned
        self._damaged_offsets = 0  # offset nodes found holding garbage
        if isinstance(zk_connect, KazooClient):
            self._client, self._own_client = zk_connect, False
        else:
            self._client = make_client(zk_connect, timeout=self.config.zk_session_timeout,
                                       security=self.config.zk_security)
            self._own_client = True
        self._rejecter = RejectHandler(
            policy=self.config.reject_policy, group=group, consumer_id=self.consumer_id,
            zk_connect=zk_connect, recover_dir=self.config.recover_dir,
            recover_interval=self.config.recover_interval, codec=self._codec,
            on_error=lambda e: self.report_error(e, None))
        self.lease = Lease(self.config.zk_session_timeout)
        self.fetcher = FetchManager(
            group=group, runner_count=self.config.fetch_runner_count,
            fetch_timeout=self.config.fetch_timeout, max_delay=self.config.max_fetch_delay,
            max_fetch_size=self.config.max_fetch_size, on_error=self.report_error,
            offset_reset=self.config.offset_reset,
            lease=self.lease, hold=self.config.fetch_hold,
            name=f"metaq-fetch-{self.consumer_id}")
        self._coordinator = Coordinator(self, self._client)

    # -- lifecycle -----------------------------------------------------------

    def __enter__(self) -> MessageConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def subscribe(self, topic: str, listener: Any, *, max_size: int = MIB,
                  auto_ack: bool = True, max_batch: int = 500) -> MessageConsumer:
        """Consume ``topic`` with ``listener``; call before :meth:`start`.

        With ``auto_ack=False`` progress stays tentative until :meth:`ack`;
        :meth:`rollback` delivers again from the last acknowledged message.
        """
        self._check_open()
        if self._started:
            raise ConsumerError("subscribe() must be called before start()")
        check_topic(topic)
        if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 32:
            raise ConfigError(f"max_size must be an int >= 32, got {max_size!r}")
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ConfigError(f"max_batch must be an int >= 1, got {max_batch!r}")
        if max_size > self.config.max_fetch_size:
            raise ConfigError(f"max_size {max_size} is over max_fetch_size "
                              f"{self.config.max_fetch_size}")
        batch = getattr(listener, "on_messages", None)
        if batch is not None and callable(batch):
            if self._dispatcher is not None or not auto_ack:
                raise ConfigError("a batch listener works in orderly auto-ack mode only")
            sub = _Subscription(topic, None, batch, max_size, auto_ack, max_batch)
        elif callable(listener):
            if self._dispatcher is not None and not auto_ack:
                raise ConfigError("manual ack works in orderly mode only")
            sub = _Subscription(topic, listener, None, max_size, auto_ack, max_batch)
        else:
            raise ConfigError("listener must be callable or have on_messages(batch)")
        if topic in self._subs:
            raise ConfigError(f"topic {topic!r} is already subscribed")
        self._subs[topic] = sub
        return self

    def start(self) -> MessageConsumer:
        """Join the group: register, rebalance, fetch (Metaq's completeSubscribe)."""
        self._check_open()
        if self._started:
            return self
        if not self._subs:
            raise ConsumerError("subscribe() to at least one topic before start()")
        if self._own_client:
            try:
                self._client.start(timeout=self.config.zk_connect_timeout)
            except KazooTimeoutError:
                self.fetcher.close()
                raise CoordinationError(
                    f"cannot connect to ZooKeeper at {self._client.hosts} within "
                    f"{self.config.zk_connect_timeout}s") from None
        self._started = True
        self._rejecter.start_redelivery(self._listener_for)
        self._coordinator.start()
        return self

    def _listener_for(self, topic: str) -> Callable[[Message], Any] | None:
        sub = self._subs.get(topic)
        if sub is None:
            return None
        if sub.listener is not None:
            return sub.listener
        batch = sub.batch_listener
        assert batch is not None
        return lambda m: batch([m])

    def close(self) -> None:
        """Stop fetching, commit, release partitions, unregister; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        timeout = self.config.close_timeout
        if self._started:
            self._coordinator.close(timeout)
        self.fetcher.close(timeout)
        if self._dispatcher is not None:
            self._dispatcher.close(timeout)
        self._rejecter.close()
        if self._own_client:
            try:
                self._client.stop()
                self._client.close()
            except Exception as e:  # noqa: BLE001 - closing anyway
                log.debug("closing the ZooKeeper client: %r", e)
        log.info("consumer %s closed", self.consumer_id)

    # -- inspection ----------------------------------------------------------

    @property
    def state(self) -> State:
        return self._coordinator.state

    @property
    def generation(self) -> int:
        return self._coordinator.generation

    def assignment(self) -> dict[str, list[str]]:
        """Partitions this consumer owns now, per topic."""
        return self._coordinator.assignment()

    def waiting(self) -> dict[tuple[str, str], str | None]:
        """Assigned partitions still held by another member: (topic, part) -> holder."""
        return self._coordinator.waiting()

    def wait_settled(self, timeout: float) -> bool:
        """Block until every assigned partition is owned and fetching (or timeout)."""
        return self._coordinator.settled.wait(timeout)

    def commit(self) -> None:
        """Ask for a commit at the next coordinator turn (the timer also commits)."""
        self._check_open()
        self._coordinator.request_commit()

    def committed(self) -> dict[tuple[str, str], int]:
        """(topic, partition) -> the offset this member last committed, for owned ones."""
        return {k: c[1] for k, _, c in self._coordinator.owned()}

    def positions(self) -> dict[tuple[str, str], int]:
        """(topic, partition) -> the next offset to deliver, for owned ones."""
        return {k: pf.offset for k, pf, _ in self._coordinator.owned()}

    def lag(self, timeout: float = 5.0) -> dict[tuple[str, str], int | None]:
        """(topic, partition) -> log end (asked of the broker) minus the consumed position.

        None where the broker could not be asked.  Does network I/O: call it from
        a monitoring thread, not from a listener.
        """
        by_broker: dict[tuple[str, int], list[PartitionFetch]] = {}
        out: dict[tuple[str, str], int | None] = {}
        for key, pf, _ in self._coordinator.owned():
            out[key] = None
            if pf.broker_address is not None:
                by_broker.setdefault(pf.broker_address, []).append(pf)
        for address, pfs in by_broker.items():
            try:
                with BrokerConnection(*address, timeout=timeout) as conn:
                    for pf in pfs:
                        end = conn.offset(pf.topic, self.config.group, pf.index, 2**63 - 1)
                        pos = pf.offset if pf.offset >= 0 else end
                        out[(pf.topic, pf.partition)] = max(0, end - pos)
            except (OSError, MetaqError) as e:
                log.debug("lag: broker %s:%s did not answer: %r", *address, e)
        return out

    def metrics(self, *, with_lag: bool = False) -> dict[str, Any]:
        """A snapshot for dashboards: state, rebalances, per-partition progress, rates.

        ``rate`` is messages/s since the previous call (or since start).
        ``with_lag`` adds each partition's lag (asks the brokers, see :meth:`lag`).
        """
        now = time.monotonic()
        owned = self._coordinator.owned()
        total = self._consumed_released + sum(pf.consumed for _, pf, _ in owned)
        last_t, last_n = self._metrics_mark
        self._metrics_mark = (now, total)
        lags = self.lag() if with_lag else {}
        store = self._rejecter.store_size()
        return {
            "consumer_id": self.consumer_id, "group": self.config.group,
            "state": self.state.value, "generation": self.generation,
            "rebalances": self._coordinator.rebalances,
            "messages": total, "rate": (total - last_n) / max(now - last_t, 1e-9),
            "rejected": self._rejecter.rejected, "recover_store_size": store,
            "errors": len(self._errors),
            "damaged_offsets": self._damaged_offsets,
            "damaged_messages": sum(pf.damaged for _, pf, _ in owned),
            "offset_resets": sum(pf.resets for _, pf, _ in owned),
            "partitions": {f"{t}/{p}": {"position": pf.offset, "committed": c[1],
                                        "consumed": pf.consumed, "damaged": pf.damaged,
                                        "skipped_bytes": pf.skipped,
                                        "stalled": None if pf.stalled is None
                                        else str(pf.stalled),
                                        **({"lag": lags.get((t, p))} if with_lag else {})}
                           for (t, p), pf, c in owned},
        }

    def threads(self) -> list[threading.Thread]:
        extra = self._dispatcher.threads if self._dispatcher is not None else []
        return [self._coordinator.thread, *self.fetcher.threads, *extra]

    def errors(self) -> list[BaseException]:
        with self._lock:
            return list(self._errors)

    @property
    def failed(self) -> BaseException | None:
        """The error that made this member give up for good (its coordinator failed
        MAX_FAILURES times in a row); None while it works."""
        return self._coordinator.failed

    def check(self) -> None:
        """Raise the first background error not yet seen, as a ConsumerError."""
        with self._lock:
            if not self._errors:
                return
            err = self._errors.pop(0)
        raise ConsumerError(f"background failure in consumer {self.consumer_id}: {err}") from err

    # -- used by the coordinator and fetchers ----------------------------------

    def report_error(self, error: BaseException, pf: PartitionFetch | None) -> None:
        if self._on_error is not None:
            try:
                self._on_error(error)
                return
            except Exception:  # noqa: BLE001
                log.exception("on_error callback failed")
        with self._lock:
            self._errors.append(error)
            del self._errors[:-100]

    def topics(self) -> list[str]:
        return sorted(self._subs)

    def topics_data(self) -> bytes:
        return encode_topic_list(self.topics())

    def new_fetch(self, topic: str, partition: str, broker_id: int,
                  address: tuple[str, int] | None,
                  stored: StoredOffset | NodeDataError | None, epoch: int) -> PartitionFetch:
        sub = self._subs[topic]
        stalled = None
        if isinstance(stored, NodeDataError):
            # garbage in the offset node: report it, start as offset_reset says; the next
            # commit writes a good value over it
            reset = self.config.offset_reset
            offset = {"earliest": EARLIEST, "latest": LATEST}.get(reset, EARLIEST)
            msg_id = -1
            err = OffsetOutOfRangeError(
                f"{topic}/{partition}: damaged committed offset ({stored}); "
                + ("not fetched until a seek (offset_reset=fail)" if reset == "fail" else
                   f"reading from the log {'start' if reset == 'earliest' else 'end'} "
                   f"(offset_reset={reset})"),
                topic=topic, partition=partition, offset=-1, log_start=None, log_end=None,
                action=reset)
            log.error("group %s consumer %s: %s", self.config.group, self.consumer_id, err)
            self.report_error(err, None)
            self._damaged_offsets += 1
            stalled = err if reset == "fail" else None
        elif stored is not None:
            offset, msg_id = stored.offset, -1 if stored.msg_id is None else stored.msg_id
        elif self.config.start_position == "latest":
            offset, msg_id = LATEST, -1  # resolved by the fetcher from the broker's log end
        else:
            offset, msg_id = 0, -1
        pf = PartitionFetch(
            topic=topic, partition=partition, broker_id=broker_id,
            index=int(partition.split("-", 1)[1]), broker_address=address, offset=offset,
            msg_id=msg_id, max_size=sub.max_size, listener=sub.listener, max_batch=sub.max_batch,
            batch_listener=sub.batch_listener, codec=self._codec,
            verify=self.config.verify_checksums, max_retries=self.config.max_fetch_retries,
            reject=self._reject, epoch=epoch)
        pf.auto_ack = sub.auto_ack
        pf.stalled = stalled
        if self._dispatcher is not None:
            cfg = self.config
            pf.dispatcher, pf.inflight = self._dispatcher, InFlight()
            pf.flow = (cfg.pull_threshold_messages, cfg.pull_threshold_bytes, cfg.max_span)
        return pf

    def drain(self, pf: PartitionFetch, timeout: float = 2.0) -> None:
        """Concurrent mode: give in-flight messages of a leaving partition a moment to
        finish, so fewer are delivered again by the next owner."""
        if self._dispatcher is not None and pf.inflight is not None:
            self._dispatcher.wait_idle(pf, timeout)

    # -- control ---------------------------------------------------------------

    def _state_of(self, topic: str, partition: str) -> PartitionFetch:
        pf = self._coordinator.fetch_state(topic, partition)
        if pf is None:
            raise ConsumerError(f"{topic}/{partition} is not assigned to {self.consumer_id}")
        return pf

    def ack(self, message: Message) -> None:
        """Manual ack: everything of the message's partition up to it is done."""
        pf = self._state_of(message.topic, message.partition)
        if message.next_offset > pf.acked[1]:
            pf.acked = (message.msg_id, message.next_offset)

    def rollback(self, topic: str, partition: str) -> None:
        """Manual ack: deliver again from the last acknowledged message."""
        self.fetcher.rollback(self._state_of(topic, partition))

    def seek(self, topic: str, partition: str, offset: int) -> None:
        """Deliver ``topic``/``partition`` from byte ``offset`` next (it must be a
        message boundary; the broker moves an offset below its log start up)."""
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise ConfigError(f"offset must be an int >= 0, got {offset!r}")
        self.fetcher.seek(self._state_of(topic, partition), offset)

    def seek_to_earliest(self, topic: str, partition: str) -> None:
        self.fetcher.seek(self._state_of(topic, partition), 0)

    def seek_to_latest(self, topic: str, partition: str) -> None:
        self.fetcher.seek(self._state_of(topic, partition), -1)  # resolved from the broker

    def pause(self, topic: str, partition: str) -> None:
        """Stop fetching a partition (it stays assigned) until :meth:`resume`."""
        self.fetcher.pause(self._state_of(topic, partition))

    def resume(self, topic: str, partition: str) -> None:
        self.fetcher.unpause(self._state_of(topic, partition))

    def _reject(self, message: Message, error: BaseException) -> None:
        self._rejecter(message, error)

    @property
    def recover_store(self) -> RecoverStore:
        """The local store of messages the listener gave up on (see reject_policy)."""
        return self._rejecter.store

    def on_assigned(self, key: tuple[str, str]) -> None:
        """Called by the coordinator after a partition was claimed, before fetching."""
        if self._on_assigned is not None:
            self._callback(self._on_assigned, key)

    def on_revoked(self, key: tuple[str, str], pf: PartitionFetch | None = None) -> None:
        """Called after fetching stopped, before the offset is committed and released."""
        if pf is not None:
            self._consumed_released += pf.consumed
        if self._on_revoked is not None:
            self._callback(self._on_revoked, key)

    def _callback(self, fn: Callable[[str, str], None], key: tuple[str, str]) -> None:
        try:
            fn(*key)
        except Exception as e:  # noqa: BLE001 - a user callback must not stop a rebalance
            log.exception("callback %r failed for %s/%s", fn, *key)
            self.report_error(e, None)

    def _check_open(self) -> None:
        if self._closed:
            raise ConsumerClosedError(f"consumer {self.consumer_id} is closed")
