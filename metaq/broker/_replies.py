"""The broker's replies: every ``result`` it sends is built here, and the two
replies that cannot go out at once are defined here.

- :func:`result`: a ``result`` with a text body (errors, 301 redirects);
- :func:`answer`: ``result 200`` with a body (``version``, ``stats``, ``offset``);
- :func:`put_results`: the ``result 200 <msgId> <partition> <offset>`` replies of
  a group of stored puts, built together (see its docstring);
- :func:`checksum_mismatch`: the 400 of a put whose payload does not match its
  checksum, echoing the opaque as the client wrote it (like :func:`put_results`);
- :class:`Gate`: replies that wait for an fsync (group commit);
- :class:`FileReply`: a ``value`` reply whose bytes are read from the log (or sent
  with ``sendfile``) only when they can go out.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from metaq.protocol import encode_result

if TYPE_CHECKING:
    from metaq.broker._storage import LogSlice, PartitionLog

__all__ = ["result", "answer", "put_results", "checksum_mismatch", "Gate", "FileReply"]


def result(code: int, text: str, opaque: int | None) -> bytes:
    """A ``result`` reply with a text body (opaque 0 when the request's is unknown)."""
    return encode_result(code, text.encode("utf-8", "replace"), 0 if opaque is None else opaque)


def answer(body: bytes, opaque: int) -> bytes:
    """``result 200`` with ``body``."""
    return encode_result(200, body, opaque)


def checksum_mismatch(opaque: bytes) -> bytes:
    """The 400 of a put whose payload does not match its checksum; ``opaque`` is the
    request's token."""
    return b"result 400 17 %b\r\nchecksum mismatch" % opaque


def put_results(partition: bytes, opaques: list[bytes] | tuple[bytes, ...], ids: list[int],
                offsets: list[int]) -> list[bytes]:
    """``result 200`` replies of stored puts to one partition (body ``<msgId>
    <partition> <offset>``); ``partition`` and ``opaques`` are decimal bytes, the
    opaques as the requests wrote them.

    msgIds and offsets only grow, so their digit counts (and the body length)
    are the same for every reply when they are the same for the first and the
    last: then, for a group big enough to pay for it, each reply is one ``%`` of
    a prebuilt format.
    """
    n = len(ids)
    if n >= _SHARED_FORMAT_MIN:
        n_id = len(b"%d" % ids[0])
        n_off = len(b"%d" % offsets[0])
        if n_id == len(b"%d" % ids[-1]) and n_off == len(b"%d" % offsets[-1]):
            fmt = b"result 200 %d %%b\r\n%%d %b %%d" % (n_id + len(partition) + n_off + 2,
                                                        partition)
            return list(map(fmt.__mod__, zip(opaques, ids, offsets, strict=True)))
    fixed = len(partition) + 2
    if n == 1:
        i = ids[0]
        o = offsets[0]
        return [_PUT_RESULT % (len(b"%d" % i) + len(b"%d" % o) + fixed, opaques[0], i, partition,
                               o)]
    out = []
    add = out.append
    for op, i, o in zip(opaques, ids, offsets, strict=True):
        add(_PUT_RESULT % (len(b"%d" % i) + len(b"%d" % o) + fixed, op, i, partition, o))
    return out


_PUT_RESULT = b"result 200 %d %b\r\n%d %b %d"
#: Smallest group whose replies share one prebuilt format (building it costs about
#: as much as formatting a few replies one by one).
_SHARED_FORMAT_MIN = 8


class Gate:
    """Replies that may leave only once ``fut`` is done (group commit): ``data``, or
    the bytes ``fut`` resolves to; a 500 per opaque of ``opaques`` when the fsync
    failed."""

    __slots__ = ("fut", "data", "opaques")

    def __init__(self, fut: asyncio.Future, data: bytes, opaques: list[int]) -> None:
        self.fut = fut
        self.data = data
        self.opaques = opaques

    def render(self) -> bytes:
        if self.fut.cancelled() or self.fut.exception() is not None:
            err = "cancelled" if self.fut.cancelled() else str(self.fut.exception())
            return b"".join(result(500, f"message written but not synced: {err}", o)
                            for o in self.opaques)
        res = self.fut.result()
        return res if type(res) is bytes else self.data


class FileReply:
    """A ``value`` reply whose bytes go out with sendfile from a pinned log slice."""

    __slots__ = ("header", "slice", "plog")

    def __init__(self, header: bytes, s: LogSlice, plog: PartitionLog) -> None:
        self.header = header
        self.slice = s
        self.plog = plog
