"""Body codecs shared by the producer and the consumer.

A codec turns a Python value into message body bytes and back.  Metaq bodies
are opaque bytes; these codecs are conventions of this library:

- ``bytes``: bodies are passed through (``bytes``/``bytearray``/``memoryview``).
- ``str``: UTF-8 text.
- ``msgpack``: any msgpack-serialisable value, decoded with strict limits
  (no extension types, bounded sizes) so that hostile bytes cannot make us
  allocate without bound.  Never pickle: nothing here evaluates input.

The producer's default (``"auto"``) sends ``bytes`` as is, ``str`` as UTF-8
and anything else with msgpack.

>>> get_codec("str").encode("héllo")
b'h\\xc3\\xa9llo'
>>> get_codec("msgpack").decode(get_codec("msgpack").encode({"a": [1, 2]}))
{'a': [1, 2]}
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from metaq._errors import ConfigError, MessageError

__all__ = ["Codec", "get_codec", "CODECS"]

_MSGPACK_LIMIT = 64 * 1024 * 1024


@dataclass(frozen=True)
class Codec:
    """A named pair of ``encode(value) -> bytes`` and ``decode(bytes) -> value``."""

    name: str
    encode: Callable[[Any], bytes]
    decode: Callable[[bytes], Any]


def _bytes_encode(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    raise MessageError(f"codec 'bytes' needs bytes, got {type(value).__name__}")


def _bytes_decode(data: bytes) -> bytes:
    return bytes(data)


def _str_encode(value: Any) -> bytes:
    if not isinstance(value, str):
        raise MessageError(f"codec 'str' needs str, got {type(value).__name__}")
    return value.encode("utf-8")


def _str_decode(data: bytes) -> str:
    try:
        return bytes(data).decode("utf-8")
    except UnicodeDecodeError as e:
        raise MessageError(f"codec 'str': body is not UTF-8: {e}") from None


def _msgpack_encode(value: Any) -> bytes:
    try:
        return msgpack.packb(value, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise MessageError(f"codec 'msgpack' cannot encode {type(value).__name__}: {e}") from None


def _msgpack_decode(data: bytes) -> Any:
    n = len(data)
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True,
            max_str_len=min(n, _MSGPACK_LIMIT), max_bin_len=min(n, _MSGPACK_LIMIT),
            max_array_len=min(n, _MSGPACK_LIMIT), max_map_len=min(n // 2 + 1, _MSGPACK_LIMIT),
            max_ext_len=0,
        )
    except (ValueError, TypeError, msgpack.UnpackException) as e:  # several types on garbage
        raise MessageError(f"codec 'msgpack': body is not valid msgpack: {e}") from None


def _auto_encode(value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    return _msgpack_encode(value)


CODECS: dict[str, Codec] = {
    "bytes": Codec("bytes", _bytes_encode, _bytes_decode),
    "str": Codec("str", _str_encode, _str_decode),
    "msgpack": Codec("msgpack", _msgpack_encode, _msgpack_decode),
    # "auto" encodes by type; decoding cannot know the type, so it yields bytes.
    "auto": Codec("auto", _auto_encode, _bytes_decode),
}


def get_codec(codec: str | Codec) -> Codec:
    """Return the codec named ``codec`` (or ``codec`` itself when it is one)."""
    if isinstance(codec, Codec):
        return codec
    try:
        return CODECS[codec]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown codec {codec!r}; choose one of {sorted(CODECS)}") from None
