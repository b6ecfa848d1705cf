"""Print every chaos run's report at the end of the session (in CI output too)."""

from __future__ import annotations

import pytest
from _chaos_report import REPORTS


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    reports = terminalreporter.config.stash.get(REPORTS, [])
    if reports:
        terminalreporter.write_sep("=", "chaos reports")
        for text in reports:
            terminalreporter.write_line(text)
