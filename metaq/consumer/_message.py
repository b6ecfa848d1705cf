"""The message a listener receives.

A :class:`Message` is a tuple underneath (built in one step on the consumer's
hot path, read through C-level properties); use its attributes, not its
indices.  Its layout, private to this package::

    (topic, partition, offset, next_offset, msg_id, flag, payload, codec)

``payload`` is the message's bytes after the 20-byte header (attribute
section included when ``flag`` bit 0 is set).  Which class a message gets
decides how ``body``/``raw_body``/``attribute`` are read:

- :class:`Message`: no attribute and a pass-through codec (``bytes``,
  ``auto``): ``body`` and ``raw_body`` are the payload itself, free to read;
- ``_DecodedMessage``: no attribute, another codec: ``body`` decodes the
  payload on every access;
- ``_AttributeMessage``: flag bit 0 set: the attribute section is split off on
  access (a bad section raises :class:`metaq.MessageError` there, not while
  fetching).

All three are :class:`Message` (``isinstance`` holds); :meth:`Message.create`
picks the right one.
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from metaq.protocol import CODECS, FLAG_HAS_ATTRIBUTE, Codec, split_payload

__all__ = ["Message", "message_classes"]

#: decode functions that return a bytes payload unchanged
_PASS_THROUGH = frozenset({CODECS["bytes"].decode, CODECS["auto"].decode})


class Message(tuple):
    """One consumed message.

    ``offset`` is the message's byte position in its partition and
    ``next_offset`` the position just after it (what a commit stores).
    ``body`` is decoded by the consumer's codec (for the ``bytes`` codec it is
    the raw bytes, no copy); ``raw_body`` is always the bytes.  ``attribute``
    is the Metaq attribute string or None.  Messages compare equal when all
    their fields are equal.
    """

    __slots__ = ()

    topic = property(itemgetter(0), doc="Topic name.")
    partition = property(itemgetter(1), doc='Partition name, ``"<brokerId>-<index>"``.')
    offset = property(itemgetter(2), doc="Byte position of the message in its partition.")
    next_offset = property(itemgetter(3),
                           doc="Byte position right after the message (what a commit stores).")
    msg_id = property(itemgetter(4), doc="Broker-assigned message id.")
    flag = property(itemgetter(5), doc="Metaq flag; bit 0 = has attribute.")
    raw_body = property(itemgetter(6), doc="The body bytes.")
    body = property(itemgetter(6), doc="The body decoded by the consumer's codec.")
    payload = property(itemgetter(6), doc="The bytes after the header, attribute section "
                       "included (what a producer sent; see metaq.protocol.split_payload).")
    #: The Metaq attribute string, or None (a property on messages that have one).
    attribute: str | None = None

    @staticmethod
    def create(topic: str, partition: str, offset: int, next_offset: int, msg_id: int,
               flag: int, payload: bytes, codec: Codec) -> Message:
        """A message of the right class for ``flag`` and ``codec``."""
        plain, with_attribute = message_classes(codec)
        cls = with_attribute if flag & FLAG_HAS_ATTRIBUTE else plain
        return cls((topic, partition, offset, next_offset, msg_id, flag, bytes(payload), codec))

    def __repr__(self) -> str:
        return (f"Message(topic={self[0]!r}, partition={self[1]!r}, offset={self[2]}, "
                f"msg_id={self[4]}, size={len(self[6])})")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (tuple(self),))


class _DecodedMessage(Message):
    """No attribute; ``body`` goes through a codec that is not pass-through."""

    __slots__ = ()

    @property
    def body(self) -> Any:
        return self[7].decode(self[6])


class _AttributeMessage(Message):
    """Flag bit 0 set: the payload starts with ``int32 attrLen, attribute``."""

    __slots__ = ()

    @property
    def attribute(self) -> str | None:  # type: ignore[override]
        return split_payload(self[6], self[5])[0]

    @property
    def raw_body(self) -> bytes:  # type: ignore[override]
        return split_payload(self[6], self[5])[1]

    @property
    def body(self) -> Any:
        return self[7].decode(split_payload(self[6], self[5])[1])


def message_classes(codec: Codec) -> tuple[type[Message], type[Message]]:
    """``(class without attribute, class with attribute)`` for messages decoded by ``codec``."""
    plain = Message if codec.decode in _PASS_THROUGH else _DecodedMessage
    return plain, _AttributeMessage
