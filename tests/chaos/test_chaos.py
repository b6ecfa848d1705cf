"""Chaos suite: a consumer group under seeded random faults keeps its promises.

A 3-node ZooKeeper ensemble, 3 broker processes, 4 member processes of one
group and a producer of sequence-numbered messages.  For ``window`` seconds
a seeded plan kills -9 and restarts members and brokers, stops and restarts
ZooKeeper nodes (the leader at least once), expires members' sessions on
the server (their ZooKeeper traffic blackholed through a proxy beyond the
session timeout), SIGSTOPs members beyond the session timeout, writes garbage
into offset nodes and flips bytes of a message on a killed broker's disk.  Then
the group must settle with lag 0, and the audit (``_chaos_check``) must find:
every acknowledged message consumed or, damaged on disk, reported with its
offset; no offset acknowledged twice; duplicates only from offsets not yet
committed; no two member processes delivering one partition except a zombie's
in-flight batch; owner nodes only in their member's session; no member
idle while partitions sat unowned; no thread or process left behind.

Every run prints its report (seed, faults by kind, messages, duplicates, max
unowned time) in the terminal summary.  Knobs (environment):

- ``METAQ_CHAOS_SEEDS=1,2,3``: these seeds (default: 3 random ones, printed);
- ``METAQ_SOAK=1``: 10 seeds of 120 s each;
- ``METAQ_CHAOS_SECONDS=N``: the fault window of each seed.
"""

from __future__ import annotations

import os
import random

import pytest
from _chaos_report import add_report
from _chaos_run import ChaosRun, ChaosSettings

pytestmark = pytest.mark.broker

SOAK = os.environ.get("METAQ_SOAK", "") not in ("", "0")


def _seeds() -> list[int]:
    given = os.environ.get("METAQ_CHAOS_SEEDS", "").strip()
    if given:
        return [int(x) for x in given.replace(" ", "").split(",") if x]
    rng = random.SystemRandom()
    return [rng.randrange(1, 2**31) for _ in range(10 if SOAK else 3)]


def _settings() -> ChaosSettings:
    window = os.environ.get("METAQ_CHAOS_SECONDS", "").strip()
    return ChaosSettings(window=float(window) if window else (120.0 if SOAK else 40.0))


@pytest.mark.timeout(_settings().window + 300)
@pytest.mark.parametrize("seed", _seeds(), ids=lambda s: f"seed{s}")
def test_chaos(seed: int, zk_ensemble, tmp_path, request: pytest.FixtureRequest) -> None:
    settings = _settings()
    run = ChaosRun(seed, zk_ensemble, tmp_path, settings)
    try:
        run.execute()
    finally:
        add_report(request.config, run.report())
    failures = run.problems + run.verdict.violations
    if failures:
        path = run.dump()
        pytest.fail(f"{run.report()}\n  data: {path}", pytrace=False)
