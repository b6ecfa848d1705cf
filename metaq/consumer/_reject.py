"""What happens to a message the listener failed on ``max_fetch_retries + 1`` times.

The reject handler runs on the fetch runner, *before* the partition's progress
moves past the message, and must not return until the message is safe:

- ``"recover"`` (default, Metaq's): stored in the local :class:`RecoverStore`
  and redelivered to the listener on a schedule until it succeeds, surviving
  restarts;
- ``"dlq"``: sent to the dead-letter topic ``%DLQ%<group>`` (RocketMQ's
  name) with its original body and attribute, acknowledged by a broker; if
  that fails the message goes to the recover store instead (never dropped);
- ``"drop"``: logged at ERROR and skipped;
- a callable ``fn(message, error)``: yours; if it raises, the recover store
  keeps the message.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from metaq._errors import ConfigError, MetaqError
from metaq.consumer._message import Message
from metaq.consumer._recover import RecoveredMessage, RecoverStore
from metaq.protocol import Codec

__all__ = ["RejectHandler", "POLICIES", "default_recover_dir", "dlq_topic"]

log = logging.getLogger(__name__)

POLICIES = ("recover", "dlq", "drop")


def default_recover_dir() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
    return Path(state) / "metaq" / "recover"


def dlq_topic(group: str) -> str:
    return f"%DLQ%{group}"


class RejectHandler:
    """Applies the configured policy; owns the recover store and the DLQ producer."""

    def __init__(self, *, policy: str | Callable[[Message, BaseException], Any], group: str,
                 consumer_id: str, zk_connect: Any, recover_dir: str | None,
                 recover_interval: float, codec: Codec,
                 on_error: Callable[[BaseException], None]) -> None:
        if not callable(policy) and policy not in POLICIES:
            raise ConfigError(f"reject_policy must be one of {POLICIES} or a callable, "
                              f"got {policy!r}")
        self.policy = policy
        self.group = group
        self._zk = zk_connect
        self._codec = codec
        self._on_error = on_error
        self._consumer_id = consumer_id
        self._store_dir = Path(recover_dir) if recover_dir else default_recover_dir()
        self._interval = recover_interval
        self._store: RecoverStore | None = None
        self._producer = None
        self._lock = threading.Lock()
        self._listeners: Callable[[str], Callable[[Message], Any] | None] | None = None
        self._redelivering = False
        self.rejected = 0

    @property
    def store(self) -> RecoverStore:
        with self._lock:
            if self._store is None:
                self._store = RecoverStore(self._store_dir, self.group, interval=self._interval)
            return self._store

    def store_size(self) -> int:
        """Messages in the recover store (0 without opening one)."""
        with self._lock:
            store = self._store
        if store is None and not (self._store_dir / self.group).is_dir():
            return 0
        return len(self.store)

    def __call__(self, message: Message, error: BaseException) -> None:
        self.rejected += 1
        if self.policy == "drop":
            log.error("dropping %r after repeated failures: %r", message, error)
            return
        if self.policy == "dlq":
            try:
                self._send_dlq(message)
                return
            except MetaqError as e:
                log.error("dead-lettering %r failed (%r); keeping it in the recover store",
                          message, e)
                self._on_error(e)
        elif callable(self.policy):
            try:
                self.policy(message, error)
                return
            except Exception as e:  # noqa: BLE001 - the user's handler failed: keep the message
                log.exception("reject handler failed on %r; keeping it in the recover store",
                              message)
                self._on_error(e)
        self._keep(message, error)

    def _keep(self, m: Message, error: BaseException) -> None:
        self.store.put(topic=m.topic, partition=m.partition, offset=m.offset,
                       next_offset=m.next_offset, msg_id=m.msg_id, flag=m.flag,
                       payload=m[6], error=error)
        self._ensure_redelivery()

    def _send_dlq(self, m: Message) -> None:
        from metaq.producer import Producer

        with self._lock:
            if self._producer is None:
                self._producer = Producer(self._zk)
            producer = self._producer
        producer.send(dlq_topic(self.group), m.raw_body, attribute=m.attribute)

    # -- redelivery --------------------------------------------------------------------

    def start_redelivery(self, listeners: Callable[[str], Callable[[Message], Any] | None]
                         ) -> None:
        """Redeliver stored messages through the current listener of their topic.

        The redelivery thread starts now if an earlier run left messages in the
        store, else at the first message kept.
        """
        self._listeners = listeners
        if (self._store_dir / self.group).is_dir():
            self._ensure_redelivery()

    def _ensure_redelivery(self) -> None:
        with self._lock:
            if self._redelivering or self._listeners is None:
                return
            self._redelivering = True
        listeners = self._listeners
        store = self.store

        def deliver(rec: RecoveredMessage) -> None:
            fn = listeners(rec.topic)
            if fn is None:
                raise MetaqError(f"no listener subscribed to {rec.topic!r} for redelivery")
            fn(Message.create(rec.topic, rec.partition, rec.offset, rec.next_offset,
                              rec.msg_id, rec.flag, rec.payload, self._codec))

        store.start(deliver, name=f"metaq-recover-{self._consumer_id}",
                    on_error=self._on_error)

    def close(self) -> None:
        with self._lock:
            store, producer = self._store, self._producer
        if store is not None:
            store.close()
        if producer is not None:
            producer.close()
