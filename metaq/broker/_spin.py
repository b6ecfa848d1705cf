"""The broker's event loop waits for a synchronous slave's answer by polling, not
sleeping, for a moment.

A synchronous put is answered when its in-sync slaves hold it: the master hands
the put's bytes to the slave (the slave's held get) and its event loop then has
nothing to do until the slave's next get arrives, some tens of microseconds
later.  Sleeping in ``epoll_wait`` for that costs a wake-up of the master's
process when the slave's get lands, and on a virtual machine whose other vCPU
went idle a cross-vCPU wake-up is the slowest part of the round trip.  So while
a lone put waits for slaves (:meth:`ReplicaSet.waiting`), the loop's selector
polls (``epoll_wait`` with timeout 0) for up to ``replication_poll_us`` (default
:data:`SPIN_SECONDS`) before it blocks; at any other time it blocks at once, as
asyncio's own does.  What it costs: at most that much CPU per wait, none when
nothing waits; never for a stream of batches (many puts wait, and the producer
keeps the loop busy): polling there would take a CPU from the slave.

The slave's side of the same round trip: a slave configured for synchronous
replication that has just copied a lone put (a value of one message, within the
last millisecond: ``Follower.expecting``) polls as long for the next one, which a
producer sending one message at a time puts on its way within some tens of
microseconds; its master's send then wakes no sleeping process (the cost that
showed as the master's ``send`` calls in a profile).  Never after a batch's copy.

Between two polls the loop yields its CPU (``sched_yield``): on a machine with
more runnable processes than CPUs, a process polling for an answer that another
one, waiting for that very CPU, must first produce, made each put wait for a
scheduler tick (0.7 ms a put, master and slave each burning a CPU, seen with
other work running on the 2 cores); with nothing else runnable the yield returns
at once.
"""

from __future__ import annotations

import asyncio
import os
import selectors
import time
from collections.abc import Callable

__all__ = ["SpinSelector", "SPIN_SECONDS", "new_loop"]

#: How long the loop polls for a slave's answer before it sleeps.
SPIN_SECONDS = 0.0003


class SpinSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """An epoll selector that polls for up to ``spin`` seconds before blocking while
    ``wanted()`` says an answer is due (see the module docstring)."""

    def __init__(self, spin: float = SPIN_SECONDS) -> None:
        super().__init__()
        self.spin = spin
        #: says whether an answer is due now (set once the broker knows its role)
        self.wanted: Callable[[], bool] | None = None

    def select(self, timeout: float | None = None) -> list:
        wanted = self.wanted
        if (timeout is None or timeout > 0) and wanted is not None and self.spin > 0 \
                and wanted():
            poll = super().select
            yield_cpu = os.sched_yield
            start = time.monotonic()
            spin = self.spin if timeout is None else min(self.spin, timeout)
            while True:
                ready = poll(0)
                if ready:
                    return ready
                spun = time.monotonic() - start
                if spun >= spin:
                    break
                yield_cpu()  # a process waiting for this CPU runs first
            if timeout is not None:
                timeout = max(0.0, timeout - spun)
        return super().select(timeout)


def new_loop(selector: SpinSelector) -> asyncio.AbstractEventLoop:
    """An event loop on ``selector``."""
    return asyncio.SelectorEventLoop(selector)
