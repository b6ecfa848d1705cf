"""What consumers delivered, and the checks on it shared by consumer tests:
:func:`listener` collects ``(partition, offset, next_offset, body)`` (optionally
blocking after ``stop_at`` messages until a gate opens), :func:`check_contiguous`
asserts every body once and each partition read from 0 with no gap and no repeat,
:func:`brokers_read` says where consumers read their partitions from now."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["brokers_read", "check_contiguous", "listener"]


def listener(got: list, gate: threading.Event | None = None,
             stop_at: int = 0) -> Callable[[object], None]:
    lock = threading.Lock()

    def listen(m) -> None:  # noqa: ANN001
        with lock:
            got.append((m.partition, m.offset, m.next_offset, bytes(m.body)))
            n = len(got)
        if gate is not None and n >= stop_at:
            gate.wait(30)
    return listen


def check_contiguous(got: list, bodies: set[bytes]) -> None:
    """Every message once, each partition read from 0 with no gap and no repeat."""
    assert sorted(b for *_, b in got) == sorted(bodies)
    by_part: dict[str, list] = {}
    for part, offset, nxt, _ in got:
        by_part.setdefault(part, []).append((offset, nxt))
    for part, seq in by_part.items():
        pos = 0
        for offset, nxt in seq:
            assert offset == pos, f"{part}: delivered {offset}, expected {pos}"
            pos = nxt


def brokers_read(*consumers: object) -> set[str]:
    """Where the consumers' partitions are read from now (their metrics)."""
    return {p["broker"] for c in consumers for p in c.metrics()["partitions"].values()}
