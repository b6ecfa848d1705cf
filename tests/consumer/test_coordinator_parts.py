"""The coordinator's parts that need no ZooKeeper: the state machine's one writer
(:class:`~metaq.consumer._lifecycle.Lifecycle`), the pure planning
(:func:`~metaq.consumer._plan.make_plan`) and the retry timing
(:class:`~metaq.consumer._backoff.Backoff`).  The coordinator driving them
against a real ZooKeeper is in test_consumer_group.py."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from metaq._types import BrokerAddress, PartitionKey
from metaq.consumer import State, get_strategy
from metaq.consumer._backoff import Backoff
from metaq.consumer._lifecycle import TRANSITIONS, Lifecycle, TransitionError
from metaq.consumer._plan import Plan, make_plan
from zk_layout import StaticMember, Topology

# --------------------------------------------------------------------------- Lifecycle

#: one member's life: joins, waits for a held partition, is moved by a newcomer,
#: loses its connection and gets it back, loses its session, rejoins, closes
LIFE = [
    (State.CONNECTING, False),
    (State.REBALANCING, True),
    (State.CLAIMING, False),
    (State.STABLE, False),
    (State.REBALANCING, True),
    (State.STABLE, False),
    (State.SUSPENDED, False),
    (State.STABLE, False),
    (State.CONNECTING, True),
    (State.REBALANCING, True),
    (State.REBALANCING, True),  # that rebalance failed and is tried again
    (State.STABLE, False),
    (State.CLOSED, False),
]


def _live(life: Lifecycle) -> None:
    for state, new_generation in LIFE:
        life.set_state(state, "test", new_generation=new_generation)


def test_every_transition_is_numbered_and_kept_in_order():
    life = Lifecycle("g", "g_a")
    assert (life.state, life.state_id, life.generation) == (State.INIT, 0, 0)
    _live(life)
    kept = life.transitions()
    assert [t.state for t in kept[1:]] == [s for s, _ in LIFE]
    assert [t.id for t in kept] == list(range(len(LIFE) + 1))
    for (before, after), (_, new_generation) in zip(itertools.pairwise(kept), LIFE,
                                                    strict=True):
        assert after.previous is before.state
        assert after.state in TRANSITIONS[before.state]
        assert after.generation == before.generation + new_generation
    assert life.generation == sum(1 for _, g in LIFE if g)
    assert life.rebalances == sum(1 for s, _ in LIFE if s is State.REBALANCING)
    assert life.transitions(after_id=len(LIFE) - 1) == [kept[-1]]


def test_staying_in_a_state_is_no_transition():
    life = Lifecycle("g", "g_a")
    life.set_state(State.CONNECTING, "start")
    life.set_state(State.SUSPENDED, "dropped")
    assert life.set_state(State.SUSPENDED, "dropped again") is None
    assert life.state_id == 2


def test_a_transition_the_machine_does_not_have_is_refused_and_changes_nothing():
    life = Lifecycle("g", "g_a")
    life.set_state(State.CONNECTING, "start")
    life.set_state(State.REBALANCING, "joined", new_generation=True)
    life.set_state(State.STABLE, "all claimed")
    with pytest.raises(TransitionError) as e:
        life.set_state(State.CLAIMING, "out of nowhere")
    msg = str(e.value)
    assert "stable -> claiming" in msg and "out of nowhere" in msg and "g_a" in msg
    assert "rebalancing" in msg  # where it could have gone
    assert (life.state, life.state_id, life.generation) == (State.STABLE, 3, 1)
    with pytest.raises(TransitionError, match="stable -> stable"):
        life.set_state(State.STABLE, "a new generation without a rebalance",
                       new_generation=True)


def test_closed_is_final():
    life = Lifecycle("g", "g_a")
    life.set_state(State.CLOSED, "closed before start")
    for state in State:
        if state is not State.CLOSED:
            with pytest.raises(TransitionError, match="closed -> "):
                life.set_state(state, "after close")
    assert TRANSITIONS[State.CLOSED] == frozenset()
    assert set(TRANSITIONS) == set(State)


def test_a_waiter_walking_the_transitions_sees_every_one():
    life = Lifecycle("g", "g_a")
    seen = []
    ready = threading.Event()

    def walk() -> None:
        t = life.current
        ready.set()
        while t.state is not State.CLOSED:
            t = life.wait_transition(t.id, 10)
            assert t is not None
            seen.append(t)

    waiter = threading.Thread(target=walk, name="test-walker")
    waiter.start()
    assert ready.wait(10)
    _live(life)  # as fast as it goes: the waiter is behind, and misses none
    waiter.join(10)
    assert not waiter.is_alive()
    assert seen == life.transitions(after_id=0)


def test_wait_for_a_state_already_left():
    life = Lifecycle("g", "g_a")
    life.set_state(State.CONNECTING, "start")
    mark = life.state_id
    life.set_state(State.REBALANCING, "joined", new_generation=True)
    life.set_state(State.STABLE, "all claimed")
    t = life.wait_for(State.REBALANCING, 0, after=mark)
    assert t is not None and t.id == mark + 1 and t.generation == 1
    # without ``after``: the state now, else what comes next
    assert life.wait_for(State.STABLE, 0) == life.current
    assert life.wait_for(State.REBALANCING, 0) is None
    assert life.wait_for({State.CLAIMING, State.STABLE}, 0) == life.current
    assert life.wait_for(lambda t: t.generation >= 1, 0) == life.current


def test_wait_for_wakes_on_a_transition_from_another_thread():
    life = Lifecycle("g", "g_a")
    life.set_state(State.CONNECTING, "start")
    mark = life.state_id
    got = []
    waiter = threading.Thread(target=lambda: got.append(life.wait_for(State.STABLE, 10)),
                              name="test-waiter")
    waiter.start()
    life.set_state(State.REBALANCING, "joined", new_generation=True)
    life.set_state(State.STABLE, "all claimed")
    waiter.join(10)
    assert got and got[0] is not None and got[0].id == mark + 2


def test_wait_for_gives_up_at_its_timeout():
    life = Lifecycle("g", "g_a")
    t0 = time.monotonic()
    assert life.wait_for(State.STABLE, 0.05) is None
    assert life.wait_transition(life.state_id, 0.05) is None
    assert time.monotonic() - t0 >= 0.1


def test_wait_for_refuses_what_is_no_state():
    life = Lifecycle("g", "g_a")
    with pytest.raises(TypeError, match="wait_for wants a State"):
        life.wait_for("stable", 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="wait_for wants a State"):
        life.wait_for([], 0)


def test_a_waiter_that_fell_behind_the_history_gets_the_oldest_kept():
    life = Lifecycle("g", "g_a", history=4)
    _live(life)
    oldest = life.wait_transition(0, 0)
    assert oldest is not None and oldest.id == len(LIFE) - 3
    assert [t.id for t in life.transitions()] == list(range(len(LIFE) - 3, len(LIFE) + 1))


# --------------------------------------------------------------------------- make_plan

ME, OTHER, AWAY = "g_a", "g_b", "g_c"
PARTS = ["0-0", "0-1", "1-0", "1-1"]


def _topo(members: list[str], *, owners: dict[str, str] | None = None) -> Topology:
    return Topology(members={"t": members, "u": [ME]},
                    partitions={"t": list(PARTS), "u": ["2-0"]},
                    brokers={0: ("10.0.0.1", 8123), 1: None, 2: ("10.0.0.2", 8124)},
                    owners={"t": owners or {}},
                    member_topics={m: ("t",) for m in members})


def _away(cid: str, topics: tuple[str, ...]) -> StaticMember:
    return StaticMember(instance_id=cid, consumer_id=cid, topics=topics, grace_ms=30000,
                        session_timeout_ms=10000, away_since_ms=1)


def test_a_plan_is_the_strategys_share_with_each_partitions_broker():
    strategy = get_strategy("default")
    plan = make_plan(["t"], _topo([ME, OTHER]), {}, strategy, me=ME)
    share = strategy.assign_all([ME, OTHER], PARTS)[ME]
    assert list(plan.target) == [PartitionKey("t", p) for p in share]
    assert plan.target == {PartitionKey("t", p): int(p.split("-")[0]) for p in share}
    assert plan.brokers == {0: BrokerAddress("10.0.0.1", 8123), 1: None,
                            2: BrokerAddress("10.0.0.2", 8124)}
    assert all(isinstance(a, BrokerAddress) for a in plan.brokers.values() if a)


def test_an_away_static_member_keeps_its_share_of_its_own_topics_only():
    strategy = get_strategy("default")
    topo = _topo([ME])
    alone = make_plan(["t"], topo, {}, strategy, me=ME)
    held = make_plan(["t"], topo, {AWAY: _away(AWAY, ("t",))}, strategy, me=ME)
    elsewhere = make_plan(["t"], topo, {AWAY: _away(AWAY, ("v",))}, strategy, me=ME)
    assert len(alone.target) == 4 and elsewhere == alone
    assert list(held.target) == [PartitionKey("t", p)
                                 for p in strategy.assign_all([ME, AWAY], PARTS)[ME]]
    assert topo.members["t"] == [ME]  # the input is left as it was


def test_the_strategy_gets_the_current_owners_and_only_our_topics():
    calls = []

    def recording(members, parts, *, me, previous=None):  # noqa: ANN001, ANN202
        calls.append((list(members), list(parts), me, previous))
        return list(parts)[:1]

    owners = {"0-0": OTHER}
    plan = make_plan(["t", "u"], _topo([ME, OTHER], owners=owners), {}, recording, me=ME)
    assert calls == [([ME, OTHER], PARTS, ME, owners), ([ME], ["2-0"], ME, None)]
    assert list(plan.target) == [PartitionKey("t", "0-0"), PartitionKey("u", "2-0")]


def test_broadcast_plans_every_partition_without_a_strategy():
    def never(*_a, **_k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("broadcast members share nothing")

    plan = make_plan(["t"], _topo([ME, OTHER]), {}, never, me=ME, broadcast=True)
    assert list(plan.target) == [PartitionKey("t", p) for p in PARTS]


def test_a_member_not_yet_listed_plans_nothing():
    plan = make_plan(["t"], _topo([OTHER]), {}, get_strategy("default"), me=ME)
    assert plan == Plan(target={}, brokers=plan.brokers) and not plan.target


def test_moves_release_what_left_the_plan_and_claim_what_came():
    k = [PartitionKey("t", p) for p in PARTS]
    plan = Plan(target={k[2]: 1, k[0]: 0, k[3]: 1}, brokers={0: None, 1: None})
    assert plan.moves([k[1], k[0]]) == ([k[1]], [k[2], k[3]])
    assert plan.moves([("t", "0-0"), ("t", "1-0"), ("t", "1-1")]) == ([], [])
    assert Plan().moves([k[0]]) == ([k[0]], [])


# --------------------------------------------------------------------------- Backoff

def test_backoff_doubles_up_to_its_cap_within_its_jitter():
    b = Backoff(0.1, 1.0, jitter=(0.5, 1.5))
    for n in range(1, 8):
        before = time.monotonic()
        wait = b.failed()
        base = min(1.0, 0.1 * 2 ** (n - 1))
        assert 0.5 * base <= wait <= 1.5 * base
        assert b.attempts == n and b.next_at is not None and b.next_at >= before + wait
        assert b.waiting(before) and not b.due(before)
    assert b.due(b.next_at)
    b.now()
    assert b.due(time.monotonic()) and b.attempts == 7
    b.reset()
    assert (b.attempts, b.next_at) == (0, None)
    assert not b.due(time.monotonic()) and not b.waiting(time.monotonic())


def test_backoff_doublings_stop_at_their_limit():
    b = Backoff(1.0, 1e9, jitter=(1.0, 1.0), max_doublings=3)
    assert [b.failed() for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]


@pytest.mark.parametrize(("first", "cap", "jitter"), [
    (0, 1, (0.5, 1.5)), (2, 1, (0.5, 1.5)), (0.1, 1, (0, 1)), (0.1, 1, (1.5, 0.5))])
def test_backoff_refuses_nonsense(first, cap, jitter):
    with pytest.raises(ValueError, match="backoff"):
        Backoff(first, cap, jitter=jitter)
