"""What the brokers say about a group's partitions: log bounds, and whether each
committed offset is a message boundary (the one broker-reading part of insight).

:func:`read_logs` asks each partition's broker, over the admin path
(``metaq._admin.log_ends``: the ``offset`` command for the log start and end), and,
for a committed offset strictly inside the log, whether a message starts there:

1. ``offset c``: a metaq-py broker answers the start of the message holding ``c``
   (exact), so an answer equal to ``c`` is a boundary;
2. otherwise the message lengths are walked from that answer ``b`` (a message start:
   on metaq-py's broker the one holding ``c``, on a Java broker, whose answer is
   coarse, a segment start), in one ``get`` of at most :data:`_WALK_BYTES`: a walk
   that lands on ``c`` says boundary, one that steps over it says not;
3. when the walk cannot tell (``c`` too far from ``b``), a ``get`` at ``c``: a
   boundary when the bytes there begin with a message whose CRC32 matches its
   payload (Metaq's checksum), not one when the header is impossible or the CRC
   does not match.  (Bytes inside a message can look like a header whose length
   runs past what the broker sends: then it cannot tell.)

A broker that is not registered or does not answer gives a :class:`LogState`
with ``error`` set, for that broker's partitions alone; nothing here raises for a
broker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from kazoo.client import KazooClient

from metaq._admin import log_ends
from metaq._errors import BrokerError, BrokerUnavailableError
from metaq._types import PartitionKey
from metaq.net import BrokerConnection
from metaq.protocol import HEADER, HEADER_SIZE, MAX_PAYLOAD_SIZE, checksum
from zk_layout import Layout, Snapshot, broker_address, partition_broker_id

__all__ = ["LogState", "read_logs", "ADMIN_GROUP"]

log = logging.getLogger(__name__)

#: The group name the reads are made as (brokers log it; it owns nothing).
ADMIN_GROUP = "metaq-admin"


@dataclass(frozen=True, kw_only=True)
class LogState:
    """A partition's log as its broker answered: ``log_start``/``log_end`` (None when
    it did not answer: see ``error``), and ``on_boundary``: whether the committed
    offset starts a message (None: not checked, i.e. no committed offset, one at a
    log bound or outside the log, or the broker could not tell)."""

    log_start: int | None = None
    log_end: int | None = None
    committed: int | None = None
    on_boundary: bool | None = None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"log_start": self.log_start, "log_end": self.log_end,
                "committed": self.committed, "on_boundary": self.on_boundary,
                "error": self.error}


#: Bytes read to walk message lengths from the broker's boundary to an offset.
_WALK_BYTES = 1 << 20


def on_boundary(conn: BrokerConnection, topic: str, index: int, offset: int) -> bool | None:
    """Whether a message starts at ``offset`` of partition ``index`` (module docstring);
    None when the broker could not tell (no bytes there)."""
    start = conn.offset(topic, ADMIN_GROUP, index, offset)
    if start == offset:
        return True
    if start < offset <= start + _WALK_BYTES:
        walked = _walk_to(conn, topic, index, start, offset)
        if walked is not None:
            return walked
    try:
        head = bytes(conn.get(topic, ADMIN_GROUP, index, offset, 64))
    except BrokerError as e:
        if e.code in (301, 404):
            return False  # the broker moved us: no message starts here
        raise
    if len(head) < HEADER_SIZE:
        return None
    length, check, _msg_id, _flag = HEADER.unpack_from(head, 0)
    if length < 0 or length > MAX_PAYLOAD_SIZE:
        return False
    whole = head if len(head) >= HEADER_SIZE + length else \
        bytes(conn.get(topic, ADMIN_GROUP, index, offset, HEADER_SIZE + length))
    if len(whole) < HEADER_SIZE + length:
        return None  # the broker sent less than one message: cannot tell
    return checksum(whole[HEADER_SIZE:HEADER_SIZE + length]) == check


def _walk_to(conn: BrokerConnection, topic: str, index: int, start: int,
             offset: int) -> bool | None:
    """From the message start ``start``, follow the messages' lengths: True when one
    starts at ``offset``, False when one spans it, None when the bytes read end first
    (or hold an impossible length)."""
    try:
        data = conn.get(topic, ADMIN_GROUP, index, start, offset - start + HEADER_SIZE)
    except BrokerError:
        return None
    pos, end, want = 0, len(data), offset - start
    while pos + HEADER_SIZE <= end:
        length = HEADER.unpack_from(data, pos)[0]
        if length < 0 or length > MAX_PAYLOAD_SIZE:
            return None
        pos += HEADER_SIZE + length
        if pos >= want:
            return pos == want
    return None


def read_logs(client: KazooClient, layout: Layout, snapshot: Snapshot, group: str, *,
              timeout: float = 5.0) -> dict[PartitionKey, LogState]:
    """PartitionKey -> :class:`LogState` for every partition of the group's topics in
    ``snapshot`` (an unknown group gives {})."""
    info = snapshot.group(group)
    if info is None:
        return {}
    out: dict[PartitionKey, LogState] = {}
    for gt in info.topics:
        committed = {str(ps.partition): ps.offset.offset for ps in gt.partitions
                     if ps.offset is not None}
        failed = None
        try:
            ends = log_ends(client, layout, gt.topic, group=ADMIN_GROUP, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - ZooKeeper garbage or a vanished node
            log.warning("could not read where %s's partitions end: %s", gt.topic, e)
            ends, failed = {}, f"could not read where the topic's partitions end: {e}"
        names = {str(ps.partition) for ps in gt.partitions} | set(ends)
        by_broker: dict[int, list[str]] = {}
        for name in sorted(names):
            by_broker.setdefault(partition_broker_id(name), []).append(name)
        for bid, parts in by_broker.items():
            _broker(client, layout, gt.topic, bid, parts, ends, committed, out,
                    timeout=timeout, failed=failed or _garbage(snapshot, bid))
    return out


def _garbage(snapshot: Snapshot, bid: int) -> str | None:
    """Why broker ``bid`` cannot be asked when its nodes hold garbage (None: they do not)."""
    info = snapshot.broker(bid)
    if info is None or info.master is not None or not info.damaged:
        return None
    return f"broker {bid}'s nodes hold garbage: " + "; ".join(
        f"{d.path}: {d.error}" for d in info.damaged)


def _broker(client: KazooClient, layout: Layout, topic: str, bid: int, parts: list[str],
            ends: dict[str, tuple[int | None, int | None]], committed: dict[str, int],
            out: dict[PartitionKey, LogState], *, timeout: float,
            failed: str | None = None) -> None:
    """One broker's partitions of ``topic`` into ``out`` (``failed``: why none can be
    asked, when known beforehand)."""
    try:
        address = broker_address(client, layout, bid)
        gone = failed or (None if address is not None
                          else f"broker {bid} is not registered (no master)")
    except Exception as e:  # noqa: BLE001 - garbage in its node: a finding, not a crash
        log.warning("broker %d's address is unreadable: %s", bid, e)
        address, gone = None, f"broker {bid}'s address is unreadable: {e}"
    check = []
    for p in parts:
        start, end = ends.get(p, (None, None))
        c = committed.get(p)
        if start is None or end is None:
            out[PartitionKey(topic, p)] = LogState(committed=c, error=(
                gone or (f"broker {bid} at {address[0]}:{address[1]} did not answer"
                         if p in ends else f"broker {bid} does not list this partition")))
        else:
            out[PartitionKey(topic, p)] = LogState(log_start=start, log_end=end, committed=c)
            if c is not None and start < c < end:
                check.append((p, c))
    if not check or address is None:
        return
    try:
        with BrokerConnection(*address, timeout=timeout) as conn:
            for p, c in check:
                key = PartitionKey(topic, p)
                try:
                    boundary = on_boundary(conn, topic, int(p.split("-", 1)[1]), c)
                except BrokerError as e:
                    log.warning("broker %d could not say whether %s/%s has a message at "
                                "%d: %s", bid, topic, p, c, e)
                    continue
                s = out[key]
                out[key] = LogState(log_start=s.log_start, log_end=s.log_end, committed=c,
                                    on_boundary=boundary)
    except BrokerUnavailableError as e:
        log.warning("broker %d at %s:%s did not answer: %s", bid, *address, e)
