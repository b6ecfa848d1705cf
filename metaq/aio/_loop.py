"""The running event loop, or a clear error: what every ``metaq.aio`` call checks first."""

from __future__ import annotations

import asyncio

from metaq._errors import MetaqError

__all__ = ["running_loop", "NO_LOOP"]

#: Said when an asyncio API is used where no event loop runs (a plain thread, module level).
NO_LOOP = ("{what} must be called from a coroutine or callback running in an asyncio event "
           "loop, and none is running in this thread; from threads use the threaded API "
           "(metaq.Producer / metaq.MessageConsumer)")


def running_loop(what: str, error: type[MetaqError]) -> asyncio.AbstractEventLoop:
    """The event loop running in this thread; ``error`` naming ``what`` when none runs."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        raise error(NO_LOOP.format(what=what)) from None
