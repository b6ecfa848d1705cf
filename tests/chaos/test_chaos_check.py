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


def test_a_new_owner_stepping_over_an_unacknowledged_damaged_message(clean: History) -> None:
    # the message at 40 was written but never acknowledged (the broker stopped before
    # it answered), then damaged on disk; the committed offset points at it
    clean.acked[5] = ("0-0", 50)
    clean.commits["0-0"] = [Commit(3.0, 0, 40, 3.0, 100)]
    clean.events.append(ev("R", 3.5, "0#1", "0-0", session=S0))
    clean.events.append(ev("A", 4.0, "1#1", "0-0", session=S1))
    clean.events.append(ev("D", 4.05, "1#1", "0-0", 40, "50"))
    clean.events.append(ev("M", 4.1, "1#1", "0-0", 50, "seq-5"))
    assert clean.verdict().violations == []
    clean.events[-2] = ev("D", 4.05, "1#1", "0-0", 30, "40")  # reported elsewhere
    assert "start-not-committed" in clean.kinds()


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


# ---- static members (issue 15): held partitions, duplicates

S2, S3 = 0xC2, 0xD3  # c0's session after it came back; a duplicate's session


def ssample(t: float, ids: dict[str, int], owners: dict[str, tuple[str, int]],
            statics: dict[str, tuple[int | None, int]],
            published: tuple[str, ...] = ("0-0",)) -> Sample:
    return Sample(t - 0.01, t, dict(ids), dict(owners), dict(ids), frozenset(published),
                  dict(statics))


def away_history(clean: History, *, grace: float, away_at: float, back_at: float | None,
                 end: float, claim_by_c1: float | None = None,
                 mark_delay: float = 0.0) -> History:
    """The clean history with c0 a static member (grace ``grace``) and c1 a dynamic
    one, registered throughout and owning nothing (one partition: c0's share).  c0's
    session ends at ``away_at`` (c1 marks it away ``mark_delay`` later); it comes back
    as 0#2 at ``back_at`` and claims 0-0 again; c1 claims 0-0 at ``claim_by_c1``.  The
    record is deleted when the grace runs out."""
    away_at_ms = int((away_at + mark_delay) * 1000)
    until = away_at + mark_delay + grace
    samples = []
    t = 0.5
    while t < end:
        c1_owns = claim_by_c1 is not None and t > claim_by_c1
        if t < away_at:
            ids, owners, rec = {"g_c0": S0, "g_c1": S1}, {"0-0": ("g_c0", S0)}, (None, 0)
        elif back_at is None or t < back_at:
            ids, owners = {"g_c1": S1}, {}
            rec = None if t >= until else (away_at_ms if t >= away_at + mark_delay else None, 0)
        else:
            ids, rec = {"g_c0": S2, "g_c1": S1}, (None, 0)
            owners = {"0-0": ("g_c0", S2)} if t > back_at + 0.1 else {}
        if c1_owns:
            owners = {"0-0": ("g_c1", S1)}
        statics = {} if rec is None else {"g_c0": (rec[0], int(grace * 1000))}
        samples.append(ssample(t, ids, owners, statics))
        t += 0.25
    events = list(clean.events)
    if back_at is not None:
        events.append(ev("A", back_at + 0.05, "0#2", "0-0", session=S2))
    if claim_by_c1 is not None:
        events.append(ev("A", claim_by_c1, "1#1", "0-0", session=S1))
    return History(clean.acked, events, clean.commits, samples)


def test_a_partition_held_for_an_away_static_member_waits_within_its_grace(
        clean: History) -> None:
    # away 18 s: longer than unowned_bound (15 s) and idle_bound (10 s), within its grace
    h = away_history(clean, grace=20.0, away_at=4.0, back_at=22.0, end=25.0)
    v = h.verdict()
    assert v.violations == []
    assert (v.metrics["static_away"], v.metrics["static_returned"]) == (1, 1)
    assert 17.5 < v.metrics["max_unowned_held_s"] < 18.5 and v.metrics["max_unowned_s"] < 1
    # the same history without the hold (no record: a dynamic member) is a failure
    h.samples = [dataclasses.replace(s, statics={}) for s in h.samples]
    assert h.kinds() == {"unowned", "idle-member"}


def test_a_held_partition_unowned_longer_than_the_grace_plus_the_bound(
        clean: History) -> None:
    # the grace (5 s) ran out at 9 s; nobody took 0-0 until c0 came back at 30 s:
    # unowned 26 s, more than 15 s + 5 s; c1 idle from 9 s on
    h = away_history(clean, grace=5.0, away_at=4.0, back_at=30.0, end=33.0)
    v = h.verdict()
    assert {x.split("]")[0][1:] for x in v.violations} == {"unowned", "idle-member"}
    assert any("+ the grace 5s of the static member" in x for x in v.violations)


def test_another_member_claiming_a_held_partition_within_the_grace(clean: History) -> None:
    h = away_history(clean, grace=8.0, away_at=4.0, back_at=None, end=10.0, claim_by_c1=6.0)
    v = h.verdict()
    assert h.kinds() == {"held-claimed"}
    text = next(x for x in v.violations if x.startswith("[held-claimed]"))
    assert "1#1 (g_c1) claimed it at 6.000 while static member g_c0 was away within its " \
           "grace (held until 12.000)" in text
    assert "it owned 0-0 before it went away" in text


def test_a_claim_as_soon_as_the_member_went_away_is_caught(clean: History) -> None:
    # the first sample without c0 is at 4.0: a claim right then, before c1 marked it away
    h = away_history(clean, grace=8.0, away_at=4.0, back_at=None, end=10.0, claim_by_c1=4.01)
    assert h.kinds() == {"held-claimed"}


def test_a_claim_while_another_member_re_registered_is_not_judged(clean: History) -> None:
    """Chaos seed 4 (static): c3 re-registered in a new session between two samples; in
    the moment its id node was gone, c1 planned without it, and the held member's share
    changed.  The samples never show that moment, so such a claim cannot be judged."""
    h = away_history(clean, grace=8.0, away_at=4.0, back_at=None, end=10.0, claim_by_c1=6.0)
    assert h.kinds() == {"held-claimed"}
    # the same history with a third member, c2, that re-registers in a new session at
    # 5.9: a moment the samples do not show, when the group was c1 alone
    def with_c2(s):
        ids = {**s.ids_before, "g_c2": 71 if s.t < 5.9 else 72}
        return dataclasses.replace(s, ids_before=ids, ids_after=ids)
    h.samples = [with_c2(s) for s in h.samples]
    assert h.verdict().violations == []


def test_a_member_gone_and_never_marked_away(clean: History) -> None:
    """The group did not see c0 go (a member deaf to the group, as after a reconnect that
    lost its watches): its record says it is there 4 s after its id node went."""
    h = away_history(clean, grace=8.0, away_at=4.0, back_at=None, end=14.0, mark_delay=4.0)
    v = h.verdict()
    assert h.kinds() == {"away-unmarked"}
    assert "static member g_c0's id node was gone from 4.000 for 4.0s" in v.violations[0]
    quick = away_history(clean, grace=8.0, away_at=4.0, back_at=None, end=14.0,
                         mark_delay=1.0)
    assert quick.verdict().violations == []


def test_a_mark_late_during_a_zookeeper_stop_is_excused(clean: History) -> None:
    from _chaos_faults import Fault

    h = away_history(clean, grace=8.0, away_at=4.0, back_at=None, end=14.0, mark_delay=4.0)
    stop = Fault(3.0, "zk_stop", "leader", 2.0, started=3.0, repaired=6.5, node=1)
    v = check(acked=h.acked, events=h.events, commits=h.commits, samples=h.samples,
              faults=[stop], partitions=["0-0"], group="g", late_bytes=20, idle_bound=10.0,
              unowned_bound=15.0)
    assert v.violations == []


def test_a_claim_after_the_grace_ran_out_is_legal(clean: History) -> None:
    h = away_history(clean, grace=8.0, away_at=4.0, back_at=None, end=15.0,
                     claim_by_c1=12.1)
    v = h.verdict()
    assert v.violations == []
    assert (v.metrics["static_away"], v.metrics["static_ran_out"]) == (1, 1)


@pytest.mark.parametrize("d_leaves", [True, False])
def test_a_held_members_old_partition_may_move_when_the_plan_changes(d_leaves: bool) -> None:
    """c0 and c2 dynamic, c1 static; 0-0, 0-1, 0-2 one each.  c1 goes away at 4 s
    (held: nobody moves).  When c2 leaves too (6 s), the plan over c0 and the held c1
    gives c0 0-0 and 0-1 and holds 0-2 for c1: c0 claiming 0-1, which c1 owned before it
    went away, is right.  Without c2 leaving, the same claim takes a held partition."""
    parts = ("0-0", "0-1", "0-2")
    grace = {"g_c1": (4000, 8000)}
    samples = []
    for i in range(36):
        t = 0.5 + i / 4
        ids = {"g_c0": S0, "g_c1": S1, "g_c2": S2}
        owners = {"0-0": ("g_c0", S0), "0-1": ("g_c1", S1), "0-2": ("g_c2", S2)}
        statics: dict[str, tuple[int | None, int]] = {"g_c1": (None, 8000)}
        if t >= 4.0:
            del ids["g_c1"], owners["0-1"]
            statics = grace
        if d_leaves and t >= 6.0:
            del ids["g_c2"], owners["0-2"]
        if t > 6.1:
            owners["0-1"] = ("g_c0", S0)
        samples.append(ssample(t, ids, owners, statics, parts))
    events = [ev("A", 1.0, f"{i}#1", p, session=s)
              for i, (p, s) in enumerate(zip(parts, (S0, S1, S2), strict=True))]
    events.append(ev("A", 6.1, "0#1", "0-1", session=S0))
    v = check(acked={}, events=events, commits={}, samples=samples, faults=[],
              partitions=list(parts), group="g", late_bytes=20, idle_bound=10.0,
              unowned_bound=15.0, static={"g_c1": 8.0})
    kinds = {x.split("]")[0][1:] for x in v.violations}
    assert kinds == (set() if d_leaves else {"held-claimed"}), v.violations


def _duplicate(clean: History, *lines: Event) -> History:
    """c0 static, registered throughout; a duplicate process 0#d1 of it prints ``lines``."""
    statics = {"g_c0": (None, 8000)}
    clean.samples = [dataclasses.replace(s, statics=statics) for s in clean.samples]
    clean.events += [ev("Z", 2.0, "0#d1", body="STARTED", session=S3), *lines]
    return clean


REFUSED = "DuplicateInstanceError(\"instance_id 'c0' of group g is in use\")"


def test_a_refused_duplicate_that_owned_nothing_passes(clean: History) -> None:
    h = _duplicate(clean, ev("I", 8.0, "0#d1", body=REFUSED), ev("X", 9.0, "0#d1", body="0"))
    v = h.verdict()
    assert v.violations == []  # its I line is no background error (8)
    assert (v.metrics["duplicate_procs"], v.metrics["duplicates_refused"]) == (1, 1)


def test_a_duplicate_that_claimed_a_partition(clean: History) -> None:
    h = _duplicate(clean, ev("A", 3.0, "0#d1", "0-0", session=S3),
                   ev("I", 8.0, "0#d1", body=REFUSED))
    v = h.verdict()
    assert "duplicate-owned" in h.kinds()
    assert any("duplicate 0#d1 of g_c0 claimed 0-0 at 3.000" in x for x in v.violations)


def test_a_duplicate_registered_or_owning_in_its_own_session(clean: History) -> None:
    h = _duplicate(clean, ev("I", 8.0, "0#d1", body=REFUSED))
    h.samples[5] = dataclasses.replace(h.samples[5], owners={"0-0": ("g_c0", S3)})
    v = h.verdict()
    assert h.kinds() == {"duplicate-owned", "foreign-owner"}
    assert any("held owner nodes of ['0-0']" in x for x in v.violations)


def test_a_duplicate_never_refused(clean: History) -> None:
    assert _duplicate(clean).kinds() == {"duplicate-not-refused"}


def test_a_members_own_incarnation_refused_as_a_duplicate(clean: History) -> None:
    clean.events.append(ev("I", 5.0, "0#1", body=REFUSED))
    assert clean.kinds() == {"refused-not-duplicate"}


def test_the_refusal_line_parses() -> None:
    from _chaos_procs import is_duplicate

    i = _parse(f"I 8.5 {REFUSED}", "2#d1", 2)
    assert (i.kind, i.t, i.body) == ("I", 8.5, REFUSED)
    assert is_duplicate("2#d1") and not is_duplicate("2#1")


def test_static_faults_join_only_plans_with_static_slots() -> None:
    from _chaos_faults import STATIC_KINDS, make_plan

    kw = dict(members=4, brokers=3, session_timeout=3.0)
    for seed in range(1, 6):
        assert not {f.kind for f in make_plan(seed, 40.0, **kw)} & set(STATIC_KINDS)
        plan = make_plan(seed, 40.0, **kw, static_slots=(0, 2), static_grace=8.0)
        for f in plan:
            if f.kind in ("static_away", "duplicate_instance"):
                assert f.target in (0, 2), f.describe()
            if f.kind == "static_away":
                assert f.hold > 3.0 + 8.0  # past the session and the grace
    kinds = {f.kind for seed in range(1, 6)
             for f in make_plan(seed, 40.0, **kw, static_slots=(0, 2), static_grace=8.0)}
    assert set(STATIC_KINDS) <= kinds


def test_replica_faults_join_only_replicated_plans() -> None:
    from _chaos_faults import REPLICA_KINDS, make_plan

    kw = dict(members=4, session_timeout=3.0)
    for seed in range(1, 6):
        plain = make_plan(seed, 40.0, brokers=3, **kw)
        assert not {f.kind for f in plain} & set(REPLICA_KINDS)
        assert all(f.role is None for f in plain)
    plans = [make_plan(seed, 25.0, brokers=2, **kw, replicas=True) for seed in range(1, 6)]
    kinds = {f.kind for plan in plans for f in plan}
    assert set(REPLICA_KINDS) <= kinds and "disk_flip" not in kinds
    for plan in plans:
        busy: dict[int, float] = {}  # one fault per broker id at a time (planned)
        for f in plan:
            if f.kind == "broker_kill":
                assert f.role in ("master", "slave"), f.describe()
            if f.kind == "master_pause":
                assert f.hold > 3.0  # past the brokers' session
            if f.kind in ("broker_kill", *REPLICA_KINDS):
                assert busy.get(f.target, 0.0) <= f.at, f.describe()
                busy[f.target] = f.at + f.hold + 3.0


def _msgs(*bodies: bytes, msg_id: int = 1) -> list[tuple]:
    out, offset = [], 0
    for body in bodies:
        out.append((offset, msg_id, 0, body, offset + 20 + len(body)))
        offset += 20 + len(body)
    return out


def _replicas(master_log: dict, slave_log: dict) -> dict:
    return {0: {0: master_log, 1: slave_log}}


def _check_replicas(logs: dict, acked: dict, masters: dict | None = None):  # noqa: ANN202
    from _chaos_check import Verdict, check_replicas

    v = Verdict()
    check_replicas(v, acked=acked, logs=logs, masters={0: 0} if masters is None else masters)
    return v, {x.split("]")[0][1:] for x in v.violations}


def test_replicas_clean_logs_pass() -> None:
    log = {"0-0": _msgs(b"seq-0", b"seq-1")}
    v, kinds = _check_replicas(_replicas(log, dict(log)), {0: ("0-0", 0), 1: ("0-0", 25)})
    assert kinds == set()
    assert v.metrics["acked_lost"] == 0 and v.metrics["replicas_identical"] is True
    assert v.metrics["log_messages"] == 2


def test_replicas_acked_message_not_in_the_final_masters_log() -> None:
    log = {"0-0": _msgs(b"seq-0", b"seq-1")}
    # acknowledged at an offset the final master's log does not have, or with another body
    v, kinds = _check_replicas(_replicas(log, dict(log)), {0: ("0-0", 0), 2: ("0-0", 25),
                                                           3: ("0-0", 50)})
    assert kinds == {"acked-lost"} and v.metrics["acked_lost"] == 2


def test_replicas_a_body_twice_in_a_partition() -> None:
    log = {"0-0": _msgs(b"seq-0", b"seq-1", b"seq-0")}
    v, kinds = _check_replicas(_replicas(log, dict(log)), {0: ("0-0", 0)})
    assert kinds == {"log-duplicate"} and v.metrics["log_duplicates"] == 1
    # the same body in two partitions is not a duplicate in a log (counted apart)
    log = {"0-0": _msgs(b"seq-0"), "0-1": _msgs(b"seq-0")}
    v, kinds = _check_replicas(_replicas(log, dict(log)), {0: ("0-0", 0)})
    assert kinds == set() and v.metrics["cross_partition_duplicates"] == 1


def test_replicas_that_differ() -> None:
    master = {"0-0": _msgs(b"seq-0", b"seq-1")}
    other_id = {"0-0": _msgs(b"seq-0", b"seq-1", msg_id=2)}  # same bodies, other msgIds
    shorter = {"0-0": _msgs(b"seq-0")}
    for slave in (other_id, shorter):
        v, kinds = _check_replicas(_replicas(master, slave), {0: ("0-0", 0)})
        assert kinds == {"replicas-differ"} and v.metrics["replicas_identical"] is False
    _v, kinds = _check_replicas({0: {0: master}}, {0: ("0-0", 0)})  # one replica unread
    assert kinds == {"replicas-differ"}
    _v, kinds = _check_replicas({0: {1: master}}, {0: ("0-0", 0)})  # the master's unread
    assert "replicas-differ" in kinds and "acked-lost" in kinds
