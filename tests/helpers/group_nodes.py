"""A group's nodes as tests read them from a live tree, tolerant of nodes that go while
they are read (a member releasing its partitions)."""

from __future__ import annotations

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from zk_layout import Layout

__all__ = ["owners"]


def owners(zk_client: KazooClient, group: str, topic: str,
           layout: Layout | None = None) -> dict[str, str]:
    """``partition -> owner id`` of ``group`` on ``topic`` as ZooKeeper holds them now."""
    d = (layout or Layout()).owners_dir(group, topic)
    out = {}
    for p in zk_client.get_children(d) if zk_client.exists(d) else []:
        try:
            out[p] = zk_client.get(f"{d}/{p}")[0].decode()
        except NoNodeError:  # released while we read
            pass
    return out
