"""An in-process broker (real TCP, real files, registered in the real ZooKeeper) and a
producer helper, shared by the consumer tests that do not need separate processes."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from metaq import Producer, SendResult
from metaq.broker import Broker, BrokerConfig
from metaq.testing import free_port


@contextmanager
def inproc_broker(zk_connect: str | None, data_dir: Path, topics: Mapping[str, int],
                  broker_id: int = 0, **options: Any) -> Iterator[Broker]:
    """A started broker, registered in ZooKeeper unless ``zk_connect`` is None, on a free
    port unless ``port`` is given; ``options`` are any other ``BrokerConfig`` fields."""
    if "port" not in options:
        options["port"] = free_port()
    cfg = BrokerConfig(broker_id=broker_id, data_dir=data_dir, topics=dict(topics),
                       zk_connect=zk_connect, **options)
    with Broker(cfg) as b:
        yield b


def produce(zk_connect: str, topic: str, bodies: Iterable[bytes],
            attribute: str | None = None) -> list[SendResult]:
    """Send ``bodies`` pipelined; return every acknowledgement, in order."""
    with Producer(zk_connect) as p:
        futures = [p.send_async(topic, b, attribute=attribute) for b in bodies]
        return [f.result(timeout=30) for f in futures]
