"""Transactions of an :class:`~metaq.aio.AsyncProducer`: the threaded producer's
:class:`~metaq.LocalTransaction` and :class:`~metaq.XAResource`, each call run on the
producer's worker threads so that the event loop never waits for the broker.

A transaction talks to one broker over one blocking connection, one request at a
time (begin, puts, commit): there is no pipelining to bridge, so each call is handed
to a thread whole.  Calls of one transaction are awaited one after the other, so they
reach the broker in the order they were made.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

from metaq._errors import ProducerError
from metaq.aio._loop import running_loop
from metaq.producer import LocalTransaction, SendResult, XAResource, Xid

__all__ = ["AsyncTransaction", "AsyncXAResource"]

T = TypeVar("T")


async def _call(executor: Executor, what: str, fn: Callable[..., T], *args: Any,
                **kwargs: Any) -> T:
    loop = running_loop(what, ProducerError)
    if kwargs:
        return await loop.run_in_executor(executor, lambda: fn(*args, **kwargs))
    return await loop.run_in_executor(executor, fn, *args)


class AsyncTransaction:
    """A local transaction (see :meth:`metaq.Producer.transaction`): its messages go to
    one broker and become visible together, in order, when it commits::

        async with producer.transaction(timeout=30) as tx:
            await tx.send("orders", b"created")
            await tx.send("audit", b"order 7 created")
        # committed here; an exception (or cancellation) in the block rolls it back
    """

    def __init__(self, tx: LocalTransaction, executor: Executor) -> None:
        self._tx = tx
        self._executor = executor

    @property
    def key(self) -> str:
        """The transaction's key (``TX:<session>:<n>``, as Java Metaq's)."""
        return self._tx.key

    async def send(self, topic: str, body: Any, attribute: str | None = None,
                   key: Any = None, *, partition: str | None = None) -> None:
        """Put one message in the transaction (the first send picks the broker, or
        ``partition`` does); refusals are reported by :meth:`commit`."""
        await _call(self._executor, "AsyncTransaction.send()", self._tx.send, topic, body,
                    attribute, key, partition=partition)

    async def commit(self) -> list[SendResult]:
        """Commit: the :class:`~metaq.SendResult` of every message, in order; raises
        :class:`~metaq.TransactionError` (rolled back) when a put was refused."""
        return await _call(self._executor, "AsyncTransaction.commit()", self._tx.commit)

    async def rollback(self) -> None:
        """Roll back (nothing of it becomes visible)."""
        await _call(self._executor, "AsyncTransaction.rollback()", self._tx.rollback)

    async def __aenter__(self) -> AsyncTransaction:
        running_loop("async with producer.transaction()", ProducerError)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        # The threaded __exit__ (commit, or rollback after an exception), on a thread; when
        # the block was cancelled the rollback still runs to its end there.
        fut = asyncio.get_running_loop().run_in_executor(
            self._executor, self._tx.__exit__, exc_type, *exc)
        await asyncio.shield(fut) if exc_type is not None else await fut


class AsyncXAResource:
    """An XA resource on one broker (see :meth:`metaq.Producer.xa_resource`), for an
    asyncio transaction manager: every call of :class:`~metaq.XAResource`, awaited."""

    def __init__(self, resource: XAResource, executor: Executor) -> None:
        self._r = resource
        self._executor = executor

    @property
    def unique_qualifier(self) -> str:
        return self._r.unique_qualifier

    def key(self, xid: Xid) -> str:
        """The transaction key of branch ``xid`` on the wire."""
        return self._r.key(xid)

    async def _do(self, name: str, *args: Any) -> Any:
        return await _call(self._executor, f"AsyncXAResource.{name}()",
                           getattr(self._r, name), *args)

    async def set_transaction_timeout(self, seconds: int) -> None:
        await self._do("set_transaction_timeout", seconds)

    async def start(self, xid: Xid) -> None:
        await self._do("start", xid)

    async def send(self, topic: str, body: Any, attribute: str | None = None,
                   key: Any = None, *, partition: str | None = None) -> None:
        await _call(self._executor, "AsyncXAResource.send()", self._r.send, topic, body,
                    attribute, key, partition=partition)

    async def end(self, xid: Xid) -> None:
        await self._do("end", xid)

    async def prepare(self, xid: Xid) -> int:
        result: int = await self._do("prepare", xid)
        return result

    async def commit(self, xid: Xid, one_phase: bool = False) -> None:
        await self._do("commit", xid, one_phase)

    async def rollback(self, xid: Xid) -> None:
        await self._do("rollback", xid)

    async def forget(self, xid: Xid) -> None:
        await self._do("forget", xid)

    async def recover(self) -> list[Xid]:
        result: list[Xid] = await self._do("recover")
        return result

    async def close(self) -> None:
        await self._do("close")

    async def __aenter__(self) -> AsyncXAResource:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
