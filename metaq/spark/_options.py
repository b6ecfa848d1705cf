"""The options of the ``metaq`` Spark source, parsed and validated once.

Spark hands a data source its options as strings with case-insensitive names;
:meth:`SourceOptions.from_options` turns them into a frozen, validated
:class:`SourceOptions` or raises :class:`metaq.ConfigError` naming the option
and what is wrong with it.  Unknown option names are refused (a typo such as
``startingOffset`` would otherwise silently read from the default position).

Offsets (``startingOffsets`` / ``endingOffsets``) are ``earliest``,
``latest``, ``group`` (the group's committed offsets in ZooKeeper) or JSON
per partition as in Spark's Kafka source: ``{"orders": {"0-0": 4096, "0-1":
-2}}`` with ``-2`` for earliest and ``-1`` for latest.  Partitions that the
JSON does not name take the default: earliest for a start, latest for an end.

Times (issue 16, Kafka's names and meaning): ``startingTimestamp`` (one time for
every partition; wins over the two below), ``startingOffsetsByTimestamp`` (JSON
``{"orders": {"0-0": <time>}}``; wins over ``startingOffsets`` for the
partitions it names, the others take ``startingOffsets``), and for batch reads
``endingTimestamp`` / ``endingOffsetsByTimestamp`` likewise over
``endingOffsets``.  A time is epoch milliseconds or ISO-8601; a partition
starts at its first message whose msgId time is at or after it.  When no
message is that late, a start follows ``startingOffsetsByTimestampStrategy``
(``error``, Kafka's default, or ``latest``) and an end is the log end.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from metaq._errors import ConfigError
from metaq._time import parse_time_ms
from metaq.spark._arrow import CODECS
from zk_layout import (
    DEFAULT_ROOT,
    READ_FROM,
    InvalidNameError,
    Layout,
    check_group,
    check_topic,
    parse_partition,
)

__all__ = ["OffsetSpec", "SourceOptions", "EARLIEST", "LATEST", "GROUP", "DEFAULT_GROUP"]

MIB = 1024 * 1024
#: Group used for the ``get`` requests and for commits when no ``group`` option is given.
DEFAULT_GROUP = "metaq-spark"
EARLIEST_CODE, LATEST_CODE = -2, -1
_KINDS = ("earliest", "latest", "group", "json", "timestamp")


@dataclass(frozen=True, kw_only=True)
class OffsetSpec:
    """Where to start or end: ``kind`` is ``earliest``, ``latest``, ``group``,
    ``json`` or ``timestamp``; for ``json``, ``per_partition`` maps topic ->
    partition name -> offset (``-2`` earliest, ``-1`` latest); for
    ``timestamp`` it maps topic -> partition -> epoch ms, or ``all_ms`` is the
    time of every partition, ``fallback`` is where partitions that
    ``per_partition`` does not name go, and ``strategy`` (``error`` or
    ``latest``) what a start does when no message is that late."""

    kind: str
    per_partition: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    all_ms: int | None = None
    fallback: OffsetSpec | None = None
    strategy: str = "error"

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ConfigError(f"offset kind must be one of {_KINDS}, got {self.kind!r}")

    def describe(self) -> str:
        if self.kind not in ("json", "timestamp"):
            return self.kind
        if self.all_ms is not None:
            return str(self.all_ms)
        return json.dumps({t: dict(p) for t, p in self.per_partition.items()}, sort_keys=True)


EARLIEST = OffsetSpec(kind="earliest")
LATEST = OffsetSpec(kind="latest")
GROUP = OffsetSpec(kind="group")


def _json_object(name: str, text: str, example: str, *, value: str,
                 words: str = "") -> dict:
    """Option ``name``'s JSON object of topic -> {partition: ``value``}; ``words``:
    the other forms the option takes, named when the text is no JSON."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"option {name} must be {words}JSON like {example}, "
                          f"got {text!r} ({e})") from None
    if not isinstance(obj, dict) or not obj:
        raise ConfigError(f"option {name}: JSON must be a non-empty object of topic -> "
                          f"{{partition: {value}}} like {example}, got {text!r}")
    return obj


def _check_json_topic(name: str, topic: str, topics: tuple[str, ...]) -> None:
    if topics:
        if topic not in topics:
            raise ConfigError(f"option {name} names topic {topic!r}, which is not among the "
                              f"topics read ({', '.join(topics)})")
        return
    try:  # subscribePattern: the topics are known only when planning
        check_topic(topic)
    except InvalidNameError as e:
        raise ConfigError(f"option {name}: {e}") from None


def _json_partition(name: str, topic: str, part: str) -> str:
    try:
        return str(parse_partition(part))
    except InvalidNameError:
        raise ConfigError(f"option {name}: {part!r} of topic {topic!r} is not a "
                          f"partition name '<brokerId>-<index>'") from None


def parse_timestamps(name: str, text: str, topics: tuple[str, ...]) -> OffsetSpec:
    """Parse ``startingOffsetsByTimestamp`` / ``endingOffsetsByTimestamp``:
    ``{"topic": {"<brokerId>-<index>": <epoch ms or ISO-8601>}}``."""
    obj = _json_object(name, text, '{"topic": {"0-0": 1700000000000}}', value="time")
    out: dict[str, dict[str, int]] = {}
    for topic, parts in obj.items():
        _check_json_topic(name, topic, topics)
        if not isinstance(parts, dict) or not parts:
            raise ConfigError(f"option {name}: the value for topic {topic!r} must be a "
                              f"non-empty object of partition -> time, got {parts!r}")
        out[topic] = {_json_partition(name, topic, part):
                      parse_time_ms(when, f"option {name}: time of {topic} {part}")
                      for part, when in parts.items()}
    return OffsetSpec(kind="timestamp", per_partition=out)


def parse_offsets(name: str, text: str, topics: tuple[str, ...]) -> OffsetSpec:
    """Parse a ``startingOffsets`` / ``endingOffsets`` value (see the module doc)."""
    word = text.strip().lower()
    if word in ("earliest", "latest", "group"):
        return OffsetSpec(kind=word)
    obj = _json_object(name, text, '{"topic": {"0-0": 1234}}', value="offset",
                       words="earliest, latest, group or ")
    out: dict[str, dict[str, int]] = {}
    for topic, parts in obj.items():
        _check_json_topic(name, topic, topics)
        if not isinstance(parts, dict):
            raise ConfigError(f"option {name}: the value for topic {topic!r} must be an object "
                              f"of partition -> offset, got {parts!r}")
        per: dict[str, int] = {}
        for part, offset in parts.items():
            per[_json_partition(name, topic, part)] = offset
            if isinstance(offset, bool) or not isinstance(offset, int) or offset < -2 \
                    or offset > 2**63 - 1:
                raise ConfigError(f"option {name}: offset of {topic} {part} must be an integer "
                                  f">= 0, or -2 (earliest) / -1 (latest), got {offset!r}")
        out[topic] = per
    return OffsetSpec(kind="json", per_partition=out)


def _positive_int(name: str, value: Any, *, lo: int = 1, hi: int = 2**62) -> int:
    if isinstance(value, str):
        try:
            value = int(value.strip().replace("_", ""))
        except ValueError:
            raise ConfigError(f"option {name} must be an integer, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(f"option {name} must be an integer in {lo}..{hi}, got {value!r}")
    return value


def _seconds(name: str, value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"option {name} must be a number of seconds, got {value!r}") from None
    if not seconds > 0 or seconds != seconds or seconds == float("inf"):
        raise ConfigError(f"option {name} must be a positive number of seconds, got {value!r}")
    return seconds


_DURATION = re.compile(r"\s*(\d+(?:\.\d*)?)\s*(ms|s|sec|secs|m|min|mins|h|d)?\s*", re.I)
_UNIT_MS = {None: 1, "ms": 1, "s": 1000, "sec": 1000, "secs": 1000, "m": 60_000,
            "min": 60_000, "mins": 60_000, "h": 3_600_000, "d": 86_400_000}


def _duration_seconds(name: str, value: Any) -> float:
    """Spark's time strings (``15m``, ``30s``, ``500ms``; a plain number is ms)."""
    match = _DURATION.fullmatch(str(value))
    if match is None:
        raise ConfigError(f"option {name} must be a duration like 15m, 30s or 500ms "
                          f"(a plain number is milliseconds), got {value!r}")
    unit = match.group(2).lower() if match.group(2) else None
    seconds = float(match.group(1)) * _UNIT_MS[unit] / 1000
    if not seconds > 0:
        raise ConfigError(f"option {name} must be a positive duration, got {value!r}")
    return seconds


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ConfigError(f"option {name} must be true or false, got {value!r}")


# Spark option name -> dataclass field (and the other way, for messages).
_NAMES = {
    "zk.connect": "zk_connect",
    "zk.root": "zk_root",
    "zk.timeout": "zk_timeout",
    "topic": "topics",
    "group": "group",
    "startingoffsets": "starting_offsets",
    "endingoffsets": "ending_offsets",
    "maxbytesperpartition": "max_bytes_per_partition",
    "maxbytespertrigger": "max_bytes_per_trigger",
    "failondataloss": "fail_on_data_loss",
    "fetchsize": "fetch_size",
    "verifychecksums": "verify_checksums",
    "codec": "codec",
    "brokertimeout": "broker_timeout",
    "brokerretrytimeout": "broker_retry_timeout",
    "commitoffsets": "commit_offsets",
    "offsetreset": "offset_reset",
    "subscribepattern": "subscribe_pattern",
    "startingtimestamp": "starting_timestamp",
    "startingoffsetsbytimestamp": "starting_offsets_by_timestamp",
    "startingoffsetsbytimestampstrategy": "starting_offsets_by_timestamp_strategy",
    "endingtimestamp": "ending_timestamp",
    "endingoffsetsbytimestamp": "ending_offsets_by_timestamp",
    "maxoffsetspertrigger": "max_offsets_per_trigger",
    "minoffsetspertrigger": "min_offsets_per_trigger",
    "maxtriggerdelay": "max_trigger_delay",
    "readfrom": "read_from",
}
_SPELLING = {
    "zk.connect": "zk.connect", "zk.root": "zk.root", "zk.timeout": "zk.timeout",
    "topic": "topic", "group": "group", "startingoffsets": "startingOffsets",
    "endingoffsets": "endingOffsets", "maxbytesperpartition": "maxBytesPerPartition",
    "maxbytespertrigger": "maxBytesPerTrigger", "failondataloss": "failOnDataLoss",
    "fetchsize": "fetchSize", "verifychecksums": "verifyChecksums", "codec": "codec",
    "brokertimeout": "brokerTimeout", "brokerretrytimeout": "brokerRetryTimeout",
    "commitoffsets": "commitOffsets", "offsetreset": "offsetReset",
    "subscribepattern": "subscribePattern", "startingtimestamp": "startingTimestamp",
    "startingoffsetsbytimestamp": "startingOffsetsByTimestamp",
    "startingoffsetsbytimestampstrategy": "startingOffsetsByTimestampStrategy",
    "endingtimestamp": "endingTimestamp", "endingoffsetsbytimestamp": "endingOffsetsByTimestamp",
    "maxoffsetspertrigger": "maxOffsetsPerTrigger", "minoffsetspertrigger": "minOffsetsPerTrigger",
    "maxtriggerdelay": "maxTriggerDelay", "readfrom": "readFrom",
}
#: Options that make no sense for a stream (refused there, by name).
BATCH_ONLY = ("endingOffsets", "endingTimestamp", "endingOffsetsByTimestamp")
_FIELD_SPELLING = {field_name: _SPELLING[key] for key, field_name in _NAMES.items()}


@dataclass(frozen=True, kw_only=True)
class SourceOptions:
    """Validated options of one ``spark.read`` / ``spark.readStream`` of ``metaq``.

    Spark option names in brackets; defaults after the colon.
    """

    #: [``zk.connect``] ZooKeeper ``host:port[,host:port][/chroot]``: required.
    zk_connect: str
    #: [``topic``] topics to read, comma-separated in the option: required
    #: unless ``subscribePattern`` is given (exactly one of the two).
    topics: tuple[str, ...] = ()
    #: [``subscribePattern``] a regular expression (Python ``re``, matched against
    #: the whole name as Kafka's Java pattern is) over the topics registered in
    #: ZooKeeper (``brokers/topics-sub``), listed again at every plan, so a
    #: stream picks up topics created later (from their log start).
    subscribe_pattern: str | None = None
    #: [``zk.root``] root of Metaq's tree: ``/meta``.
    zk_root: str = DEFAULT_ROOT
    #: [``zk.timeout``] seconds to wait for a ZooKeeper session: 15.
    zk_timeout: float = 15.0
    #: [``group``] consumer group whose offsets ``group`` positions read and that
    #: streaming queries and ``foreach_partition`` commit to: ``metaq-spark``.
    group: str = DEFAULT_GROUP
    #: [``startingOffsets``] batch: ``earliest``; streaming: ``group`` (partitions
    #: without a committed offset start at the earliest, as a new Metaq consumer does).
    starting_offsets: OffsetSpec | None = None
    #: [``endingOffsets``] batch only (None: not given, ``latest``).
    ending_offsets: OffsetSpec | None = None
    #: [``startingTimestamp``] one time (epoch ms or ISO-8601) for every
    #: partition; wins over startingOffsetsByTimestamp and startingOffsets;
    #: streaming: only when the query starts without a checkpoint.
    starting_timestamp: int | None = None
    #: [``startingOffsetsByTimestamp``] JSON topic -> partition -> time; wins
    #: over startingOffsets for the partitions it names.
    starting_offsets_by_timestamp: OffsetSpec | None = None
    #: [``startingOffsetsByTimestampStrategy``] ``error`` (fail) or ``latest``
    #: (the log end) when a starting time is later than every message: ``error``.
    starting_offsets_by_timestamp_strategy: str = "error"
    #: [``endingTimestamp``] batch only: one end time for every partition (the
    #: first message at or after it is not read; none that late: the log end).
    ending_timestamp: int | None = None
    #: [``endingOffsetsByTimestamp``] batch only: JSON topic -> partition -> time.
    ending_offsets_by_timestamp: OffsetSpec | None = None
    #: [``maxBytesPerPartition``] batch: a topic partition with more bytes to
    #: read is split into byte ranges of about this size: 128 MiB.
    max_bytes_per_partition: int = 128 * MIB
    #: [``maxBytesPerTrigger``] streaming: most bytes per micro-batch over all
    #: partitions, shared in proportion to each partition's backlog: no limit.
    max_bytes_per_trigger: int | None = None
    #: [``maxOffsetsPerTrigger``] streaming: most messages per micro-batch over
    #: all partitions, shared in proportion to each partition's backlog (see the
    #: package docstring for how messages are counted in a byte-offset log).
    max_offsets_per_trigger: int | None = None
    #: [``minOffsetsPerTrigger``] streaming: plan no micro-batch until this many
    #: messages wait (over all partitions) or maxTriggerDelay has passed since
    #: the last micro-batch (or the query's start).
    min_offsets_per_trigger: int | None = None
    #: [``maxTriggerDelay``] seconds (the option takes ``15m``, ``30s``,
    #: ``500ms``): with minOffsetsPerTrigger, the longest wait: 15 minutes.
    max_trigger_delay: float = 900.0
    #: [``failOnDataLoss``] fail when wanted messages are gone (deleted by
    #: retention, log shorter than planned, corrupt bytes); false: log a warning
    #: and skip to what is there: true.
    fail_on_data_loss: bool = True
    #: [``offsetReset``] a committed group offset outside the log (above its end, below
    #: its start) or garbage in its node: ``earliest`` (read from the log start),
    #: ``latest`` (from its end) or ``fail`` (DataLossError), as the consumer's
    #: offset_reset; default: ``fail`` with failOnDataLoss, else the nearest end.
    offset_reset: str | None = None
    #: [``fetchSize``] bytes asked for per ``get`` (a broker caps it, 1 MiB by
    #: default; a bigger message makes a fetch grow as needed): 1 MiB.
    fetch_size: int = MIB
    #: [``verifyChecksums``] check every message's CRC32: true.
    verify_checksums: bool = True
    #: [``codec``] add a ``decoded`` string column: ``str`` (UTF-8 text) or
    #: ``msgpack`` (the value as JSON text): none.
    codec: str | None = None
    #: [``brokerTimeout``] socket timeout of one broker request, seconds: 30.
    broker_timeout: float = 30.0
    #: [``brokerRetryTimeout``] how long a task keeps trying to reach a broker
    #: that is down (re-reading its address from ZooKeeper), seconds: 120.
    broker_retry_timeout: float = 120.0
    #: [``commitOffsets``] streaming: write processed offsets to ZooKeeper: true.
    commit_offsets: bool = True
    #: [``readFrom``] which of a broker id's brokers its partitions are read from, as
    #: the consumer's read_from: ``master`` (the master while it is registered, else a
    #: slave) or ``slave-preferred`` (a slave while one is registered, else the
    #: master); among several slaves the group name picks one: ``master``.
    read_from: str = "master"

    def __post_init__(self) -> None:
        if not isinstance(self.zk_connect, str) or not self.zk_connect.strip():
            raise ConfigError("option zk.connect is required: 'host:port[/chroot]'")
        if self.topics and self.subscribe_pattern is not None:
            raise ConfigError("options topic and subscribePattern are exclusive: give one "
                              "(a list of topics, or a regular expression over topic names)")
        if not self.topics and self.subscribe_pattern is None:
            raise ConfigError("option topic (one topic, or several comma-separated) or "
                              "subscribePattern is required")
        if self.subscribe_pattern is not None:
            try:
                re.compile(self.subscribe_pattern)
            except (re.error, TypeError) as e:
                raise ConfigError(f"option subscribePattern {self.subscribe_pattern!r} is not "
                                  f"a regular expression: {e}") from None
        for topic in self.topics:
            try:
                check_topic(topic)
            except InvalidNameError as e:
                raise ConfigError(f"option topic: {e}") from None
        if len(set(self.topics)) != len(self.topics):
            raise ConfigError(f"option topic names a topic twice: {','.join(self.topics)}")
        try:
            Layout(self.zk_root)
        except (InvalidNameError, TypeError) as e:
            raise ConfigError(f"option zk.root must be a ZooKeeper path: {e}") from None
        try:
            check_group(self.group)
        except InvalidNameError as e:
            raise ConfigError(f"option group: {e}") from None
        for name in ("max_bytes_per_partition", "fetch_size"):
            _positive_int(name, getattr(self, name), lo=1024)
        for name in ("max_bytes_per_trigger", "max_offsets_per_trigger",
                     "min_offsets_per_trigger"):
            if getattr(self, name) is not None:
                _positive_int(_FIELD_SPELLING[name], getattr(self, name))
        if self.starting_offsets_by_timestamp_strategy not in ("error", "latest"):
            raise ConfigError(f"option startingOffsetsByTimestampStrategy must be error or "
                              f"latest, got {self.starting_offsets_by_timestamp_strategy!r}")
        for name in ("starting_timestamp", "ending_timestamp"):
            if getattr(self, name) is not None:
                parse_time_ms(getattr(self, name), f"option {_FIELD_SPELLING[name]}")
        if self.offset_reset not in (None, "earliest", "latest", "fail"):
            raise ConfigError(f"option offsetReset must be earliest, latest or fail, "
                              f"got {self.offset_reset!r}")
        if self.read_from not in READ_FROM:
            raise ConfigError(f"option readFrom must be master or slave-preferred, "
                              f"got {self.read_from!r}")
        if self.codec is not None and self.codec not in CODECS:
            raise ConfigError(f"option codec must be one of {', '.join(CODECS)}, "
                              f"got {self.codec!r}")
        if self.ending_offsets is not None and self.ending_offsets.kind == "json":
            for topic, parts in self.ending_offsets.per_partition.items():
                for part, offset in parts.items():
                    if offset == EARLIEST_CODE:
                        raise ConfigError(f"option endingOffsets: -2 (earliest) is not allowed "
                                          f"as an end ({topic} {part})")

    @classmethod
    def from_options(cls, options: Mapping[str, Any]) -> SourceOptions:
        """Parse Spark's string options (names case-insensitive)."""
        raw: dict[str, Any] = {}
        for key, value in options.items():
            low = str(key).lower()
            if low == "path":  # what .load(path) passes; meaningless here
                raise ConfigError("the metaq source takes no path: use .option('topic', ...)")
            if low not in _NAMES:
                known = ", ".join(sorted(_SPELLING.values()))
                raise ConfigError(f"unknown option {key!r} for the metaq source; known: {known}")
            raw[_NAMES[low]] = value
        kwargs: dict[str, Any] = {}
        for name, value in raw.items():
            spelled = _FIELD_SPELLING[name]
            if name == "topics":
                kwargs[name] = tuple(t.strip() for t in str(value).split(",") if t.strip())
            elif name in ("zk_connect", "zk_root", "group"):
                kwargs[name] = str(value).strip()
            elif name == "offset_reset":
                kwargs[name] = str(value).strip().lower()
            elif name == "codec":
                text = str(value).strip().lower()
                kwargs[name] = None if text in ("", "none", "bytes") else text
            elif name in ("zk_timeout", "broker_timeout", "broker_retry_timeout"):
                kwargs[name] = _seconds(spelled, value)
            elif name in ("fail_on_data_loss", "verify_checksums", "commit_offsets"):
                kwargs[name] = _bool(spelled, value)
            elif name in ("max_bytes_per_partition", "fetch_size"):
                kwargs[name] = _positive_int(spelled, value, lo=1024)
            elif name in ("max_bytes_per_trigger", "max_offsets_per_trigger",
                          "min_offsets_per_trigger"):
                kwargs[name] = _positive_int(spelled, value)
            elif name == "max_trigger_delay":
                kwargs[name] = _duration_seconds(spelled, value)
            elif name == "subscribe_pattern":
                kwargs[name] = str(value)
            elif name in ("starting_timestamp", "ending_timestamp"):
                kwargs[name] = parse_time_ms(str(value), f"option {spelled}")
            elif name in ("starting_offsets_by_timestamp_strategy", "read_from"):
                kwargs[name] = str(value).strip().lower()
        topics = kwargs.get("topics", ())
        for name in ("starting_offsets", "ending_offsets"):
            if name in raw:
                kwargs[name] = parse_offsets(_FIELD_SPELLING[name], str(raw[name]), topics)
        for name in ("starting_offsets_by_timestamp", "ending_offsets_by_timestamp"):
            if name in raw:
                kwargs[name] = parse_timestamps(_FIELD_SPELLING[name], str(raw[name]), topics)
        if "zk_connect" not in kwargs:
            raise ConfigError("option zk.connect is required: 'host:port[/chroot]'")
        if not topics:
            if "subscribe_pattern" not in kwargs:
                raise ConfigError("option topic (one topic, or several comma-separated) or "
                                  "subscribePattern is required")
        elif "subscribe_pattern" in kwargs:
            raise ConfigError("options topic and subscribePattern are exclusive: give one "
                              "(a list of topics, or a regular expression over topic names)")
        return cls(**kwargs)

    def starting(self, streaming: bool) -> OffsetSpec:
        """The start position, with the default for batch or streaming, and the
        time options over it (Kafka's precedence)."""
        base = self.starting_offsets
        if base is None:
            base = GROUP if streaming else EARLIEST
        strategy = self.starting_offsets_by_timestamp_strategy
        if self.starting_timestamp is not None:
            return OffsetSpec(kind="timestamp", all_ms=self.starting_timestamp, strategy=strategy)
        if self.starting_offsets_by_timestamp is not None:
            return OffsetSpec(kind="timestamp",
                              per_partition=self.starting_offsets_by_timestamp.per_partition,
                              fallback=base, strategy=strategy)
        return base

    def ending(self) -> OffsetSpec:
        """The end of a batch read, the time options over endingOffsets."""
        if self.ending_timestamp is not None:
            return OffsetSpec(kind="timestamp", all_ms=self.ending_timestamp, strategy="latest")
        if self.ending_offsets_by_timestamp is not None:
            return OffsetSpec(kind="timestamp",
                              per_partition=self.ending_offsets_by_timestamp.per_partition,
                              fallback=self.ending_offsets or LATEST, strategy="latest")
        return self.ending_offsets or LATEST

    def batch_only_given(self) -> list[str]:
        """The batch-only options these hold (a stream refuses them)."""
        out = []
        if self.ending_offsets is not None:
            out.append("endingOffsets")
        if self.ending_timestamp is not None:
            out.append("endingTimestamp")
        if self.ending_offsets_by_timestamp is not None:
            out.append("endingOffsetsByTimestamp")
        return out

    def pattern(self) -> re.Pattern[str] | None:
        return None if self.subscribe_pattern is None else re.compile(self.subscribe_pattern)

    def to_options(self) -> dict[str, str]:
        """Spark options that parse back to these (for tests and examples)."""
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or value == f.default:
                continue
            key = _FIELD_SPELLING[f.name]
            if isinstance(value, OffsetSpec):
                out[key] = value.describe()
            elif isinstance(value, tuple):
                out[key] = ",".join(value)
            elif isinstance(value, bool):
                out[key] = str(value).lower()
            elif f.name == "max_trigger_delay":
                out[key] = f"{value * 1000:g}ms"
            else:
                out[key] = str(value)
        return out
