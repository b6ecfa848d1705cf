"""A message's payload: the body's bytes (codec), their size limit, the attribute header.

What the producer puts on the wire for ``(body, attribute)``: the codec's
bytes (bytes bodies as they are with the ``auto`` and ``bytes`` codecs), at
most ``max_message_size`` of them, behind ``int32 length + UTF-8`` of the
attribute when there is one (flag bit 0, Metaq's layout).  Single sends read
:attr:`MessageEncoder.encode`, :attr:`~MessageEncoder.raw_bytes` and
:attr:`~MessageEncoder.max_size` once per message; batches encode all their
bodies through :meth:`MessageEncoder.encode_all`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from metaq._errors import MessageError, MessageTooLargeError
from metaq.protocol import Codec, get_codec

__all__ = ["MAX_ATTRIBUTE_BYTES", "MessageEncoder"]

#: Most bytes an attribute may take, so that payloads stay within the broker's limit.
MAX_ATTRIBUTE_BYTES = 32 * 1024


class MessageEncoder:
    """Bodies to bytes (``codec``) within ``max_size``, and the attribute header."""

    def __init__(self, codec: str | Codec, max_size: int) -> None:
        codec = get_codec(codec)
        #: body -> bytes (raises MessageError for a body the codec cannot encode)
        self.encode: Callable[[Any], bytes] = codec.encode
        #: bytes bodies go as they are (no codec call)
        self.raw_bytes = codec.name in ("auto", "bytes")
        #: most bytes a body may take after the codec (``max_message_size``)
        self.max_size = max_size

    @staticmethod
    def with_attribute(data: bytes, attribute: str) -> bytes:
        """``data`` behind the header of ``attribute`` (the payload when flag bit 0 is set)."""
        if not isinstance(attribute, str):
            raise MessageError(f"attribute must be a str or None, not "
                               f"{type(attribute).__name__}")
        attr = attribute.encode("utf-8")
        if len(attr) > MAX_ATTRIBUTE_BYTES:
            raise MessageTooLargeError(f"attribute of {len(attr)} bytes is over the limit of "
                                       f"{MAX_ATTRIBUTE_BYTES} bytes; nothing was sent")
        return len(attr).to_bytes(4, "big") + attr + data

    def encode_all(self, bodies: list[Any]) -> list[bytes]:
        """Every body's bytes, in order; an error names the body's index in the batch."""
        encode = self.encode
        raw = self.raw_bytes
        out = []
        for i, body in enumerate(bodies):
            try:
                out.append(body if raw and type(body) is bytes else encode(body))
            except MessageError as e:
                raise type(e)(f"message #{i} of the batch: {e}; nothing was sent") from e
        return out
