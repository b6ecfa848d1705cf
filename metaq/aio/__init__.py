"""metaq for asyncio: :class:`AsyncConsumer` (the consumer group member as coroutines)
and :class:`AsyncProducer`, with the guarantees of the threaded API and calls that never
block the event loop.

One concept per module:

================  ==========================================================
``_consumer``     AsyncConsumer: handlers awaited in the loop, ``async for``,
                  commits of finished messages only, cancellation, control
``_bridge``       the fetch runners' slices into the loop (one wake-up a
                  burst) and each partition's in-flight tracker, read by
                  commits
``_cwatch``       the thread that reports a handler blocking the event loop
``_loop``         the running event loop, or a clear error outside one
``_send``         :class:`~metaq.aio._send.AioSend`: a threaded send that is
                  awaitable, completed into the loop once per run of replies
``_producer``     :class:`AsyncProducer`: the bridge over the threaded
                  producer, its in-flight window and ordered queue (the
                  measured design choice is in its docstring)
``_transaction``  :class:`AsyncTransaction` / :class:`AsyncXAResource`: the
                  threaded transactions, each call on a worker thread
================  ==========================================================

The stable API is :data:`__all__`; the modules are private.
"""

from metaq.aio._consumer import AsyncConsumer
from metaq.aio._cwatch import BlockingHandlerWarning
from metaq.aio._producer import AsyncProducer
from metaq.aio._transaction import AsyncTransaction, AsyncXAResource

__all__ = ["AsyncConsumer", "BlockingHandlerWarning", "AsyncProducer", "AsyncTransaction",
           "AsyncXAResource"]
