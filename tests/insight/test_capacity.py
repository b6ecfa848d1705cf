"""The capacity hint: against a real group consuming at a known rate, and the rules.

The live test paces each member's listener at a known message rate and a producer
at another, all on a real broker, then runs ``metaq group describe --catch-up``,
which samples twice ``--sample`` apart.  The estimates must land in ranges around
the true rates (wide enough for a loaded machine, narrow enough to fail on a wrong
unit, a wrong window or a member counted twice).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time

import pytest

from metaq import ConfigError, MessageConsumer, Producer
from metaq._insight import PartitionReading, Reading, capacity
from metaq._types import PartitionKey
from metaq.testing import wait_until

TOPIC, GROUP = "cap", "capg"
BODY = b"y" * 100
MSG = 120                         # bytes per message on the log (20-byte header)
MEMBER_RATE = 100                 # messages/s each member's listener lets through
PRODUCE_RATE = 50                 # messages/s produced during the sample


class Pace:
    """A listener letting at most ``rate`` messages a second through (one member's)."""

    def __init__(self, rate: float) -> None:
        self.interval = 1.0 / rate
        self.lock = threading.Lock()
        self.next = time.monotonic()
        self.count = 0

    def __call__(self, _message: object) -> None:
        with self.lock:
            now = time.monotonic()
            wait = self.next - now
            self.next = max(self.next, now) + self.interval
            self.count += 1
        if wait > 0:
            time.sleep(wait)  # the workload's pace, not synchronisation


def test_catch_up_estimate_for_a_group_consuming_at_a_known_rate(zk_connect, broker_factory):
    broker_factory({TOPIC: 8}, broker_id=0, zk_connect=zk_connect)
    with Producer(zk_connect) as p:
        for f in [p.send_async(TOPIC, BODY) for _ in range(5000)]:
            f.result(timeout=30)
    stop = threading.Event()

    def producing() -> None:
        with Producer(zk_connect) as p:
            nxt = time.monotonic()
            while not stop.is_set():
                p.send_async(TOPIC, BODY)
                nxt += 1.0 / PRODUCE_RATE
                stop.wait(max(0.0, nxt - time.monotonic()))

    members, paces = [], []
    producer = threading.Thread(target=producing, name="test-producer")
    try:
        for name in ("k1", "k2"):
            pace = Pace(MEMBER_RATE)
            c = MessageConsumer(GROUP, zk_connect, consumer_id=name, commit_period=0.1,
                                zk_session_timeout=4.0)
            # progress moves a batch (one get's messages) at a time: small gets, so the
            # committed offsets move many times within the window
            c.subscribe(TOPIC, pace, max_size=2048)
            c.start()
            members.append(c)
            paces.append(pace)
        # both members consuming (each has delivered something) before the window opens
        wait_until(lambda: all(p.count > 20 for p in paces), timeout=30,
                   what="both members consuming")
        producer.start()
        target = 10.0
        run = subprocess.run(
            [sys.executable, "-m", "metaq", "group", "describe", GROUP, "--zk", zk_connect,
             "--catch-up", f"{target:g}s", "--sample", "3s", "--json"],
            capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        hint = json.loads(run.stdout)["capacity"]
    finally:
        stop.set()
        if producer.is_alive():
            producer.join(timeout=10)
        for c in members:
            c.close()
    member_bps = MEMBER_RATE * MSG
    produce_bps = PRODUCE_RATE * MSG
    assert hint["members"] == 2 and hint["partitions"] == 8
    assert 2.5 <= hint["window"] <= 6.0
    assert sorted(hint["busy_members"]) == ["capg_k1", "capg_k2"]
    for member, rate in hint["member_rates"].items():
        assert 0.4 * member_bps <= rate <= 1.3 * member_bps, (member, rate, hint)
    assert 0.4 * member_bps <= hint["per_member_rate"] <= 1.3 * member_bps, hint
    assert 0.4 * produce_bps <= hint["produce_rate"] <= 1.5 * produce_bps, hint
    lag = hint["lag"]
    assert 1000 * MSG <= lag <= 5050 * MSG, hint           # most of the backlog is left
    # catch-up: lag over the net rate, the true one within the ranges above
    fastest = lag / (2 * 1.3 * member_bps - 0.4 * produce_bps)
    slowest = lag / (2 * 0.4 * member_bps - 1.5 * produce_bps)
    assert fastest <= hint["catch_up_seconds"] <= slowest, hint
    # members needed within the target: what the true rates give, within the ranges
    need = (produce_bps + lag / target)
    assert math.ceil(0.4 * need / (1.3 * member_bps)) <= hint["members_needed"] \
        <= math.ceil(1.5 * need / (0.4 * member_bps)), hint
    assert hint["members_needed"] > 2, hint                # the two cannot do it in 10 s
    assert hint["target_seconds"] == target
    assert any("linearly" in a for a in hint["assumptions"])


def reading(at: float, parts: dict[str, tuple[str | None, int | None, int | None]],
            members=("g_a", "g_b")) -> Reading:
    return Reading(group="g", at=at, members=tuple(members), partitions={
        PartitionKey("t", p): PartitionReading(owner=o, committed=c, log_end=e)
        for p, (o, c, e) in parts.items()})


def test_capacity_rules_on_readings():
    first = reading(0.0, {"0-0": ("g_a", 0, 10_000), "0-1": ("g_b", 0, 10_000),
                          "0-2": ("g_b", 500, 500)})
    second = reading(2.0, {"0-0": ("g_a", 2_000, 11_000), "0-1": ("g_b", 1_000, 10_000),
                           "0-2": ("g_b", 500, 500)})
    h = capacity(first, second, target=10.0)
    assert h.produce_rate == 500.0 and h.member_rates == {"g_a": 1000.0, "g_b": 500.0}
    assert h.lag == 9_000 + 9_000 and h.per_member_rate == 750.0
    assert h.catch_up_seconds == pytest.approx(18_000 / (1500 - 500))
    assert h.members_needed == math.ceil((500 + 1800) / 750)            # 4 > 3 partitions
    assert any("only 3 partitions" in n for n in h.notes)
    # a partition that changed owner counts for nobody; a dead broker is left out, said so
    moved = reading(2.0, {"0-0": ("g_b", 2_000, 11_000), "0-1": ("g_b", 1_000, 10_000),
                          "0-2": ("g_b", 500, None)})
    h = capacity(first, moved)
    assert h.member_rates == {"g_a": 0.0, "g_b": 500.0} and h.busy_members == ("g_b",)
    assert any("broker did not answer" in n and "t/0-2" in n for n in h.notes)
    # not gaining: no catch-up time; caught up: the members there are suffice
    stuck = reading(2.0, {"0-0": ("g_a", 0, 12_000), "0-1": ("g_b", 0, 10_000),
                          "0-2": ("g_b", 500, 500)})
    h = capacity(first, stuck, target=60)
    assert h.catch_up_seconds is None and h.members_needed is None
    assert any("not catching up" in n for n in h.notes)
    done = reading(0.0, {"0-0": ("g_a", 100, 100)})
    h = capacity(done, reading(1.0, {"0-0": ("g_a", 150, 150)}), target=5)
    assert h.catch_up_seconds == 0.0 and h.members_needed == 2
    # nothing measured (every broker down): no estimate rather than "caught up"
    h = capacity(reading(0.0, {"0-0": ("g_a", 5, None)}), reading(1.0, {"0-0": ("g_a", 5, None)}),
                 target=5)
    assert h.catch_up_seconds is None and h.members_needed is None
    assert any("no estimate" in n for n in h.notes)
    with pytest.raises(ConfigError, match="after the first"):
        capacity(second, first)
    with pytest.raises(ConfigError, match="> 0 seconds"):
        capacity(first, second, target=0)


@pytest.mark.parametrize("flag, value, needle", [
    ("--catch-up", "0", "must be > 0"), ("--catch-up", "soon", "not a duration"),
    ("--sample", "0ms", "must be > 0")])
def test_bad_durations_are_named_with_exit_2(flag, value, needle):
    run = subprocess.run([sys.executable, "-m", "metaq", "group", "describe", "g", "--zk",
                          "127.0.0.1:1", flag, value], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and needle in run.stderr and flag in run.stderr, run.stderr
