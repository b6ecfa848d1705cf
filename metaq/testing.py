"""Helpers for tests and chaos scripts: waiting on conditions and ZooKeeper faults.

- :func:`wait_until` polls a condition with a deadline (never sleep for synchronisation).
- :func:`expire_session` expires a live kazoo client's session for real on the server.
- :class:`ZkProxy` sits between clients and a server to drop or blackhole connections.
- :func:`free_port` a TCP port free a moment ago.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kazoo.client import KazooClient
from kazoo.protocol.states import KazooState

from metaq._zk import ZkProxy, free_port

__all__ = ["WaitTimeout", "ZkProxy", "expire_session", "free_port", "wait_until"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class WaitTimeout(AssertionError, TimeoutError):
    """:func:`wait_until` ran out of time (both an AssertionError and a TimeoutError)."""


def wait_until(
    predicate: Callable[[], _T],
    timeout: float = 10.0,
    interval: float = 0.02,
    what: str = "condition",
) -> _T:
    """Call ``predicate`` every ``interval`` seconds until it returns something truthy.

    Returns that value.  Raises :class:`WaitTimeout` naming ``what`` (and the last value
    seen) when ``timeout`` seconds pass first.  Exceptions from ``predicate`` propagate.
    """
    if timeout < 0 or interval <= 0:
        raise ValueError(
            f"wait_until needs timeout >= 0 and interval > 0, got {timeout}, {interval}")
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise WaitTimeout(
                f"timed out after {timeout:g}s waiting for {what} (last value: {value!r})")
        time.sleep(min(interval, remaining))


def expire_session(client: KazooClient, hosts: str, timeout: float = 15.0) -> None:
    """Expire ``client``'s session on the server for real and wait until ``client`` sees LOST.

    Opens a second connection to ``hosts`` with the same session id and password and closes
    it: the server ends the session (its ephemeral nodes go) and the original connection is
    told the session expired.  Raises :class:`WaitTimeout` if ``client`` has not observed
    ``KazooState.LOST`` within ``timeout`` seconds.
    """
    if client.client_id is None or not client.connected:
        raise ValueError("expire_session needs a connected KazooClient")
    session_id, password = client.client_id
    lost = threading.Event()

    def listener(state: KazooState) -> bool:
        if state == KazooState.LOST:
            lost.set()
            return True  # remove this listener
        return False

    client.add_listener(listener)
    try:
        twin = KazooClient(hosts=hosts, client_id=(session_id, password),
                           timeout=client._session_timeout / 1000.0)
        twin.start(timeout=timeout)
        try:
            if twin.client_id is None or twin.client_id[0] != session_id:
                raise RuntimeError(
                    f"could not attach to session 0x{session_id:x} (got {twin.client_id!r})")
        finally:
            twin.stop()  # closeSession: the server ends the session now
            twin.close()
        log.info("session 0x%x closed on the server", session_id)
        wait_until(lost.is_set, timeout=timeout, interval=0.01,
                   what=f"the client to observe LOST for session 0x{session_id:x}")
    finally:
        client.remove_listener(listener)
