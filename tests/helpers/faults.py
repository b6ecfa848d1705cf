"""Faults planted inside a live consumer for tests."""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["fail_next_rebalance"]


def fail_next_rebalance(consumer: Any, monkeypatch: pytest.MonkeyPatch,
                        message: str = "injected coordinator bug") -> dict[str, int]:
    """Make ``consumer``'s next rebalance fail once (its strategy raises ``message``), as
    a bug in the coordinator would; the ones after it run the real strategy.  Returns
    ``{"n": how many times the strategy was called}``, kept up to date."""
    real = consumer._coordinator._strategy
    calls = {"n": 0}

    def once(*args: Any, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError(message)
        return real(*args, **kw)

    once.uses_previous = real.uses_previous  # type: ignore[attr-defined]
    monkeypatch.setattr(consumer._coordinator, "_strategy", once)
    return calls
