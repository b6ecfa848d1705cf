"""metaq for asyncio: the consumer group member as coroutines.

One concept per module:

=============  ==============================================================
``_consumer``  AsyncConsumer: handlers awaited in the loop, ``async for``,
               commits of finished messages only, cancellation, control
``_bridge``    the fetch runners' slices into the loop (one wake-up a burst)
               and each partition's in-flight tracker, read by commits
``_cwatch``    the thread that reports a handler blocking the event loop
=============  ==============================================================

The stable API is :data:`__all__`; the modules are private.
"""

from metaq.aio._consumer import AsyncConsumer
from metaq.aio._cwatch import BlockingHandlerWarning

__all__ = ["AsyncConsumer", "BlockingHandlerWarning"]
