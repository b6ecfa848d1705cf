"""metaq for asyncio: :class:`AsyncProducer` (and, from its own module,
``AsyncConsumer``), with the guarantees of the threaded API and calls that never
block the event loop.

One concept per module:

================  ==========================================================
``_loop``         the running event loop, or a clear error outside one
``_send``         :class:`~metaq.aio._send.AioSend`: a threaded send that is
                  awaitable, completed into the loop once per run of replies
``_producer``     :class:`AsyncProducer`: the bridge over the threaded
                  producer, its in-flight window and ordered queue (the
                  measured design choice is in its docstring)
``_transaction``  :class:`AsyncTransaction` / :class:`AsyncXAResource`: the
                  threaded transactions, each call on a worker thread
================  ==========================================================
"""

from metaq.aio._producer import AsyncProducer
from metaq.aio._transaction import AsyncTransaction, AsyncXAResource

# --- AsyncConsumer (metaq/aio/_consumer.py, built beside this): the integrator adds
# --- its import here and its name to __all__ below.

__all__ = ["AsyncProducer", "AsyncTransaction", "AsyncXAResource"]
