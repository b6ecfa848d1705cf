"""ZooKeeper in Docker containers for the tests, with the embedded launcher's settings.

- :func:`engine` a reachable Docker engine (a ``docker.DockerClient``), or
  :class:`DockerUnavailable` saying what is missing;
- :func:`zk_image` the ZooKeeper image to run: ``$METAQ_TEST_ZK_IMAGE``, else
  ``metaq-zookeeper:test`` (docker/zookeeper/Dockerfile, built by
  ``python docker/prepare.py images``) when present, else the public ``zookeeper:3.9``;
  an image missing here is pulled, and when it cannot be, :class:`DockerUnavailable`;
- :class:`ZooKeeperContainer` one server in a testcontainers container (the session's
  server under ``METAQ_TEST_ZK=docker``, see tests/conftest.py);
- :class:`ContainerEnsemble` a 3-node ensemble in containers on a user-defined network,
  each member's 2181 published on a fixed host port (so a member stopped or killed and
  started again keeps its address), with the interface of
  :class:`metaq._zk.ZooKeeperEnsemble` plus :meth:`ContainerEnsemble.kill_node`;
- :func:`unavailable` skips (or, under ``METAQ_TEST_DOCKER=1``, which
  ``docker/prepare.py suite`` sets after building the images, fails) a test that cannot
  have what it needs.

Both image flavours take the same environment (``ZOO_TICK_TIME``, ``ZOO_CFG_EXTRA`` ...).
The settings are those of :class:`metaq._zk.ZooKeeperConfig`, so sessions time out as they
do with the launcher: tickTime 200 ms, sessions of 1 s to 60 s, no limit on connections
per client address (every connection comes from the engine's bridge), no fsync, every
four-letter word allowed.

Containers carry the label ``org.metaq.test.owner=<host>:<pid>``; ones left behind by a
test process that died without cleaning up (kill -9) are removed the next time.
testcontainers' reaper (Ryuk) is used when its image is here or can be pulled, and turned
off otherwise (no registry): the fixtures stop what they start.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time
import uuid
from typing import Any

import pytest
from kazoo.client import KazooClient

from metaq._zk import ZooKeeperConfig, four_letter_word, server_mode, wait_for_quorum
from metaq.testing import WaitTimeout, free_port, wait_until

__all__ = [
    "LOCAL_ZK_IMAGE",
    "METAQ_IMAGE",
    "PREPARE",
    "ContainerEnsemble",
    "DockerUnavailable",
    "ZooKeeperContainer",
    "engine",
    "have_image",
    "owner_labels",
    "require_image",
    "unavailable",
    "zk_image",
]

log = logging.getLogger(__name__)

LOCAL_ZK_IMAGE = "metaq-zookeeper:test"
PUBLIC_ZK_IMAGE = "zookeeper:3.9"
METAQ_IMAGE = "metaq-py:test"
PREPARE = "python docker/prepare.py images"
OWNER_LABEL = "org.metaq.test.owner"
_OWNER = f"{socket.gethostname()}:{os.getpid()}"


def owner_labels() -> dict[str, str]:
    """Labels for a container a test starts: removed after this process dies, if left."""
    return {OWNER_LABEL: _OWNER}


class DockerUnavailable(Exception):
    """What a Docker test needs is not here; the message says exactly what."""


def unavailable(reason: str) -> None:
    """Skip the test, or fail it when ``METAQ_TEST_DOCKER=1`` (the images were just built,
    so a skip would hide a breakage)."""
    if os.environ.get("METAQ_TEST_DOCKER") == "1":
        pytest.fail(f"METAQ_TEST_DOCKER=1 but {reason}", pytrace=False)
    pytest.skip(reason)


# -- engine and images ----------------------------------------------------------------------

_engine: Any = None


def engine() -> Any:
    """A ``docker.DockerClient`` whose engine answers (created once per process)."""
    global _engine
    if _engine is not None:
        return _engine
    try:
        import docker  # docker-py, a dependency of testcontainers (the ``test`` extra)
    except ImportError as e:
        raise DockerUnavailable(
            f"docker-py is not installed ({e}): pip install -e '.[test]'") from None
    try:
        client = docker.from_env(timeout=30)
        client.ping()
    except Exception as e:
        where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
        raise DockerUnavailable(
            f"no Docker engine is reachable at {where} ({type(e).__name__}: {e}); start "
            f"one, or as root with apt run `python docker/prepare.py engine`") from None
    _configure_testcontainers(client)
    _reap_orphans(client)
    _engine = client
    return client


def have_image(image: str) -> bool:
    import docker.errors

    try:
        engine().images.get(image)
        return True
    except docker.errors.ImageNotFound:
        return False


def _pull(image: str, client: Any = None) -> str | None:
    """Pull ``image``; None when done, else why not."""
    try:
        (client or engine()).images.pull(image)
        return None
    except Exception as e:  # no registry, no such image, ...
        why = getattr(e, "explanation", None) or str(e)
        return f"cannot be pulled: {why.splitlines()[0][:200]}"


def require_image(image: str, *, pull: bool = True) -> str:
    """``image`` present here (pulled if it can be and ``pull``), or
    :class:`DockerUnavailable`.  The project's images (``*:test``) are built, not pulled."""
    if have_image(image):
        return image
    if not pull:
        raise DockerUnavailable(
            f"image {image} is not on this Docker engine: build it with `{PREPARE}`")
    why = _pull(image)
    if why is None:
        return image
    raise DockerUnavailable(f"image {image} is not on this Docker engine and {why}")


def zk_image() -> str:
    """The ZooKeeper image the tests run (see the module docstring)."""
    chosen = os.environ.get("METAQ_TEST_ZK_IMAGE", "").strip()
    if chosen:
        try:
            return require_image(chosen)
        except DockerUnavailable as e:
            raise DockerUnavailable(f"METAQ_TEST_ZK_IMAGE: {e}") from None
    for image in (LOCAL_ZK_IMAGE, PUBLIC_ZK_IMAGE):
        if have_image(image):
            return image
    why = _pull(PUBLIC_ZK_IMAGE)
    if why is None:
        return PUBLIC_ZK_IMAGE
    raise DockerUnavailable(
        f"no ZooKeeper image: {LOCAL_ZK_IMAGE} is not on this Docker engine and "
        f"{PUBLIC_ZK_IMAGE} {why}: build {LOCAL_ZK_IMAGE} with `{PREPARE}`, or name "
        f"another image in METAQ_TEST_ZK_IMAGE")


def _configure_testcontainers(client: Any) -> None:
    """Ryuk (testcontainers' reaper) only when its image is here or can be pulled."""
    from testcontainers.core.config import testcontainers_config as tc

    if "TESTCONTAINERS_RYUK_DISABLED" in os.environ or tc.ryuk_disabled:
        return
    try:
        client.images.get(tc.ryuk_image)
        return
    except Exception:
        pass
    if _pull(tc.ryuk_image, client) is not None:
        log.info("testcontainers' reaper image %s cannot be had: reaper off", tc.ryuk_image)
        tc.ryuk_disabled = True


def _reap_orphans(client: Any) -> None:
    """Remove containers and networks of test processes of this machine that are gone."""
    host = socket.gethostname()

    def orphan(labels: dict[str, str]) -> bool:
        owner = labels.get(OWNER_LABEL, "")
        name, _, pid = owner.rpartition(":")
        if name != host or not pid.isdigit() or int(pid) == os.getpid():
            return False
        try:
            os.kill(int(pid), 0)
            return False
        except ProcessLookupError:
            return True
        except PermissionError:
            return False

    try:
        for c in client.containers.list(all=True, filters={"label": OWNER_LABEL}):
            if orphan(c.labels):
                log.info("removing container %s left by a dead test process", c.name)
                c.remove(force=True, v=True)  # with its anonymous /data volume
        for n in client.networks.list(filters={"label": OWNER_LABEL}):
            if orphan(n.attrs.get("Labels") or {}):
                n.remove()
    except Exception:  # best effort
        log.exception("could not remove containers left by dead test processes")


# -- one server -----------------------------------------------------------------------------

def _settings(config: ZooKeeperConfig, extra: tuple[str, ...] = ()) -> dict[str, str]:
    """The environment giving a container the launcher's zoo.cfg (metaq._zk._launcher)."""
    cfg_extra = [
        f"minSessionTimeout={config.min_session_timeout_ms}",
        f"maxSessionTimeout={config.max_session_timeout_ms}",
        "maxClientCnxns=0",
        f"forceSync={'yes' if config.force_sync else 'no'}",
        *extra,
    ]
    return {
        "ZOO_TICK_TIME": str(config.tick_time_ms),
        "ZOO_INIT_LIMIT": str(config.init_limit),
        "ZOO_SYNC_LIMIT": str(config.sync_limit),
        "ZOO_4LW_COMMANDS_WHITELIST": "*",
        "ZOO_MAX_CLIENT_CNXNS": "0",  # the official image's name for it
        "ZOO_ADMINSERVER_ENABLED": "false",
        "ZOO_HEAP": f"{config.heap_mb}m",  # metaq-zookeeper's
        "JVMFLAGS": f"-Xmx{config.heap_mb}m",  # the official image's
        "ZOO_CFG_EXTRA": " ".join(cfg_extra),
    }


class ZooKeeperContainer:
    """One ZooKeeper server in a container, reached from here at :attr:`hosts`.

    ``host_port`` None publishes 2181 on a port the engine picks; a fixed one keeps the
    address across :meth:`stop`/:meth:`kill` and :meth:`start`.  ``network``, ``alias``
    and ``ip`` put it on a user-defined network (ensemble members).  The log is the
    container's.
    """

    def __init__(self, image: str, *, config: ZooKeeperConfig | None = None,
                 env: dict[str, str] | None = None, network: str | None = None,
                 alias: str | None = None, ip: str | None = None,
                 host_port: int | None = None, cfg_extra: tuple[str, ...] = ()) -> None:
        from testcontainers.core.container import DockerContainer

        self.image = image
        self.config = config or ZooKeeperConfig()
        c = DockerContainer(image)
        for k, v in {**_settings(self.config, cfg_extra), **(env or {})}.items():
            c.with_env(k, v)
        if host_port is None:
            c.with_exposed_ports(2181)
        else:
            c.with_bind_ports(2181, host_port)
        kwargs: dict[str, Any] = {"labels": {OWNER_LABEL: _OWNER}}
        if network is not None:
            from docker.types import EndpointConfig

            kwargs["network"] = network
            kwargs["networking_config"] = {network: EndpointConfig(
                engine().api._version, aliases=[alias] if alias else None, ipv4_address=ip)}
        c.with_kwargs(**kwargs)
        self._tc = c
        self._host: str | None = None
        self._port: int | None = host_port
        self.alias = alias
        self.ip = ip

    # -- addresses ------------------------------------------------------------------------
    @property
    def host(self) -> str:
        if self._host is None:
            raise RuntimeError("the container is not started")
        return self._host

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the container is not started")
        return self._port

    @property
    def hosts(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def pid(self) -> None:
        """No process of ours (the server runs in the engine); for ``ZooKeeperServer``'s
        interface."""
        return None

    @property
    def container(self) -> Any:
        """The docker-py ``Container``."""
        return self._tc.get_wrapped_container()

    def __repr__(self) -> str:
        return f"ZooKeeperContainer({self.image}, {self._host}:{self._port}, {self.alias})"

    # -- lifecycle ------------------------------------------------------------------------
    def __enter__(self) -> ZooKeeperContainer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def start(self, *, wait: bool = True) -> ZooKeeperContainer:
        """Create and start the container (or start it again after :meth:`stop`/:meth:`kill`);
        ``wait`` until it serves a client (ruok, srvr, a kazoo session)."""
        if self._tc._container is None:
            engine()
            self._tc.start()
            host = self._tc.get_container_host_ip()
            self._host = "127.0.0.1" if host in ("localhost", "::1") else host
            self._port = self._tc.get_exposed_port(2181)
        else:
            self.container.start()
        if wait:
            self.wait_serving(self.config.start_timeout)
        return self

    def stop(self, timeout: int = 10) -> None:
        """``docker stop``: SIGTERM, SIGKILL after ``timeout`` s; the container is kept."""
        self.container.stop(timeout=timeout)

    def kill(self) -> None:
        """``docker kill``: SIGKILL at once; the container is kept."""
        self.container.kill()

    def remove(self) -> None:
        if self._tc._container is not None:
            try:
                self._tc.stop()
            finally:
                self._tc._container = None

    def running(self) -> bool:
        c = self.container
        c.reload()
        return c.status == "running"

    def mode(self) -> str | None:
        """``standalone``/``leader``/``follower``, None when it does not serve."""
        if self._tc._container is None or not self.running():
            return None
        return server_mode(self.host, self.port, timeout=1.0)

    def wait_serving(self, timeout: float) -> None:
        """Until the server answers ``ruok`` and ``srvr`` and opens a kazoo session.

        Raises RuntimeError with the log tail when the container exits or the deadline
        passes.
        """
        deadline = time.monotonic() + timeout
        last = ["no answer yet"]

        def serving() -> bool:
            if not self.running():
                raise RuntimeError(
                    f"ZooKeeper container {self.container.short_id} ({self.image}) exited "
                    f"({self.container.attrs['State'].get('ExitCode')}):\n{self.log_tail()}")
            try:
                if four_letter_word(self.host, self.port, "ruok", 1.0).strip() != "imok":
                    raise OSError("ruok not answered imok")
                if server_mode(self.host, self.port, 1.0) is None:
                    raise OSError("srvr: not currently serving requests")
                self._kazoo_probe(min(5.0, max(1.0, deadline - time.monotonic())))
                return True
            except OSError as e:
                last[0] = str(e) or type(e).__name__
                return False

        try:
            wait_until(serving, timeout, interval=0.1, what="the server to serve")
        except WaitTimeout:
            raise RuntimeError(
                f"ZooKeeper container {self.container.short_id} ({self.image}) on "
                f"{self.hosts} did not serve within {timeout:.0f}s (last: {last[0]}):\n"
                f"{self.log_tail()}") from None

    def _kazoo_probe(self, timeout: float) -> None:
        client = KazooClient(hosts=self.hosts, timeout=max(timeout, 1.0))
        try:
            client.start(timeout=timeout)
            client.exists("/")
        except Exception as e:
            raise OSError(f"kazoo could not connect: {e!r}") from e
        finally:
            client.stop()
            client.close()

    # -- logs (the interface of ZooKeeperServer the conftest's report hook uses) ------------
    def log_size(self) -> float:
        """A mark for :meth:`read_log`: now (the container's log is read by time)."""
        return time.time()

    def read_log(self, since: float = 0) -> str:
        """The container's log written since the mark ``since`` (0: all of it)."""
        try:
            # a second early: the engine's clock may be a little behind ours
            kw = {"since": since - 1.0} if since else {}
            return self.container.logs(**kw).decode("utf-8", "replace")
        except Exception as e:  # best effort: a report must not fail on it
            return f"(could not read the container's log: {e!r})"

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.container.logs(tail=lines).decode("utf-8", "replace")
        except Exception as e:
            return f"(could not read the container's log: {e!r})"
        return f"--- container {self.container.short_id} {self.alias or ''} ---\n{text}"


# -- an ensemble ----------------------------------------------------------------------------

def _distinct_free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


class ContainerEnsemble:
    """``size`` ZooKeeper containers forming one quorum on a user-defined network.

    Members ``zk1``.. have fixed addresses on the network (quorum ports 2888/3888 there);
    member ``i``'s 2181 is published on a fixed host port.  The interface is that of
    :class:`metaq._zk.ZooKeeperEnsemble` (``hosts``, ``node_hosts``, ``stop_node``,
    ``start_node``, ``mode``, ``leader``, ``wait_quorum``, ``log_tail``, ``servers``) plus
    :meth:`kill_node` (``docker kill``).
    """

    def __init__(self, size: int = 3, image: str | None = None, *,
                 config: ZooKeeperConfig | None = None) -> None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(f"ensemble size must be a positive int, got {size!r}")
        self.size = size
        self.image = image
        self.config = config or ZooKeeperConfig()
        self._network: Any = None
        self._servers: list[ZooKeeperContainer] = []

    @property
    def servers(self) -> list[ZooKeeperContainer]:
        return list(self._servers)

    @property
    def network_name(self) -> str:
        return str(self._network.name)

    def node_ip(self, i: int) -> str:
        """Member ``i``'s address on the ensemble's network."""
        return str(self.servers[i].ip)

    @property
    def hosts(self) -> str:
        if not self._servers:
            raise RuntimeError("the ensemble is not started")
        return ",".join(s.hosts for s in self._servers)

    def node_hosts(self, i: int) -> str:
        return self._servers[i].hosts

    def __enter__(self) -> ContainerEnsemble:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> ContainerEnsemble:
        if self._servers:
            raise RuntimeError("the ensemble is already started")
        engine()
        image = self.image or zk_image()
        subnet = self._create_network()
        ips = [str(subnet[10 + i]) for i in range(self.size)]
        servers = " ".join(f"server.{i + 1}={ip}:2888:3888;2181" for i, ip in enumerate(ips))
        try:
            ports = _distinct_free_ports(self.size)
            self._servers = [
                ZooKeeperContainer(
                    image, config=self.config, network=self._network.name,
                    alias=f"zk{i + 1}", ip=ips[i], host_port=ports[i],
                    env={"ZOO_MY_ID": str(i + 1), "ZOO_SERVERS": servers,
                         "ZOO_STANDALONE_ENABLED": "false"},
                    cfg_extra=("quorumListenOnAllIPs=true",))
                for i in range(self.size)
            ]
            for s in self._servers:
                s.start(wait=False)
            deadline = time.monotonic() + self.config.start_timeout
            for s in self._servers:
                s.wait_serving(max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise
        log.info("ZooKeeper ensemble in containers serving on %s", self.hosts)
        return self

    def _create_network(self) -> ipaddress.IPv4Network:
        """A bridge network with a subnet of its own, members at fixed addresses in it.

        Members name each other by address, not by name: a name resolves only once its
        container runs, and a ZooKeeper that found a peer's name unresolved backs off its
        election for up to a minute.  A fixed address needs a subnet given at creation:
        the engine picks a free one for a first network, which is then made again with it.
        """
        from docker.errors import APIError
        from docker.types import IPAMConfig, IPAMPool

        client = engine()
        labels = {OWNER_LABEL: _OWNER}
        for attempt in range(5):
            name = f"metaq-zk-{uuid.uuid4().hex[:8]}"
            probe = client.networks.create(name, driver="bridge", labels=labels)
            try:
                subnet = probe.attrs["IPAM"]["Config"][0]["Subnet"]
            finally:
                probe.remove()
            try:
                self._network = client.networks.create(
                    name, driver="bridge", labels=labels,
                    ipam=IPAMConfig(pool_configs=[IPAMPool(subnet=subnet)]))
                return ipaddress.ip_network(subnet)  # type: ignore[return-value]
            except APIError as e:  # another network took the subnet meanwhile
                if attempt == 4:
                    raise
                log.info("network subnet %s taken (%s), trying again", subnet, e)
        raise AssertionError("unreachable")

    def stop_node(self, i: int) -> None:
        """``docker stop`` member ``i`` (SIGTERM); :meth:`start_node` brings it back."""
        self._servers[i].stop()

    def kill_node(self, i: int) -> None:
        """``docker kill`` member ``i`` (SIGKILL)."""
        self._servers[i].kill()

    def start_node(self, i: int, *, wait: bool = True) -> None:
        self._servers[i].start(wait=wait)

    def mode(self, i: int) -> str | None:
        return self._servers[i].mode()

    def leader(self) -> int | None:
        for i in range(len(self._servers)):
            if self.mode(i) == "leader":
                return i
        return None

    def wait_quorum(self, timeout: float = 30.0) -> int:
        """Until a leader serves with a majority of members serving; its index."""
        return wait_for_quorum(lambda: [self.mode(i) for i in range(len(self._servers))],
                               timeout)

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(f"=== node {i} ===\n{s.log_tail(lines)}"
                         for i, s in enumerate(self._servers))

    def stop(self) -> None:
        """Remove every member and the network."""
        errors: list[BaseException] = []
        for s in self._servers:
            try:
                s.remove()
            except Exception as e:
                errors.append(e)
        self._servers = []
        if self._network is not None:
            try:
                self._network.remove()
            except Exception as e:
                errors.append(e)
            self._network = None
        if errors:
            raise errors[0]
