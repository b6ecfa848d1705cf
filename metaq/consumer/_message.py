"""The message a listener receives.

A :class:`Message` is a tuple underneath (built in one step on the consumer's
hot path; its fields are made by :func:`metaq.protocol.slot_fields`: with the C
speedups member descriptors that read the tuple's items in place, else
``property(itemgetter(i))``); use its attributes, not its indices.  Its layout,
private to this package::

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

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from metaq.protocol import (
    CODECS,
    FLAG_HAS_ATTRIBUTE,
    SPEEDUPS_IN_USE,
    Codec,
    slot_fields,
    split_payload,
)

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

    # topic, partition, offset, next_offset, msg_id, flag, raw_body, body, payload:
    # read-only fields made by slot_fields below (with the C speedups, member
    # descriptors reading the tuple's items in place; else property(itemgetter(i)))
    if SPEEDUPS_IN_USE:
        # the C fields read an item without checking the length: every instance
        # has all of them (the consumer's C builds messages whole, without this)
        def __new__(cls, fields: Iterable[Any] = ()) -> Message:
            self = tuple.__new__(cls, fields)
            if len(self) != _SIZE:
                raise TypeError(f"a Message has {_SIZE} fields, not {len(self)}")
            return self

    if TYPE_CHECKING:  # what slot_fields makes, as type checkers should see it
        @property
        def topic(self) -> str: ...
        @property
        def partition(self) -> str: ...
        @property
        def offset(self) -> int: ...
        @property
        def next_offset(self) -> int: ...
        @property
        def msg_id(self) -> int: ...
        @property
        def flag(self) -> int: ...
        @property
        def raw_body(self) -> bytes: ...
        @property
        def body(self) -> Any: ...
        @property
        def payload(self) -> bytes: ...

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


#: (name, index, doc) of each field, the layout above; ``attribute`` is not one (a
#: class attribute, a property of ``_AttributeMessage``)
_FIELDS = (
    ("topic", 0, "Topic name."),
    ("partition", 1, 'Partition name, ``"<brokerId>-<index>"``.'),
    ("offset", 2, "Byte position of the message in its partition."),
    ("next_offset", 3, "Byte position right after the message (what a commit stores)."),
    ("msg_id", 4, "Broker-assigned message id."),
    ("flag", 5, "Metaq flag; bit 0 = has attribute."),
    ("raw_body", 6, "The body bytes."),
    ("body", 6, "The body decoded by the consumer's codec."),
    ("payload", 6, "The bytes after the header, attribute section included (what a "
     "producer sent; see metaq.protocol.split_payload)."),
)
_SIZE = 8
slot_fields(Message, _SIZE, _FIELDS)


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
