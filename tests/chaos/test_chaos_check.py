"""The chaos audit itself: each check catches what it is for, on made-up histories.

Fast (no ZooKeeper, no processes): every scenario starts from one clean
history, where member c0 claims partition 0-0, delivers 4 messages and
commits, and breaks it in one way.
"""

from __future__ import annotations

import dataclasses

import pytest
from _chaos_check import check
from _chaos_procs import Event, _parse
from _chaos_zk import Commit, Sample

S0, S1 = 0xA0, 0xB1  # sessions of members c0 and c1


def ev(kind: str, t: float, who: str, part: str = "", offset: int = -1, body: str = "",
       session: int | None = None) -> Event:
    return Event(kind, t, who, int(who.split("#")[0]), part=part, offset=offset, body=body,
                 session="" if session is None else f"{session:x}")


def sample(t: float, ids: dict[str, int], owners: dict[str, tuple[str, int]]) -> Sample:
    return Sample(t - 0.01, t, dict(ids), dict(owners), dict(ids), frozenset({"0-0"}))


@dataclasses.dataclass
class History:
    acked: dict[int, tuple[str, int]]
    events: list[Event]
    commits: dict[str, list[Commit]]
    samples: list[Sample]

    def verdict(self):  # noqa: ANN201
        return check(acked=self.acked, events=self.events, commits=self.commits,
                     samples=self.samples, faults=[], partitions=["0-0"], group="g",
                     late_bytes=20, idle_bound=10.0, unowned_bound=15.0)

    def kinds(self) -> set[str]:
        return {v.split("]")[0][1:] for v in self.verdict().violations}


@pytest.fixture
def clean() -> History:
    acked = {i: ("0-0", 10 * i) for i in range(4)}
    events = [ev("A", 1.0, "0#1", "0-0", session=S0)]
    events += [ev("M", 2.0 + i / 10, "0#1", "0-0", 10 * i, f"seq-{i}") for i in range(4)]
    commits = {"0-0": [Commit(3.0, 0, 40, 3.0, 100)]}
    c0 = {"g_c0": S0}
    samples = [sample(0.5 + i / 4, c0, {"0-0": ("g_c0", S0)}) for i in range(30)]
    return History(acked, events, commits, samples)


def test_a_clean_history_passes(clean: History) -> None:
    v = clean.verdict()
    assert v.violations == []
    assert v.metrics["delivered"] == 4 and v.metrics["duplicates"] == 0


def test_an_acknowledged_message_never_delivered_is_lost(clean: History) -> None:
    del clean.events[3]  # offset 20
    assert clean.kinds() == {"lost", "skip"}


def test_a_body_other_than_the_acknowledged_one(clean: History) -> None:
    clean.events[2] = dataclasses.replace(clean.events[2], body="seq-7")
    assert "body" in clean.kinds()


def test_a_delivery_without_a_claim(clean: History) -> None:
    clean.events.append(ev("M", 2.5, "1#1", "0-0", 30, "seq-3"))
    assert "unclaimed" in clean.kinds()


def test_a_commit_moving_backwards(clean: History) -> None:
    clean.commits["0-0"].append(Commit(4.0, 1, 20, 4.0, 101))
    assert "commit-backwards" in clean.kinds()


def test_a_new_owner_starting_below_the_committed_offset(clean: History) -> None:
    clean.events.append(ev("R", 3.5, "0#1", "0-0", session=S0))
    clean.events.append(ev("A", 4.0, "1#1", "0-0", session=S1))
    clean.events.append(ev("M", 4.1, "1#1", "0-0", 20, "seq-2"))  # committed: 40
    assert "redelivered-committed" in clean.kinds()


def test_a_new_owner_starting_past_the_committed_offset(clean: History) -> None:
    clean.commits["0-0"] = [Commit(3.0, 0, 20, 3.0, 100)]
    clean.events.append(ev("R", 3.5, "0#1", "0-0", session=S0))
    clean.events.append(ev("A", 4.0, "1#1", "0-0", session=S1))
    clean.events.append(ev("M", 4.1, "1#1", "0-0", 30, "seq-3"))  # skipped 20
    assert "start-not-committed" in clean.kinds()


def test_duplicates_from_the_uncommitted_window_are_legal(clean: History) -> None:
    clean.commits["0-0"] = [Commit(3.0, 0, 20, 3.0, 100)]
    clean.events.append(ev("R", 3.5, "0#1", "0-0", session=S0))
    clean.events.append(ev("A", 4.0, "1#1", "0-0", session=S1))
    clean.events += [ev("M", 4.1, "1#1", "0-0", 20, "seq-2"),
                     ev("M", 4.2, "1#1", "0-0", 30, "seq-3")]
    v = clean.verdict()
    assert v.violations == [] and v.metrics["duplicates"] == 2


def test_two_registered_members_delivering_one_partition(clean: History) -> None:
    # c1 claims while c0 (still registered: sampled later) goes on delivering
    clean.events.insert(3, ev("A", 2.15, "1#1", "0-0", session=S1))
    for s in range(len(clean.samples)):
        clean.samples[s] = dataclasses.replace(
            clean.samples[s], ids_before={"g_c0": S0, "g_c1": S1},
            ids_after={"g_c0": S0, "g_c1": S1})
    assert "two-live-owners" in clean.kinds()


def test_a_late_claim_from_an_ended_session_that_delivers_nothing_is_no_second_owner(
        clean: History) -> None:
    """Seen in CI (seed 1318133972): c1, frozen right after claiming, runs its
    on_assigned only on waking, after the server ended its session; it delivers
    nothing in that session, while c0 (registered all along) goes on."""
    for s in range(len(clean.samples)):
        t = clean.samples[s].t
        ids = {"g_c0": S0, "g_c1": S1} if t < 1.9 else {"g_c0": S0}  # c1's session ends
        clean.samples[s] = dataclasses.replace(clean.samples[s], ids_before=ids,
                                               ids_after=ids)
    clean.events.insert(3, ev("A", 2.15, "1#1", "0-0", session=S1))
    clean.events.insert(4, ev("Z", 2.16, "1#1", body="LOST"))
    assert clean.verdict().violations == []


def _c0_session_ends_at(h: History, t: float) -> None:
    h.samples = [s if s.t < t else dataclasses.replace(
        s, ids_before={}, ids_after={}, owners={}) for s in h.samples]


def test_a_zombie_finishing_its_batch_in_flight_is_tolerated(clean: History) -> None:
    _c0_session_ends_at(clean, 2.1)  # ended by 2.25: the delivery of 30 comes after
    v = clean.verdict()
    assert v.violations == [] and v.metrics["zombie_deliveries"] >= 1


def test_a_zombie_fetching_on_after_its_session_ended(clean: History) -> None:
    clean.acked.update({i: ("0-0", 10 * i) for i in range(4, 8)})
    clean.events += [ev("M", 3.0 + i / 10, "0#1", "0-0", 10 * i, f"seq-{i}")
                     for i in range(4, 8)]
    clean.commits["0-0"] = [Commit(3.5, 0, 40, 3.5, 100), Commit(4.0, 1, 80, 4.0, 101)]
    _c0_session_ends_at(clean, 2.1)  # 30..70 after it: more than late_bytes=20
    assert "zombie-kept-fetching" in clean.kinds()


def test_a_claim_acted_on_after_the_session_ended(clean: History) -> None:
    _c0_session_ends_at(clean, 0.6)  # ended (sampled at 0.75) before the A line at 1.0
    assert "fetch-after-session-end" in clean.kinds()


def test_an_owner_node_of_a_session_that_is_not_the_members(clean: History) -> None:
    clean.samples[2] = dataclasses.replace(clean.samples[2], owners={"0-0": ("g_c0", S1)})
    assert "foreign-owner" in clean.kinds()


def test_a_registered_member_idle_while_a_partition_is_unowned(clean: History) -> None:
    clean.samples = [sample(0.5 + i, {"g_c0": S0}, {}) for i in range(14)]
    assert clean.kinds() == {"idle-member"}


def test_a_partition_unowned_too_long(clean: History) -> None:
    clean.samples = [sample(0.5 + i, {}, {}) for i in range(18)]
    assert clean.kinds() == {"unowned"}


def test_a_background_error_or_garbage_line_fails(clean: History) -> None:
    clean.events.append(ev("E", 5.0, "0#1", body="ValueError('x')"))
    clean.events.append(ev("?", 5.0, "0#1", body="garbage"))
    assert {"error", "garbage"} <= clean.kinds()


def test_member_lines_parse() -> None:
    m = _parse("M 12.5 0-3 1040 77 seq-9", "0#1", 0)
    assert (m.kind, m.t, m.part, m.offset, m.body) == ("M", 12.5, "0-3", 1040, "seq-9")
    a = _parse("A 13.0 0-3 1a2b", "0#1", 0)
    assert (a.kind, a.part, a.session) == ("A", "0-3", "1a2b")
    z = _parse("Z 14.0 LOST -", "0#1", 0)
    assert (z.kind, z.body, z.session) == ("Z", "LOST", "-")
    with pytest.raises(ValueError):
        _parse("M 1.0 0-3 notanumber 1 b", "0#1", 0)


# ---- data faults (issue 13): damaged messages, garbage offsets, reused offsets

def test_an_undelivered_message_reported_as_damaged_is_not_lost(clean: History) -> None:
    del clean.events[3]  # offset 20: damaged on disk, the member skipped it and said so
    clean.events.insert(3, ev("D", 2.25, "0#1", "0-0", 20, "30"))
    v = clean.verdict()
    assert v.violations == [] and v.metrics["damaged_reported"] == 1


def test_a_damage_report_elsewhere_does_not_excuse_a_loss(clean: History) -> None:
    del clean.events[3]
    clean.events.insert(3, ev("D", 2.25, "0#1", "0-0", 30, "40"))  # not where it is missing
    assert {"lost", "skip"} <= clean.kinds()


def test_a_flipped_message_neither_delivered_before_nor_reported(clean: History) -> None:
    from _chaos_faults import Fault

    clean.acked[4] = ("0-0", 40)
    flip = Fault(1.0, "disk_flip", 0, 1.0, damaged=["0-0", 40, 50])
    v = check(acked=clean.acked, events=clean.events, commits=clean.commits,
              samples=clean.samples, faults=[flip], partitions=["0-0"], group="g",
              late_bytes=20, idle_bound=10.0, unowned_bound=15.0)
    kinds = {x.split("]")[0][1:] for x in v.violations}
    assert "damage-unreported" in kinds and "lost" in kinds


def test_an_offset_acknowledged_twice(clean: History) -> None:
    clean.acked[9] = ("0-0", 20)
    assert "offset-reused" in clean.kinds()


def test_a_run_reset_from_a_garbage_offset_starts_at_the_log_start(clean: History) -> None:
    # c0's commit said 40; the node then held garbage: c1 resets to the start
    clean.events.append(ev("R", 3.5, "0#1", "0-0", session=S0))
    clean.events.append(ev("O", 3.9, "1#1", "0-0", body="earliest"))
    clean.events.append(ev("A", 4.0, "1#1", "0-0", session=S1))
    clean.events += [ev("M", 4.1 + i / 10, "1#1", "0-0", 10 * i, f"seq-{i}") for i in range(4)]
    clean.commits["0-0"].append(Commit(5.0, 2, 20, 5.0, 102))  # back down: a reset
    v = clean.verdict()
    assert v.violations == [] and v.metrics["resets"] == 1


def test_the_member_lines_for_damage_and_resets_parse() -> None:
    d = _parse("D 1.5 0-1 120 240", "0#1", 0)
    assert (d.kind, d.part, d.offset, d.body) == ("D", "0-1", 120, "240")
    o = _parse("O 1.5 0-1 earliest", "0#1", 0)
    assert (o.kind, o.part, o.body) == ("O", "0-1", "earliest")
