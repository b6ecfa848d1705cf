"""Shared fixtures: a real ZooKeeper server, a fresh chroot per test, a started kazoo client.

``METAQ_TEST_ZK`` picks the server:

- unset/empty: the embedded launcher (``metaq._zk.ZooKeeperServer``) runs one JVM for the
  whole session, from the jars of the pyspark wheel (or $ZOOKEEPER_HOME / Debian's package);
- ``host:port``: an external server that is already running;
- ``docker``: a container per session through testcontainers (``helpers.zk_docker``), of
  ``$METAQ_TEST_ZK_IMAGE``, else ``metaq-zookeeper:test`` when built
  (``python docker/prepare.py images``), else ``zookeeper:3.9``, with the launcher's
  settings; the ``zk_ensemble`` is then three containers too.  Every ZooKeeper test is
  skipped, saying what is missing, when no engine is reachable or no image can be had.

When a test using the server fails, the server log written since the test started is
attached to its report.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterator

import pytest
from kazoo.client import KazooClient

try:
    from metaq._zk import ZooKeeperEnsemble, ZooKeeperServer
except ImportError as e:
    # tests/ is on sys.path: without the repository root there too (pythonpath in
    # pyproject.toml), tests/zk_layout/ is imported as an empty namespace package in place
    # of the real zk_layout wherever that is found only through an editable install's finder.
    import zk_layout

    if getattr(zk_layout, "__file__", None) is None:
        raise ImportError(f"zk_layout resolves to the namespace package {list(zk_layout.__path__)}"
                          ", not the real package: put the repository root on sys.path "
                          '(pythonpath = [".", "tests"] in pyproject.toml)') from e
    raise

_SERVER_KEY = pytest.StashKey[object]()
_ENSEMBLE_KEY = pytest.StashKey[object]()
_LOG_MARK_KEY = pytest.StashKey[float]()  # a byte offset, or a time (containers)
_LOG_LINES = 200


class ExternalZooKeeper:
    """A server we did not start (``METAQ_TEST_ZK=host:port``); no log access."""

    def __init__(self, hosts: str) -> None:
        self.hosts = hosts

    @property
    def port(self) -> int:
        return int(self.hosts.split(",")[0].rsplit(":", 1)[1])

    def log_size(self) -> int:
        return 0

    def read_log(self, since: float = 0) -> str:
        return ""


def _docker_server() -> Iterator[object]:
    """The session's server in a container (``helpers.zk_docker``); skips saying what is
    missing when there is no engine or no image."""
    from helpers.zk_docker import DockerUnavailable, ZooKeeperContainer, unavailable, zk_image

    try:
        image = zk_image()
    except DockerUnavailable as e:
        unavailable(f"METAQ_TEST_ZK=docker: {e}")
    with ZooKeeperContainer(image) as server:
        yield server


@pytest.fixture(scope="session")
def zk_server(request: pytest.FixtureRequest) -> Iterator[object]:
    """The session's real ZooKeeper server; ``.hosts`` is ``host:port``."""
    spec = os.environ.get("METAQ_TEST_ZK", "").strip()
    if spec == "docker":
        for server in _docker_server():
            request.config.stash[_SERVER_KEY] = server
            yield server
    elif spec:
        server = ExternalZooKeeper(spec)
        request.config.stash[_SERVER_KEY] = server
        yield server
    else:
        with ZooKeeperServer() as server:
            request.config.stash[_SERVER_KEY] = server
            yield server


@pytest.fixture(scope="session")
def zk_ensemble(request: pytest.FixtureRequest) -> Iterator[ZooKeeperEnsemble]:
    """A 3-node ZooKeeper ensemble, started only when a test asks for it: on localhost
    (the launcher), or under ``METAQ_TEST_ZK=docker`` three containers on a Docker network
    (``helpers.zk_docker.ContainerEnsemble``, the same interface)."""
    if os.environ.get("METAQ_TEST_ZK", "").strip() == "docker":
        from helpers.zk_docker import ContainerEnsemble, DockerUnavailable, unavailable, zk_image

        try:
            image = zk_image()
        except DockerUnavailable as e:
            unavailable(f"METAQ_TEST_ZK=docker: {e}")
        ensemble: object = ContainerEnsemble(3, image)
    else:
        ensemble = ZooKeeperEnsemble(3)
    with ensemble as started:  # type: ignore[attr-defined]
        request.config.stash[_ENSEMBLE_KEY] = started
        yield started


@pytest.fixture(scope="session")
def _zk_admin(zk_server: object) -> Iterator[KazooClient]:
    client = KazooClient(hosts=zk_server.hosts, timeout=10.0)  # type: ignore[attr-defined]
    client.start(timeout=30)
    yield client
    client.stop()
    client.close()


def _chroot_for(name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_.")[:60] or "test"
    return f"/t/{safe}-{uuid.uuid4().hex[:6]}"


@pytest.fixture
def zk_connect(request: pytest.FixtureRequest, zk_server: object,
               _zk_admin: KazooClient) -> Iterator[str]:
    """``host:port/<chroot>``: a fresh chroot, created before the test, removed after it."""
    chroot = _chroot_for(request.node.name)
    _zk_admin.ensure_path(chroot)
    yield f"{zk_server.hosts}{chroot}"  # type: ignore[attr-defined]
    try:
        _zk_admin.delete(chroot, recursive=True)
    except Exception:
        pass  # a lingering session's ephemeral node: the chroot is unique anyway


@pytest.fixture
def zk_client(zk_connect: str) -> Iterator[KazooClient]:
    """A started KazooClient on :func:`zk_connect`, stopped after the test."""
    client = KazooClient(hosts=zk_connect, timeout=10.0)
    client.start(timeout=30)
    yield client
    client.stop()
    client.close()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    server = item.config.stash.get(_SERVER_KEY, None)
    item.stash[_LOG_MARK_KEY] = server.log_size() if server is not None else 0  # type: ignore[attr-defined]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    fixtures = getattr(item, "fixturenames", ())
    server = item.config.stash.get(_SERVER_KEY, None)
    if server is not None and "zk_server" in fixtures:
        text = server.read_log(item.stash.get(_LOG_MARK_KEY, 0))  # type: ignore[attr-defined]
        lines = text.splitlines()[-_LOG_LINES:]
        if lines:
            report.sections.append(
                (f"zookeeper log ({report.when}, last {len(lines)} lines since test start)",
                 "\n".join(lines)))
    ensemble = item.config.stash.get(_ENSEMBLE_KEY, None)
    if ensemble is not None and "zk_ensemble" in fixtures:
        report.sections.append((f"zookeeper ensemble logs ({report.when})",
                                ensemble.log_tail(40)))  # type: ignore[attr-defined]


@pytest.fixture
def broker_factory(request: pytest.FixtureRequest, tmp_path) -> Iterator[object]:
    """The one way a test starts brokers: ``broker_factory(topics, broker_id=0,
    zk_connect=None, process=False, data_dir=None, **options)`` starts an in-process broker
    (``process=True``: a ``metaq broker start`` subprocess), data in ``tmp_path``; see
    tests/helpers/brokers.py.  Every one stops after the test, before its chroot goes."""
    from helpers.brokers import BrokerFactory

    if "zk_connect" in request.fixturenames:
        request.getfixturevalue("zk_connect")  # set up first, so torn down after the brokers
    with BrokerFactory(tmp_path) as factory:
        yield factory


@pytest.fixture
def brokers(zk_connect: str, broker_factory) -> object:
    """``brokers(id, {topic: n}, **kw)`` starts a broker process registered on the test's
    chroot (``broker_factory(..., process=True)``, data in ``tmp_path / f"broker{id}"``)."""
    def start(broker_id: int, topics: dict[str, int], **kw: object):  # noqa: ANN202
        return broker_factory(topics, broker_id=broker_id, zk_connect=zk_connect, process=True,
                              **kw)

    return start


# Fixtures whose use means a test needs a real ZooKeeper server / starts broker servers.
_ZK_FIXTURES = frozenset({"zk_server", "zk_ensemble"})
# make_topic: tests/spark/conftest.py
_BROKER_FIXTURES = frozenset({"broker_factory", "brokers", "make_topic"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``zk`` / ``broker`` from each test's fixture closure (see tests/README.md).

    Modules that start ZooKeeper or brokers without these fixtures (through
    ``helpers.procs``, ``helpers.inproc`` or directly) carry a ``pytestmark``.
    """
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & _ZK_FIXTURES and item.get_closest_marker("zk") is None:
            item.add_marker(pytest.mark.zk)
        if fixtures & _BROKER_FIXTURES and item.get_closest_marker("broker") is None:
            item.add_marker(pytest.mark.broker)
