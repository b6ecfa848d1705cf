"""Offset stores: where a group's consumed positions live.

The ZooKeeper store writes Metaq's ``<msgId>-<offset>`` strings under
``consumers/<group>/offsets/<topic>/<brokerId>-<part>`` and reads Java Metaq's
(legacy bare offsets included).  A commit is *fenced*: it is sent in one
ZooKeeper transaction with a check of this consumer's owner node, and only
while the ZooKeeper session that created that owner node is still the
current one (see :class:`SessionFence`), so a consumer whose ownership moved
(a zombie) can never overwrite the new owner's progress.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NodeExistsError, NoNodeError, RolledBackError

from metaq._durable import write_durably
from metaq._errors import CoordinationError, StorageError
from metaq._types import PartitionKey
from zk_layout import Layout, NodeDataError, StoredOffset, decode_offset, encode_offset

__all__ = ["OffsetStore", "ZkOffsetStore", "LocalFileOffsetStore", "SessionFence", "Ownership",
           "StaleOwnershipError"]

log = logging.getLogger(__name__)


class StaleOwnershipError(CoordinationError):
    """A commit was refused because this consumer no longer owns the partition."""


class SessionFence:
    """Counts ZooKeeper sessions; lets a write go out only in the session it belongs to.

    The consumer's kazoo state listener calls :meth:`lost` when a session
    ends.  kazoo calls listeners *before* it fails the requests still queued
    for the dead session, so a request enqueued under :attr:`lock` while the
    epoch still matched either reaches the server in the old session (which
    then refuses it as expired) or is failed by kazoo; it is never sent in
    the next session.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.epoch = 0

    def lost(self) -> None:
        with self.lock:  # held only around an enqueue: never blocks for long
            self.epoch += 1


@dataclass(frozen=True, slots=True)
class Ownership:
    """Proof of ownership for fenced writes: the owner node and its session."""

    owner_path: str
    version: int
    epoch: int


class OffsetStore(Protocol):
    """Where committed offsets are kept (ZooKeeper by default; issue 5 adds more)."""

    def load(self, topic: str, partition: str) -> StoredOffset | None: ...

    def load_many(self, keys: list[PartitionKey]
                  ) -> dict[PartitionKey, StoredOffset | NodeDataError]: ...

    def commit(self, topic: str, partition: str, msg_id: int, offset: int,
               ownership: Ownership | None) -> None: ...


class ZkOffsetStore:
    """Metaq's ZooKeeper offset storage with fenced commits."""

    def __init__(self, client: KazooClient, layout: Layout, group: str,
                 fence: SessionFence, *, timeout: float = 10.0) -> None:
        self._client = client
        self._layout = layout
        self._group = group
        self._fence = fence
        self._timeout = timeout
        self._dirs: set[str] = set()

    def load(self, topic: str, partition: str) -> StoredOffset | None:
        path = self._layout.offset(self._group, topic, partition)
        try:
            data, _ = self._client.get(path)
        except NoNodeError:
            return None
        return decode_offset(data, path)

    def load_many(self, keys: list[PartitionKey]
                  ) -> dict[PartitionKey, StoredOffset | NodeDataError]:
        """``load`` for many (topic, partition) keys, pipelined.  A node holding garbage
        gives its :class:`NodeDataError` (naming the path and the bytes) instead of a
        value: one damaged node must not stop the others from being read."""
        paths = {k: self._layout.offset(self._group, *k) for k in keys}
        pending = {k: self._client.get_async(p) for k, p in paths.items()}
        out: dict[PartitionKey, StoredOffset | NodeDataError] = {}
        for k, r in pending.items():
            try:
                out[k] = decode_offset(r.get()[0], paths[k])
            except NoNodeError:
                pass
            except NodeDataError as e:
                out[k] = e
        return out

    def commit(self, topic: str, partition: str, msg_id: int, offset: int,
               ownership: Ownership | None) -> None:
        path = self._layout.offset(self._group, topic, partition)
        data = encode_offset(StoredOffset(offset=offset, msg_id=msg_id))
        if ownership is None:  # unfenced (tools, group reset): plain write
            self._write_plain(topic, path, data)
            return
        exists = self._client.exists(path) is not None
        if not exists:
            self._ensure_dir(topic)
        with self._fence.lock:
            if self._fence.epoch != ownership.epoch:
                raise StaleOwnershipError(
                    f"not committing {path}: the ZooKeeper session that owned it has ended")
            tx = self._client.transaction()
            tx.check(ownership.owner_path, ownership.version)
            if exists:
                tx.set_data(path, data)
            else:
                tx.create(path, data)
            pending = tx.commit_async()
        results = pending.get(timeout=self._timeout)
        if results and isinstance(results[0], (BadVersionError, NoNodeError)):
            raise StaleOwnershipError(
                f"not committing {path}: owner node {ownership.owner_path} is gone or changed")
        failure = next((r for r in results if isinstance(r, Exception)
                        and not isinstance(r, RolledBackError)), None)
        if isinstance(failure, NodeExistsError | NoNodeError):
            # raced with another writer creating/deleting the offset node: once more
            return self.commit(topic, partition, msg_id, offset, ownership)
        if failure is not None:
            raise CoordinationError(f"committing {path} failed: {failure!r}")

    def commit_and_release(
        self, items: list[tuple[str, str, tuple[int, int] | None, Ownership]],
    ) -> dict[PartitionKey, BaseException | None]:
        """Release partitions: for each (topic, partition, final (msg_id, offset) or None,
        ownership), write the offset and delete the owner node in one transaction (the
        delete, conditional on the owner node's version, fences the write), all of them
        pipelined: one round trip for any number of partitions.

        Returns, per (topic, partition): None when released, :class:`StaleOwnershipError`
        when our owner node was already gone (nothing written; the session or the
        ownership ended), or the exception that left the outcome unknown (the caller
        keeps the owner node to delete later)."""
        out: dict[PartitionKey, BaseException | None] = {}
        paths = {(t, p): self._layout.offset(self._group, t, p) for t, p, pos, _ in items
                 if pos is not None}
        exists = {k: self._client.exists_async(path) for k, path in paths.items()}
        present = {}
        for k, r in exists.items():
            present[k] = r.get(timeout=self._timeout) is not None
            if not present[k]:
                self._ensure_dir(k[0])
        pending = {}
        with self._fence.lock:
            for topic, partition, pos, ownership in items:
                key = (topic, partition)
                if self._fence.epoch != ownership.epoch:
                    out[key] = StaleOwnershipError(
                        f"not releasing {topic}/{partition}: its session has ended")
                    continue
                tx = self._client.transaction()
                if pos is not None:
                    data = encode_offset(StoredOffset(offset=pos[1], msg_id=pos[0]))
                    if present[key]:
                        tx.set_data(paths[key], data)
                    else:
                        tx.create(paths[key], data)
                tx.delete(ownership.owner_path, ownership.version)
                pending[key] = tx.commit_async()
        retry = []
        for (topic, partition, pos, ownership) in items:
            key = (topic, partition)
            if key not in pending:
                continue
            try:
                results = pending[key].get(timeout=self._timeout)
            except Exception as e:  # noqa: BLE001 - the outcome is unknown: the caller's
                out[key] = e
                continue
            last = results[-1] if results else None
            if isinstance(last, (BadVersionError, NoNodeError)):
                out[key] = StaleOwnershipError(
                    f"not committing {topic}/{partition}: owner node {ownership.owner_path} "
                    "is gone or changed")
            elif pos is not None and isinstance(results[0], NodeExistsError | NoNodeError):
                retry.append((topic, partition, pos, ownership))  # raced on the offset node
            elif any(isinstance(r, Exception) for r in results):
                failure = next(r for r in results if isinstance(r, Exception)
                               and not isinstance(r, RolledBackError))
                out[key] = CoordinationError(f"releasing {topic}/{partition} failed: "
                                             f"{failure!r}")
            else:
                out[key] = None
        for topic, partition, pos, ownership in retry:  # the slow way, one by one
            key = (topic, partition)
            try:
                assert pos is not None
                self.commit(topic, partition, pos[0], pos[1], ownership)
                with self._fence.lock:
                    if self._fence.epoch != ownership.epoch:
                        raise StaleOwnershipError(f"{topic}/{partition}: session ended")
                    r = self._client.delete_async(ownership.owner_path, ownership.version)
                r.get(timeout=self._timeout)
                out[key] = None
            except (StaleOwnershipError, NoNodeError, BadVersionError) as e:
                out[key] = e if isinstance(e, StaleOwnershipError) else StaleOwnershipError(
                    f"{topic}/{partition}: owner node gone or changed")
            except Exception as e:  # noqa: BLE001 - unknown outcome: the caller's
                out[key] = e
        return out

    def _ensure_dir(self, topic: str) -> None:
        d = self._layout.offsets_dir(self._group, topic)
        if d not in self._dirs:
            self._client.ensure_path(d)
            self._dirs.add(d)

    def _write_plain(self, topic: str, path: str, data: bytes) -> None:
        try:
            self._client.set(path, data)
        except NoNodeError:
            self._ensure_dir(topic)
            try:
                self._client.create(path, data)
            except NodeExistsError:
                self._client.set(path, data)


class LocalFileOffsetStore:
    """Offsets in a local JSON file (broadcast mode: each member keeps its own progress).

    Written atomically (temporary file, fsync, rename, fsync of the directory) so a
    crash leaves either the previous or the new content, never a torn file.
    Values use Metaq's ``<msgId>-<offset>`` text, keys are ``<topic>/<partition>``.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._data: dict[str, str] = {}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if self.path.exists():
                raw = json.loads(self.path.read_text("utf-8"))
                if not isinstance(raw, dict) or not all(
                        isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
                    raise ValueError("expected an object of strings")
                for k, v in raw.items():
                    decode_offset(v.encode(), f"{self.path}:{k}")
                self._data = raw
        except (OSError, ValueError) as e:
            raise StorageError(f"offset file {self.path} cannot be used: {e}") from None

    def load(self, topic: str, partition: str) -> StoredOffset | None:
        v = self._data.get(f"{topic}/{partition}")
        return None if v is None else decode_offset(v.encode(), str(self.path))

    def load_many(self, keys: list[PartitionKey]) -> dict[PartitionKey, StoredOffset]:
        out = {}
        for k in keys:
            v = self.load(*k)
            if v is not None:
                out[k] = v
        return out

    def commit(self, topic: str, partition: str, msg_id: int, offset: int,
               ownership: Ownership | None) -> None:
        with self._lock:
            self._data[f"{topic}/{partition}"] = encode_offset(
                StoredOffset(offset=offset, msg_id=msg_id)).decode()
            write_durably(self.path, json.dumps(self._data, sort_keys=True).encode(),
                          tmp=self.path.with_suffix(".tmp"))
