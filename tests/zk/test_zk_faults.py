"""Fault helpers against the real server: session expiry, dropped and blackholed connections."""

from __future__ import annotations

import threading

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.states import KazooState

from metaq.testing import WaitTimeout, ZkProxy, expire_session, free_port, wait_until


class StateLog:
    """Records a kazoo client's state changes (the listener only appends: it never blocks)."""

    def __init__(self, client: KazooClient) -> None:
        self.states: list[KazooState] = []
        self._lock = threading.Lock()
        client.add_listener(self._listen)

    def _listen(self, state: KazooState) -> None:
        with self._lock:
            self.states.append(state)

    def snapshot(self) -> list[KazooState]:
        with self._lock:
            return list(self.states)


def _chroot(zk_connect: str) -> str:
    return zk_connect[zk_connect.index("/"):]


def test_wait_until_returns_value_and_times_out_naming_what() -> None:
    values = iter([0, None, "", 42])
    assert wait_until(lambda: next(values), timeout=5, interval=0.001) == 42
    with pytest.raises(WaitTimeout, match="the impossible") as err:
        wait_until(lambda: False, timeout=0.05, what="the impossible")
    assert isinstance(err.value, AssertionError) and isinstance(err.value, TimeoutError)


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_expire_session_for_real(zk_server, zk_connect: str, zk_client: KazooClient) -> None:
    victim = KazooClient(hosts=zk_connect, timeout=10.0)
    victim.start(timeout=10)
    try:
        log = StateLog(victim)
        victim.create("/owned", b"x", ephemeral=True)
        old_id, old_password = victim.client_id
        assert zk_client.exists("/owned").ephemeralOwner == old_id

        expire_session(victim, zk_server.hosts)

        assert KazooState.LOST in log.snapshot()
        assert zk_client.exists("/owned") is None
        # kazoo starts a new session after LOST; the old one is dead on the server.
        wait_until(lambda: victim.connected and victim.client_id[0] != old_id, timeout=10,
                   what="the victim to get a new session")
        # Re-attaching with the old id and password: the server refuses, kazoo gets a new id.
        ghost = KazooClient(hosts=zk_connect, client_id=(old_id, old_password), timeout=10.0)
        ghost.start(timeout=10)
        try:
            assert ghost.client_id[0] != old_id
        finally:
            ghost.stop()
            ghost.close()
    finally:
        victim.stop()
        victim.close()


def test_expire_session_needs_a_connected_client(zk_server) -> None:
    with pytest.raises(ValueError, match="connected"):
        expire_session(KazooClient(hosts=zk_server.hosts), zk_server.hosts)


def test_proxy_drop_suspends_then_reconnects_same_session(zk_server, zk_connect: str,
                                                          zk_client: KazooClient) -> None:
    with ZkProxy(zk_server.hosts) as proxy:
        client = KazooClient(hosts=proxy.hosts + _chroot(zk_connect), timeout=10.0)
        client.start(timeout=10)
        try:
            log = StateLog(client)
            client.create("/survivor", ephemeral=True)
            session = client.client_id[0]
            assert proxy.connection_count == 1

            assert proxy.drop() == 1

            wait_until(lambda: log.snapshot()[-2:] == [KazooState.SUSPENDED, KazooState.CONNECTED],
                       timeout=10, what="SUSPENDED then CONNECTED")
            assert KazooState.LOST not in log.snapshot()
            assert client.client_id[0] == session
            assert zk_client.exists("/survivor").ephemeralOwner == session
            client.set("/survivor", b"still mine")  # the session works through the proxy
        finally:
            client.stop()
            client.close()


def test_proxy_pause_expires_the_session_on_the_server(zk_server, zk_connect: str,
                                                       zk_client: KazooClient) -> None:
    with ZkProxy(zk_server.hosts) as proxy:
        client = KazooClient(hosts=proxy.hosts + _chroot(zk_connect), timeout=1.5)
        client.start(timeout=10)
        try:
            log = StateLog(client)
            client.create("/doomed", ephemeral=True)
            session = client.client_id[0]
            proxy.pause()
            # Nothing reaches the server: after the session timeout it drops the ephemeral.
            wait_until(lambda: zk_client.exists("/doomed") is None, timeout=15,
                       what="the server to expire the blackholed session")
            assert KazooState.LOST not in log.snapshot()  # the client cannot know yet
            proxy.resume()
            wait_until(lambda: KazooState.LOST in log.snapshot(), timeout=15,
                       what="the client to learn its session expired")
            wait_until(lambda: client.connected and client.client_id[0] != session, timeout=15,
                       what="a new session through the proxy")
        finally:
            client.stop()
            client.close()


def test_proxy_close_stops_its_threads(zk_server) -> None:
    proxy = ZkProxy(zk_server.hosts)
    client = KazooClient(hosts=proxy.hosts, timeout=10.0)
    client.start(timeout=10)
    client.stop()
    client.close()
    proxy.pause()
    proxy.close()
    names = [t.name for t in threading.enumerate() if t.name.startswith(f"ZkProxy-{proxy.port}-")]
    assert names == []
