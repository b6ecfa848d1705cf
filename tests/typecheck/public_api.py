"""A typed use of the public API, checked by ``mypy`` (``[tool.mypy]`` in pyproject.toml,
every strict flag) and never run: what an application's ``mypy --strict`` sees of
``metaq``, ``metaq.aio``, ``metaq.spark`` and ``zk_layout``.  A signature left untyped
(or typed ``Any`` where a type is known) shows up here as an error."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import assert_type

import metaq
import zk_layout
from metaq import (
    RECONSUME_LATER,
    BatchResults,
    ConsumerConfig,
    LocalTransaction,
    Message,
    MessageConsumer,
    MetaqError,
    Producer,
    ProducerConfig,
    Rewind,
    SendResult,
    XAResource,
    Xid,
    ZkSecurity,
)
from metaq.aio import AsyncProducer, AsyncTransaction, AsyncXAResource
from metaq.spark import OffsetRange, SourceOptions, offset_ranges


def threaded_producer(zk: str) -> list[int]:
    config = ProducerConfig(send_timeout=5.0, idempotent=True)
    with Producer(zk, config=config) as producer:
        one: SendResult = producer.send("t", b"x", attribute="a", key=1)
        batch: BatchResults = producer.send_batch("t", [b"a", b"b"]).result()
        later: SendResult = producer.send_async("t", {"id": 1}).result(timeout=5.0)
        tx: LocalTransaction
        with producer.transaction(timeout=30) as tx:
            tx.send("t", b"in a transaction")
        xa: XAResource = producer.xa_resource("app-1", topic="t")
        xa.start(Xid(1, b"g", b"b"))
        names: list[str] = producer.partitions("t")
        offsets = [r.offset for r in batch if r is not None]
        return [one.offset, later.offset, len(names), *offsets]


def listener(message: Message) -> object:
    topic: str = message.topic
    offset: int = message.offset
    body: bytes = message.raw_body
    if message.attribute is None and topic and offset >= 0 and body:
        return RECONSUME_LATER
    raise Rewind(message.offset)


def consumer(zk: str) -> dict[str, int]:
    config = ConsumerConfig(group="group", zk_security=ZkSecurity(auth="u:p"))
    c = MessageConsumer("group", zk, config=config)
    c.subscribe("t", listener)
    with c.start():
        c.commit()
        return {f"{k.topic} {k.partition}": v for k, v in c.committed().items()}


async def async_producer(zk: str) -> SendResult:
    async with AsyncProducer(zk, send_timeout=5.0) as producer:
        pending = producer.send_async("t", b"x")
        assert_type(pending, Awaitable[SendResult])
        assert_type(producer.send_batch("t", [b"a"]), Awaitable[BatchResults])
        batch: BatchResults = await producer.send_batch("t", [b"a"])
        tx: AsyncTransaction
        async with producer.transaction() as tx:
            await tx.send("t", b"y")
        xa: AsyncXAResource = await producer.xa_resource("app-1", topic="t")
        await xa.close()
        names: list[str] = await producer.partitions("t")
        assert names and len(batch)
        first: SendResult = await pending
        return first if first.offset else await producer.send("t", b"z")


def layout() -> list[str]:
    lay = zk_layout.Layout("/meta")
    part: zk_layout.Partition = zk_layout.parse_partition("0-1")
    topic: str = zk_layout.check_topic("t")
    return [lay.brokers(), str(part), topic]


def spark(zk: str, options: dict[str, str]) -> list[OffsetRange]:
    parsed: SourceOptions = SourceOptions.from_options(options)
    return list(offset_ranges(zk, parsed.topics, starting="earliest"))


def errors() -> type[MetaqError]:
    return metaq.SendTimeoutError
