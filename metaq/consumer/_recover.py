"""The local recover store: messages a listener kept failing on, redelivered until they succeed.

Metaq's default reject handler keeps such messages in a local store and
redelivers them every few minutes; this is that store, made crash-safe:

- a message is written (file fsynced, directory fsynced) *before* its
  partition's progress moves past it, so a crash after the skip never loses it;
- a record is deleted only *after* its redelivery succeeded, so a crash during
  redelivery delivers it again (at least once, never lost);
- one file per message under ``<dir>/<group>/<topic>/``, named
  ``<partition>-<offset>.rec``: writing the same message twice is idempotent;
- records are msgpack maps read with strict limits; a damaged file is moved
  aside to ``*.bad`` with an error logged, never silently dropped.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import msgpack

from metaq._durable import write_durably
from metaq._errors import ConfigError, StorageError

__all__ = ["RecoverStore", "RecoveredMessage"]

log = logging.getLogger(__name__)

_MAX_RECORD = 64 * 1024 * 1024
_SUFFIX = ".rec"


@dataclass(frozen=True, kw_only=True)
class RecoveredMessage:
    """A stored message and its redelivery state."""

    topic: str
    partition: str
    offset: int
    next_offset: int
    msg_id: int
    flag: int
    payload: bytes
    attempts: int
    next_due: float
    error: str

    def to_record(self) -> bytes:
        return msgpack.packb({
            "v": 1, "topic": self.topic, "partition": self.partition, "offset": self.offset,
            "next_offset": self.next_offset, "msg_id": self.msg_id, "flag": self.flag,
            "payload": self.payload, "attempts": self.attempts, "next_due": self.next_due,
            "error": self.error[:2000]}, use_bin_type=True)

    @classmethod
    def from_record(cls, data: bytes, path: Path) -> RecoveredMessage:
        try:
            d = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=_MAX_RECORD,
                                max_str_len=1 << 20, max_array_len=0, max_map_len=32,
                                max_ext_len=0)
            if not isinstance(d, dict) or d.get("v") != 1:
                raise ValueError("not a version-1 record")
            return cls(topic=str(d["topic"]), partition=str(d["partition"]),
                       offset=int(d["offset"]), next_offset=int(d["next_offset"]),
                       msg_id=int(d["msg_id"]), flag=int(d["flag"]),
                       payload=bytes(d["payload"]), attempts=int(d["attempts"]),
                       next_due=float(d["next_due"]), error=str(d.get("error", "")))
        except (ValueError, TypeError, KeyError, msgpack.UnpackException) as e:
            raise StorageError(f"damaged recover record {path}: {e}") from None


class RecoverStore:
    """Durable per-group store of rejected messages; see the module doc."""

    def __init__(self, directory: str | os.PathLike[str], group: str, *,
                 interval: float = 300.0, max_backoff: float = 3600.0) -> None:
        if interval <= 0:
            raise ConfigError(f"recover interval must be > 0, got {interval!r}")
        self.base = Path(directory) / group
        self.interval = interval
        self.max_backoff = max(max_backoff, interval)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self.base.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError(f"cannot create recover store {self.base}: {e}") from None

    # -- storing -------------------------------------------------------------------------

    def _path(self, topic: str, partition: str, offset: int) -> Path:
        return self.base / topic / f"{partition}-{offset}{_SUFFIX}"

    def _write(self, rec: RecoveredMessage) -> None:
        path = self._path(rec.topic, rec.partition, rec.offset)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_durably(path, rec.to_record(), tmp=path.with_suffix(".tmp"))

    def put(self, *, topic: str, partition: str, offset: int, next_offset: int, msg_id: int,
            flag: int, payload: bytes, error: BaseException | str) -> None:
        """Store a message durably; returns only once it is on disk."""
        rec = RecoveredMessage(topic=topic, partition=partition, offset=offset,
                               next_offset=next_offset, msg_id=msg_id, flag=flag,
                               payload=bytes(payload), attempts=0,
                               next_due=time.time() + self.interval, error=repr(error))
        with self._lock:
            self._write(rec)
        log.warning("stored %s/%s offset %d msgId %d in the recover store %s", topic,
                    partition, offset, msg_id, self.base)

    def records(self, topic: str | None = None) -> list[RecoveredMessage]:
        """Every stored message (damaged files are moved aside and logged)."""
        out = []
        dirs = [self.base / topic] if topic else sorted(p for p in self.base.iterdir()
                                                        if p.is_dir())
        for d in dirs:
            if not d.is_dir():
                continue
            for path in sorted(d.glob(f"*{_SUFFIX}")):
                try:
                    data = path.read_bytes()
                    out.append(RecoveredMessage.from_record(data, path))
                except FileNotFoundError:
                    continue
                except StorageError as e:
                    log.error("%s; moving it to %s.bad", e, path.name)
                    os.replace(path, path.with_suffix(".bad"))
        return out

    def __len__(self) -> int:
        return sum(1 for _ in self.base.glob(f"*/*{_SUFFIX}"))

    def remove(self, rec: RecoveredMessage) -> None:
        with self._lock:
            try:
                self._path(rec.topic, rec.partition, rec.offset).unlink()
            except FileNotFoundError:
                pass

    # -- redelivery ----------------------------------------------------------------------

    def redeliver_due(self, deliver: Callable[[RecoveredMessage], Any],
                      now: float | None = None) -> int:
        """Hand every due message to ``deliver``; delete it when that returns. Count done."""
        now = time.time() if now is None else now
        done = 0
        for rec in self.records():
            if rec.next_due > now or self._stop.is_set():
                continue
            try:
                deliver(rec)
            except Exception as e:  # noqa: BLE001 - the listener failed again: back off
                attempts = rec.attempts + 1
                delay = min(self.max_backoff, self.interval * 2 ** min(attempts, 16))
                again = replace(rec, attempts=attempts, next_due=now + delay, error=repr(e))
                with self._lock:
                    self._write(again)
                log.warning("redelivery of %s/%s offset %d failed (%d times): %r", rec.topic,
                            rec.partition, rec.offset, attempts, e)
                continue
            self.remove(rec)
            done += 1
        return done

    def start(self, deliver: Callable[[RecoveredMessage], Any], *, name: str,
              on_error: Callable[[BaseException], None]) -> None:
        def loop() -> None:
            while not self._stop.wait(min(self.interval, 5.0)):
                try:
                    self.redeliver_due(deliver)
                except Exception as e:  # noqa: BLE001 - reported to the user, loop goes on
                    log.exception("recover store redelivery failed")
                    on_error(e)

        self._thread = threading.Thread(target=loop, name=name, daemon=True)
        self._thread.start()

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
