"""Static members (metaq-py's extension): the record, its codec, and its state at a moment.

``consumers/<group>/static/<consumerId>`` holds a static member's record as JSON
(``{"instanceId":..,"consumerId":..,"topics":[..],"graceMs":..,"sessionTimeoutMs":..,
"awaySinceMs":..,"host":..}``); Java Metaq never reads it.  :class:`StaticMember`
is the record, :func:`encode_static_member` / :func:`decode_static_member` its
codec (garbage raises :class:`NodeDataError`), :class:`StaticMemberInfo` the
state a snapshot shows.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime

from zk_layout._codecs import json_object
from zk_layout._errors import InvalidNameError, NodeDataError
from zk_layout._names import INT32_MAX, check_consumer_id, check_name, check_topic

__all__ = ["MAX_STATIC_GRACE_MS", "StaticMember", "StaticMemberInfo", "decode_static_member",
           "encode_static_member", "iso_ms"]


#: Longest grace a static member may ask for (a week, in ms): past it a typo, not a plan.
MAX_STATIC_GRACE_MS = 7 * 24 * 3600 * 1000


@dataclass(frozen=True, kw_only=True)
class StaticMember:
    """The persistent record of a static member (``consumers/<group>/static/<consumerId>``).

    Written by the member when it joins (``away_since_ms`` None) and, when it
    goes away without leaving for good, marked with the wall-clock time it was
    seen gone (by itself on a graceful close, else by the first member that saw
    its id node vanish).  While ``now < away_since_ms + grace_ms`` the other
    metaq-py members plan as if it were still there: its partitions are held
    for it, fetched by nobody.  Java Metaq members do not read this node.

    >>> rec = StaticMember(instance_id="pod-1", consumer_id="g_pod-1", topics=("t",),
    ...                    grace_ms=30000, session_timeout_ms=10000, away_since_ms=1000)
    >>> rec.held_until_ms, rec.held(20000), rec.held(31000)
    (31000, True, False)
    >>> decode_static_member(encode_static_member(rec)) == rec
    True
    """

    instance_id: str
    consumer_id: str
    topics: tuple[str, ...]
    grace_ms: int
    session_timeout_ms: int
    away_since_ms: int | None = None
    host: str = ""

    @property
    def held_until_ms(self) -> int | None:
        """When the hold ends (epoch ms), or None while the member is present."""
        return None if self.away_since_ms is None else self.away_since_ms + self.grace_ms

    def held(self, now_ms: int) -> bool:
        """Whether the member counts as a member at ``now_ms``: present, or away
        within its grace."""
        until = self.held_until_ms
        return until is None or now_ms < until


def _static_fields(value: StaticMember) -> dict[str, object]:
    check_name("instance id", value.instance_id)
    check_consumer_id(value.consumer_id)
    topics = [check_topic(t) for t in value.topics]
    if not topics:
        raise ValueError("a static member subscribes to at least one topic")
    for name, v, top in (("grace_ms", value.grace_ms, MAX_STATIC_GRACE_MS),
                         ("session_timeout_ms", value.session_timeout_ms, INT32_MAX),
                         ("away_since_ms", value.away_since_ms, 2**63 - 1)):
        if v is None and name == "away_since_ms":
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= top:
            raise ValueError(f"{name} must be an integer in 0..{top}, got {v!r}")
    return {"instanceId": value.instance_id, "consumerId": value.consumer_id,
            "topics": topics, "graceMs": value.grace_ms,
            "sessionTimeoutMs": value.session_timeout_ms,
            "awaySinceMs": value.away_since_ms, "host": value.host}


def encode_static_member(value: StaticMember) -> bytes:
    """The record as compact JSON (keys in a fixed order)."""
    if not isinstance(value, StaticMember):
        raise TypeError(f"expected StaticMember, got {type(value).__name__}")
    return json.dumps(_static_fields(value), separators=(",", ":")).encode("utf-8")


def decode_static_member(data: bytes | str | None, path: str = "") -> StaticMember:
    """Parse a static member record; anything but a well-formed one is a
    :class:`NodeDataError` naming what is wrong."""
    obj = json_object(data, path, "(a static member record)",
                      ("instanceId", "consumerId", "topics", "graceMs", "sessionTimeoutMs"))
    topics = obj["topics"]
    if not isinstance(topics, list) or not all(isinstance(t, str) for t in topics):
        raise NodeDataError(path, data, f"topics must be a list of strings, not {topics!r}")
    for key in ("instanceId", "consumerId", "host"):
        if key in obj and not isinstance(obj[key], str):
            raise NodeDataError(path, data, f"{key} must be a string, not {obj[key]!r}")
    try:
        value = StaticMember(
            instance_id=obj["instanceId"], consumer_id=obj["consumerId"], topics=tuple(topics),
            grace_ms=obj["graceMs"], session_timeout_ms=obj["sessionTimeoutMs"],
            away_since_ms=obj.get("awaySinceMs"), host=obj.get("host", ""))
        _static_fields(value)
    except (ValueError, InvalidNameError) as e:
        raise NodeDataError(path, data, str(getattr(e, "reason", e))) from None
    return value


def iso_ms(ms: int) -> str:
    """Epoch milliseconds as ISO-8601 UTC with milliseconds (``...T21:14:03.120Z``)."""
    try:
        when = datetime.fromtimestamp(ms // 1000, UTC).replace(microsecond=ms % 1000 * 1000)
    except (ValueError, OverflowError, OSError):  # beyond year 9999: a record's typo
        return f"{ms} ms after the epoch"
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True, kw_only=True)
class StaticMemberInfo:
    """A static member's record (``consumers/<group>/static/<consumerId>``) and its
    ``state`` when the group was read:

    - ``live``: its id node exists (a stale ``away_since_ms`` is ignored);
    - ``hold_starting``: its id node is gone and nobody has marked it away yet;
    - ``away``: gone, its partitions held for it until ``held_until_ms`` (epoch ms;
      ``held_until`` is the same in ISO-8601 UTC);
    - ``hold_expired``: gone and past its hold, the record awaiting deletion.
    """

    consumer_id: str
    instance_id: str
    state: str
    host: str = ""
    topics: tuple[str, ...] = ()
    grace_ms: int = 0
    session_timeout_ms: int = 0
    away_since_ms: int | None = None
    held_until_ms: int | None = None
    held_until: str | None = None

    @classmethod
    def of(cls, record: StaticMember, *, live: bool, now_ms: int) -> StaticMemberInfo:
        until = None if live else record.held_until_ms
        state = ("live" if live else "hold_starting" if until is None
                 else "away" if now_ms < until else "hold_expired")
        return cls(consumer_id=record.consumer_id, instance_id=record.instance_id, state=state,
                   host=record.host, topics=record.topics, grace_ms=record.grace_ms,
                   session_timeout_ms=record.session_timeout_ms,
                   away_since_ms=record.away_since_ms, held_until_ms=until,
                   held_until=None if until is None else iso_ms(until))

    def state_text(self, now_ms: int) -> str:
        """The state for people, "in N s" counted from ``now_ms``."""
        if self.state == "live":
            return f"live, static (instance {self.instance_id})"
        if self.state == "hold_starting":
            return "away (just gone; hold starting)"
        if self.state == "away":
            left = (self.held_until_ms - now_ms + 500) // 1000
            return f"away, held until {self.held_until} (in {left} s)"
        return f"away, hold expired at {self.held_until} (awaiting cleanup)"
