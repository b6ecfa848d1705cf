"""The real Java Metaq 1.4 broker (``metamorphosis-server``, compiled unmodified) for tests.

::

    from helpers.java_broker import JavaBroker, java_server   # tests/ is on sys.path

    server = java_server()        # pytest.skip, naming what is missing, unless java,
                                  # the server jars and the Debian jars are all there
    with JavaBroker(server, zk_connect, tmp_path / "jb", {"t": 4}) as broker:
        ...                       # registered in ZooKeeper under zk_connect's chroot, /meta
        broker.count("is exceeded,tell the client real max offset")   # lines of its log

The jars are ``../shared/tools/metaq-java-server`` beside the repository (beside the main
checkout when this is a git worktree), or wherever ``$METAQ_JAVA_SERVER`` points; its
README names the Debian packages holding the third-party jars.  A fresh clone has no
``../shared``: every test using this skips then, saying so.

Each broker gets a folder of its own (``conf/server.ini``, ``data/``, ``broker.log``), a
free port, ``updateConsumerOffsets=true`` unless told otherwise (a get past the end is
answered ``301`` with the broker's max offset, as in Metaq's sample configuration), and is
ready when its log says ``Start metamorphosis server successfully``.  Its stdout and
stderr go to ``broker.log``; :meth:`JavaBroker.log_tail` shows the end in assertion
messages and :meth:`JavaBroker.attach_log` adds it to a failing test's report.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.procs import stop_process
from metaq.testing import free_port, wait_until

__all__ = ["JavaServer", "JavaBroker", "java_server", "missing", "missing_debian_jars",
           "shared_tool_dir", "DEBIAN_COMMON_JARS", "DEBIAN_JAVA",
           "READY_LINE", "TELL_MAX_OFFSET"]

REPO = Path(__file__).resolve().parents[2]
DEBIAN_JAVA = Path("/usr/share/java")
SERVER_JARS = ("gecko.jar", "zkclient.jar", "aviator.jar", "commons.jar", "server.jar")
# jar in /usr/share/java -> the Debian package that installs it: what the Java client and
# the Java broker both need (tools/metaq-java*/README.md)
DEBIAN_COMMON_JARS = {
    "commons-lang.jar": "libcommons-lang-java",
    "commons-logging.jar": "libcommons-logging-java",
    "log4j-1.2.jar": "liblog4j1.2-java",
    "jackson-core-asl.jar": "libjackson-json-java",
    "jackson-mapper-asl.jar": "libjackson-json-java",
    "slf4j-api.jar": "libslf4j-java",
    "slf4j-log4j12.jar": "libslf4j-java",
    "hessian.jar": "libhessian-java",
    "zookeeper.jar": "libzookeeper-java",
    "zookeeper-jute.jar": "libzookeeper-java",
}
# ... and what the broker needs besides (the server's README)
DEBIAN_JARS = {
    **DEBIAN_COMMON_JARS,
    "commons-io.jar": "libcommons-io-java",
    "commons-cli.jar": "libcommons-cli-java",
    "ini4j.jar": "libini4j-java",
    "quartz2.jar": "libquartz2-java",
    "protobuf.jar": "libprotobuf-java",
    "commons-beanutils.jar": "libcommons-beanutils-java",
    "commons-collections3.jar": "libcommons-collections3-java",
}
READY_LINE = "Start metamorphosis server successfully"
#: what the broker logs (INFO) each time it answers a get past its max offset with 301
TELL_MAX_OFFSET = "is exceeded,tell the client real max offset"
_STARTUP_TIMEOUT = 60.0  # a JVM on a loaded 2-core machine


def _main_checkout(repo: Path) -> Path:
    """The main checkout of ``repo`` (itself, unless ``repo`` is a ``git worktree``)."""
    try:
        text = (repo / ".git").read_text().strip()
        if not text.startswith("gitdir:"):
            return repo
        gitdir = Path(text[len("gitdir:"):].strip())
        return (gitdir / (gitdir / "commondir").read_text().strip()).resolve().parent
    except OSError:  # .git is a directory (a plain clone), or not there at all
        return repo


def shared_tool_dir(env: str, name: str) -> Path:
    """``$<env>``, else ``../shared/tools/<name>`` beside the repository (or beside the
    main checkout of this worktree): where the Java Metaq tools are."""
    given = os.environ.get(env, "").strip()
    if given:
        return Path(given)
    candidates = [repo.parent / "shared" / "tools" / name
                  for repo in dict.fromkeys((REPO, _main_checkout(REPO)))]
    return next((c for c in candidates if c.is_dir()), candidates[0])


def server_dir() -> Path:
    """``$METAQ_JAVA_SERVER``, else ``../shared/tools/metaq-java-server``."""
    return shared_tool_dir("METAQ_JAVA_SERVER", "metaq-java-server")


@dataclass(frozen=True)
class JavaServer:
    """How to run the Java broker: java, its class path and its log4j configuration."""

    java: str
    classpath: str
    log4j: Path


def missing() -> list[str]:
    """What is missing to run the Java broker here (empty: nothing)."""
    out: list[str] = []
    if shutil.which("java") is None:
        out.append("java (a JRE 17) on PATH")
    folder = server_dir()
    absent = [j for j in (*SERVER_JARS, "log4j.properties") if not (folder / j).is_file()]
    if absent:
        out.append(f"the Metaq server jars {', '.join(absent)} in {folder} (set "
                   f"METAQ_JAVA_SERVER to the folder holding them; see its README.md)")
    absent = missing_debian_jars(DEBIAN_JARS)
    if absent:
        out.append(absent)
    return out


def missing_debian_jars(jars: Mapping[str, str]) -> str | None:
    """Which of ``jars`` (jar -> Debian package) are not in /usr/share/java, and the
    ``apt-get`` line that installs them; None when all are there."""
    absent = [j for j in jars if not (DEBIAN_JAVA / j).is_file()]
    if not absent:
        return None
    packages = sorted({jars[j] for j in absent})
    return (f"{', '.join(str(DEBIAN_JAVA / j) for j in absent)} "
            f"(apt-get install -y {' '.join(packages)})")


def java_server() -> JavaServer:
    """The Java broker's command parts; skips the calling test, naming what is missing."""
    absent = missing()
    if absent:
        pytest.skip("the real Java Metaq broker needs " + "; ".join(absent))
    folder = server_dir()
    jars = [DEBIAN_JAVA / j for j in DEBIAN_JARS] + [folder / j for j in SERVER_JARS]
    java = shutil.which("java")
    assert java is not None
    return JavaServer(java=java, classpath=os.pathsep.join(map(str, jars)),
                      log4j=folder / "log4j.properties")


class JavaBroker:
    """One Java broker process (see the module doc); a context manager that stops it."""

    def __init__(self, server: JavaServer, zk_connect: str, folder: str | os.PathLike,
                 topics: Mapping[str, int], *, broker_id: int = 0, port: int | None = None,
                 zk_root: str = "/meta", update_consumer_offsets: bool = True,
                 system: Mapping[str, object] | None = None) -> None:
        self.server = server
        self.zk_connect = zk_connect
        self.folder = Path(folder).resolve()
        self.topics = dict(topics)
        self.broker_id = broker_id
        self.port = port or free_port()
        self.zk_root = zk_root
        self.config_path = self.folder / "conf" / "server.ini"  # absolute, in its own folder
        self.data_dir = self.folder / "data"
        self.log_path = self.folder / "broker.log"
        self.system: dict[str, object] = {
            "brokerId": broker_id, "hostName": "127.0.0.1", "numPartitions": 1,
            "serverPort": self.port, "dataPath": self.data_dir,
            "unflushThreshold": 0, "unflushInterval": 10000,
            "maxSegmentSize": 1073741824, "maxTransferSize": 1048576,
            "deletePolicy": "delete,168", "deleteWhen": "0 0 6,18 * * ?",
            "flushTxLogAtCommit": 1, "stat": "true",
            "updateConsumerOffsets": "true" if update_consumer_offsets else "false",
            **(system or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self._log_mark = 0

    def server_ini(self) -> str:
        lines = ["[system]", *(f"{k}={v}" for k, v in self.system.items()), "",
                 "[zookeeper]", f"zk.zkConnect={self.zk_connect}", f"zk.zkRoot={self.zk_root}",
                 "zk.zkSessionTimeoutMs=10000", "zk.zkConnectionTimeoutMs=30000",
                 "zk.zkSyncTimeMs=5000", ""]
        for topic, n in self.topics.items():
            lines += [f"[topic={topic}]", f"numPartitions={n}", ""]
        return "\n".join(lines)

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, timeout: float = _STARTUP_TIMEOUT) -> JavaBroker:
        """Start it and wait (with a deadline) for its ready line."""
        if self.alive:
            raise RuntimeError(f"Java broker {self.broker_id} is already running")
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.server_ini())
        argv = [self.server.java, "-Xmx256m", "-cp", self.server.classpath,
                f"-Dlog4j.configuration=file:{self.server.log4j}",
                "com.taobao.metamorphosis.server.MetamorphosisStartup",
                "-f", str(self.config_path)]
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n=== {' '.join(argv)}\n".encode())
            logf.flush()
            self._log_mark = logf.tell()
            self.proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.folder)
        try:
            wait_until(self._ready, timeout, 0.05,
                       what=f"the Java broker to log {READY_LINE!r} ({self.log_path})")
        except BaseException:
            self.kill()
            raise
        return self

    def _ready(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"the Java broker exited with {self.proc.returncode} while "
                                 f"starting:\n{self.log_tail()}")
        return READY_LINE in self.log_text()

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM (its shutdown hook unregisters it), SIGKILL after ``timeout``."""
        return stop_process(self.proc, timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> JavaBroker:
        return self.start() if not self.alive else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- its log ---------------------------------------------------------------------------

    def log_text(self) -> str:
        """Its log since the last start."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_mark)
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_text()
        return "\n".join(text.splitlines()[-lines:]) if text else "(no log)"

    def count(self, text: str) -> int:
        """Lines of its log (since the last start) that contain ``text``."""
        return sum(text in line for line in self.log_text().splitlines())

    @contextmanager
    def attach_log(self, request: pytest.FixtureRequest, lines: int = 200) -> Iterator[None]:
        """Inside it, a failure adds the end of the broker's log to the test's report."""
        try:
            yield
        except BaseException:
            request.node.add_report_section("call", f"java broker log (last {lines} lines)",
                                            self.log_tail(lines))
            raise
