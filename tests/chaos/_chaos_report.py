"""Where chaos runs leave their reports for the terminal summary (tests/chaos/conftest.py)."""

from __future__ import annotations

import pytest

REPORTS = pytest.StashKey[list[str]]()


def add_report(config: pytest.Config, text: str) -> None:
    config.stash.setdefault(REPORTS, []).append(text)
