"""Broker configuration: a frozen, validated dataclass, loadable from a TOML file.

Defaults follow Metaq 1.4 (reference section 7): port 8123, one partition per
topic, 1 GiB segments, flush after 1000 messages or 10 s, 168 h retention,
1 MiB max transfer.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import zk_layout
from metaq._errors import ConfigError, ProtocolError
from metaq._zkclient import ZkSecurity
from metaq.protocol import DEFAULT_MAX_PAYLOAD, MAX_LINE, check_topic

__all__ = ["BrokerConfig", "load_config", "parse_topic_spec"]

GiB = 1024 * 1024 * 1024
MiB = 1024 * 1024
MAX_PARTITIONS = 1024


def _int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an int, got {value!r}")
    if value < lo or (hi is not None and value > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ConfigError(f"{name} must be {rng}, got {value}")
    return value


def _num(name: str, value: object, lo: float, *, strict: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise ConfigError(f"{name} must be a finite number, got {value!r}")
    if value < lo or (strict and value == lo):
        raise ConfigError(f"{name} must be {'>' if strict else '>='} {lo}, got {value}")
    return float(value)


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value


def _str(name: str, value: object, *, empty: bool = False) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise ConfigError(f"{name} must be a{'' if empty else ' non-empty'} string, "
                          f"got {value!r}")
    return value


@dataclass(frozen=True, kw_only=True)
class BrokerConfig:
    """Everything a broker needs.  Every field is validated; a bad one raises
    :class:`metaq.ConfigError` naming it."""

    #: Broker id, 0..1023 (it goes into every msgId).
    broker_id: int
    #: Directory holding ``<topic>-<partition>/`` logs; created if missing.
    data_dir: str | Path
    #: Address to listen on.
    host: str = "127.0.0.1"
    #: TCP port; 0 picks a free one (see ``Broker.port``).
    port: int = 8123
    #: Host written into ZooKeeper (``meta://host:port``); default ``host``, or this
    #: machine's name when ``host`` is a wildcard address.
    advertised_host: str | None = None
    #: Topics served from the start: name -> number of partitions.
    topics: Mapping[str, int] = field(default_factory=dict)
    #: Partitions of a topic created without a count (auto-created topics).
    num_partitions: int = 1
    #: Create an unknown topic on its first ``put`` (Metaq can; off by default).
    auto_create_topics: bool = False
    #: A new segment file is started once the current one reaches this size.
    max_segment_size: int = GiB
    #: fsync after this many unflushed messages of a partition; 0 = group commit
    #: (fsync before every put is acknowledged, batched across connections).
    unflush_threshold: int = 1000
    #: fsync pending messages at least this often (seconds).
    unflush_interval: float = 10.0
    #: Delete whole segments older than this many hours (never the writable one).
    retention_hours: float = 168.0
    #: How often the retention check runs (seconds).
    retention_check_interval: float = 300.0
    #: Largest reply body of one ``get`` (bytes).
    max_transfer_size: int = MiB
    #: Largest put payload (attribute section + body) accepted.
    max_message_size: int = DEFAULT_MAX_PAYLOAD
    #: Answer a ``get`` above the end with 301 and the end instead of 404.
    correct_offsets: bool = False
    #: ZooKeeper connect string (``host:port[,host:port][/chroot]``); None = no registration.
    zk_connect: str | None = None
    #: Metaq's root node in ZooKeeper.
    zk_root: str = zk_layout.DEFAULT_ROOT
    #: ZooKeeper credentials, ACLs of the nodes the broker creates, TLS (default: open).
    zk_security: ZkSecurity | None = None
    #: ZooKeeper session timeout (seconds).
    zk_session_timeout: float = 10.0
    #: How long start() waits for the first ZooKeeper connection (seconds).
    zk_connect_timeout: float = 15.0
    #: Longest request line accepted (bytes).
    max_line: int = MAX_LINE
    #: Stop reading from a connection while this many reply bytes wait to be sent.
    max_pending_bytes: int = 16 * MiB
    #: Stop reading from a connection while this many requests wait for an answer.
    max_inflight_requests: int = 100_000
    #: Most simultaneous client connections; more are closed at once (unless an unused
    #: one makes way: ``evict_unused_connections``).
    max_connections: int = 10_000
    #: Most simultaneous connections from one client address; more are closed at once
    #: (unless an unused one of that address makes way: ``evict_unused_connections``).
    max_connections_per_address: int = 1_000
    #: The last this many places of max_connections admit only addresses holding fewer
    #: than 8 connections, so a client that hoards connections cannot lock others out.
    connection_reserve: int = 64
    #: Close a connection whose request (a line, or a put's payload) has been coming in
    #: for longer than this, seconds: a slow or stuck client (0: never).
    request_timeout: float = 30.0
    #: Close a connection that sent nothing for this long, seconds (0: never).  Metaq
    #: clients send ``version`` heartbeats, so live ones are never idle this long.
    idle_timeout: float = 600.0
    #: Close a connection that has not sent one whole request this long after it was
    #: accepted, seconds (0: never): connections opened and left unused (a flood).
    #: Clients send their first request as soon as they connect (Java's, Gecko's, a
    #: ``version`` heartbeat after 10 s idle at the latest: ``ClientConfig.idleTime``).
    first_request_timeout: float = 30.0
    #: At a connection limit (``max_connections``, ``max_connections_per_address``, the
    #: reserve), admit the newcomer by closing a connection that has not sent a whole
    #: request yet, the oldest first (from the newcomer's address at its own limit, else
    #: from the address holding most of them), rather than refusing it: a flood of
    #: unused connections cannot lock out clients that do real work.  A connection that
    #: has sent a request is never closed for a newcomer.  Off: refuse, as before.
    evict_unused_connections: bool = True
    #: Longest a ``get`` at the log end may be held when its client asks (metaq-py's
    #: ``hold=<ms>`` extension), seconds; 0 answers every get at once (as Metaq does).
    max_hold: float = 30.0
    #: Most gets held at once over all connections; beyond, gets are answered at once.
    max_held_gets: int = 100_000
    #: Offer the idempotent producer (metaq-py's ``+idempotent``: the ``idem`` mark
    #: before puts, a resent put stored once; ``_producers``).  Off: not offered.
    idempotent: bool = True
    #: Forget a producer id not heard from for this many hours (its next put is then
    #: accepted whatever its sequence number).
    producer_expiry_hours: float = 168.0
    #: Per producer and partition, remember where at least its last this many
    #: messages were stored (a resent put older than that is refused, 410).
    producer_window: int = 65536
    #: Answer ``offset ... time=<ms>`` from each segment's time index (metaq-py's
    #: ``+timeindex`` extension; the files ``<segment>.timeindex``).  Off: the
    #: extension is not offered and clients search the log by time as with Java Metaq.
    time_index: bool = True
    #: Cap on the timeout a BEGIN asks for (Java's maxTxTimeoutInSeconds), seconds; 0: no
    #: cap.  A transaction begun without a timeout has none (as in Java): a local one
    #: ends with its connection, an XA branch waits for its transaction manager.
    max_transaction_timeout: float = 60.0
    #: Most bytes of messages one transaction may hold until its commit (kept in
    #: memory and in the journal); beyond, its puts are refused.
    max_transaction_size: int = 64 * MiB
    #: Java Metaq 1.4's behaviours, each off by default, for interoperability tests and
    #: for running beside Java brokers exactly as they answer (README, "Running against
    #: an existing Java Metaq cluster"):
    #: ``offset`` of a partition never written answers 404 "The topic `t` in partition
    #: `p` is not exists" (Java creates a partition's storage on its first put).
    java_unwritten_404: bool = False
    #: A ``get`` that finds nothing past the fsynced end answers 301 with the fsynced end
    #: (Java's ``updateConsumerOffsets``, whose max offset lags what it serves): the
    #: client is sent back over messages it already has.
    java_tell_max_offset: bool = False
    #: Never send more than ``max_transfer_size`` in one ``get`` reply, even when one
    #: message is bigger (Java caps at ``min(maxTransferSize, maxSize)``): such a
    #: message can then never be read from this broker.
    java_transfer_cap: bool = False
    #: Replication (README, "Replication"): start as a slave of this broker id (it must
    #: equal ``broker_id``; the CLI's ``--slave-of`` sets both).  None: start as master.
    slave_of: int | None = None
    #: This broker's replica number ``N`` (ZooKeeper's ``slave<N>``) whenever it is a
    #: slave; default 1 for a broker started as a slave, 0 for one started as master
    #: (which becomes a slave if another replica was promoted while it was away).
    #: Replicas of one broker id need distinct numbers.
    slave_id: int | None = None
    #: ``async``: a put is acknowledged once it is in this broker's log; ``sync``: once
    #: every in-sync slave has it too (durably when the slave uses group commit).
    replication: str = "async"
    #: A slave that has not caught up with a partition's end for this long leaves the
    #: in-sync set (seconds); it rejoins once it has caught up with every partition.
    replication_max_lag: float = 5.0
    #: A slave this many bytes behind on a partition leaves the in-sync set at once.
    replication_max_lag_bytes: int = 256 * MiB
    #: While a lone put waits for its in-sync slaves, the event loop polls this many
    #: microseconds for their answer before it sleeps (0: it sleeps at once): the
    #: wake-up it saves is most of a synchronous put's extra latency on an idle
    #: machine; it costs up to that much CPU per put (``metaq.broker._spin``).  A
    #: slave with ``replication = "sync"`` polls as long for the next put right after
    #: it copied a lone one (a synchronous ``send`` after another).
    replication_poll_us: int = 300
    #: With sync replication and no slave in sync: ``continue`` (acknowledge from this
    #: broker's log alone, reported in stats, metrics and ZooKeeper) or ``refuse`` puts.
    no_in_sync: str = "continue"
    #: A slave in the in-sync set takes over when its master's ZooKeeper session ends.
    auto_promote: bool = False
    #: How a slave copies: ``fetch`` (it pulls the master's partitions with gets, from
    #: a metaq-py or a Java master) or ``sync`` (it fetches nothing and stores the
    #: ``sync`` commands a Samsa-style Java master pushes, as Metaq's Gregor slave).
    copy_by: str = "fetch"

    def __post_init__(self) -> None:
        _int("broker_id", self.broker_id, 0, 1023)
        if isinstance(self.data_dir, str):
            _str("data_dir", self.data_dir)
        elif not isinstance(self.data_dir, Path):
            raise ConfigError(f"data_dir must be a path, got {self.data_dir!r}")
        object.__setattr__(self, "data_dir", Path(self.data_dir))
        _str("host", self.host)
        _int("port", self.port, 0, 65535)
        if self.advertised_host is not None:
            _str("advertised_host", self.advertised_host)
            try:
                zk_layout.BrokerUri(self.advertised_host, self.port or 1)
            except ValueError as e:
                raise ConfigError(f"advertised_host {self.advertised_host!r}: {e}") from None
        _int("num_partitions", self.num_partitions, 1, MAX_PARTITIONS)
        if not isinstance(self.topics, Mapping):
            raise ConfigError(f"topics must be a mapping of name to partitions, "
                              f"got {self.topics!r}")
        topics = {}
        for name, parts in self.topics.items():
            try:
                check_topic(name)
            except ProtocolError as e:
                raise ConfigError(f"topics: {e}") from None
            topics[name] = _int(f"topics[{name!r}]", parts, 1, MAX_PARTITIONS)
        object.__setattr__(self, "topics", MappingProxyType(topics))
        _bool("auto_create_topics", self.auto_create_topics)
        _int("max_segment_size", self.max_segment_size, 4096)
        _int("unflush_threshold", self.unflush_threshold, 0)
        _num("unflush_interval", self.unflush_interval, 0, strict=True)
        _num("retention_hours", self.retention_hours, 0, strict=True)
        _num("retention_check_interval", self.retention_check_interval, 0, strict=True)
        _int("max_transfer_size", self.max_transfer_size, 1024, 2**31 - 1)
        _int("max_message_size", self.max_message_size, 1, 2**31 - 1)
        _bool("correct_offsets", self.correct_offsets)
        _bool("time_index", self.time_index)
        _num("max_transaction_timeout", self.max_transaction_timeout, 0)
        _int("max_transaction_size", self.max_transaction_size, 1024, 2**62)
        _bool("java_unwritten_404", self.java_unwritten_404)
        _bool("java_tell_max_offset", self.java_tell_max_offset)
        _bool("java_transfer_cap", self.java_transfer_cap)
        if self.zk_connect is not None:
            _str("zk_connect", self.zk_connect)
        try:
            zk_layout.Layout(self.zk_root)
        except ValueError as e:
            raise ConfigError(f"zk_root: {e}") from None
        _num("zk_session_timeout", self.zk_session_timeout, 0, strict=True)
        _num("zk_connect_timeout", self.zk_connect_timeout, 0, strict=True)
        _int("max_line", self.max_line, 64, 1024 * 1024)
        _int("max_pending_bytes", self.max_pending_bytes, 64 * 1024)
        _int("max_inflight_requests", self.max_inflight_requests, 1)
        _int("max_connections", self.max_connections, 1)
        _int("max_connections_per_address", self.max_connections_per_address, 1)
        _int("connection_reserve", self.connection_reserve, 0)
        if self.connection_reserve >= self.max_connections:
            raise ConfigError(f"connection_reserve ({self.connection_reserve}) must be below "
                              f"max_connections ({self.max_connections})")
        _num("request_timeout", self.request_timeout, 0)
        if isinstance(self.idle_timeout, bool) or not isinstance(self.idle_timeout, (int, float)) \
                or self.idle_timeout < 0:
            raise ConfigError(f"idle_timeout must be a number >= 0, got {self.idle_timeout!r}")
        _num("first_request_timeout", self.first_request_timeout, 0)
        _bool("evict_unused_connections", self.evict_unused_connections)
        _num("max_hold", self.max_hold, 0)
        if self.slave_of is not None:
            _int("slave_of", self.slave_of, 0, 1023)
            if self.slave_of != self.broker_id:
                raise ConfigError(f"slave_of ({self.slave_of}) must equal broker_id "
                                  f"({self.broker_id}): a slave has its master's broker id")
            if self.zk_connect is None:
                raise ConfigError("slave_of needs zk_connect: a slave finds its master "
                                  "in ZooKeeper")
        if self.slave_id is not None:
            _int("slave_id", self.slave_id, 0, 2**31 - 1)
        if self.replication not in ("sync", "async"):
            raise ConfigError(f"replication must be 'sync' or 'async', "
                              f"got {self.replication!r}")
        _num("replication_max_lag", self.replication_max_lag, 0, strict=True)
        _int("replication_max_lag_bytes", self.replication_max_lag_bytes, 1)
        _int("replication_poll_us", self.replication_poll_us, 0, 100_000)
        if self.no_in_sync not in ("continue", "refuse"):
            raise ConfigError(f"no_in_sync must be 'continue' or 'refuse', "
                              f"got {self.no_in_sync!r}")
        _bool("auto_promote", self.auto_promote)
        if self.copy_by not in ("fetch", "sync"):
            raise ConfigError(f"copy_by must be 'fetch' or 'sync', got {self.copy_by!r}")
        _int("max_held_gets", self.max_held_gets, 0)
        _bool("idempotent", self.idempotent)
        _num("producer_expiry_hours", self.producer_expiry_hours, 0, strict=True)
        _int("producer_window", self.producer_window, 1, 2**31 - 1)

    @property
    def group_commit(self) -> bool:
        """True when every put is fsynced before it is acknowledged."""
        return self.unflush_threshold == 0

    @property
    def replica(self) -> int:
        """This broker's replica number (``slave_id`` or its default)."""
        if self.slave_id is not None:
            return self.slave_id
        return 1 if self.slave_of is not None else 0

    def replace(self, **changes: Any) -> BrokerConfig:
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


_FIELDS = {f.name for f in dataclasses.fields(BrokerConfig)}


def parse_topic_spec(spec: str, default_partitions: int = 1) -> tuple[str, int]:
    """``NAME`` or ``NAME:PARTITIONS`` (as given to ``--topic``)."""
    name, sep, count = spec.rpartition(":")
    if not sep:
        name, count = spec, str(default_partitions)
    if not count.isdigit():
        raise ConfigError(f"--topic {spec!r}: expected NAME or NAME:PARTITIONS")
    try:
        check_topic(name)
    except ProtocolError as e:
        raise ConfigError(f"--topic {spec!r}: {e}") from None
    return name, _int(f"--topic {spec!r} partitions", int(count), 1, MAX_PARTITIONS)


def load_config(path: str | Path | None = None, **overrides: Any) -> BrokerConfig:
    """Read a TOML file of :class:`BrokerConfig` fields, then apply ``overrides``.

    The file holds top-level keys named like the fields and a ``[topics]``
    table of ``name = partitions``.  Overrides whose value is None are ignored;
    an override ``topics`` is merged into the file's topics.
    """
    values: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                values = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        unknown = sorted(set(values) - _FIELDS)
        if unknown:
            raise ConfigError(f"config file {path}: unknown keys {', '.join(unknown)} "
                              f"(known: {', '.join(sorted(_FIELDS))})")
        if "topics" in values and not isinstance(values["topics"], dict):
            raise ConfigError(f"config file {path}: topics must be a table name = partitions")
    for key, value in overrides.items():
        if value is None:
            continue
        if key not in _FIELDS:
            raise ConfigError(f"unknown broker option {key}")
        if key == "topics":
            merged = dict(values.get("topics", {}))
            merged.update(value)
            values["topics"] = merged
        else:
            values[key] = value
    for required in ("broker_id", "data_dir"):
        if required not in values:
            raise ConfigError(f"{required} is required (flag or config file)")
    return BrokerConfig(**values)
