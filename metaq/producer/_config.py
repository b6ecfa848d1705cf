"""Producer configuration: one frozen, validated, keyword-only dataclass.

Defaults follow RocketMQ's producer where Metaq users know them (3 s send
timeout, 2 retries on another partition, 4 MiB bodies; reference section 9).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

from metaq._errors import ConfigError
from metaq._zkclient import ZkSecurity
from metaq.protocol import MAX_MESSAGE_SIZE, MAX_PAYLOAD_SIZE, Codec, get_codec
from zk_layout import DEFAULT_ROOT, InvalidNameError, Layout, Partition

__all__ = ["ProducerConfig", "PartitionerFn", "PARTITIONERS", "MIB"]

MIB = 1024 * 1024
PARTITIONERS = ("roundrobin", "hash")

#: A user partitioner: ``(topic, partitions, body, key) -> partition`` where
#: ``partitions`` is the topic's writable partitions in Metaq order and the
#: answer is one of them (a :class:`zk_layout.Partition`, its name
#: ``"<brokerId>-<index>"``, or its position in ``partitions``).
PartitionerFn = Callable[[str, Sequence[Partition], bytes, Any], "Partition | str | int"]


def _number(name: str, value: object, *, minimum: float = 0.0, allow_equal: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if value < minimum or (value == minimum and not allow_equal):
        op = ">=" if allow_equal else ">"
        raise ConfigError(f"{name} must be {op} {minimum:g}, got {value!r}")


def _integer(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{name} must be in {lo}..{hi}, got {value}")


@dataclass(frozen=True, kw_only=True)
class ProducerConfig:
    """How a :class:`~metaq.Producer` behaves.

    Every field is validated on construction; a wrong value raises
    :class:`metaq.ConfigError` naming the field.
    """

    #: ZooKeeper root of the Metaq tree [``/meta``].
    zk_root: str = DEFAULT_ROOT
    #: ZooKeeper session timeout in seconds.
    zk_session_timeout: float = 30.0
    #: How long the constructor waits for a ZooKeeper session, seconds.
    zk_connect_timeout: float = 15.0
    #: ZooKeeper credentials and TLS (:class:`metaq.ZkSecurity`); None: plain, open.
    zk_security: ZkSecurity | None = None
    #: Total time one message may take, all attempts included, seconds [3].
    send_timeout: float = 3.0
    #: Extra attempts after a failed one, each on another partition when there is one [2].
    retries: int = 2
    #: Nothing answered on a broker connection for this long while messages wait
    #: for replies and the connection is declared dead (its messages are retried);
    #: ``None``: ``send_timeout / (retries + 1)``.
    request_timeout: float | None = None
    #: TCP connect timeout to a broker, seconds (capped by what is left of send_timeout).
    connect_timeout: float = 3.0
    #: Largest message body in bytes, after the codec [4 MiB].
    max_message_size: int = MAX_MESSAGE_SIZE
    #: ``"roundrobin"`` (default), ``"hash"`` (CRC32 of the key: stable across
    #: processes; no key falls back to round-robin) or a :data:`PartitionerFn`.
    partitioner: str | PartitionerFn = "roundrobin"
    #: Body codec: ``"auto"`` (bytes as is, str as UTF-8, anything else msgpack),
    #: ``"bytes"``, ``"str"``, ``"msgpack"`` or a :class:`metaq.protocol.Codec`.
    codec: str | Codec = "auto"
    #: Most requests in flight on one broker connection; ``send_async`` blocks beyond.
    max_in_flight: int = 16384
    #: Most request bytes in flight on one broker connection.
    max_in_flight_bytes: int = 64 * MIB
    #: How long a broker that failed is avoided for first attempts, seconds.
    broker_backoff: float = 1.0
    #: Pause before a retry that has to reuse a partition or broker that just failed.
    retry_backoff: float = 0.05
    #: How long ``close()`` waits for messages in flight, seconds.
    close_timeout: float = 10.0
    #: Idempotent sends (metaq-py brokers listing ``+idempotent``): each message carries
    #: this producer's id and a per-partition sequence number, and a retry goes to the
    #: *same* partition with the same number, so a resend whose first answer was lost
    #: is stored once (the broker answers it with the original msgId and offset).
    #: Retries then wait for that partition's broker (within ``send_timeout``) rather
    #: than moving on.  To brokers without the extension (Java Metaq) plain puts go,
    #: retried as usual.  Off by default.
    idempotent: bool = False

    def __post_init__(self) -> None:
        try:
            Layout(self.zk_root)
        except (InvalidNameError, TypeError) as e:
            raise ConfigError(f"zk_root must be a ZooKeeper path, got "
                              f"{self.zk_root!r}: {e}") from None
        for name in ("zk_session_timeout", "zk_connect_timeout", "send_timeout",
                     "connect_timeout", "close_timeout"):
            _number(name, getattr(self, name))
        for name in ("broker_backoff", "retry_backoff"):
            _number(name, getattr(self, name), allow_equal=True)
        if self.zk_security is not None and not isinstance(self.zk_security, ZkSecurity):
            raise ConfigError(f"zk_security must be a metaq.ZkSecurity, got "
                              f"{type(self.zk_security).__name__}")
        if self.request_timeout is not None:
            _number("request_timeout", self.request_timeout)
        if not isinstance(self.idempotent, bool):
            raise ConfigError(f"idempotent must be true or false, got {self.idempotent!r}")
        _integer("retries", self.retries, 0, 100)
        _integer("max_message_size", self.max_message_size, 1, MAX_PAYLOAD_SIZE)
        _integer("max_in_flight", self.max_in_flight, 1, 1 << 24)
        _integer("max_in_flight_bytes", self.max_in_flight_bytes, 1024, 1 << 40)
        p = self.partitioner
        if isinstance(p, str):
            if p not in PARTITIONERS:
                raise ConfigError(f"partitioner must be one of {PARTITIONERS} or a callable "
                                  f"(topic, partitions, body, key) -> partition, got {p!r}")
        elif not callable(p):
            raise ConfigError(f"partitioner must be one of {PARTITIONERS} or a callable, "
                              f"got {type(p).__name__}")
        get_codec(self.codec)

    @property
    def attempt_timeout(self) -> float:
        """The effective ``request_timeout``."""
        if self.request_timeout is not None:
            return self.request_timeout
        return self.send_timeout / (self.retries + 1)

    @classmethod
    def from_mapping(cls, options: dict[str, Any]) -> ProducerConfig:
        """Build from keyword options, naming any unknown one."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown producer option(s): {', '.join(unknown)}; known: "
                              f"{', '.join(sorted(known))}")
        return cls(**options)
