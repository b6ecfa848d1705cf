"""Points in time as users write them: ISO-8601, epoch milliseconds, or a datetime.

One parser for every place that takes a time (``start_position="time:..."``,
``MessageConsumer.seek_to_time``, ``metaq group reset-offsets --to-time``, the
Spark source's timestamp options), so they all accept the same spellings and
refuse the same mistakes with the same words.

>>> parse_time_ms("1700000000000")
1700000000000
>>> parse_time_ms("2023-11-14T22:13:20Z")
1700000000000
>>> parse_time_ms("2023-11-14T23:13:20.5+01:00")
1700000000500
>>> from datetime import datetime, timezone
>>> parse_time_ms(datetime(2023, 11, 14, 22, 13, 20, tzinfo=timezone.utc))
1700000000000
>>> parse_time_ms("yesterday")
Traceback (most recent call last):
...
metaq._errors.ConfigError: time 'yesterday' is neither epoch milliseconds nor ISO-8601 \
(e.g. 2026-11-25T14:00:00Z)
"""

from __future__ import annotations

from datetime import UTC, datetime

from metaq._errors import ConfigError

__all__ = ["parse_time_ms", "format_time_ms"]

#: Epoch ms outside these bounds is a unit mistake (seconds, microseconds), not a plan.
_MIN_MS = 946_684_800_000  # 2000-01-01
_MAX_MS = 32_503_680_000_000  # 3000-01-01


def parse_time_ms(value: object, what: str = "time") -> int:
    """Epoch milliseconds from an int (ms), a digit string (ms), an ISO-8601 string
    (a time without zone is UTC) or a timezone-aware datetime.  Anything else, and
    epoch values before 2000 or after 3000 (seconds or microseconds given by
    mistake), raise :class:`metaq.ConfigError` naming ``what``."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ConfigError(f"{what} {value!r} has no timezone; give an aware datetime")
        return _checked(round(value.timestamp() * 1000), what, value)
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a time, not {value!r}")
    if isinstance(value, int):
        return _checked(value, what, value)
    if isinstance(value, str):
        text = value.strip()
        if text.lstrip("-").isdigit():
            return _checked(int(text), what, value)
        try:
            when = datetime.fromisoformat(text.replace("Z", "+00:00").replace("z", "+00:00"))
        except ValueError:
            raise ConfigError(f"{what} {value!r} is neither epoch milliseconds nor ISO-8601 "
                              "(e.g. 2026-11-25T14:00:00Z)") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        return _checked(round(when.timestamp() * 1000), what, value)
    raise ConfigError(f"{what} must be epoch milliseconds, an ISO-8601 string or a datetime, "
                      f"not {type(value).__name__} {value!r}")


def _checked(ms: int, what: str, value: object) -> int:
    if not _MIN_MS <= ms <= _MAX_MS:
        raise ConfigError(f"{what} {value!r} is {ms} ms after the epoch, outside 2000..3000: "
                          "give milliseconds (not seconds or microseconds) or ISO-8601")
    return ms


def format_time_ms(ms: int) -> str:
    """ISO-8601 UTC with milliseconds.

    >>> format_time_ms(1700000000500)
    '2023-11-14T22:13:20.500Z'
    """
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(
        timespec="milliseconds").replace("+00:00", "Z")
