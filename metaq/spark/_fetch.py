"""Reading one offset range straight from its broker (runs in Spark tasks).

:func:`iter_chunks` fetches ``[from_offset, until_offset)`` with ``get``
requests of ``fetch_size`` bytes (never asking past ``until``, so no byte of
the next range is read) and yields each reply with the positions of its
complete messages; a message bigger than the fetch size makes the next
request grow.  A broker that is down or restarting is retried with backoff,
re-reading its address from ZooKeeper, for up to ``retry_timeout`` seconds.
A reply that shows messages are gone (``301`` below the log start, ``404``
before the planned end, corrupt bytes) is data loss: an error, or with
``fail_on_data_loss=False`` a warning and a skip to what is there.

:func:`fetch_range` gives the same messages as :class:`RangeMessage` tuples,
for RDD code.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

from metaq._errors import (
    BrokerError,
    BrokerUnavailableError,
    ConfigError,
    ConnectionClosedError,
    DataLossError,
    MessageError,
    ProtocolError,
)
from metaq._types import BrokerAddress
from metaq.net import BrokerConnection
from metaq.protocol import HEADER, HEADER_SIZE, split_payload
from metaq.spark._arrow import Walk, WalkHint, walk
from metaq.spark._cluster import LOG_END, open_zk
from metaq.spark._options import DEFAULT_GROUP, MIB
from metaq.spark._ranges import OffsetRange
from zk_layout import DEFAULT_ROOT, READ_FROM

__all__ = ["FetchSettings", "RangeMessage", "iter_chunks", "fetch_range"]

log = logging.getLogger(__name__)

_TRANSIENT = frozenset((500, 503, 504))


@dataclass(frozen=True, kw_only=True)
class FetchSettings:
    """How a task reads a range (the fetch-related options of the source)."""

    #: Group name sent with ``get`` requests (brokers log it; nothing is committed here).
    group: str = DEFAULT_GROUP
    #: Bytes asked for per ``get`` [1 MiB].
    fetch_size: int = MIB
    #: Check every message's CRC32 [true].
    verify_checksums: bool = True
    #: Raise :class:`metaq.DataLossError` when messages are gone [true].
    fail_on_data_loss: bool = True
    #: Socket timeout of one request, seconds [30].
    broker_timeout: float = 30.0
    #: How long to keep trying a broker that is down, seconds [120].
    retry_timeout: float = 120.0
    #: ZooKeeper to re-read a moved broker's address from (None: keep the planned one).
    zk_connect: str | None = None
    zk_root: str = DEFAULT_ROOT
    zk_timeout: float = 15.0
    #: Which of a broker id's master and slaves an address is re-read as
    #: (``master`` or ``slave-preferred``, the group name picking among slaves).
    read_from: str = "master"

    def __post_init__(self) -> None:
        if self.read_from not in READ_FROM:
            raise ConfigError(f"read_from must be one of {READ_FROM}, got {self.read_from!r}")
        if isinstance(self.fetch_size, bool) or not isinstance(self.fetch_size, int) \
                or self.fetch_size < HEADER_SIZE:
            raise ConfigError(f"fetch_size must be an int >= {HEADER_SIZE}, "
                              f"got {self.fetch_size!r}")
        for name in ("broker_timeout", "retry_timeout", "zk_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")


class RangeMessage(NamedTuple):
    """One message read from a range: ``offset`` is its byte position,
    ``next_offset`` the position after it (what a commit stores)."""

    topic: str
    partition: str
    offset: int
    next_offset: int
    msg_id: int
    attribute: str | None
    value: bytes


class _Link:
    """The connection to one range's broker, re-established on failure."""

    def __init__(self, rng: OffsetRange, settings: FetchSettings) -> None:
        self.rng = rng
        self.settings = settings
        self.address = rng.address
        self.conn: BrokerConnection | None = None

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def _resolve(self) -> None:
        s = self.settings
        if s.zk_connect is None:
            return
        from zk_layout import Layout, broker_replicas

        client = open_zk(s.zk_connect, s.zk_timeout)
        try:
            address = broker_replicas(client, Layout(s.zk_root),
                                      self.rng.broker_id).choose(s.read_from, s.group)
        finally:
            client.stop()
            client.close()
        if address is not None:
            self.address = BrokerAddress(*address)

    def call(self, what: str, fn):  # type: ignore[no-untyped-def]
        deadline = None
        delay = 0.05
        rng = self.rng
        while True:
            try:
                if self.conn is None:
                    if self.address is None:
                        raise ConnectionClosedError(f"broker {rng.broker_id} has no address")
                    self.conn = BrokerConnection(*self.address,
                                                 timeout=self.settings.broker_timeout)
                return fn(self.conn)
            except BrokerError as e:
                if e.code not in _TRANSIENT:
                    raise
                problem: Exception = e
            except (BrokerUnavailableError, ProtocolError) as e:
                self.close()
                problem = e
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.settings.retry_timeout
                log.warning("%s %s: broker %d failed %s (%s); retrying for up to %gs",
                            rng.topic, rng.partition, rng.broker_id, what, problem,
                            self.settings.retry_timeout)
            if now >= deadline:
                raise ConnectionClosedError(
                    f"{rng.topic} {rng.partition}: broker {rng.broker_id} failed {what} for "
                    f"{self.settings.retry_timeout:g}s: {problem}") from problem
            time.sleep(min(delay * (0.5 + random.random()), max(0.0, deadline - now)))
            delay = min(delay * 2, 2.0)
            try:
                self._resolve()
            except Exception as e:  # ZooKeeper trouble: keep the old address, retry later
                log.warning("re-reading broker %d's address failed: %s", rng.broker_id, e)

    def get(self, offset: int, size: int) -> memoryview:
        r = self.rng
        return self.call("get", lambda c: c.get(r.topic, self.settings.group, r.index,
                                                offset, size))

    def nearest(self, offset: int) -> int:
        r = self.rng
        return self.call("offset", lambda c: c.offset(r.topic, self.settings.group, r.index,
                                                      offset))

    def resume_after_damage(self, bad: int) -> int:
        r = self.rng
        return self.call("offset", lambda c: c.resume_after_damage(
            r.topic, self.settings.group, r.index, bad))


def iter_chunks(rng: OffsetRange, settings: FetchSettings
                ) -> Iterator[tuple[memoryview, int, Walk]]:
    """Yield ``(data, base_offset, walk)`` per reply, in order; ``data`` is only
    valid until the next item is asked for (the connection reuses its buffer)."""
    link = _Link(rng, settings)
    where = f"{rng.topic} {rng.partition}"
    fail = settings.fail_on_data_loss
    pos, until = rng.from_offset, rng.until_offset
    want = settings.fetch_size
    stuck_since = None
    hint = WalkHint()
    try:
        while pos < until:
            ask = min(want, until - pos)
            try:
                data = link.get(pos, ask)
            except BrokerError as e:
                moved = _after_refusal(link, e, pos, until, where, fail)
                if moved == pos:  # the broker says "nothing here" and "more here": again
                    now = time.monotonic()
                    stuck_since = stuck_since or now
                    if now - stuck_since > settings.retry_timeout:
                        raise DataLossError(f"{where}: the broker keeps answering {e.code} at "
                                            f"offset {pos} for {settings.retry_timeout:g}s") from e
                    time.sleep(0.1)
                pos = moved
                continue
            stuck_since = None
            found = walk(data, verify=settings.verify_checksums, hint=hint)
            if found.count:
                yield data, pos, found
                pos += found.stop
                want = settings.fetch_size
            if found.problem is not None:
                pos = _after_corruption(link, pos, until, where, found.problem, fail)
            elif not found.count:
                want = _grow(data, ask, pos, until, where)
    finally:
        link.close()


def _after_refusal(link: _Link, e: BrokerError, pos: int, until: int, where: str,
                   fail: bool) -> int:
    """Where to go on after the broker refused a ``get`` at ``pos``."""
    if e.code == 301:
        try:
            moved = int(e.detail.strip())
        except ValueError:
            raise ProtocolError(f"{where}: 301 reply without an offset: {e.detail!r}") from None
        if moved <= pos:
            raise ProtocolError(f"{where}: broker moved offset {pos} back to {moved}")
        # below the log start (retention deleted them), or damaged bytes the broker knows
        # of (it sends a reader past them with the same answer): the start tells which
        start = link.nearest(0)  # (below the log, or its start: the start, as it is)
        if start <= pos:
            what = (f"{where}: bad message at offset {pos}: the broker knows bytes "
                    f"{pos}..{moved} as damaged")
            if fail:
                raise DataLossError(what + " (set failOnDataLoss=false to skip to the next "
                                    "valid message)")
            log.warning("%s; skipping to %d (failOnDataLoss=false)", what, min(moved, until))
            return min(moved, until)
        what = f"{where}: bytes {pos}..{min(moved, until)} are gone (the log starts at {moved})"
        if fail:
            raise DataLossError(what + " (set failOnDataLoss=false to skip them)")
        log.warning("%s; skipping them (failOnDataLoss=false)", what)
        return min(moved, until)
    if e.code == 404:
        try:
            end = link.nearest(LOG_END)
        except BrokerError as again:
            if again.code != 404:
                raise
            return pos  # the broker does not know the partition (yet): again, for a while
        if end > pos:  # the broker has the bytes after all (it was restarting): again
            return pos
        what = (f"{where}: the log ends at {end}, before the planned end {until} (a broker "
                f"lost unflushed messages, or the partition was recreated)")
        if fail:
            raise DataLossError(what + " (set failOnDataLoss=false to skip them)")
        log.warning("%s; stopping this range there (failOnDataLoss=false)", what)
        return until
    raise e


def _after_corruption(link: _Link, pos: int, until: int, where: str, problem: str,
                      fail: bool) -> int:
    what = f"{where}: bad message at offset {pos}: {problem}"
    if fail:
        raise DataLossError(what + " (set failOnDataLoss=false to skip to the next valid "
                            "message)")
    resume = link.resume_after_damage(pos)
    if resume <= pos:
        raise DataLossError(what + f"; the broker names no valid message after it (it "
                            f"answered {resume})")
    log.warning("%s; skipping to %d (failOnDataLoss=false)", what, resume)
    return min(resume, until)


def _grow(data: memoryview, ask: int, pos: int, until: int, where: str) -> int:
    """The next fetch size when a reply held no complete message."""
    if len(data) >= HEADER_SIZE:
        length = HEADER.unpack_from(data, 0)[0]
        need = HEADER_SIZE + length
        if pos + need > until:
            raise MessageError(f"{where}: the message at {pos} ({need} bytes) runs past the "
                               f"range end {until}, which is not a message boundary")
        if len(data) < ask or need <= len(data):
            raise MessageError(f"{where}: the broker sends at most {len(data)} bytes per reply "
                               f"but the message at {pos} is {need} bytes")
        return need
    if len(data) < ask:
        raise MessageError(f"{where}: the broker answered {len(data)} bytes at offset {pos}, "
                           f"less than a message header, before the range end {until}")
    return max(ask * 2, HEADER_SIZE)


def fetch_range(rng: OffsetRange, settings: FetchSettings | None = None,
                **options: object) -> Iterator[RangeMessage]:
    """The messages of ``rng`` in order, read from its broker.

    Options are the fields of :class:`FetchSettings` (``settings=`` or keywords).
    """
    if settings is None:
        settings = FetchSettings(**options)  # type: ignore[arg-type]
    elif options:
        raise ConfigError("pass either settings= or keyword options, not both")
    unpack = HEADER.unpack_from
    topic, partition = rng.topic, rng.partition
    for data, base, found in iter_chunks(rng, settings):
        # not a walk: each message is read where ``walk`` found it (checked then), for
        # its msgId and flag; iter_messages would walk the chunk again
        starts = found.bounds.to_pylist()
        for a, b in zip(starts, starts[1:], strict=False):
            _length, _check, msg_id, flag = unpack(data, a)
            attribute, value = split_payload(data[a + HEADER_SIZE:b], flag)
            yield RangeMessage(topic, partition, base + a, base + b, msg_id, attribute,
                               bytes(value))
