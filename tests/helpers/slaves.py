"""A slave broker for consumer tests, emulated until the real one (issue 26) is on main.

:func:`start_slave` gives a broker id a slave as a consumer sees one: a second, real
broker (in-process: real TCP, real files) serving a byte-for-byte COPY of the master's
data directory (same bytes at the same offsets, as a real slave's log is), registered the
way Metaq's slaves register: ephemeral ``brokers/ids/<id>/slave<N>`` holding its
``meta://host:port`` and ``brokers/topics-sub/<topic>/<id>-s<N>`` per topic, written with
``zk_layout``'s paths and codecs on a ZooKeeper session of its own (closing it takes the
nodes away, as a slave's death would).

What it does not do: follow the master.  It holds what the master had written when it
was copied (a put is written to the segment file before it is acknowledged, so a copy
taken after the acknowledgements holds them), nothing later.  Tests use that: a message
produced after the copy can only come from the master.  When the real slave lands,
replace the body of :func:`start_slave` (``metaq broker start --slave-of <id>``) and keep
its face: the tests then also hold for the real thing.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

from kazoo.client import KazooClient

from metaq.broker import Broker, BrokerConfig
from metaq.testing import free_port
from zk_layout import (
    BrokerUri,
    Layout,
    TopicBroker,
    encode_broker_uri,
    encode_topic_broker,
)

__all__ = ["SlaveBroker", "start_slave", "broker_stat"]


class SlaveBroker:
    """A registered (emulated) slave of ``broker_id``: ``.broker`` serves, ``.port``."""

    def __init__(self, zk_connect: str, broker_id: int, slave_no: int, broker: Broker,
                 topics: Mapping[str, int], zk_root: str = "/meta") -> None:
        self.broker_id = broker_id
        self.slave_no = slave_no
        self.broker = broker
        self.topics = dict(topics)
        self.layout = Layout(zk_root)
        self._zk_connect = zk_connect
        self._zk: KazooClient | None = None

    @property
    def port(self) -> int:
        return self.broker.port

    def register(self) -> None:
        """Its ephemeral nodes, on a session of its own (as a slave broker writes them)."""
        if self._zk is not None:
            return
        zk = KazooClient(hosts=self._zk_connect, timeout=10.0)
        zk.start(timeout=15)
        self._zk = zk
        L, b, n = self.layout, self.broker_id, self.slave_no
        zk.ensure_path(L.broker_id(b))
        zk.create(L.broker_slave(b, n), encode_broker_uri(BrokerUri("127.0.0.1", self.port)),
                  ephemeral=True)
        for topic, parts in self.topics.items():
            zk.ensure_path(L.topic_sub_dir(topic))
            zk.create(L.topic_sub(topic, b, n),
                      encode_topic_broker(TopicBroker(num_parts=parts, broker_id=b,
                                                      slave_no=n)), ephemeral=True)

    def unregister(self) -> None:
        """Its session ends: its nodes go (as when a slave dies)."""
        zk, self._zk = self._zk, None
        if zk is not None:
            zk.stop()
            zk.close()

    def gets(self) -> int:
        """``get`` requests it answered (its ``stats``)."""
        return broker_stat(self.broker.stats(), "cmd_get")

    def close(self) -> None:
        self.unregister()
        self.broker.stop()

    def __enter__(self) -> SlaveBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_slave(zk_connect: str, master_data_dir: str | Path, data_dir: str | Path,
                topics: Mapping[str, int], *, broker_id: int, slave_no: int = 1,
                register: bool = True) -> SlaveBroker:
    """A slave ``slave_no`` of broker ``broker_id`` holding what the master has written
    now (see the module doc), serving and (with ``register``) registered."""
    shutil.copytree(master_data_dir, data_dir, ignore=shutil.ignore_patterns(".lock"))
    cfg = BrokerConfig(broker_id=broker_id, data_dir=Path(data_dir), topics=dict(topics),
                       zk_connect=None, port=free_port())
    broker = Broker(cfg).start()
    slave = SlaveBroker(zk_connect, broker_id, slave_no, broker, topics)
    if register:
        try:
            slave.register()
        except BaseException:
            slave.close()
            raise
    return slave


def broker_stat(text: str, name: str) -> int:
    """One counter of a broker's ``stats`` answer (``STAT <name> <value>`` lines)."""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "STAT" and parts[1] == name:
            return int(parts[2])
    raise KeyError(f"no {name!r} in the broker's stats: {text!r}")
