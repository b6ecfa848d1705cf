"""One segment file of a partition log: ``<20-digit start offset>.meta``.

A segment holds whole messages back to back; its name is the absolute log
offset of its first byte.  Only the last segment of a partition is written.
Besides the file, a segment keeps a sparse index of message boundaries (at
least one every :data:`INDEX_STEP` bytes) used to find a valid position
without scanning the whole file.
"""

from __future__ import annotations

import bisect
import logging
import os
import re
import shutil
from pathlib import Path

from metaq._errors import StorageError
from metaq._message import HEADER, HEADER_SIZE, scan_messages

__all__ = ["Segment", "segment_name", "parse_segment_name", "INDEX_STEP"]

log = logging.getLogger(__name__)

SUFFIX = ".meta"
INDEX_STEP = 64 * 1024
_SCAN_CHUNK = 8 * 1024 * 1024
_NAME = re.compile(r"(\d{20})\.meta")
_INT32_MAX = 2**31 - 1


def segment_name(start: int) -> str:
    return f"{start:020d}{SUFFIX}"


def parse_segment_name(name: str) -> int | None:
    m = _NAME.fullmatch(name)
    return int(m.group(1)) if m else None


class Segment:
    """A segment file; ``size`` bytes of whole messages starting at offset ``start``."""

    def __init__(self, path: Path, start: int, *, writable: bool) -> None:
        self.path = path
        self.start = start
        self.rfile = open(path, "a+b" if writable else "rb", buffering=0)  # noqa: SIM115
        self.size = os.fstat(self.rfile.fileno()).st_size
        self.wfd: int | None = None
        if writable:
            self.wfd = os.open(path, os.O_WRONLY)
        self.index: list[int] = [start]     # absolute offsets of known message boundaries
        self.indexed = False                # True once index covers the whole segment
        self.pins = 0                       # reads (sendfile) in progress
        self.retired = False                # deleted; close the file once unpinned

    @property
    def end(self) -> int:
        return self.start + self.size

    def __repr__(self) -> str:
        return f"Segment({self.path.name}, size={self.size})"

    # -- writing (event loop thread) -------------------------------------------------------
    def write(self, data: bytes) -> None:
        """Append ``data`` (whole messages); on failure the file is cut back and
        StorageError raised, so no partial message is ever left behind."""
        fd = self.wfd
        if fd is None:
            raise StorageError(f"segment {self.path} is not writable")
        old = self.size
        try:
            n = os.pwrite(fd, data, old)
            while n < len(data):
                n += os.pwrite(fd, memoryview(data)[n:], old + n)
        except OSError as e:
            try:
                os.ftruncate(fd, old)
            except OSError:
                log.exception("cannot cut %s back to %d bytes after a failed write",
                              self.path, old)
            raise StorageError(f"cannot write {len(data)} bytes to {self.path}: {e}") from e
        start = self.start + old
        self.size = old + len(data)
        if start - self.index[-1] >= INDEX_STEP:
            self.index.append(start)

    def seal(self) -> int | None:
        """Stop writing; return the write fd for the caller to fsync and close."""
        fd, self.wfd = self.wfd, None
        return fd

    # -- reading ----------------------------------------------------------------------------
    def pread(self, offset: int, n: int) -> bytes:
        return os.pread(self.rfile.fileno(), n, offset - self.start)

    def close(self) -> None:
        if self.wfd is not None:
            os.close(self.wfd)
            self.wfd = None
        self.rfile.close()

    # -- recovery and boundaries -----------------------------------------------------------
    def recover(self) -> tuple[int, int]:
        """Check every message; cut the file at the first torn or corrupt one.

        The cut bytes are kept next to the segment as ``<name>.cut-<offset>`` and
        the cut is logged.  Returns ``(messages kept, bytes cut)``.
        """
        fd = self.rfile.fileno()
        pos = 0
        count = 0
        problem: str | None = None
        want = _SCAN_CHUNK
        index = [self.start]
        while pos < self.size:
            chunk = os.pread(fd, min(want, self.size - pos), pos)
            valid, n, problem = scan_messages(chunk, max_payload=_INT32_MAX)
            count += n
            if n:
                # index the boundaries of this chunk sparsely
                b = pos
                view = memoryview(chunk)
                while b < pos + valid:
                    if self.start + b - index[-1] >= INDEX_STEP:
                        index.append(self.start + b)
                    b += HEADER_SIZE + HEADER.unpack_from(view, b - pos)[0]
            pos += valid
            if problem is not None or pos >= self.size:
                break
            if valid == 0:
                # a message larger than the chunk, or a torn tail
                length = HEADER.unpack_from(chunk, 0)[0] if len(chunk) >= HEADER_SIZE else 0
                need = HEADER_SIZE + length
                if len(chunk) >= HEADER_SIZE and pos + need <= self.size and need > want:
                    want = need
                    continue
                break
            want = _SCAN_CHUNK
        cut = self.size - pos
        if cut:
            reason = problem or "truncated message"
            keep = self.path.with_name(f"{self.path.name}.cut-{self.start + pos}")
            try:
                with open(self.path, "rb") as src, open(keep, "wb") as dst:
                    src.seek(pos)
                    shutil.copyfileobj(src, dst)
            except OSError as e:
                log.error("could not save the cut bytes of %s to %s: %s", self.path, keep, e)
                keep = None
            log.warning("recovery of %s: %s at offset %d; cut %d bytes (offsets %d..%d)%s",
                        self.path, reason, self.start + pos, cut, self.start + pos,
                        self.end, f", saved to {keep}" if keep else "")
            os.ftruncate(self.wfd if self.wfd is not None else fd, pos)
            self.size = pos
        self.index = index
        self.indexed = True
        return count, cut

    def build_index(self) -> None:
        """Walk the headers of the whole segment to fill the sparse index."""
        fd = self.rfile.fileno()
        size = self.size
        index = [self.start]
        pos = 0
        while pos + HEADER_SIZE <= size:
            chunk = os.pread(fd, min(_SCAN_CHUNK, size - pos), pos)
            view = memoryview(chunk)
            b = 0
            while b + HEADER_SIZE <= len(chunk):
                length = HEADER.unpack_from(view, b)[0]
                if length < 0:
                    size = 0  # garbage: stop here, boundary_at_or_before resyncs
                    break
                if self.start + pos + b - index[-1] >= INDEX_STEP:
                    index.append(self.start + pos + b)
                b += HEADER_SIZE + length
            if b == 0:
                break
            pos += b
        self.index = index
        self.indexed = True

    def boundary_at_or_before(self, offset: int) -> int:
        """Start of the message holding ``offset`` (``offset`` itself at a boundary),
        or the next valid message start when the bytes there are corrupt; the
        segment end when nothing valid follows."""
        if not self.indexed:
            self.build_index()
        i = bisect.bisect_right(self.index, offset) - 1
        pos = self.index[max(i, 0)]
        end = self.end
        fd = self.rfile.fileno()
        while pos + HEADER_SIZE <= end:
            head = os.pread(fd, HEADER_SIZE, pos - self.start)
            length = HEADER.unpack(head)[0]
            nxt = pos + HEADER_SIZE + length
            if length < 0 or nxt > end:
                break
            if nxt > offset:
                body = os.pread(fd, length, pos + HEADER_SIZE - self.start)
                if scan_messages(head + body, max_payload=_INT32_MAX)[1] == 1:
                    return pos
                break
            pos = nxt
        return self._resync(max(pos, min(offset, end)))

    def _resync(self, pos: int) -> int:
        """First offset >= pos where a valid message starts (byte-by-byte search)."""
        end = self.end
        fd = self.rfile.fileno()
        while pos + HEADER_SIZE <= end:
            chunk = os.pread(fd, min(_SCAN_CHUNK, end - pos), pos - self.start)
            view = memoryview(chunk)
            for b in range(0, len(chunk) - HEADER_SIZE + 1):
                length = HEADER.unpack_from(view, b)[0]
                if length >= 0 and pos + b + HEADER_SIZE + length <= end:
                    if b + HEADER_SIZE + length <= len(chunk):
                        rec = view[b:b + HEADER_SIZE + length]
                    else:
                        rec = os.pread(fd, HEADER_SIZE + length, pos + b - self.start)
                    if scan_messages(rec, max_payload=_INT32_MAX)[1] == 1:
                        return pos + b
            pos += max(1, len(chunk) - HEADER_SIZE + 1)
        return end


def check_contiguous(segments: list[Segment], where: Path) -> None:
    """Raise StorageError unless each segment ends where the next starts."""
    for a, b in zip(segments, segments[1:], strict=False):
        if a.end != b.start:
            raise StorageError(
                f"log {where} is inconsistent: {a.path.name} holds {a.size} bytes so it ends at "
                f"offset {a.end}, but the next segment {b.path.name} starts at {b.start}")
