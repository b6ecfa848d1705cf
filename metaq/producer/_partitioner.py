"""Choosing a message's partition: round-robin, key hash, or a user function.

A partitioner here is ``choose(topic, partitions, body, key) -> int``: the
position in ``partitions`` (the topic's writable partitions in Metaq order,
the same list in every producer that sees the same brokers).

- ``roundrobin``: each topic cycles through its partitions, starting at a
  random one so that many producers do not all start on the first partition.
- ``hash``: ``crc32(key) % len(partitions)`` with the key as bytes (``str`` is
  UTF-8, ``int`` its decimal text): the same key goes to the same partition in
  every process and every run, as long as the partition list is the same
  (Python's ``hash()`` is randomized per process, so it is not used).  A
  message without a key is placed round-robin.
- a callable ``(topic, partitions, body, key)`` returning a partition, its
  name ``"<brokerId>-<index>"`` or its position.
"""

from __future__ import annotations

import itertools
import random
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from metaq._errors import MessageError, ProducerError
from metaq.producer._config import PartitionerFn
from zk_layout import InvalidNameError, Partition, parse_partition

__all__ = ["Chooser", "make_partitioner", "key_bytes", "hash_index"]

Chooser = Callable[[str, Sequence[Partition], bytes, Any], int]


def key_bytes(key: Any) -> bytes:
    """The bytes a key is hashed as: bytes as is, str UTF-8, int its decimal text."""
    if isinstance(key, bytes):
        return key
    if isinstance(key, (bytearray, memoryview)):
        return bytes(key)
    if isinstance(key, str):
        return key.encode("utf-8")
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key).encode("ascii")
    raise MessageError(f"key must be bytes, str or int, not {type(key).__name__}")


def hash_index(key: Any, n: int) -> int:
    """Position of ``key``'s partition among ``n``: ``crc32(key bytes) % n``."""
    return zlib.crc32(key_bytes(key)) % n


class RoundRobin:
    """Per-topic counters; ``next()`` on an ``itertools.count`` is atomic."""

    def __init__(self) -> None:
        self._counters: dict[str, itertools.count] = {}

    def __call__(self, topic: str, partitions: Sequence[Partition], body: bytes,
                 key: Any) -> int:
        counter = self._counters.get(topic)
        if counter is None:
            counter = self._counters.setdefault(topic, itertools.count(random.randrange(1 << 16)))
        return next(counter) % len(partitions)


class KeyHash:
    """``crc32(key) % n``; messages without a key go round-robin."""

    def __init__(self) -> None:
        self._fallback = RoundRobin()

    def __call__(self, topic: str, partitions: Sequence[Partition], body: bytes,
                 key: Any) -> int:
        if key is None:
            return self._fallback(topic, partitions, body, key)
        return hash_index(key, len(partitions))


class UserPartitioner:
    """Wraps a user function and checks its answer."""

    def __init__(self, fn: PartitionerFn) -> None:
        self.fn = fn

    def __call__(self, topic: str, partitions: Sequence[Partition], body: bytes,
                 key: Any) -> int:
        got = self.fn(topic, partitions, body, key)
        if isinstance(got, bool):
            pass
        elif isinstance(got, int):
            if 0 <= got < len(partitions):
                return got
        else:
            part = got
            if isinstance(got, str):
                try:
                    part = parse_partition(got)
                except InvalidNameError:
                    part = None
            if isinstance(part, Partition):
                try:
                    return list(partitions).index(part)
                except ValueError:
                    pass
        shown = ", ".join(str(p) for p in partitions[:16])
        more = ", ..." if len(partitions) > 16 else ""
        raise ProducerError(
            f"partitioner {getattr(self.fn, '__name__', self.fn)!r} returned {got!r} for "
            f"topic {topic!r}: not one of its {len(partitions)} partitions [{shown}{more}] "
            f"(return a Partition, its name or its position)")


def make_partitioner(spec: str | PartitionerFn) -> Chooser:
    """The chooser for a :class:`ProducerConfig.partitioner` value."""
    if spec == "roundrobin":
        return RoundRobin()
    if spec == "hash":
        return KeyHash()
    if callable(spec):
        return UserPartitioner(spec)
    raise ProducerError(f"unknown partitioner {spec!r}")  # ProducerConfig validated it
