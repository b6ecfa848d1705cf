"""The member's state machine: its states, the transitions allowed, the generation,
and the one writer every change goes through (:class:`Lifecycle`).

States and transitions (``MessageConsumer.state``)::

    INIT --start--> CONNECTING --registered--> REBALANCING
    REBALANCING --every assigned partition claimed--> STABLE
    REBALANCING --some still held by their old owner--> CLAIMING
    REBALANCING --a failed rebalance tried again--> REBALANCING (a new generation)
    CLAIMING --claim retry succeeds--> STABLE
    STABLE | CLAIMING --member/topic/broker change--> REBALANCING
    any live state --connection SUSPENDED--> SUSPENDED   (fetching stops)
    SUSPENDED --CONNECTED, same session--> STABLE | CLAIMING (fetching resumes; the
                                       group is read again, as kazoo dropped every
                                       watch: nothing moves unless the group changed)
    SUSPENDED --CONNECTED, not yet registered--> REBALANCING
    any live state --session LOST--> CONNECTING  (fetchers stopped, progress dropped,
                                       nothing committed; a new generation)
    any live state --unexpected exception--> CONNECTING (left the group; rejoins after
                                       a backoff; a new generation) or, after
                                       MAX_FAILURES in a row, CLOSED with the error
    any --close()--> CLOSED            (terminal)

The generation counts rebalances and the breaks between them (a session lost, a
failure): it moves only together with a state, through the same writer.

Every change goes through :meth:`Lifecycle.set_state`, which refuses a
transition not in :data:`TRANSITIONS` (:class:`TransitionError`), logs it with
the group, the consumer id and the generation, numbers it (:attr:`state_id`, one
more each time) and keeps the last :data:`HISTORY` of them, so that a waiter sees
*every* transition, not only the one the machine settled in: :meth:`wait_for` a
state (or any condition) reached after a given id, :meth:`wait_transition` for
the next transition after one.  Kazoo's partitioner recipe is the model (one
``_set_state``, documented transitions), with the ids added.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Mapping
from types import MappingProxyType
from typing import NamedTuple

__all__ = ["State", "Transition", "TransitionError", "Lifecycle", "Want", "TRANSITIONS",
           "HISTORY"]

log = logging.getLogger(__name__)

#: Transitions kept for waiters that fall behind.
HISTORY = 256


class State(enum.Enum):
    """Where a consumer group member stands (see the module's diagram)."""

    INIT = "init"
    CONNECTING = "connecting"
    REBALANCING = "rebalancing"
    CLAIMING = "claiming"
    STABLE = "stable"
    SUSPENDED = "suspended"
    CLOSED = "closed"


_LIVE = (State.CONNECTING, State.REBALANCING, State.CLAIMING, State.STABLE, State.SUSPENDED)

#: state -> the states it may go to.  A state goes to itself only with a new
#: generation (a rebalance tried again, a failure or a lost session while connecting).
TRANSITIONS: Mapping[State, frozenset[State]] = MappingProxyType({
    State.INIT: frozenset({State.CONNECTING, State.CLOSED}),
    State.CONNECTING: frozenset({State.CONNECTING, State.REBALANCING, State.SUSPENDED,
                                 State.CLOSED}),
    State.REBALANCING: frozenset({*_LIVE, State.CLOSED}),
    State.CLAIMING: frozenset({State.CONNECTING, State.REBALANCING, State.STABLE,
                               State.SUSPENDED, State.CLOSED}),
    State.STABLE: frozenset({State.CONNECTING, State.REBALANCING, State.SUSPENDED,
                             State.CLOSED}),
    State.SUSPENDED: frozenset({State.CONNECTING, State.REBALANCING, State.CLAIMING,
                                State.STABLE, State.CLOSED}),
    State.CLOSED: frozenset(),
})

#: transitions into or out of these are news for an operator (INFO); the rest is the
#: routine of a rebalance, whose decisions are logged where they are made
_NOTABLE = frozenset({State.INIT, State.CONNECTING, State.SUSPENDED, State.CLOSED})


class TransitionError(RuntimeError):
    """A state change the machine does not have (a bug in the coordinator)."""


class Transition(NamedTuple):
    """One change of state: the ``id`` it got, the state left and the state entered,
    the generation from then on, why, and when (``time.monotonic``)."""

    id: int
    previous: State
    state: State
    generation: int
    reason: str
    at: float


Want = State | Collection[State] | Callable[[Transition], bool]


class Lifecycle:
    """One member's state, generation and rebalance count, changed only by
    :meth:`set_state` (the coordinator thread) and waited on from any thread."""

    def __init__(self, group: str, consumer_id: str, *, history: int = HISTORY) -> None:
        self.group = group
        self.consumer_id = consumer_id
        #: rebalances begun (entries into REBALANCING)
        self.rebalances = 0
        self._cond = threading.Condition()
        self._current = Transition(0, State.INIT, State.INIT, 0, "created", time.monotonic())
        self._history: deque[Transition] = deque([self._current], maxlen=history)

    # -- reading (any thread) -----------------------------------------------------------

    @property
    def state(self) -> State:
        return self._current.state

    @property
    def generation(self) -> int:
        return self._current.generation

    @property
    def state_id(self) -> int:
        """The id of the last transition: one more after each."""
        return self._current.id

    @property
    def current(self) -> Transition:
        """The last transition (id 0, INIT -> INIT, before any)."""
        return self._current

    @property
    def label(self) -> str:
        """``group G consumer C gen N``: how every rebalance log line begins."""
        return f"group {self.group} consumer {self.consumer_id} gen {self.generation}"

    def transitions(self, after_id: int = -1) -> list[Transition]:
        """The transitions kept with an id above ``after_id`` (all of them by default,
        the first being id 0, INIT -> INIT), oldest first."""
        with self._cond:
            return list(self._after(after_id))

    # -- the one writer (the coordinator thread) ----------------------------------------

    def set_state(self, state: State, reason: str, *,
                  new_generation: bool = False) -> Transition | None:
        """Go to ``state`` (``new_generation``: with the generation one up), because of
        ``reason``.  Staying in the same state without a new generation changes nothing
        (None).  A transition the machine does not have raises :class:`TransitionError`
        and changes nothing."""
        with self._cond:
            old = self._current
            if state is old.state and not new_generation:
                return None
            if state not in TRANSITIONS[old.state]:
                allowed = ", ".join(sorted(s.value for s in TRANSITIONS[old.state])) or "nothing"
                raise TransitionError(
                    f"group {self.group} consumer {self.consumer_id} gen {old.generation}: "
                    f"no transition {old.state.value} -> {state.value} ({reason}); from "
                    f"{old.state.value} the member goes to: {allowed}")
            generation = old.generation + 1 if new_generation else old.generation
            t = Transition(old.id + 1, old.state, state, generation, reason, time.monotonic())
            if state is State.REBALANCING:
                self.rebalances += 1
            self._current = t
            self._history.append(t)
            self._cond.notify_all()
        notable = old.state in _NOTABLE or state in _NOTABLE
        log.log(logging.INFO if notable else logging.DEBUG,
                "group %s consumer %s gen %d: %s -> %s (%s) [state %d]", self.group,
                self.consumer_id, generation, old.state.value, state.value, reason, t.id)
        return t

    # -- waiting (any thread) -----------------------------------------------------------

    def wait_for(self, want: Want, timeout: float | None, *,
                 after: int | None = None) -> Transition | None:
        """The first transition that matches ``want`` (a state, some states, or a
        predicate on a :class:`Transition`): the current one if it matches (without
        ``after``), else the first after it, or with ``after`` the first whose id is
        above ``after``; a state passed through meanwhile counts even if already left.
        None when ``timeout`` (seconds; None: no limit) passes first."""
        match = _matcher(want)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if after is None:
                if match(self._current):
                    return self._current
                after = self._current.id
            while True:
                for t in self._after(after):
                    if match(t):
                        return t
                    after = t.id
                if not self._sleep(deadline):
                    return None

    def wait_transition(self, after_id: int, timeout: float | None) -> Transition | None:
        """The next transition after ``after_id`` (the oldest kept, if the waiter fell
        more than :data:`HISTORY` behind); None when ``timeout`` passes first.  Walk
        every transition with ``t = wait_transition(t.id, ...)``."""
        return self.wait_for(lambda _t: True, timeout, after=after_id)

    def _after(self, after_id: int) -> Iterator[Transition]:
        return (t for t in self._history if t.id > after_id)

    def _sleep(self, deadline: float | None) -> bool:
        """Wait for the next transition; False once the deadline passed."""
        if deadline is None:
            self._cond.wait()
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        self._cond.wait(remaining)
        return True


def _matcher(want: Want) -> Callable[[Transition], bool]:
    if isinstance(want, State):
        return lambda t: t.state is want
    if callable(want):
        return want
    if isinstance(want, Collection) and want and all(isinstance(s, State) for s in want):
        states = frozenset(want)
        return lambda t: t.state in states
    raise TypeError(f"wait_for wants a State, a collection of States or a predicate on a "
                    f"Transition, got {want!r}")
