"""The chaos suite's verdict: checks over what members printed and ZooKeeper recorded.

A *run* is one claim of one partition by one member incarnation: it starts at
the member's ``A`` line and holds every ``M`` line of that partition the
incarnation printed until its next ``A`` for it (or its ``R``).  Deliveries of
a run after its session was lost are still its own (a batch in flight).

Checks (each failure is a line in :attr:`Verdict.violations`):

1. every acknowledged sequence number was delivered at the (partition,
   offset) the broker acknowledged, with the same body;
2. within a run offsets move forward one message at a time (no skip, no repeat);
3. committed offsets never move backwards (ZooKeeper history, version order);
4. a run starts exactly at the offset committed when it claimed the partition
   (so a duplicate is always at or after the committed offset at the time the
   previous owner lost it; when a watch missed a commit, only ``>=`` is checked);
5. when a new run claims a partition, an older run of another incarnation may
   deliver after that instant only the batch(es) it already had in flight:
   at offsets >= the new run's start, spanning at most ``late_bytes``;
6. every owner node is held by the session its member is registered with;
7. no stretch longer than ``idle_bound`` seconds where a partition was
   unowned (and not held for an away static member, 10) while a registered
   member owned nothing, and no partition unowned longer than ``unowned_bound``
   seconds (plus the grace of the static member it was held for, if it was);
8. no background error line (``E``) and no unparsable line from a member
   (``I``, a duplicate's refusal, is checked by 10);
9. data faults (issue 13): an acknowledged message may go undelivered only when
   a member reported damaged bytes (``D``) covering it, and every message a
   ``disk_flip`` damaged was either delivered before or reported; no offset is
   acknowledged for two messages; a run that began with a reset of a garbage
   offset node (``O``) is exempt from 3 and 4 (it starts where offset_reset
   says), and a run may step over reported damage (2, 4).
10. static members (issue 15), from the samples of their records: a static
   member is *away* while its id node is gone and its record is within the
   grace (``away_since + grace``; a record not marked yet counts from now, as
   the members do).  Its *held* partitions are its share of the plan over the
   registered members plus the away ones (the members' own rule: the partitions
   it owned before it went away, unless the group or the published partitions
   changed meanwhile).  No other member claims a held partition
   (``held-claimed``): a claim fails when every sample from ``HOLD_LOOKBACK``
   seconds before it to the first one after it shows the partition reserved
   for the away member (held, or owned by it as its share before it went away)
   and that first one shows the member away, and the registered members (ids and
   sessions) are the same in all of them (else the claimant may have planned in a
   moment between samples, e.g. while a member re-registered: not judged).  The
   others mark it away in its
   record within ``MARK_BOUND`` seconds of its id node going
   (``away-unmarked``: the group did not see it go; stretches near a
   ZooKeeper node stop are excused, nothing is written without a quorum).  A
   duplicate process of a static slot (``<slot>#d<n>``) prints ``I``
   (DuplicateInstanceError) and never claims, delivers, registers or owns
   anything (``duplicate-owned``, ``duplicate-not-refused``); a member's own
   incarnation is never refused as a duplicate (``refused-not-duplicate``).
   Two owners stay impossible: 5 and 6 apply to static members unchanged.

:func:`check_replicas` (replicated runs, issue 26) audits the final logs of both
replicas of every broker id: 11. every acknowledged message is in the log of its
broker id's final master at its acknowledged offset with its body (``acked-lost``);
12. no body is twice in one partition's log (``log-duplicate``: the producer is
idempotent); 13. both replicas hold the same messages, byte for byte
(``replicas-differ``).
"""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from _chaos_faults import Fault
from _chaos_procs import Event, is_duplicate
from _chaos_zk import Commit, Sample

from metaq.consumer import get_strategy

_EXAMPLES = 8  # examples kept per kind of violation
#: check 10: how stale a member's view of the group may be when it claims (seconds)
HOLD_LOOKBACK = 1.5
#: check 10: the first sample after a claim must start within this many seconds of it
HOLD_LOOKAHEAD = 1.0
#: check 10: a static member gone this long with its record not marked away: nobody saw
#: it go (members mark it in the rebalance its id node's going starts, well under 1 s)
MARK_BOUND = 2.0
#: ... unless a ZooKeeper node was stopped from this long before to this long after
MARK_ELECTION_MARGIN = (1.0, 3.0)
_PLAN = get_strategy("default")  # the chaos members' strategy


@dataclass
class Run:
    who: str
    part: str
    claim_t: float
    session: str
    deliveries: list[Event] = field(default_factory=list)
    lost_t: float | None = None
    reset: bool = False  # began with an offset_reset (an O line just before its claim)


@dataclass
class Verdict:
    violations: list[str] = field(default_factory=list)
    metrics: dict[str, object] = field(default_factory=dict)
    _per_kind: Counter = field(default_factory=Counter)

    def fail(self, kind: str, text: str) -> None:
        self._per_kind[kind] += 1
        if self._per_kind[kind] <= _EXAMPLES:
            self.violations.append(f"[{kind}] {text}")
        elif self._per_kind[kind] == _EXAMPLES + 1:
            self.violations.append(f"[{kind}] ... more of this kind")


def build_runs(events: list[Event], verdict: Verdict) -> list[Run]:
    runs: list[Run] = []
    by_who: dict[str, list[Event]] = defaultdict(list)
    for e in events:
        by_who[e.who].append(e)
    for who, evs in by_who.items():
        current: dict[str, Run] = {}
        resets: set[str] = set()
        for e in evs:
            if e.kind == "A":
                run = Run(who, e.part, e.t, e.session, reset=e.part in resets)
                resets.discard(e.part)
                current[e.part] = run
                runs.append(run)
            elif e.kind == "O":
                resets.add(e.part)  # printed while claiming, before its A line
            elif e.kind == "M":
                run = current.get(e.part)
                if run is None:
                    verdict.fail("unclaimed", f"{who} delivered {e.part}@{e.offset} "
                                              f"without having claimed it")
                    continue
                run.deliveries.append(e)
            elif e.kind == "R":
                current.pop(e.part, None)
            elif e.kind == "Z" and e.body == "LOST":
                for run in current.values():
                    if run.lost_t is None:
                        run.lost_t = e.t
            elif e.kind == "E":
                verdict.fail("error", f"{who} reported a background error: {e.body}")
            elif e.kind == "?":
                verdict.fail("garbage", f"{who} printed an unparsable line: {e.body!r}")
    return runs


def _committed_at(history: list[Commit], t: float) -> tuple[int, bool]:
    """(committed offset at time ``t``, exact?) from a version-ordered history."""
    k = bisect.bisect_right([c.mtime for c in history], t) - 1
    if k < 0:
        exact = not history or history[0].version == 0
        return 0, exact
    nxt = history[k + 1] if k + 1 < len(history) else None
    exact = nxt is None or nxt.version == history[k].version + 1
    return history[k].value, exact


def _session(run: Run) -> int | None:
    return None if run.session in ("", "-") else int(run.session, 16)


def _member(group: str, run: Run) -> tuple[str, int | None]:
    """(consumer id, session) of a run, as the ZooKeeper samples name them; the slot
    comes from ``who`` (``slot#incarnation``), so runs that delivered nothing (a
    claim acted on late, by a member that had been frozen) are named too."""
    return f"{group}_c{run.who.split('#')[0]}", _session(run)


def _session_times(samples: list[Sample]
                   ) -> tuple[dict[tuple[str, int | None], float],
                              dict[tuple[str, int | None], float]]:
    """Per (consumer id, session): the last sample start at which it was surely
    registered, and the first sample end by which the server had surely ended it."""
    alive: dict[tuple[str, int | None], float] = {}
    ended: dict[tuple[str, int | None], float] = {}
    for s in samples:
        present = {(c, x) for ids in (s.ids_before, s.ids_after) for c, x in ids.items()}
        for key in present:
            alive[key] = s.t0
            ended.pop(key, None)  # (cannot come back; a sample may be torn)
        for key in alive:
            if key not in present:
                ended.setdefault(key, s.t)
    return alive, ended


# -- static members (check 10) ----------------------------------------------------------

def _away(s: Sample, cid: str, t: float) -> int | None | bool:
    """Whether static member ``cid`` counts as away (held) in view of sample ``s`` at
    time ``t``, given that its id node is gone: False when not, else when its hold
    ends (epoch ms; None: not marked yet, the members hold it from now on)."""
    rec = s.statics.get(cid)
    if rec is None:
        return False
    away_ms, grace_ms = rec
    if away_ms is None:
        return None
    return away_ms + grace_ms if t * 1000 < away_ms + grace_ms else False


_Plans = list[tuple[dict[str, "int | None"], dict[str, set[str]]]]
#: plans computed during one check, by (id of the sample, strict): the samples outlive it
_Cache = dict[tuple[int, bool], _Plans]


def _plans(s: Sample, cache: _Cache, *, strict: bool) -> _Plans:
    """Per membership view of ``s`` (before and after its owners, when they differ):
    (away static members -> hold end, every member's share of the plan over the
    registered and the away ones and the published partitions).  ``strict``
    judges the hold at the sample's end, else at its start (more held)."""
    cached = cache.get((id(s), strict))
    if cached is not None:
        return cached
    out: _Plans = []
    views = [s.ids_before] if s.ids_before == s.ids_after else [s.ids_before, s.ids_after]
    for view in views:
        held: dict[str, int | None] = {}
        for cid in s.statics:
            if cid in view:
                continue
            until = _away(s, cid, s.t if strict else s.t0)
            if until is not False:
                held[cid] = until  # type: ignore[assignment]
        members = sorted(set(view) | set(held))
        plan = _PLAN.assign_all(members, sorted(s.published)) if members else {}
        out.append((held, {c: set(ps) for c, ps in plan.items()}))
    cache[(id(s), strict)] = out
    return out


def _held_parts(s: Sample, cache: _Cache) -> dict[str, int]:
    """Partitions held for away static members in ``s`` (leniently: in either view,
    the hold judged at the sample's start) -> the longest grace they are held for (ms)."""
    out: dict[str, int] = {}
    for held, plan in _plans(s, cache, strict=False):
        for cid in held:
            grace = s.statics[cid][1]
            for p in plan.get(cid, ()):
                out[p] = max(out.get(p, 0), grace)
    return out


def _reserved(s: Sample, cid: str, part: str, cache: _Cache) -> str | None:
    """Strictly, whether ``part`` is reserved for static member ``cid`` in ``s``:
    ``"held"`` (away, within its grace, its share in every view), ``"owned"``
    (registered in both views, owning it, its share in every view), else None."""
    plans = _plans(s, cache, strict=True)
    if not all(part in plan.get(cid, ()) for _held, plan in plans):
        return None
    if all(cid in held for held, _plan in plans) and cid not in s.ids_before \
            and cid not in s.ids_after:
        return "held"
    if cid in s.ids_before and cid in s.ids_after and s.owners.get(part, ("",))[0] == cid:
        return "owned"
    return None


@dataclass
class _Away:
    cid: str
    start: float                # first sample showing it away
    end: float | None = None    # first sample showing it back, or past its grace
    returned: bool = False      # came back within the grace
    owned_before: frozenset[str] = frozenset()  # what it owned in the last sample before


def _away_intervals(samples: list[Sample], cids: set[str]) -> list[_Away]:
    """When each static member was away within its grace, from the samples (a sample
    seeing it in one view only changes nothing)."""
    out: list[_Away] = []
    current: dict[str, _Away] = {}
    owned: dict[str, frozenset[str]] = {}
    for s in samples:
        for cid in cids:
            present = cid in s.ids_before and cid in s.ids_after
            absent = cid not in s.ids_before and cid not in s.ids_after
            if present:
                owned[cid] = frozenset(p for p, (c, _x) in s.owners.items() if c == cid)
            held = absent and _away(s, cid, s.t) is not False
            a = current.get(cid)
            if a is None and held:
                current[cid] = a = _Away(cid, s.t, owned_before=owned.get(cid, frozenset()))
                out.append(a)
            elif a is not None and (present or (absent and not held)):
                a.end, a.returned = s.t, present
                del current[cid]
    return out


def _unmarked(v: Verdict, samples: list[Sample], cids: set[str],
              faults: list[Fault]) -> float:
    """Stretches where a static member's id node was gone and its record still said
    it was there; returns the longest one not excused by a ZooKeeper node stop."""
    before, after = MARK_ELECTION_MARGIN
    stops = [(f.started - before, (f.repaired or f.started + f.hold) + after)
             for f in faults if f.kind == "zk_stop" and f.started is not None]
    longest = 0.0
    for cid in sorted(cids):
        since: float | None = None
        for s in [*samples, None]:
            gone = s is not None and cid not in s.ids_before and cid not in s.ids_after \
                and s.statics.get(cid, (0,))[0] is None
            if gone and since is None:
                since = s.t  # type: ignore[union-attr]
            elif not gone and since is not None:
                end = s.t if s is not None else samples[-1].t
                excused = any(a <= end and since <= b for a, b in stops)
                if not excused:
                    longest = max(longest, end - since)
                    if end - since > MARK_BOUND:
                        v.fail("away-unmarked",
                               f"static member {cid}'s id node was gone from {since:.3f} for "
                               f"{end - since:.1f}s with its record never marked away (bound "
                               f"{MARK_BOUND:g}s): the other members did not see it go")
                since = None
    return longest


def _check_static(v: Verdict, events: list[Event], samples: list[Sample], group: str,
                  static: dict[str, float], faults: list[Fault],
                  cache: _Cache) -> dict[str, object]:
    """Check 10; returns its metrics."""
    cids = set(static) | {c for s in samples for c in s.statics}
    aways = _away_intervals(samples, cids)
    max_unmarked = _unmarked(v, samples, cids, faults)
    starts = [s.t0 for s in samples]
    checked = 0
    for e in events:
        if e.kind != "A" or is_duplicate(e.who):
            continue
        claimant = f"{group}_c{e.slot}"
        k = bisect.bisect_left(starts, e.t)  # the first sample starting after the claim
        if k >= len(samples) or samples[k].t0 - e.t > HOLD_LOOKAHEAD:
            continue  # no sample soon after (ZooKeeper electing): cannot tell
        window = [s for s in samples[:k + 1] if s.t >= e.t - HOLD_LOOKBACK]
        if len(window) < 2:
            continue
        after = samples[k]
        for cid in sorted(cids - {claimant}):
            others = {frozenset((c, sid) for c, sid in ids.items() if c != cid)
                      for s in window for ids in (s.ids_before, s.ids_after)}
            if len(others) > 1:
                # the rest of the group changed within the window: a member re-registering
                # in a new session (or leaving, or joining) left a moment the samples did
                # not see, in which the claimant may have planned over other members and
                # the held share legitimately moved: cannot tell
                continue
            if cid in after.ids_before or cid in after.ids_after or _away(
                    after, cid, after.t) is False:
                continue  # not away when the claim was sampled
            checked += 1
            kinds = [_reserved(s, cid, e.part, cache) for s in window]
            if None in kinds or kinds[-1] != "held":
                continue
            a = next((a for a in aways if a.cid == cid and a.start <= after.t
                      and (a.end is None or a.end >= after.t)), None)
            rec = after.statics.get(cid, (None, 0))
            until = "not marked yet" if rec[0] is None else f"{(rec[0] + rec[1]) / 1000:.3f}"
            before = "" if a is None else (
                f"; it owned {e.part} before it went away at {a.start:.3f}"
                if e.part in a.owned_before else
                f"; it owned {sorted(a.owned_before)} before it went away at {a.start:.3f}")
            v.fail("held-claimed",
                   f"{e.part}: {e.who} ({claimant}) claimed it at {e.t:.3f} while static "
                   f"member {cid} was away within its grace (held until {until}) and "
                   f"{e.part} was its share of the plan{before}")
    # duplicates of a static slot: refused, owning nothing
    dups: dict[str, list[Event]] = defaultdict(list)
    for e in events:
        if is_duplicate(e.who):
            dups[e.who].append(e)
        elif e.kind == "I":
            v.fail("refused-not-duplicate",
                   f"{e.who} ({group}_c{e.slot}), a member's own incarnation, was refused "
                   f"as a duplicate instance at {e.t:.3f}: {e.body}")
    refused = 0
    for who, evs in dups.items():
        cid = f"{group}_c{evs[0].slot}"
        took = [e for e in evs if e.kind in ("A", "M")]
        if took:
            v.fail("duplicate-owned",
                   f"duplicate {who} of {cid} " + ("claimed" if took[0].kind == "A" else
                                                    "delivered from")
                   + f" {took[0].part} at {took[0].t:.3f} ({len(took)} A/M lines)")
        sessions = {int(e.session, 16) for e in evs if e.session not in ("", "-")}
        for s in samples:
            if s.ids_before.get(cid) in sessions or s.ids_after.get(cid) in sessions:
                v.fail("duplicate-owned", f"duplicate {who} registered {cid} in its own "
                                          f"session, sampled at {s.t:.3f}")
                break
            mine = sorted(p for p, (c, x) in s.owners.items() if x in sessions)
            if mine:
                v.fail("duplicate-owned", f"duplicate {who} of {cid} held owner nodes of "
                                          f"{mine}, sampled at {s.t:.3f}")
                break
        if any(e.kind == "I" for e in evs):
            refused += 1
        else:
            v.fail("duplicate-not-refused",
                   f"duplicate {who} of {cid} never printed DuplicateInstanceError")
    return dict(static_away=len(aways), static_returned=sum(a.returned for a in aways),
                max_unmarked_s=round(max_unmarked, 2),
                static_ran_out=sum(a.end is not None and not a.returned for a in aways),
                held_claims_checked=checked, duplicate_procs=len(dups),
                duplicates_refused=refused)


def check(*, acked: dict[int, tuple[str, int]], events: list[Event],
          commits: dict[str, list[Commit]], samples: list[Sample], faults: list[Fault],
          partitions: list[str], group: str, late_bytes: int, idle_bound: float,
          unowned_bound: float, static: dict[str, float] | None = None) -> Verdict:
    """``static``: consumer id -> grace (seconds) of the static slots (their records
    in the samples say the same; this names them when none was sampled)."""
    v = Verdict()
    runs = build_runs(events, v)
    deliveries = [e for e in events if e.kind == "M"]

    # 1. completeness and bodies
    bodies: dict[tuple[str, int], str] = {}
    for d in deliveries:
        key = (d.part, d.offset)
        if bodies.setdefault(key, d.body) != d.body:
            v.fail("body", f"{d.part}@{d.offset} delivered as {bodies[key]!r} and {d.body!r}")
    damage: dict[str, list[tuple[int, int]]] = defaultdict(list)  # reported, per partition
    for e in events:
        if e.kind == "D":
            damage[e.part].append((e.offset, int(e.body)))

    def reported(part: str, offset: int) -> bool:
        return any(a <= offset < b for a, b in damage.get(part, ()))

    missing = damaged_reported = 0
    for seq, key in acked.items():
        got = bodies.get(key)
        if got is None and reported(*key):
            damaged_reported += 1  # damaged on disk and reported: not lost silently
        elif got is None:
            missing += 1
            v.fail("lost", f"seq {seq} acknowledged at {key[0]}@{key[1]} never delivered")
        elif got != f"seq-{seq}":
            v.fail("body", f"{key[0]}@{key[1]} acknowledged for seq {seq}, delivered {got!r}")

    # 9. data faults: no offset acknowledged twice; every flipped message accounted for
    reused = Counter(acked.values())
    offsets_reused = sum(n - 1 for n in reused.values() if n > 1)
    for key, n in reused.items():
        if n > 1:
            v.fail("offset-reused", f"{key[0]}@{key[1]} acknowledged for {n} messages")
    flipped = [f.damaged for f in faults if f.kind == "disk_flip" and f.damaged]
    flipped_read = 0
    for part, off, _nxt in flipped:
        before = [d for d in deliveries if d.part == part and d.offset == off]
        if reported(part, off):
            flipped_read += 1
        elif not before:
            v.fail("damage-unreported", f"{part}@{off} was damaged on disk and neither "
                                        f"delivered before nor reported")
    resets = sum(1 for r in runs if r.reset)

    # 2. contiguity within a run
    known: dict[str, list[int]] = defaultdict(list)
    # a reported damage's bounds are message boundaries too: the damaged message may
    # never have been acknowledged (written, then the broker stopped before it answered)
    bounds = {(p, off) for p, ranges in damage.items() for r in ranges for off in r}
    for p, off in set(bodies) | set(acked.values()) | bounds:
        known[p].append(off)
    nxt: dict[str, dict[int, int]] = {}
    for p, offs in known.items():
        offs.sort()
        nxt[p] = dict(zip(offs, offs[1:], strict=False))
    def stepped_over_damage(part: str, a: int, b: int) -> bool:
        """Every known offset between a and b (a delivered, b the next delivered) is
        reported damage: the run went past it, as it must."""
        k = nxt[part].get(a)
        while k is not None and k < b:
            if not reported(part, k):
                return False
            k = nxt[part].get(k)
        return k == b

    for r in runs:
        for a, b in zip(r.deliveries, r.deliveries[1:], strict=False):
            if b.offset != nxt[r.part].get(a.offset) and not stepped_over_damage(
                    r.part, a.offset, b.offset):
                v.fail("skip", f"run of {r.who} on {r.part} went from {a.offset} to {b.offset} "
                               f"(next message is at {nxt[r.part].get(a.offset)})")

    # 3. commits only move forward
    histories = {p: sorted(h, key=lambda c: c.version) for p, h in commits.items()}
    reset_parts = {r.part for r in runs if r.reset}
    for p, hist in histories.items():
        if p in reset_parts:
            continue  # offset_reset moved it back to the log start (9)
        for a, b in zip(hist, hist[1:], strict=False):
            if b.value < a.value:
                v.fail("commit-backwards", f"{p}: committed offset went {a.value} -> {b.value} "
                                           f"(versions {a.version} -> {b.version})")

    # 4. each run starts at the committed offset of its claim
    lenient = 0
    for r in runs:
        if not r.deliveries or r.reset:
            continue
        start = r.deliveries[0].offset
        committed, exact = _committed_at(histories.get(r.part, []), r.claim_t)
        if start > committed and reported(r.part, committed) and (
                nxt[r.part].get(committed) == start
                or stepped_over_damage(r.part, committed, start)):
            continue  # the committed message (and any up to start) was damaged: skipped
        lenient += not exact
        if start < committed:
            v.fail("redelivered-committed",
                   f"{r.part}: {r.who} claimed at {r.claim_t:.3f} and started at {start}, "
                   f"below the committed offset {committed}")
        elif exact and start != committed:
            v.fail("start-not-committed",
                   f"{r.part}: {r.who} claimed at {r.claim_t:.3f} and started at {start}, "
                   f"not at the committed offset {committed}")

    # 5. zombies: what a run delivered while another owned the partition
    alive, ended = _session_times(samples)
    by_part: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        by_part[r.part].append(r)
    for p, rs in by_part.items():
        rs.sort(key=lambda r: r.claim_t)
        for i, new in enumerate(rs):
            if ended.get(_member(group, new), new.claim_t + 1) < new.claim_t:
                continue  # a claim acted on after its session ended: see below
            for old in rs[:i]:
                key = _member(group, old)
                both = [d for d in old.deliveries if new.claim_t < d.t <= alive.get(key, 0.0)]
                if old.who != new.who and both:
                    v.fail("two-live-owners",
                           f"{p}: {old.who} delivered {both[0].offset} at {both[0].t:.3f} in "
                           f"session {key[1]:x}, still registered at {alive[key]:.3f}, after "
                           f"{new.who} claimed it at {new.claim_t:.3f}")
    zombie = zombie_committed = 0
    zombie_max_s = 0.0
    for r in runs:
        if not r.deliveries:
            continue
        key = _member(group, r)
        end = ended.get(key)
        late = [d for d in r.deliveries if end is not None and d.t > end]
        if not late:
            continue
        zombie += len(late)
        zombie_max_s = max(zombie_max_s, late[-1].t - end)
        hist = histories.get(r.part, [])
        zombie_committed += sum(d.offset < _committed_at(hist, d.t)[0] for d in late)
        if r.claim_t > end:
            v.fail("fetch-after-session-end",
                   f"{r.part}: {r.who} took the partition at {r.claim_t:.3f} in session "
                   f"{key[1]:x}, which the server had ended by {end:.3f}, and delivered "
                   f"{len(late)} messages from offset {late[0].offset} (committed then: "
                   f"{_committed_at(hist, late[0].t)[0]})")
        elif late[-1].offset - late[0].offset > late_bytes:
            v.fail("zombie-kept-fetching",
                   f"{r.part}: {r.who} delivered {len(late)} messages over "
                   f"{late[-1].offset - late[0].offset} bytes (up to {late[-1].t - end:.2f}s) "
                   f"after its session {key[1]:x} ended by {end:.3f}: more than the batch "
                   f"it had in flight")

    # 6./7. ZooKeeper samples
    cache: _Cache = {}
    unowned_since: dict[str, float] = {}
    held_grace: dict[str, int] = {}  # an unowned stretch held for an away member: its grace
    stretches: list[tuple[str, float, float, int | None]] = []  # part, since, length, grace
    idle_since: float | None = None
    max_idle = idle_at = 0.0
    for s in samples:
        for p, (cid, session) in s.owners.items():
            if session not in (s.ids_before.get(cid), s.ids_after.get(cid)):
                v.fail("foreign-owner",
                       f"{p} owned by session {session:x} naming {cid}, registered as "
                       f"{s.ids_before.get(cid)}/{s.ids_after.get(cid)} at {s.t:.3f}")
        unowned = s.published - set(s.owners)  # a gone broker's partitions are nobody's
        held = _held_parts(s, cache) if s.statics else {}
        for p in unowned:
            unowned_since.setdefault(p, s.t)
            if p in held:
                held_grace[p] = max(held_grace.get(p, 0), held[p])
        for p, since in list(unowned_since.items()):
            if p not in unowned:  # owned again (or its broker gone): the stretch ends
                stretches.append((p, since, s.t - since, held_grace.pop(p, None)))
                del unowned_since[p]
        stable = {c for c, sess in s.ids_before.items() if s.ids_after.get(c) == sess}
        owning = {cid for cid, _ in s.owners.values()}
        if unowned - set(held) and stable - owning:
            idle_since = s.t if idle_since is None else idle_since
            if s.t - idle_since > max_idle:
                max_idle, idle_at = s.t - idle_since, idle_since
        else:
            idle_since = None
    if samples:  # stretches still open at the last sample
        stretches += [(p, since, samples[-1].t - since, held_grace.get(p))
                      for p, since in unowned_since.items()]
    max_unowned = max((n for _p, _s, n, g in stretches if g is None), default=0.0)
    max_unowned_held = max((n for _p, _s, n, g in stretches if g is not None), default=0.0)
    for p, since, length, grace in sorted(stretches, key=lambda x: x[1]):
        if length > unowned_bound + (grace or 0) / 1000:
            v.fail("unowned", f"{p} stayed unowned {length:.1f}s from {since:.3f} (bound "
                              f"{unowned_bound:.0f}s" + (
                                  f" + the grace {grace / 1000:g}s of the static member "
                                  f"it was held for" if grace else "") + ")")
    if max_idle > idle_bound:
        v.fail("idle-member", f"for {max_idle:.1f}s a registered member owned nothing while "
                              f"partitions were unowned, from {idle_at:.3f} "
                              f"(bound {idle_bound:.0f}s)")

    # 10. static members: held partitions, duplicates
    static_metrics = _check_static(v, events, samples, group, static or {}, faults, cache)

    lost = [e for e in events if e.kind == "Z" and e.body == "LOST"]
    keys = Counter((d.part, d.offset) for d in deliveries)
    v.metrics.update(
        delivered=len(deliveries), distinct=len(keys),
        duplicates=sum(n - 1 for n in keys.values()), missing=missing,
        damaged_reported=damaged_reported, flipped=len(flipped), flipped_read=flipped_read,
        resets=resets, offsets_reused=offsets_reused,
        runs=len(runs), lenient_starts=lenient, zombie_deliveries=zombie,
        zombie_committed=zombie_committed, zombie_max_s=round(zombie_max_s, 2),
        max_unowned_s=round(max_unowned, 2), max_unowned_held_s=round(max_unowned_held, 2),
        max_idle_s=round(max_idle, 2), sessions_lost=len(lost),
        commits_seen=sum(len(h) for h in histories.values()), samples=len(samples),
        **static_metrics)
    return v


def check_dump(path: str, **bounds: float) -> Verdict:
    """Run :func:`check` again on a ``chaos-data.jsonl`` left by a failed run (the
    static slots are named by their sampled records)."""
    import json

    from _chaos_zk import Sample

    events: list[Event] = []
    acked: dict[int, tuple[str, int]] = {}
    commits: dict[str, list[Commit]] = defaultdict(list)
    samples: list[Sample] = []
    faults: list[Fault] = []
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            if "event" in d:
                events.append(Event(**d["event"]))
            elif "acked" in d:
                seq, p, off = d["acked"]
                acked[seq] = (p, off)
            elif "commit" in d:
                p, *c = d["commit"]
                commits[p].append(Commit(*c))
            elif "sample" in d:
                s = d["sample"]
                samples.append(Sample(s.get("t0", s["t"] - 0.05), s["t"], s["ids_before"],
                                      {p: tuple(o) for p, o in s["owners"].items()},
                                      s["ids_after"], frozenset(s["published"]),
                                      {c: tuple(r) for c, r in s.get("statics", {}).items()}))
            elif "fault" in d:
                faults.append(Fault(**d["fault"]))
    partitions = sorted({p for s in samples for p in s.published} | set(commits))
    options = dict(late_bytes=4096, idle_bound=10.0, unowned_bound=15.0)
    options.update(bounds)
    return check(acked=acked, events=events, commits=commits, samples=samples, faults=faults,
                 partitions=partitions, group="chaos-g", **options)


def check_replicas(v: Verdict, *, acked: dict[int, tuple[str, int]],
                   logs: dict[int, dict[int, dict[str, list[tuple]]]],
                   masters: dict[int, int]) -> None:
    """Checks 11-13 into ``v``.  ``logs``: broker id -> replica id -> partition
    (``<id>-<n>``) -> its messages as ``(offset, msg_id, flag, payload, next_offset)``;
    ``masters``: broker id -> the replica id leading at the end."""
    lost = duplicates = total = 0
    identical = True
    bodies: dict[tuple[str, int], bytes] = {}
    seen: Counter = Counter()  # body -> partitions holding it
    for b in sorted(set(logs) | set(masters)):
        replicas = logs.get(b, {})
        master = masters.get(b)
        if master is None or master not in replicas:
            v.fail("replicas-differ", f"broker {b}: no final master's log was read "
                                      f"(master {master}, read {sorted(replicas)})")
            identical = False
            continue
        for part, msgs in sorted(replicas[master].items()):
            total += len(msgs)
            counts = Counter(m[3] for m in msgs)
            for body, n in counts.items():
                seen[body] += 1
                if n > 1:
                    duplicates += n - 1
                    at = [m[0] for m in msgs if m[3] == body]
                    v.fail("log-duplicate", f"{part}: {bytes(body)!r} is in the log {n} times "
                                            f"(offsets {at})")
            bodies.update(((part, m[0]), bytes(m[3])) for m in msgs)
        for r, log in sorted(replicas.items()):
            if r == master:
                continue
            if log != replicas[master]:
                identical = False
                where = _first_difference(replicas[master], log)
                v.fail("replicas-differ", f"broker {b}: replica {r} differs from the master "
                                          f"(replica {master}): {where}")
        if len(replicas) < 2:
            identical = False
            v.fail("replicas-differ", f"broker {b}: only replica(s) {sorted(replicas)} read")
    for seq, (part, off) in sorted(acked.items()):
        got = bodies.get((part, off))
        if got != b"seq-%d" % seq:
            lost += 1
            v.fail("acked-lost", f"seq {seq} acknowledged at {part}@{off}; the final master's "
                                 f"log has " + ("nothing there" if got is None else repr(got)))
    v.metrics.update(log_messages=total, acked_lost=lost, log_duplicates=duplicates,
                     cross_partition_duplicates=sum(n - 1 for n in seen.values() if n > 1),
                     replicas_identical=identical)


def _first_difference(a: dict[str, list[tuple]], b: dict[str, list[tuple]]) -> str:
    for part in sorted(set(a) | set(b)):
        ma, mb = a.get(part, []), b.get(part, [])
        for x, y in zip(ma, mb, strict=False):
            if x != y:
                return f"{part}@{x[0]}: {x[:4]!r} vs {y[:4]!r}"
        if len(ma) != len(mb):
            return (f"{part}: {len(ma)} messages (end {ma[-1][4] if ma else 0}) vs {len(mb)} "
                    f"(end {mb[-1][4] if mb else 0})")
    return "(none found)"
