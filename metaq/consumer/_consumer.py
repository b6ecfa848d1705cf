"""MessageConsumer: the public face of a consumer group member.

It builds the member's parts and wires them together: the subscription state
(topics and owned partitions), the fetch manager, the coordinator (handed only
the collaborators it needs), the reject handler and the concurrent pool; its
methods are the user's, each a thin call into the part that owns the answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from kazoo.client import KazooClient
from kazoo.handlers.threading import KazooTimeoutError

from metaq._errors import (
    BrokerError,
    BrokerUnavailableError,
    ConfigError,
    ConsumerClosedError,
    ConsumerError,
    CoordinationError,
)
from metaq._time import parse_time_ms
from metaq._types import BrokerAddress, PartitionKey
from metaq._zkclient import make_client
from metaq.consumer._concurrent import ConcurrentDispatcher
from metaq.consumer._config import MIB, ConsumerConfig
from metaq.consumer._coordinator import Coordinator
from metaq.consumer._fetcher import FetchManager
from metaq.consumer._lease import Lease
from metaq.consumer._lifecycle import State, Transition
from metaq.consumer._message import Message
from metaq.consumer._offsets import LocalFileOffsetStore
from metaq.consumer._recover import RecoverStore
from metaq.consumer._reject import RejectHandler, default_recover_dir
from metaq.consumer._subscription import (
    BY_TIME,
    DEFAULT_MAX_BATCH,
    LATEST,
    PartitionState,
    SubscriptionState,
)
from metaq.net import BrokerConnection, time_at
from metaq.protocol import get_codec
from zk_layout import Layout, build_consumer_id, local_ip

__all__ = ["MessageConsumer"]


def _state_dir() -> Path:
    return default_recover_dir().parent


def _local_ip() -> str:
    return local_ip()

log = logging.getLogger(__name__)


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
        self.consumer_id = build_consumer_id(
            self.zk_group, self.config.instance_id or self.config.consumer_id)
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
        self._on_error = on_error
        self._errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._metrics_mark = (time.monotonic(), 0)
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
            on_error=self._report)
        self._subscriptions = SubscriptionState(
            self.config, consumer_id=self.consumer_id, codec=self._codec,
            reject=self._rejecter, dispatcher=self._dispatcher, on_error=self._report)
        self.lease = Lease(self.config.zk_session_timeout)
        self.fetcher = FetchManager(
            group=group, runner_count=self.config.fetch_runner_count,
            fetch_timeout=self.config.fetch_timeout, max_delay=self.config.max_fetch_delay,
            max_fetch_size=self.config.max_fetch_size, on_error=self._report,
            offset_reset=self.config.offset_reset,
            lease=self.lease, hold=self.config.fetch_hold,
            name=f"metaq-fetch-{self.consumer_id}", read_from=self.config.read_from,
            member=self.consumer_id)
        self._coordinator = Coordinator(
            self._client, config=self.config, layout=self.layout, group=self.zk_group,
            consumer_id=self.consumer_id, subscriptions=self._subscriptions,
            fetcher=self.fetcher, lease=self.lease, store=self.offset_store,
            on_error=self._report, on_assigned=on_assigned, on_revoked=on_revoked)

    # -- lifecycle -----------------------------------------------------------

    def __enter__(self) -> MessageConsumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def subscribe(self, topic: str, listener: Any, *, max_size: int = MIB,
                  auto_ack: bool = True, max_batch: int = DEFAULT_MAX_BATCH) -> MessageConsumer:
        """Consume ``topic`` with ``listener``; call before :meth:`start`.

        With ``auto_ack=False`` progress stays tentative until :meth:`ack`;
        :meth:`rollback` delivers again from the last acknowledged message.
        """
        self._check_open()
        if self._started:
            raise ConsumerError("subscribe() must be called before start()")
        self._subscriptions.subscribe(topic, listener, max_size=max_size, auto_ack=auto_ack,
                                      max_batch=max_batch)
        return self

    def start(self) -> MessageConsumer:
        """Join the group: register, rebalance, fetch (Metaq's completeSubscribe)."""
        self._check_open()
        if self._started:
            return self
        if not self._subscriptions.topics():
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
        self._rejecter.start_redelivery(self._subscriptions.listener_for)
        self._coordinator.start()
        return self

    def close(self, *, leave: bool = False) -> None:
        """Stop fetching, commit, release partitions, unregister; idempotent.

        A static member (``instance_id``) leaves its partitions held for it for
        ``static_grace`` seconds, to be taken again when it comes back; with
        ``leave=True`` it leaves for good and the group rebalances at once.  For a
        dynamic member ``leave`` changes nothing: it always leaves for good."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        timeout = self.config.close_timeout
        if self._started:
            self._coordinator.close(timeout, leave=leave)
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

    @property
    def state_id(self) -> int:
        """The id of this member's last state transition: one more after each (0 before
        any).  Pass it as ``after`` to :meth:`wait_for_state` to wait for what follows."""
        return self._coordinator.state_id

    def wait_for_state(self, want: State | Collection[State] | Callable[[Transition], bool],
                       timeout: float | None, *, after: int | None = None
                       ) -> Transition | None:
        """The first transition into ``want`` (a state, some states, or a predicate on a
        :class:`Transition`): the current one if it matches (without ``after``), else the
        first to come, or with ``after`` the first whose id is above ``after`` (a state
        passed through and left meanwhile counts).  None when ``timeout`` passes."""
        return self._coordinator.wait_for(want, timeout, after=after)

    def transitions(self, after_id: int = -1) -> list[Transition]:
        """The member's recent state transitions with an id above ``after_id``, oldest
        first (the last 256 are kept): each with its generation and reason."""
        return self._coordinator.life.transitions(after_id)

    def assignment(self) -> dict[str, list[str]]:
        """Partitions this consumer owns now, per topic."""
        return self._subscriptions.assignment()

    def waiting(self) -> dict[PartitionKey, str | None]:
        """Assigned partitions still held by another member: (topic, part) -> holder."""
        return self._coordinator.waiting()

    def wait_settled(self, timeout: float) -> bool:
        """Block until every assigned partition is owned and fetching (or timeout)."""
        return self._coordinator.wait_for(State.STABLE, timeout) is not None

    def commit(self) -> None:
        """Ask for a commit at the next coordinator turn (the timer also commits)."""
        self._check_open()
        self._coordinator.request_commit()

    def committed(self) -> dict[PartitionKey, int]:
        """(topic, partition) -> the offset this member last committed, for owned ones."""
        return {pf.key: pf.committed[1] for pf in self._subscriptions.assigned()}

    def positions(self) -> dict[PartitionKey, int]:
        """(topic, partition) -> the next offset to deliver, for owned ones."""
        return {pf.key: pf.offset for pf in self._subscriptions.assigned()}

    def lag(self, timeout: float = 5.0, *, seconds: bool = False
            ) -> dict[PartitionKey, int | float | None]:
        """(topic, partition) -> log end (asked of the broker) minus the consumed position,
        in bytes; with ``seconds``, the age of the oldest unconsumed message instead (now
        minus its msgId time, 0.0 when caught up): what an SLO is written in.

        None where the broker could not be asked.  Does network I/O: call it from
        a monitoring thread, not from a listener.
        """
        detail = self._lag_detail(timeout)
        return {k: (v if v is None else v[1 if seconds else 0]) for k, v in detail.items()}

    def _lag_detail(self, timeout: float) -> dict[PartitionKey, tuple[int, float] | None]:
        by_broker: dict[BrokerAddress, list[PartitionState]] = {}
        out: dict[PartitionKey, tuple[int, float] | None] = {}
        for pf in self._subscriptions.assigned():
            out[pf.key] = None
            if pf.broker_address is not None:
                by_broker.setdefault(pf.broker_address, []).append(pf)
        for address, pfs in by_broker.items():
            try:
                with BrokerConnection(*address, timeout=timeout) as conn:
                    for pf in pfs:
                        end = conn.offset(pf.topic, self.config.group, pf.index, 2**63 - 1)
                        pos = pf.offset if pf.offset >= 0 else end
                        behind = max(0, end - pos)
                        age = 0.0
                        if behind:
                            t = time_at(conn, pf.topic, pf.index, pos, group=self.config.group)
                            age = 0.0 if t is None else max(0.0, time.time() - t / 1000)
                        out[pf.key] = (behind, age)
            except (BrokerUnavailableError, BrokerError) as e:
                log.debug("lag: broker %s:%s did not answer: %r", *address, e)
        return out

    def metrics(self, *, with_lag: bool = False) -> dict[str, Any]:
        """A snapshot for dashboards: state, rebalances, per-partition progress, rates.

        ``rate`` is messages/s since the previous call (or since start).  Each
        partition's ``broker`` is the ``host:port`` it is read from now (its broker id's
        master or a slave, see ``read_from``; None while none is registered).
        ``with_lag`` adds each partition's lag in bytes and in seconds (asks the brokers,
        see :meth:`lag`).
        """
        now = time.monotonic()
        subs = self._subscriptions
        owned = subs.assigned()
        total = subs.consumed_released + sum(pf.consumed for pf in owned)
        last_t, last_n = self._metrics_mark
        self._metrics_mark = (now, total)
        lags = self._lag_detail(5.0) if with_lag else {}
        store = self._rejecter.store_size()
        return {
            "consumer_id": self.consumer_id, "group": self.config.group,
            "state": self.state.value, "generation": self.generation,
            "rebalances": self._coordinator.rebalances,
            "messages": total, "rate": (total - last_n) / max(now - last_t, 1e-9),
            "rejected": self._rejecter.rejected, "recover_store_size": store,
            "errors": len(self._errors),
            "damaged_offsets": subs.damaged_offsets,
            "damaged_messages": sum(pf.damaged for pf in owned),
            "offset_resets": sum(pf.resets for pf in owned),
            "broker_rewinds": sum(pf.rewinds for pf in owned),
            "redelivered_skipped": sum(pf.redelivered_skipped for pf in owned),
            "partitions": {f"{pf.topic}/{pf.partition}": {
                "position": pf.offset, "committed": pf.committed[1], "consumed": pf.consumed,
                "broker": _host_port(self.fetcher.address(pf)),
                "damaged": pf.damaged, "skipped_bytes": pf.skipped,
                "stalled": None if pf.stalled is None else str(pf.stalled),
                "over_transfer_cap": None if pf.capped is None else
                {"message_size": pf.capped[0], "broker_sends": pf.capped[1]},
                **({"lag": None if (d := lags.get(pf.key)) is None else d[0],
                    "lag_seconds": None if d is None else d[1]} if with_lag else {})}
                for pf in owned},
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
        MAX_FAILURES times in a row, or its instance_id is held by another live process:
        DuplicateInstanceError); None while it works."""
        return self._coordinator.failed

    def check(self) -> None:
        """Raise the first background error not yet seen, as a ConsumerError."""
        with self._lock:
            if not self._errors:
                return
            err = self._errors.pop(0)
        raise ConsumerError(f"background failure in consumer {self.consumer_id}: {err}") from err

    # -- errors from the background threads -------------------------------------

    def _report(self, error: BaseException, pf: PartitionState | None = None) -> None:
        """The error sink of every part: the user's on_error, else kept for check()."""
        if self._on_error is not None:
            try:
                self._on_error(error)
                return
            except Exception:  # noqa: BLE001
                log.exception("on_error callback failed")
        with self._lock:
            self._errors.append(error)
            del self._errors[:-100]

    # -- control ---------------------------------------------------------------

    def _state_of(self, topic: str, partition: str) -> PartitionState:
        pf = self._subscriptions.partition(topic, partition)
        if pf is None:
            raise ConsumerError(f"{topic}/{partition} is not assigned to {self.consumer_id}")
        return pf

    def ack(self, message: Message) -> None:
        """Manual ack: everything of the message's partition up to it is done."""
        self._state_of(message.topic, message.partition).ack(message.msg_id,
                                                             message.next_offset)

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
        self.fetcher.seek(self._state_of(topic, partition), LATEST)  # resolved by the broker

    def seek_to_time(self, topic: str, partition: str | None, when: object) -> None:
        """Deliver from the first message whose msgId time is at or after ``when``
        (epoch ms, an ISO-8601 string, or an aware datetime): of ``partition``, or with
        None of every partition of ``topic`` this consumer owns now.  The position is
        found by a search over the log (a few round trips; works against a Java Metaq
        broker too) when the partition is next fetched; a time after the last message
        gives the log end."""
        ms = parse_time_ms(when, "seek_to_time time")
        parts = [partition] if partition is not None else self.assignment().get(topic, [])
        for p in parts:
            self.fetcher.seek(self._state_of(topic, p), BY_TIME, ms)

    def pause(self, topic: str, partition: str) -> None:
        """Stop fetching a partition (it stays assigned) until :meth:`resume`."""
        self.fetcher.pause(self._state_of(topic, partition))

    def resume(self, topic: str, partition: str) -> None:
        self.fetcher.unpause(self._state_of(topic, partition))

    @property
    def recover_store(self) -> RecoverStore:
        """The local store of messages the listener gave up on (see reject_policy)."""
        return self._rejecter.store

    def _check_open(self) -> None:
        if self._closed:
            raise ConsumerClosedError(f"consumer {self.consumer_id} is closed")


def _host_port(address: BrokerAddress | None) -> str | None:
    """``host:port`` of the broker a partition is read from (its master or a slave)."""
    return None if address is None else f"{address[0]}:{address[1]}"
