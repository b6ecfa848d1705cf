"""Watching a group's owner nodes from the outside, for tests that audit ownership."""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from kazoo.client import KazooClient

from zk_layout import Layout

L = Layout()


class OwnerAudit:
    """Watches every owner node of a topic; records who owned what, when."""

    def __init__(self, client: KazooClient, group: str, topic: str,
                 layout: Layout = L) -> None:
        self.client = client
        self.dir = layout.owners_dir(group, topic)
        self.lock = threading.Lock()
        self.events: list[tuple[float, str, str | None]] = []
        self.watched: set[str] = set()
        client.ensure_path(self.dir)
        client.ChildrenWatch(self.dir, self._children)

    def _children(self, children):
        for c in children:
            if c not in self.watched:
                self.watched.add(c)
                self.client.DataWatch(f"{self.dir}/{c}", self._data_for(c))

    def _data_for(self, part):
        def watch(data, stat):
            with self.lock:
                self.events.append((time.monotonic(), part,
                                    None if data is None else data.decode()))
        return watch

    def owners(self) -> dict[str, str]:
        out = {}
        for c in self.client.get_children(self.dir):
            try:
                out[c] = self.client.get(f"{self.dir}/{c}")[0].decode()
            except Exception:
                pass
        return out

    def changes(self) -> dict[str, list[str | None]]:
        with self.lock:
            out: dict[str, list[str | None]] = defaultdict(list)
            for _, part, owner in self.events:
                out[part].append(owner)
            return out
