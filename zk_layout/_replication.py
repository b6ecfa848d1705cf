"""metaq-py's replication nodes: who is master of a broker id, in which epoch,
and which slaves are in sync (metaq-py only; Java Metaq neither writes nor reads
them, and they live outside the paths a Java client lists).

::

    <root>/brokers/replication/<id>            persistent  {"epoch":3,"master":0,
                                                            "inSync":[1],"mode":"sync"}
    <root>/brokers/replication/<id>/epoch-<E>  persistent  {"epoch":3,"master":1,
                                                            "ends":{"orders":[4096,0]}}

The state node is the fence between masters: every change of it is a
conditional write on its version, so of two brokers that both believe they may
lead, one write fails.  ``epoch`` counts masters (0 for the first), ``master``
is the replica number (the ``N`` of ``slave<N>``, 0 for a broker started as
master) that leads in that epoch, ``inSync`` the replica numbers of the slaves
that hold every acknowledged message (never the master itself), ``mode`` the
master's replication mode.  An epoch node records, per topic, each
partition's log end on the new master at the moment its epoch began: a broker
that led (or copied) in an older epoch cuts its logs back to these ends before it
copies again, because what it holds beyond them no in-sync slave ever had.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from zk_layout._codecs import INT64_MAX, json_object
from zk_layout._errors import NodeDataError
from zk_layout._names import INT32_MAX, check_slave_no, check_topic
from zk_layout._paths import Layout

__all__ = [
    "REPLICATION_MODES",
    "read_epoch_starts",
    "read_replication",
    "EpochStart",
    "ReplicationState",
    "decode_epoch_start",
    "decode_replication_state",
    "encode_epoch_start",
    "encode_replication_state",
]

#: A master's replication modes: ``sync`` acknowledges a put once every in-sync slave
#: has it, ``async`` once it is in the master's own log.
REPLICATION_MODES = ("sync", "async")


def _int(value: object, lo: int, hi: int) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        return None
    return value


@dataclass(frozen=True, kw_only=True)
class ReplicationState:
    """``brokers/replication/<id>``: the epoch, its master and the in-sync slaves.

    >>> encode_replication_state(ReplicationState(epoch=2, master=1, in_sync=(0,)))
    b'{"epoch":2,"master":1,"inSync":[0],"mode":"sync"}'
    """

    epoch: int
    master: int
    in_sync: tuple[int, ...] = ()
    mode: str = "sync"

    def __post_init__(self) -> None:
        if _int(self.epoch, 0, INT64_MAX) is None:
            raise ValueError(f"epoch must be an int >= 0, got {self.epoch!r}")
        check_slave_no(self.master)
        in_sync = tuple(sorted({check_slave_no(r) for r in self.in_sync}))
        if self.master in in_sync:
            raise ValueError(f"the master (replica {self.master}) cannot be in its own "
                             f"in-sync set {list(in_sync)}")
        if self.mode not in REPLICATION_MODES:
            raise ValueError(f"mode must be one of {REPLICATION_MODES}, got {self.mode!r}")
        object.__setattr__(self, "in_sync", in_sync)

    def with_in_sync(self, in_sync: tuple[int, ...] | list[int] | set[int]) -> ReplicationState:
        return ReplicationState(epoch=self.epoch, master=self.master, in_sync=tuple(in_sync),
                                mode=self.mode)


def encode_replication_state(value: ReplicationState) -> bytes:
    if not isinstance(value, ReplicationState):
        raise TypeError(f"expected ReplicationState, got {type(value).__name__}")
    ins = ",".join(map(str, value.in_sync))
    return (f'{{"epoch":{value.epoch},"master":{value.master},"inSync":[{ins}],'
            f'"mode":"{value.mode}"}}').encode()


def decode_replication_state(data: bytes | str | None, path: str = "") -> ReplicationState:
    """Parse a replication state node; :class:`NodeDataError` naming what is wrong."""
    obj = json_object(data, path, "with epoch, master, inSync and mode",
                      ("epoch", "master", "inSync", "mode"))
    epoch = _int(obj["epoch"], 0, INT64_MAX)
    if epoch is None:
        raise NodeDataError(path, data, f"epoch must be an integer >= 0, not {obj['epoch']!r}")
    master = _int(obj["master"], 0, INT32_MAX)
    if master is None:
        raise NodeDataError(path, data,
                            f"master must be a replica number >= 0, not {obj['master']!r}")
    in_sync = obj["inSync"]
    if not isinstance(in_sync, list) or any(_int(r, 0, INT32_MAX) is None for r in in_sync):
        raise NodeDataError(path, data, f"inSync must be a list of replica numbers, "
                            f"not {in_sync!r}")
    mode = obj["mode"]
    if mode not in REPLICATION_MODES:
        raise NodeDataError(path, data, f"mode must be one of {list(REPLICATION_MODES)}, "
                            f"not {mode!r}")
    try:
        return ReplicationState(epoch=epoch, master=master, in_sync=tuple(in_sync), mode=mode)
    except ValueError as e:
        raise NodeDataError(path, data, str(e)) from None


@dataclass(frozen=True, kw_only=True)
class EpochStart:
    """``brokers/replication/<id>/epoch-<E>``: the new master's log ends when epoch
    ``epoch`` began (topic -> end offset of each partition, in partition order)."""

    epoch: int
    master: int
    ends: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if _int(self.epoch, 0, INT64_MAX) is None:
            raise ValueError(f"epoch must be an int >= 0, got {self.epoch!r}")
        check_slave_no(self.master)
        ends = {}
        for topic, offsets in self.ends.items():
            check_topic(topic)
            offsets = tuple(offsets)
            if any(_int(o, 0, INT64_MAX) is None for o in offsets):
                raise ValueError(f"ends of {topic!r} must be offsets >= 0, got {offsets!r}")
            ends[topic] = offsets
        object.__setattr__(self, "ends", MappingProxyType(dict(sorted(ends.items()))))

    def end_of(self, topic: str, partition: int) -> int | None:
        """The partition's end when the epoch began, or None when it did not exist."""
        offsets = self.ends.get(topic)
        if offsets is None or partition >= len(offsets):
            return None
        return offsets[partition]


def encode_epoch_start(value: EpochStart) -> bytes:
    if not isinstance(value, EpochStart):
        raise TypeError(f"expected EpochStart, got {type(value).__name__}")
    return json.dumps({"epoch": value.epoch, "master": value.master,
                       "ends": {t: list(o) for t, o in value.ends.items()}},
                      separators=(",", ":")).encode()


def decode_epoch_start(data: bytes | str | None, path: str = "") -> EpochStart:
    """Parse an epoch node; :class:`NodeDataError` naming what is wrong."""
    obj = json_object(data, path, "with epoch, master and ends", ("epoch", "master", "ends"))
    epoch = _int(obj["epoch"], 0, INT64_MAX)
    master = _int(obj["master"], 0, INT32_MAX)
    if epoch is None or master is None:
        raise NodeDataError(path, data, "epoch and master must be integers >= 0")
    ends = obj["ends"]
    if not isinstance(ends, dict) or not all(
            isinstance(v, list) and all(_int(o, 0, INT64_MAX) is not None for o in v)
            for v in ends.values()):
        raise NodeDataError(path, data, "ends must map topics to lists of offsets >= 0")
    try:
        return EpochStart(epoch=epoch, master=master, ends={t: tuple(v) for t, v in ends.items()})
    except ValueError as e:
        raise NodeDataError(path, data, str(e)) from None


def read_replication(client: KazooClient, layout: Layout, broker_id: int,
                     watch: Callable[..., object] | None = None
                     ) -> tuple[ReplicationState, int] | None:
    """A broker id's replication state and the node's version (for a conditional
    write), or None when it has none (never replicated).  With ``watch``, armed
    on the node (also while it does not exist)."""
    path = layout.replication(broker_id)
    try:
        data, stat = client.get(path, watch=watch)
    except NoNodeError:
        if watch is not None:
            client.exists(path, watch=watch)
        return None
    return decode_replication_state(data, path), stat.version


def read_epoch_starts(client: KazooClient, layout: Layout, broker_id: int,
                      after: int = -1) -> list[EpochStart]:
    """The epoch nodes of a broker id newer than epoch ``after``, oldest first."""
    base = layout.replication(broker_id)
    try:
        names = client.get_children(base)
    except NoNodeError:
        return []
    out = []
    for name in names:
        if not name.startswith("epoch-") or not name[6:].isdigit():
            continue
        epoch = int(name[6:])
        if epoch <= after:
            continue
        path = f"{base}/{name}"
        try:
            data, _stat = client.get(path)
        except NoNodeError:
            continue
        start = decode_epoch_start(data, path)
        if start.epoch != epoch:
            raise NodeDataError(path, data, f"holds epoch {start.epoch}, named epoch {epoch}")
        out.append(start)
    out.sort(key=lambda s: s.epoch)
    return out
