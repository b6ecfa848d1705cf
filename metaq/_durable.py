"""Durable files: a file replaced so that a crash leaves the old or the new content.

:func:`write_durably` is the one way the library replaces a file it must not lose
(the broker's transaction journal when compacted, the consumer's local offsets
and its recover store): a temporary file in the same directory, written and
fsynced, renamed over the target, then the directory fsynced so the rename
itself survives a crash.  :func:`fsync_dir` is that last step alone (the broker
after it creates a segment file).

Errors are :class:`OSError`, raised as they come; each caller turns them into
its own error with its own words.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

__all__ = ["fsync_dir", "write_durably"]


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync the directory ``path``: the names created, renamed or removed in it last."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes | Iterable[bytes], *,
                  tmp: Path | None = None) -> int:
    """Replace ``path`` with ``data`` (bytes, or chunks written one after another)
    so a crash leaves either the previous or the new content, never a torn file.

    The bytes go to ``tmp`` (default ``<path>.tmp``, in the same directory so the
    rename is atomic), which is fsynced, renamed over ``path``, and the directory
    fsynced.  Returns the number of bytes written.  On failure the temporary file
    is removed and the OSError raised; ``path`` is untouched."""
    tmp = path.with_name(path.name + ".tmp") if tmp is None else tmp
    size = 0
    try:
        with open(tmp, "wb") as f:
            for chunk in (data,) if isinstance(data, bytes | bytearray | memoryview) else data:
                f.write(chunk)
                size += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)
    return size
