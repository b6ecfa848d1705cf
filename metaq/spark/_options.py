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
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from metaq._errors import ConfigError
from metaq.spark._arrow import CODECS
from zk_layout import InvalidNameError, Layout, check_group, check_topic, parse_partition

__all__ = ["OffsetSpec", "SourceOptions", "EARLIEST", "LATEST", "GROUP", "DEFAULT_GROUP"]

MIB = 1024 * 1024
#: Group used for the ``get`` requests and for commits when no ``group`` option is given.
DEFAULT_GROUP = "metaq-spark"
EARLIEST_CODE, LATEST_CODE = -2, -1
_KINDS = ("earliest", "latest", "group", "json")


@dataclass(frozen=True, kw_only=True)
class OffsetSpec:
    """Where to start or end: ``kind`` is ``earliest``, ``latest``, ``group`` or
    ``json``; for ``json``, ``per_partition`` maps topic -> partition name ->
    offset (``-2`` earliest, ``-1`` latest)."""

    kind: str
    per_partition: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ConfigError(f"offset kind must be one of {_KINDS}, got {self.kind!r}")

    def describe(self) -> str:
        return self.kind if self.kind != "json" else json.dumps(
            {t: dict(p) for t, p in self.per_partition.items()}, sort_keys=True)


EARLIEST = OffsetSpec(kind="earliest")
LATEST = OffsetSpec(kind="latest")
GROUP = OffsetSpec(kind="group")


def parse_offsets(name: str, text: str, topics: tuple[str, ...]) -> OffsetSpec:
    """Parse a ``startingOffsets`` / ``endingOffsets`` value (see the module doc)."""
    word = text.strip().lower()
    if word in ("earliest", "latest", "group"):
        return OffsetSpec(kind=word)
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"option {name} must be earliest, latest, group or JSON like "
                          f'{{"topic": {{"0-0": 1234}}}}, got {text!r} ({e})') from None
    if not isinstance(obj, dict) or not obj:
        raise ConfigError(f"option {name}: JSON must be a non-empty object of topic -> "
                          f"{{partition: offset}}, got {text!r}")
    out: dict[str, dict[str, int]] = {}
    for topic, parts in obj.items():
        if topic not in topics:
            raise ConfigError(f"option {name} names topic {topic!r}, which is not among the "
                              f"topics read ({', '.join(topics)})")
        if not isinstance(parts, dict):
            raise ConfigError(f"option {name}: the value for topic {topic!r} must be an object "
                              f"of partition -> offset, got {parts!r}")
        per: dict[str, int] = {}
        for part, offset in parts.items():
            try:
                per[str(parse_partition(part))] = offset
            except InvalidNameError:
                raise ConfigError(f"option {name}: {part!r} of topic {topic!r} is not a "
                                  f"partition name '<brokerId>-<index>'") from None
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
}
_SPELLING = {
    "zk.connect": "zk.connect", "zk.root": "zk.root", "zk.timeout": "zk.timeout",
    "topic": "topic", "group": "group", "startingoffsets": "startingOffsets",
    "endingoffsets": "endingOffsets", "maxbytesperpartition": "maxBytesPerPartition",
    "maxbytespertrigger": "maxBytesPerTrigger", "failondataloss": "failOnDataLoss",
    "fetchsize": "fetchSize", "verifychecksums": "verifyChecksums", "codec": "codec",
    "brokertimeout": "brokerTimeout", "brokerretrytimeout": "brokerRetryTimeout",
    "commitoffsets": "commitOffsets", "offsetreset": "offsetReset",
}
_FIELD_SPELLING = {field_name: _SPELLING[key] for key, field_name in _NAMES.items()}


@dataclass(frozen=True, kw_only=True)
class SourceOptions:
    """Validated options of one ``spark.read`` / ``spark.readStream`` of ``metaq``.

    Spark option names in brackets; defaults after the colon.
    """

    #: [``zk.connect``] ZooKeeper ``host:port[,host:port][/chroot]``: required.
    zk_connect: str
    #: [``topic``] topics to read, comma-separated in the option: required.
    topics: tuple[str, ...]
    #: [``zk.root``] root of Metaq's tree: ``/meta``.
    zk_root: str = "/meta"
    #: [``zk.timeout``] seconds to wait for a ZooKeeper session: 15.
    zk_timeout: float = 15.0
    #: [``group``] consumer group whose offsets ``group`` positions read and that
    #: streaming queries and ``foreach_partition`` commit to: ``metaq-spark``.
    group: str = DEFAULT_GROUP
    #: [``startingOffsets``] batch: ``earliest``; streaming: ``group`` (partitions
    #: without a committed offset start at the earliest, as a new Metaq consumer does).
    starting_offsets: OffsetSpec | None = None
    #: [``endingOffsets``] batch only: ``latest``.
    ending_offsets: OffsetSpec = LATEST
    #: [``maxBytesPerPartition``] batch: a topic partition with more bytes to
    #: read is split into byte ranges of about this size: 128 MiB.
    max_bytes_per_partition: int = 128 * MIB
    #: [``maxBytesPerTrigger``] streaming: most bytes per micro-batch over all
    #: partitions, shared in proportion to each partition's backlog: no limit.
    max_bytes_per_trigger: int | None = None
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

    def __post_init__(self) -> None:
        if not isinstance(self.zk_connect, str) or not self.zk_connect.strip():
            raise ConfigError("option zk.connect is required: 'host:port[/chroot]'")
        if not self.topics:
            raise ConfigError("option topic is required (one topic, or several comma-separated)")
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
            raise ConfigError(f"option zk.root must be an absolute ZooKeeper path: {e}") from None
        try:
            check_group(self.group)
        except InvalidNameError as e:
            raise ConfigError(f"option group: {e}") from None
        for name in ("max_bytes_per_partition", "fetch_size"):
            _positive_int(name, getattr(self, name), lo=1024)
        if self.max_bytes_per_trigger is not None:
            _positive_int("maxBytesPerTrigger", self.max_bytes_per_trigger)
        if self.offset_reset not in (None, "earliest", "latest", "fail"):
            raise ConfigError(f"option offsetReset must be earliest, latest or fail, "
                              f"got {self.offset_reset!r}")
        if self.codec is not None and self.codec not in CODECS:
            raise ConfigError(f"option codec must be one of {', '.join(CODECS)}, "
                              f"got {self.codec!r}")
        if self.ending_offsets.kind == "json":
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
            elif name == "max_bytes_per_trigger":
                kwargs[name] = _positive_int(spelled, value)
        topics = kwargs.get("topics", ())
        for name in ("starting_offsets", "ending_offsets"):
            if name in raw:
                kwargs[name] = parse_offsets(_FIELD_SPELLING[name], str(raw[name]), topics)
        if "zk_connect" not in kwargs:
            raise ConfigError("option zk.connect is required: 'host:port[/chroot]'")
        if not topics:
            raise ConfigError("option topic is required (one topic, or several comma-separated)")
        return cls(**kwargs)

    def starting(self, streaming: bool) -> OffsetSpec:
        """The start position, with the default for batch or streaming."""
        if self.starting_offsets is not None:
            return self.starting_offsets
        return GROUP if streaming else EARLIEST

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
            else:
                out[key] = str(value)
        return out
