"""The message a listener receives."""

from __future__ import annotations

from typing import Any

from metaq._codec import Codec
from metaq._message import split_payload

__all__ = ["Message"]


class Message:
    """One consumed message.

    ``offset`` is the message's byte position in its partition and
    ``next_offset`` the position just after it (what a commit stores).
    ``body`` is decoded by the consumer's codec on first access; ``raw_body``
    is always the bytes.  ``attribute`` is the Metaq attribute string or None.
    """

    __slots__ = ("topic", "partition", "offset", "next_offset", "msg_id", "flag",
                 "_payload", "_codec", "_split")

    def __init__(self, topic: str, partition: str, offset: int, next_offset: int,
                 msg_id: int, flag: int, payload: bytes, codec: Codec) -> None:
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.next_offset = next_offset
        self.msg_id = msg_id
        self.flag = flag
        self._payload = payload
        self._codec = codec
        self._split: tuple[str | None, bytes] | None = None

    def _parts(self) -> tuple[str | None, bytes]:
        if self._split is None:
            if self.flag & 1:
                self._split = split_payload(self._payload, self.flag)
            else:
                self._split = (None, bytes(self._payload))
        return self._split

    @property
    def attribute(self) -> str | None:
        return self._parts()[0]

    @property
    def raw_body(self) -> bytes:
        return self._parts()[1]

    @property
    def body(self) -> Any:
        return self._codec.decode(self._parts()[1])

    def __repr__(self) -> str:
        return (f"Message(topic={self.topic!r}, partition={self.partition!r}, "
                f"offset={self.offset}, msg_id={self.msg_id}, size={len(self._payload)})")
