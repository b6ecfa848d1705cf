"""A watch-based copy of the Metaq tree: kazoo's ``TreeCache`` under the root, mirrored
into plain dicts, and :class:`TreeView`, a read-only stand-in for a kazoo client that
answers ``get`` / ``get_children`` / ``exists`` from that copy.

The dashboard answers every page from the view (``zk_layout.take_snapshot(view)``,
``zk_layout.broker_address(view, ...)``): polling costs ZooKeeper nothing; what it
costs is the cache's own reads, one ``get`` per changed node (a data watch fired), one
``get_children`` per changed child list, and a ``get`` + ``get_children`` per new node.
:attr:`ZkTreeCache.reads` counts every read the cache sent (the benchmark's and the
tests' measure of "one read per changed node"); :attr:`ZkTreeCache.changes` counts the
node events it applied.

The cache never writes: kazoo's ``TreeCache.start`` would create a missing root
(``ensure_path``); here that is a no-op, and a missing root is watched until it appears.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.recipe.cache import TreeCache, TreeEvent

__all__ = ["ZkTreeCache", "TreeView"]

log = logging.getLogger(__name__)


class _Counting:
    """The kazoo client as ``TreeCache`` sees it: every read counted, no writes."""

    def __init__(self, client: KazooClient, count: Callable[[], None]) -> None:
        self._client = client
        self._count = count

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def get_async(self, path: str, watch: Any = None) -> Any:
        self._count()
        return self._client.get_async(path, watch=watch)

    def get_children_async(self, path: str, watch: Any = None, include_data: bool = False
                           ) -> Any:
        self._count()
        return self._client.get_children_async(path, watch=watch, include_data=include_data)

    def exists_async(self, path: str, watch: Any = None) -> Any:
        self._count()
        return self._client.exists_async(path, watch=watch)

    def ensure_path(self, path: str, acl: Any = None) -> bool:
        return True  # read-only: a missing root is watched (TreeCache's exists), not made


class ZkTreeCache:
    """The tree under ``root`` kept current by watches (see the module doc)."""

    def __init__(self, client: KazooClient, root: str) -> None:
        self.root = root.rstrip("/") or "/"
        self._lock = threading.Lock()
        self._data: dict[str, tuple[bytes, Any]] = {}
        self._children: dict[str, set[str]] = {}
        self._reads = 0
        self._changes = 0
        self._version = 0
        self._initialized = threading.Event()
        self._connected = True
        self._cache = TreeCache(_Counting(client, self._count_read), self.root)
        self._cache.listen(self._on_event)
        self._cache.listen_fault(lambda e: log.warning("tree cache: %r", e))

    def _count_read(self) -> None:
        with self._lock:
            self._reads += 1

    @property
    def reads(self) -> int:
        """ZooKeeper reads the cache sent so far (initial load included)."""
        return self._reads

    @property
    def changes(self) -> int:
        """Node events applied (added, updated, removed), initial load included."""
        return self._changes

    @property
    def version(self) -> int:
        """Moves on every change: anything derived from the tree is stale once it moved."""
        return self._version

    @property
    def connected(self) -> bool:
        """False while the ZooKeeper connection is suspended or lost (the copy may lag)."""
        return self._connected

    @property
    def nodes(self) -> int:
        return len(self._data)

    def start(self, timeout: float = 30.0) -> None:
        """Start the watches and wait until the first full read is in."""
        self._cache.start()
        if not self._initialized.wait(timeout):
            raise TimeoutError(f"the tree under {self.root} was not read within {timeout} s")

    def close(self) -> None:
        self._cache.close()

    def _on_event(self, event: TreeEvent) -> None:
        kind = event.event_type
        if kind == TreeEvent.INITIALIZED:
            self._initialized.set()
            return
        if kind in (TreeEvent.CONNECTION_SUSPENDED, TreeEvent.CONNECTION_LOST):
            self._connected = False
            return
        if kind == TreeEvent.CONNECTION_RECONNECTED:
            self._connected = True
            return
        node = event.event_data
        if node is None:
            return
        path = node.path
        parent, _, name = path.rpartition("/")
        parent = parent or "/"
        with self._lock:
            self._changes += 1
            self._version += 1
            if kind == TreeEvent.NODE_REMOVED:
                self._data.pop(path, None)
                self._children.pop(path, None)
                if parent in self._children:
                    self._children[parent].discard(name)
            else:
                self._data[path] = (node.data, node.stat)
                self._children.setdefault(path, set())
                if path != self.root:
                    self._children.setdefault(parent, set()).add(name)

    # -- reads from the copy (TreeView) -----------------------------------------------------
    def _get(self, path: str) -> tuple[bytes, Any]:
        with self._lock:
            try:
                return self._data[path]
            except KeyError:
                raise NoNodeError(path) from None

    def _list(self, path: str) -> list[str]:
        with self._lock:
            if path not in self._data:
                raise NoNodeError(path)
            return list(self._children.get(path, ()))

    def _stat(self, path: str) -> Any:
        with self._lock:
            entry = self._data.get(path)
        return None if entry is None else entry[1]

    def view(self, *, only_group: str | None = None) -> TreeView:
        """A read-only client answering from the copy; with ``only_group``, the groups
        directory lists that group alone (a snapshot of one group costs one group)."""
        return TreeView(self, only_group=only_group)

    def paths(self) -> Iterable[str]:
        with self._lock:
            return list(self._data)


class _Result:
    """What ``get_async`` returns: ``get()`` gives the value or raises NoNodeError."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        try:
            self._value, self._error = fn(), None
        except NoNodeError as e:
            self._value, self._error = None, e

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if self._error is not None:
            raise self._error
        return self._value


class TreeView:
    """A kazoo-client look-alike over a :class:`ZkTreeCache` (reads only; ``watch``
    arguments are accepted and ignored: the cache itself is watching)."""

    def __init__(self, cache: ZkTreeCache, *, only_group: str | None = None) -> None:
        self._cache = cache
        self._only_group = only_group
        self._groups_dir: str | None = None
        if only_group is not None:
            root = cache.root
            self._groups_dir = ("" if root == "/" else root) + "/consumers"
        self.read_at = time.time()

    def get(self, path: str, watch: Any = None) -> tuple[bytes, Any]:
        return self._cache._get(path)

    def get_async(self, path: str, watch: Any = None) -> _Result:
        return _Result(lambda: self._cache._get(path))

    def get_children(self, path: str, watch: Any = None, include_data: bool = False
                     ) -> list[str]:
        names = self._cache._list(path)
        if self._groups_dir is not None and path == self._groups_dir:
            names = [n for n in names if n == self._only_group]
        return names

    def exists(self, path: str, watch: Any = None) -> Any:
        return self._cache._stat(path)
