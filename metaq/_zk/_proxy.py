"""A TCP proxy in front of a ZooKeeper server, to cut or blackhole client connections in tests."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from metaq._errors import ConfigError

__all__ = ["ZkProxy"]

log = logging.getLogger(__name__)


def _parse_upstream(upstream: str | tuple[str, int]) -> tuple[str, int]:
    if isinstance(upstream, tuple):
        return upstream
    hostport = upstream.split("/", 1)[0].split(",", 1)[0]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"upstream must be 'host:port', got {upstream!r}")
    return host, int(port)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


class _Link:
    """One client connection and its upstream connection, with two pump threads."""

    def __init__(self, proxy: ZkProxy, client: socket.socket, n: int) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream: socket.socket | None = None
        self.n = n
        self.closed = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        """Connect upstream (once not paused) and pump both ways."""
        if not self.proxy._wait_resumed(self):
            self.close()
            return
        if self.closed.is_set():
            return
        try:
            upstream = socket.create_connection(self.proxy.upstream, timeout=5.0)
            upstream.settimeout(None)
        except OSError as e:
            log.info("ZkProxy %s: upstream %s unreachable: %s", self.proxy.hosts,
                     self.proxy.upstream, e)
            self.close()
            return
        with self.lock:
            if self.closed.is_set():
                _close(upstream)
                return
            self.upstream = upstream
        t = threading.Thread(target=self._pump, args=(upstream, self.client),
                             name=f"ZkProxy-{self.proxy.port}-{self.n}-down", daemon=True)
        t.start()
        self._pump(self.client, upstream)
        t.join()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while not self.closed.is_set():
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            # Whatever was read while paused is held back until resume: a blackhole.
            if not self.proxy._wait_resumed(self) or self.closed.is_set():
                break
            if not data:
                break
            try:
                dst.sendall(data)
            except OSError:
                break
        self.close()

    def close(self) -> None:
        with self.lock:
            if self.closed.is_set():
                return
            self.closed.set()
            socks = [self.client] + ([self.upstream] if self.upstream is not None else [])
        for s in socks:
            _close(s)
        self.proxy._forget(self)


class ZkProxy:
    """Forward ``127.0.0.1:<port>`` to ``upstream`` (a ZooKeeper ``host:port``).

    Give clients :attr:`hosts`.  :meth:`drop` closes every current connection (clients see
    SUSPENDED, then reconnect through the proxy).  :meth:`pause` stops forwarding without
    closing anything — a blackhole: no byte goes either way and no new connection reaches
    the server — until :meth:`resume`; held longer than a session timeout, the server expires
    the session.  :meth:`down` is an outage: every connection is closed and new ones are
    refused (closed at once) until :meth:`up`.  :meth:`close` stops everything (also via
    ``with``).
    """

    def __init__(self, upstream: str | tuple[str, int], *, port: int = 0) -> None:
        self.upstream = _parse_upstream(upstream)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self._listener.listen(64)
        self.port: int = self._listener.getsockname()[1]
        self._links: set[_Link] = set()
        self._lock = threading.Lock()
        self._resumed = threading.Event()
        self._resumed.set()
        self._closed = threading.Event()
        self._down = threading.Event()
        self._count = 0
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept_loop,
                                          name=f"ZkProxy-{self.port}-accept", daemon=True)
        self._acceptor.start()

    @property
    def hosts(self) -> str:
        """Connect string for clients: ``127.0.0.1:<proxy port>``."""
        return f"127.0.0.1:{self.port}"

    @property
    def connection_count(self) -> int:
        """Client connections currently open through the proxy."""
        with self._lock:
            return len(self._links)

    @property
    def paused(self) -> bool:
        return not self._resumed.is_set()

    def __enter__(self) -> ZkProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                break
            if self._closed.is_set():
                _close(client)
                break
            if self._down.is_set():  # an outage: refused
                _close(client)
                continue
            with self._lock:
                self._count += 1
                link = _Link(self, client, self._count)
                self._links.add(link)
                t = threading.Thread(target=link.run, name=f"ZkProxy-{self.port}-{self._count}-up",
                                     daemon=True)
                self._threads = [x for x in self._threads if x.is_alive()]
                self._threads.append(t)
            t.start()

    def _wait_resumed(self, link: _Link | None = None) -> bool:
        """Block while paused; False when the proxy (or ``link``) closed meanwhile."""
        while not self._resumed.wait(0.05):
            if self._closed.is_set() or (link is not None and link.closed.is_set()):
                return False
        return not self._closed.is_set()

    def _forget(self, link: _Link) -> None:
        with self._lock:
            self._links.discard(link)

    def drop(self) -> int:
        """Close every current connection (both sides).  Returns how many were closed."""
        with self._lock:
            links = list(self._links)
        for link in links:
            link.close()
        log.info("ZkProxy %s: dropped %d connection(s)", self.hosts, len(links))
        return len(links)

    def down(self) -> None:
        """An outage: close every connection and refuse new ones until :meth:`up`."""
        self._down.set()
        self.drop()
        log.info("ZkProxy %s: down", self.hosts)

    def up(self) -> None:
        """End the outage: connections are accepted again."""
        self._down.clear()
        log.info("ZkProxy %s: up", self.hosts)

    def pause(self) -> None:
        """Stop forwarding in both directions without closing any connection."""
        self._resumed.clear()
        log.info("ZkProxy %s: paused", self.hosts)

    def resume(self) -> None:
        """Forward again (bytes held while paused go through now)."""
        self._resumed.set()
        log.info("ZkProxy %s: resumed", self.hosts)

    @contextmanager
    def paused_for(self) -> Iterator[None]:
        """``with proxy.paused_for(): ...`` pauses, then resumes on exit."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def close(self) -> None:
        """Stop accepting, close every connection and join the threads."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._resumed.set()
        _close(self._listener)
        self.drop()
        self._acceptor.join(5.0)
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(5.0)
