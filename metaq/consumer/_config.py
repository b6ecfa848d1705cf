"""Consumer configuration: one frozen, validated, keyword-only dataclass.

Defaults follow Metaq 1.4's client where it has one (in brackets in the
field docs); the others are what a production service expects.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from metaq._errors import ConfigError
from metaq._time import parse_time_ms
from metaq._zkclient import ZkSecurity
from zk_layout import (
    DEFAULT_MAX_MEMBERS,
    DEFAULT_MAX_TOTAL_BYTES,
    DEFAULT_NODE_BYTES,
    DEFAULT_RECORDS,
    DEFAULT_ROOT,
    READ_FROM,
    InvalidNameError,
    Layout,
)

__all__ = ["ConsumerConfig", "START_POSITIONS"]

START_POSITIONS = ("earliest", "latest")
OFFSET_RESETS = ("earliest", "latest", "fail")
_NAME = re.compile(r"^[A-Za-z0-9_.%\-]{1,200}$")
MIB = 1024 * 1024


def _positive(name: str, value: float, *, allow_zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ConsumerConfig:
    """How a :class:`~metaq.MessageConsumer` behaves.

    Every field is validated on construction; a wrong value raises
    :class:`metaq.ConfigError` naming the field.
    """

    #: Consumer group name; consumers of one group share the partitions.
    group: str
    #: The part after ``<group>_`` in the consumer id; ``None`` builds ``ip-pid-uuid``.
    consumer_id: str | None = None
    #: Static membership: a name stable across restarts (a pod or host name).  The
    #: consumer id becomes ``<group>_<instance_id>``; when this member goes away without
    #: ``close(leave=True)`` (a restart, a crash, a pause past its session), its
    #: partitions are held for it, fetched by nobody, for ``static_grace`` seconds; back
    #: within them, it takes the same partitions again and no other member moves.  A
    #: second live process with the same instance id is refused.  ``None``: a dynamic
    #: member (today's Metaq behaviour).  Not with ``consumer_id`` or ``broadcast``.
    instance_id: str | None = None
    #: How long a static member's partitions are held for it while it is away [30 s].
    static_grace: float = 30.0
    #: ZooKeeper root of the Metaq tree [``/meta``].
    zk_root: str = DEFAULT_ROOT
    #: ZooKeeper credentials, ACLs for the nodes we create, and TLS (default: open).
    zk_security: ZkSecurity | None = None
    #: ZooKeeper session timeout in seconds [30].
    zk_session_timeout: float = 30.0
    #: ZooKeeper connection timeout for ``start()`` in seconds.
    zk_connect_timeout: float = 15.0
    #: Fetch runner threads shared by all partitions [CPU count].  With listeners
    #: that only use the CPU, 1 is fastest (the GIL); more help listeners that wait.
    fetch_runner_count: int = field(default_factory=lambda: os.cpu_count() or 1)
    #: Socket timeout of one ``get`` in seconds [10].
    fetch_timeout: float = 10.0
    #: Largest delay between fetches of an idle or failing partition, seconds [5].
    max_fetch_delay: float = 5.0
    #: How long a metaq-py broker may hold a fetch of a partition with nothing new,
    #: answering it the moment a message arrives (long polling), seconds [RocketMQ's
    #: broker suspends a pull 15 s]; an idle partition then costs one request per hold.
    #: 0, or a broker that does not offer holding (a Java Metaq broker), backs off as
    #: Metaq does (max_fetch_delay).
    fetch_hold: float = 15.0
    #: Period of the offset commit timer, seconds [5].
    commit_period: float = 5.0
    #: Times a listener may fail on one message before the reject policy [5].
    max_fetch_retries: int = 5
    #: After the retries: ``recover`` (local store, redelivered until it succeeds),
    #: ``dlq`` (topic ``%DLQ%<group>``), ``drop``, or a callable ``fn(message, error)``.
    reject_policy: Any = "recover"
    #: Directory of the recover store (default ``$XDG_STATE_HOME/metaq/recover``).
    recover_dir: str | None = None
    #: Seconds between redeliveries from the recover store [300, Metaq's 5 min].
    recover_interval: float = 300.0
    #: ``orderly`` (one message at a time per partition, in offset order) or
    #: ``concurrent`` (a partition's messages handed to a pool of consume_threads;
    #: the committed offset is the smallest one still in flight).
    consume_mode: str = "orderly"
    #: Worker threads of concurrent mode [RocketMQ: 20].
    consume_threads: int = 20
    #: Concurrent mode flow control: stop pulling a partition while more than this many
    #: messages [1000] or bytes [100 MiB] of it are in flight, or while the span of its
    #: in-flight messages is over max_span messages [2000] (RocketMQ's defaults).
    pull_threshold_messages: int = 1000
    pull_threshold_bytes: int = 100 * MIB
    max_span: int = 2000
    #: Broadcast: every member consumes every partition; offsets go to a local file,
    #: the ZooKeeper group is ``<group>-<ip>`` (Metaq's naming).
    broadcast: bool = False
    #: Broadcast offsets file (default under $XDG_STATE_HOME/metaq/broadcast/).
    offset_file: str | None = None
    #: A custom offset store (load/load_many/commit), replacing ZooKeeper's.
    offset_store: Any = None
    #: Upper limit for the fetch size when a message is larger than max_size.
    max_fetch_size: int = 16 * MIB
    #: Assignment strategy: ``default``, ``consist``, ``roundrobin``, ``sticky`` or ``cooperative``.
    strategy: str = "default"
    #: Where a group with no committed offset starts: ``earliest``, ``latest``, or
    #: ``time:<ISO-8601 or epoch ms>`` (the first message at or after that time, found
    #: by msgId time; works against Java Metaq brokers too).
    start_position: str = "earliest"
    #: What to do with a position outside the log (a committed offset above the log end
    #: or below its start, garbage in an offset node): ``earliest`` (read from the log
    #: start: duplicates, never gaps), ``latest`` (skip to the end) or ``fail`` (fetch
    #: nothing from that partition until a seek).  Every case is reported to on_error
    #: as an OffsetOutOfRangeError naming what was skipped or re-read; an offset inside
    #: a message always moves to the start of that message.
    offset_reset: str = "earliest"
    #: Which of a broker id's brokers its partitions are read from: ``master`` (Metaq's
    #: rule: the master while it is registered, else one of its slaves) or
    #: ``slave-preferred`` (a slave while one is registered, else the master: takes read
    #: load off masters).  Master and slaves hold the same offsets, so a partition moves
    #: between them keeping its position; among several slaves each consumer keeps one
    #: (picked by its id).
    read_from: str = "master"
    #: Body codec for ``Message.body``: ``bytes``, ``str`` or ``msgpack``.
    codec: str = "bytes"
    #: Verify each message's CRC32 while consuming.
    verify_checksums: bool = True
    #: First and largest delay between attempts to claim a partition still held.
    claim_backoff: float = 0.1
    claim_backoff_max: float = 2.0
    #: Deadline for ``close()`` to stop fetchers and release partitions, seconds.
    close_timeout: float = 30.0
    #: Rebalance history (``consumers/<group>/history/<consumerId>``, kept after the
    #: member is gone; ``metaq group history``): this member's last rebalances kept
    #: [50] (0: record none), in a node of at most history_node_bytes [32 KiB]; the
    #: group keeps at most history_max_members nodes [100] and history_max_bytes
    #: bytes [2 MiB], the nodes written longest ago (gone members first) deleted.
    history_records: int = DEFAULT_RECORDS
    history_node_bytes: int = DEFAULT_NODE_BYTES
    history_max_members: int = DEFAULT_MAX_MEMBERS
    history_max_bytes: int = DEFAULT_MAX_TOTAL_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.group, str) or not _NAME.match(self.group):
            raise ConfigError(f"group must be 1-200 of [A-Za-z0-9_.%-], got {self.group!r}")
        if self.consumer_id is not None and (
            not isinstance(self.consumer_id, str) or not _NAME.match(self.consumer_id)
        ):
            raise ConfigError(
                f"consumer_id must be 1-200 of [A-Za-z0-9_.%-], got {self.consumer_id!r}")
        if self.instance_id is not None:
            if not isinstance(self.instance_id, str) or not _NAME.match(self.instance_id):
                raise ConfigError(
                    f"instance_id must be 1-200 of [A-Za-z0-9_.%-], got {self.instance_id!r}")
            if self.consumer_id is not None:
                raise ConfigError("give instance_id or consumer_id, not both: a static "
                                  "member's consumer id is <group>_<instance_id>")
            if self.broadcast:
                raise ConfigError("instance_id (static membership) does not apply to "
                                  "broadcast consumers: they own no partitions")
        if isinstance(self.static_grace, bool) or not isinstance(
                self.static_grace, (int, float)) or not 0 < self.static_grace <= 7 * 24 * 3600:
            raise ConfigError(f"static_grace must be a number of seconds in (0, 604800], "
                              f"got {self.static_grace!r}")
        try:  # "meta" and "/meta/" are "/meta", as Java reads a zkRoot
            Layout(self.zk_root)
        except (InvalidNameError, TypeError) as e:
            raise ConfigError(f"zk_root must be a ZooKeeper path, got {self.zk_root!r}: "
                              f"{e}") from None
        if not callable(self.reject_policy) and self.reject_policy not in ("recover", "dlq",
                                                                           "drop"):
            raise ConfigError("reject_policy must be 'recover', 'dlq', 'drop' or a callable, "
                              f"got {self.reject_policy!r}")
        for name in ("zk_session_timeout", "zk_connect_timeout", "fetch_timeout",
                     "recover_interval", "max_fetch_delay", "commit_period", "claim_backoff",
                     "claim_backoff_max", "close_timeout"):
            _positive(name, getattr(self, name))
        if isinstance(self.fetch_hold, bool) or not isinstance(self.fetch_hold, (int, float)) \
                or not 0 <= self.fetch_hold <= 3600:
            raise ConfigError(f"fetch_hold must be a number of seconds 0..3600, "
                              f"got {self.fetch_hold!r}")
        if self.zk_security is not None and not isinstance(self.zk_security, ZkSecurity):
            raise ConfigError("zk_security must be a metaq.ZkSecurity")
        if self.claim_backoff > self.claim_backoff_max:
            raise ConfigError("claim_backoff must not exceed claim_backoff_max")
        for name in ("fetch_runner_count", "max_fetch_retries", "max_fetch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{name} must be an int, got {value!r}")
        if not 1 <= self.fetch_runner_count <= 256:
            raise ConfigError(f"fetch_runner_count must be 1..256, got {self.fetch_runner_count}")
        if self.max_fetch_retries < 0:
            raise ConfigError(f"max_fetch_retries must be >= 0, got {self.max_fetch_retries}")
        if self.max_fetch_size < 1024:
            raise ConfigError(f"max_fetch_size must be >= 1024, got {self.max_fetch_size}")
        if self.consume_mode not in ("orderly", "concurrent"):
            raise ConfigError(f"consume_mode must be 'orderly' or 'concurrent', "
                              f"got {self.consume_mode!r}")
        for name in ("consume_threads", "pull_threshold_messages", "pull_threshold_bytes",
                     "max_span"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        if self.offset_store is not None and not all(
                callable(getattr(self.offset_store, m, None))
                for m in ("load", "load_many", "commit")):
            raise ConfigError("offset_store needs load(), load_many() and commit() methods")
        if self.offset_reset not in OFFSET_RESETS:
            raise ConfigError(
                f"offset_reset must be one of {OFFSET_RESETS}, got {self.offset_reset!r}")
        if self.start_position not in START_POSITIONS and not (
                isinstance(self.start_position, str) and self.start_position.startswith("time:")):
            raise ConfigError(
                f"start_position must be one of {START_POSITIONS} or 'time:<ISO-8601 or epoch "
                f"ms>', got {self.start_position!r}")
        self.start_time_ms  # noqa: B018 - validates a time: position
        from metaq.consumer._assignors import get_strategy

        if self.read_from not in READ_FROM:
            raise ConfigError(
                f"read_from must be 'master' (the master while it is registered, else a "
                f"slave) or 'slave-preferred' (a slave while one is registered, else the "
                f"master), got {self.read_from!r}")
        from metaq.protocol import get_codec

        get_codec(self.codec)
        get_strategy(self.strategy)
        self._check_history()

    def _check_history(self) -> None:
        for name, low, high in (("history_records", 0, 10_000),
                                ("history_node_bytes", 1024, 512 * 1024),
                                ("history_max_members", 1, 100_000),
                                ("history_max_bytes", 1024, 1024 * MIB)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ConfigError(f"{name} must be an int in {low}..{high}, got {value!r}")
        if self.history_max_bytes < self.history_node_bytes:
            raise ConfigError(f"history_max_bytes ({self.history_max_bytes}) must be at least "
                              f"history_node_bytes ({self.history_node_bytes}): the group "
                              f"must hold one member's node")

    @property
    def start_time_ms(self) -> int | None:
        """The time of a ``time:`` start position (epoch ms), else None."""
        if isinstance(self.start_position, str) and self.start_position.startswith("time:"):
            return parse_time_ms(self.start_position[5:], "start_position time")
        return None

    @classmethod
    def from_mapping(cls, group: str, options: dict[str, Any]) -> ConsumerConfig:
        """Build from keyword options, naming any unknown one."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown consumer option(s): {', '.join(unknown)}")
        return cls(group=group, **options)
