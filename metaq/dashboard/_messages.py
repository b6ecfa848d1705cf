"""The message browser: a partition's messages around an offset or a time, each with
its msgId, time, attribute and body decoded by a codec.

Codecs: ``msgpack``, ``json``, ``text`` (UTF-8), ``hex``, and ``auto`` (JSON when the
body is a JSON object or array, else text when it is printable UTF-8, else msgpack
when the whole body is one msgpack value, else hex).  A body that the chosen codec
cannot decode is shown in hex with the codec's error (``body_error``), never an
exception.  Bodies are cut at :data:`BODY_LIMIT` bytes for display.

"Around": up to ``before`` messages that end where the target offset starts (found by
asking the broker for the message boundary some bytes earlier and reading forward:
exact against a metaq-py broker, fewer or none where a Java broker answers a coarser
boundary), then up to ``count`` from the target.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from metaq._errors import BrokerError, BrokerUnavailableError, MessageError
from metaq._time import format_time_ms
from metaq.net import BrokerConnection, offset_for_time
from metaq.protocol import get_codec, iter_messages, msg_id_parts, split_payload

__all__ = ["browse", "decode_body", "CODEC_NAMES", "BODY_LIMIT"]

log = logging.getLogger(__name__)

CODEC_NAMES = ("auto", "msgpack", "json", "text", "hex")
BODY_LIMIT = 16 * 1024
_READ = 256 * 1024
_BACK = 64 * 1024
_MAX_COUNT = 500
_LOG_END = 2**63 - 1


def _jsonable(value: Any) -> Any:
    """msgpack values as JSON: bytes become {"$bytes": hex}, map keys strings."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"$bytes": bytes(value).hex()}
    if isinstance(value, dict):
        return {str(k) if not isinstance(k, bytes) else k.hex(): _jsonable(v)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and value != value:  # NaN is not JSON
        return None
    return value


def _printable(text: str) -> bool:
    return all(c.isprintable() or c in "\r\n\t" for c in text)


def decode_body(body: bytes, codec: str) -> tuple[str, Any, str | None]:
    """``(codec used, value, error)``: the value is JSON-ready (text for ``text`` and
    ``hex``); on an error the value is the hex of the body."""
    if codec not in CODEC_NAMES:
        return "hex", body.hex(), f"unknown codec {codec!r}; choose one of {CODEC_NAMES}"
    if codec == "hex":
        return "hex", body.hex(), None
    if codec == "auto":
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError:
            text = None
        if text is not None and text.strip()[:1] in ("{", "["):
            try:
                return "json", json.loads(text), None
            except ValueError:
                pass
        if text is not None and _printable(text):
            return "text", text, None
        try:
            return "msgpack", _jsonable(get_codec("msgpack").decode(body)), None
        except MessageError:
            return "hex", body.hex(), None
    try:
        if codec == "msgpack":
            return "msgpack", _jsonable(get_codec("msgpack").decode(body)), None
        text = get_codec("str").decode(body)
        if codec == "json":
            try:
                return "json", json.loads(text), None
            except ValueError as e:
                raise MessageError(f"codec 'json': body is not JSON: {e}") from None
        return "text", text, None
    except MessageError as e:
        return "hex", body.hex(), str(e)


def _message(m: Any, codec: str) -> dict[str, Any]:
    time_ms, _seq, _broker = msg_id_parts(m.msg_id)
    out: dict[str, Any] = {"offset": m.offset, "next_offset": m.next_offset,
                           "size": m.next_offset - m.offset, "msg_id": m.msg_id,
                           "time_ms": time_ms, "time": format_time_ms(time_ms),
                           "flag": m.flag, "attribute": None, "body_bytes": None,
                           "codec": None, "body": None, "body_error": None,
                           "truncated": False}
    try:
        attribute, body = split_payload(m.payload, m.flag)
    except MessageError as e:
        out.update(codec="hex", body=bytes(m.payload[:BODY_LIMIT]).hex(), body_error=str(e),
                   body_bytes=len(m.payload))
        return out
    out["attribute"] = attribute
    out["body_bytes"] = len(body)
    if len(body) > BODY_LIMIT:
        body = body[:BODY_LIMIT]
        out["truncated"] = True
        codec = "hex" if codec != "text" else codec
    used, value, error = decode_body(body, codec)
    out.update(codec=used, body=value, body_error=error)
    return out


def _walk(conn: BrokerConnection, topic: str, index: int, group: str, start: int,
          size: int) -> tuple[list[Any], str | None]:
    """The whole messages of one ``get`` at ``start``; a problem in the bytes ends the
    list with its description."""
    try:
        data = bytes(conn.get(topic, group, index, start, size))
    except BrokerError as e:
        if e.code in (301, 404):
            return [], f"nothing to read at offset {start}: {e}"
        raise
    out = []
    try:
        for m in iter_messages(data, start):
            out.append(m)
    except MessageError as e:  # damaged bytes: the messages before them stand
        return out, str(e)
    return out, None


def browse(address: tuple[str, int], topic: str, partition: str, *, offset: int | None,
           when_ms: int | None, count: int = 20, before: int = 5, codec: str = "auto",
           timeout: float = 5.0, group: str = "metaq-dashboard") -> dict[str, Any]:
    """The messages around ``offset`` (or the first at or after ``when_ms``, or the
    log's last ones when neither is given) of ``topic`` partition ``partition``
    (``"<broker id>-<n>"``) on the broker at ``address``; a broker that does not
    answer is an ``error`` in the result."""
    count = max(1, min(int(count), _MAX_COUNT))
    before = max(0, min(int(before), _MAX_COUNT))
    index = int(partition.split("-", 1)[1])
    out: dict[str, Any] = {"topic": topic, "partition": partition,
                           "broker": f"{address[0]}:{address[1]}", "codec": codec,
                           "log_start": None, "log_end": None, "target": None,
                           "messages": [], "error": None, "flagged": False,
                           "older": None, "newer": None}
    try:
        with BrokerConnection(*address, timeout=timeout) as conn:
            start = conn.offset(topic, group, index, 0)
            end = conn.offset(topic, group, index, _LOG_END)
            out.update(log_start=start, log_end=end)
            if when_ms is not None:
                target = offset_for_time(conn, topic, index, when_ms, group=group).offset
            elif offset is None:
                target = end
            else:
                target = min(max(offset, start), end)
                if start < target < end:
                    target = conn.offset(topic, group, index, target)  # a boundary
            out["target"] = target
            earlier: list[Any] = []
            if before and target > start:
                back = conn.offset(topic, group, index, max(start, target - _BACK))
                if back < target:
                    msgs, _problem = _walk(conn, topic, index, group, back,
                                           min(_READ, target - back + 1024))
                    chain = [m for m in msgs if m.next_offset <= target]
                    if chain and chain[-1].next_offset == target:
                        earlier = chain[-before:]
                if not earlier and offset is None and when_ms is None:
                    before = 0
            later: list[Any] = []
            problem = None
            pos = target
            while len(later) < count and pos < end:
                msgs, problem = _walk(conn, topic, index, group, pos, _READ)
                if not msgs:
                    break
                later += msgs[:count - len(later)]
                pos = msgs[-1].next_offset
                if problem:
                    break
            if problem:
                out.update(error=problem, flagged=True)
    except (BrokerUnavailableError, BrokerError) as e:
        out.update(error=str(e), flagged=True)
        return out
    out["messages"] = ([dict(_message(m, codec), before_target=True) for m in earlier]
                       + [dict(_message(m, codec), before_target=False) for m in later])
    if out["messages"]:
        out["older"] = out["messages"][0]["offset"] if out["messages"][0]["offset"] > (
            out["log_start"] or 0) else None
        last = out["messages"][-1]["next_offset"]
        out["newer"] = last if last < (out["log_end"] or 0) else None
    return out
