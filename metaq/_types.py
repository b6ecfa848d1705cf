"""Named shapes that cross package boundaries.

Each is a :class:`typing.NamedTuple`, so it is a plain tuple at run time (it
compares, hashes and unpacks as one, ``socket.create_connection`` takes a
:class:`BrokerAddress`), but its fields have names and type checkers tell the
shapes apart:

=================  =============================================  ===================
shape              what it is                                     example
=================  =============================================  ===================
BrokerAddress      where a broker listens (its ``meta://`` URI)   ``("10.0.0.5", 8123)``
PartitionKey       a partition of a topic, as ZooKeeper names it  ``("orders", "0-3")``
=================  =============================================  ===================

The partition string is Metaq's ``<brokerId>-<index>`` (see ``zk_layout``).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["BrokerAddress", "PartitionKey"]


class BrokerAddress(NamedTuple):
    """A broker's host and port, as registered in ZooKeeper."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


class PartitionKey(NamedTuple):
    """A topic's partition: ``(topic, "<brokerId>-<index>")``."""

    topic: str
    partition: str

    def __str__(self) -> str:
        return f"{self.topic}/{self.partition}"
