"""LightFuture: a ``concurrent.futures.Future`` that is cheap to complete.

A producer creates one future per message and completes it from the thread
that reads the broker's replies, usually before anyone waits on it.  A plain
``Future`` builds a ``threading.Condition`` at birth and takes it to complete;
:class:`LightFuture` builds it only when a thread waits, adds a callback or
passes the future to :func:`concurrent.futures.wait` / ``as_completed``.  It
relies on ``Future``'s private fields (stable since Python 3.2) and falls back
to a plain ``Future`` set-up if they ever change.
"""

from __future__ import annotations

import threading
from _thread import allocate_lock as _allocate_lock
from concurrent.futures import Future, InvalidStateError
from concurrent.futures._base import CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED, RUNNING
from typing import Any

from metaq.protocol import track

__all__ = ["LightFuture", "LAZY_OK"]

_FUTURE_FIELDS = frozenset(("_condition", "_state", "_result", "_exception", "_waiters",
                            "_done_callbacks"))
# The lazy trick needs Future's private layout to be what this module knows.
LAZY_OK = set(Future().__dict__) == _FUTURE_FIELDS
_DONE_STATES = (CANCELLED, CANCELLED_AND_NOTIFIED, FINISHED)
_LAZY_LOCK = threading.Lock()


class LightFuture(Future):
    """A ``Future`` that is RUNNING from birth (so it cannot be cancelled: the
    request may already be on the wire) and builds its condition variable
    lazily, the first time a thread waits, adds a callback or calls
    :func:`concurrent.futures.wait` / ``as_completed`` on it.

    Completing it is two attribute stores and a flag test; only when a
    condition exists (someone may wait) does it take the condition and notify,
    exactly like a ``Future``.  Why this is race-free: the waiting side
    creates the condition (atomic ``dict.setdefault``) and raises the
    ``_waited`` flag *before* it looks at the state under the condition; the
    completing side writes the state *before* it tests the flag.  So either
    the waiter sees the final state, or the completer sees the flag and
    notifies under the condition.  (The fields are slots: nothing ever goes
    through the instance ``__dict__``; see the note on ``__slots__``.)
    """

    # Every field is a slot, and subclasses that are completed by one thread while
    # another may wait keep theirs in slots too: a first store of an attribute in the
    # instance ``__dict__`` can, on CPython 3.11, move the object's attribute values
    # into a new dict, and a garbage collection inside that move (a ``gc.callbacks``
    # hook or a finalizer that lets another thread run) can let a second thread's
    # first store build another dict on the same values: one of the two dicts is
    # dropped with its stores (``_waited`` or the ack fields lost: a waiter never
    # woken, a result that cannot be read) and the values are freed under the other
    # (a crash).  A slot store is one pointer write.
    __slots__ = ("_state", "_result", "_exception", "_condition", "_waiters",
                 "_done_callbacks", "_waited", "_gate")

    def __init__(self) -> None:
        if not LAZY_OK:  # pragma: no cover - a Python whose Future changed
            Future.__init__(self)
            self._state = RUNNING
            self._waited = True
            return
        self._state = RUNNING
        self._result = None
        self._exception = None
        #: True once the condition exists (a thread may wait): completing notifies.
        self._waited = False

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes missing from the instance: the lazy ones (unset
        # slots).  Built under one lock (a rare path) so that two waiters share one
        # condition.
        if name == "_gate":  # (see wait_done)
            raise AttributeError(name)
        if name in ("_condition", "_waiters", "_done_callbacks"):
            with _LAZY_LOCK:
                try:
                    return object.__getattribute__(self, name)
                except AttributeError:
                    pass
                # Callbacks and waiters may refer back to this future (a cycle): a
                # subclass that took it out of the cyclic collector's lists (a
                # producer's Send) puts it back first.
                track(self)
                self._waiters = []
                self._done_callbacks = []
                self._condition = threading.Condition()
                self._waited = True
            return object.__getattribute__(self, name)
        raise AttributeError(f"{type(self).__name__!s} object has no attribute {name!r}")

    def set_result(self, result: Any) -> None:
        if self._state in _DONE_STATES:
            raise _invalid(self)
        self._result = result
        self._state = FINISHED
        if self._waited:
            self._notify()

    def set_exception(self, exception: BaseException | None) -> None:
        if self._state in _DONE_STATES:
            raise _invalid(self)
        track(self)  # its traceback's frames may refer to this future (see __getattr__)
        self._exception = exception
        self._state = FINISHED
        if self._waited:
            self._notify()

    def wait_done(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the outcome; True once it is there.

        For **one** waiter, the thread that made the future and has not handed it
        to anyone yet (a blocking send waiting for its own message): a bare lock
        instead of the condition, waiters and callback lists that ``result()``
        builds (the same race-free order: the gate and the flag first, then the
        state; the completer writes the state first, then tests the flag)."""
        if self._state == FINISHED:
            return True
        gate = _allocate_lock()
        gate.acquire()
        self._gate = gate
        self._waited = True
        if self._state == FINISHED:
            return True
        return gate.acquire(True, timeout) or self._state == FINISHED

    def _notify(self) -> None:
        try:
            gate = self._gate  # one waiter in wait_done()
        except AttributeError:
            pass
        else:
            gate.release()
            try:  # and nobody else: no condition to build and take
                object.__getattribute__(self, "_condition")
            except AttributeError:
                return
        # What Future.set_result does after storing the outcome.
        with self._condition:
            for waiter in self._waiters:
                waiter.add_result(self) if self._exception is None \
                    else waiter.add_exception(self)
            self._condition.notify_all()
        self._invoke_callbacks()

    def done(self) -> bool:
        return self._state in _DONE_STATES

    def running(self) -> bool:
        return self._state == RUNNING

    def cancel(self) -> bool:
        return False  # never: it is RUNNING from birth (the request may be on the wire)

    def cancelled(self) -> bool:
        return False

    def result(self, timeout: float | None = None) -> Any:
        if self._state == FINISHED:
            exc = self._exception
            if exc is not None:
                raise exc
            return self._result
        return Future.result(self, timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if self._state == FINISHED:
            return self._exception
        return Future.exception(self, timeout)


def _invalid(fut: Future) -> Exception:
    return InvalidStateError(f"{fut._state}: {type(fut).__name__} at {id(fut):#x} is "
                             f"already done")
