"""Brokers for a test, started one way and all stopped at its end: :class:`BrokerFactory`,
which the ``broker_factory`` fixture (tests/conftest.py) hands out.

::

    def test_x(zk_connect, broker_factory):
        b = broker_factory({"t": 2}, zk_connect=zk_connect)        # an in-process Broker
        p = broker_factory({"t": 2}, broker_id=1, zk_connect=zk_connect,
                           process=True)                           # a broker subprocess

- In process (the default): a :class:`metaq.broker.Broker` (real TCP, real files) through
  :func:`helpers.inproc.inproc_broker`, on a free port; ``options`` are any other
  ``BrokerConfig`` fields (``max_segment_size=4096``, ``java_unwritten_404=True``, ...).  It
  registers in ZooKeeper when ``zk_connect`` is given and serves without it otherwise.
  ``config=`` starts one from a complete ``BrokerConfig`` instead.
- ``process=True``: a ``metaq broker start`` subprocess through
  :func:`helpers.procs.start_broker` (a :class:`helpers.procs.BrokerProc`, which can be
  killed, paused and restarted); ``options`` are its keywords (``port``, ``group_commit``,
  ``zk_session_timeout``, ``extra_args``, ...).  It needs ``zk_connect``.

Data goes to ``<root>/broker<id>`` unless ``data_dir`` says where.  :meth:`BrokerFactory.close`
stops every broker started, the last first: an in-process one raises if it does not stop, a
process is stopped (SIGCONT, SIGTERM, then SIGKILL) without raising.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Literal, overload

from helpers.inproc import inproc_broker
from helpers.procs import BrokerProc, start_broker, stop_all
from metaq.broker import Broker, BrokerConfig

__all__ = ["BrokerFactory"]


class BrokerFactory:
    """Starts brokers (see the module doc); use as a context manager or call :meth:`close`."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._stack = ExitStack()

    @overload
    def __call__(self, topics: Mapping[str, int], *, broker_id: int = ...,
                 zk_connect: str | None = ..., process: Literal[True],
                 data_dir: str | os.PathLike[str] | None = ..., **options: Any) -> BrokerProc: ...

    @overload
    def __call__(self, topics: Mapping[str, int] | None = ..., *, broker_id: int = ...,
                 zk_connect: str | None = ..., process: Literal[False] = ...,
                 data_dir: str | os.PathLike[str] | None = ..., config: BrokerConfig | None = ...,
                 **options: Any) -> Broker: ...

    def __call__(self, topics: Mapping[str, int] | None = None, *, broker_id: int = 0,
                 zk_connect: str | None = None, process: bool = False,
                 data_dir: str | os.PathLike[str] | None = None,
                 config: BrokerConfig | None = None, **options: Any) -> Broker | BrokerProc:
        """Start a broker serving ``topics`` (``{name: partitions}``); return it serving."""
        if config is not None:
            given = [name for name, v in (("topics", topics), ("zk_connect", zk_connect),
                                          ("data_dir", data_dir)) if v is not None]
            if given or options or process or broker_id:
                raise TypeError("config= is a complete BrokerConfig for an in-process broker; "
                                f"also given: {given + sorted(options)}"
                                + (" process=True" if process else "")
                                + (f" broker_id={broker_id}" if broker_id else ""))
            return self._stack.enter_context(Broker(config))
        if topics is None:
            raise TypeError("broker_factory needs topics ({name: partitions}) or config=")
        where = Path(data_dir) if data_dir is not None else self.root / f"broker{broker_id}"
        if process:
            if zk_connect is None:
                raise TypeError("a broker process registers in ZooKeeper: give zk_connect")
            proc = start_broker(zk_connect, broker_id, where, topics, **options)
            self._stack.callback(stop_all, [proc])
            return proc
        return self._stack.enter_context(
            inproc_broker(zk_connect, where, topics, broker_id, **options))

    def close(self) -> None:
        """Stop every broker started, the last first."""
        self._stack.close()

    def __enter__(self) -> BrokerFactory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
