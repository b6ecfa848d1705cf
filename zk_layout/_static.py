"""The static member view of a snapshot: a record and its state at a given moment."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from zk_layout._codecs import StaticMember

__all__ = ["StaticMemberInfo", "iso_ms"]


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
