"""The README's demo, driven end to end as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.zk, pytest.mark.broker]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_demo_runs_rebalances_drains_and_leaves_nothing_running():
    out = subprocess.run([sys.executable, "-m", "metaq", "demo", "--messages", "6000"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    zk_pid = int(re.search(r"ZooKeeper serving at \S+ \(pid (\d+)\)", text).group(1))
    assert "6000/6000" in text
    # the assignment after one of three members left covers all 8 partitions, 2 owners
    after = text.split("== stopping")[1].split("== draining")[0]
    owned = re.findall(r"^(demo-group_\w+)\s+((?:\d+-\d+ ?)+)$", after, re.M)
    assert {o for o, _ in owned} == {"demo-group_alice", "demo-group_carol"}
    assert sorted(p for _, ps in owned for p in ps.split()) == [
        f"{b}-{i}" for b in (0, 1) for i in range(4)]
    # the final table: every partition drained and committed at its log end
    table = text.split("== draining")[1]
    rows = re.findall(r"^(\d+-\d+)\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\w+)$", table, re.M)
    assert len(rows) == 8
    for part, owner, committed, end, lag, state in rows:
        assert committed == end and lag == "0" and state == "ok", (part, owner)
    assert "brokers exited [0, 0]" in text
    assert not _alive(zk_pid)
