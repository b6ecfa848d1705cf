"""A real ZooKeeper server (``QuorumPeerMain`` in its own JVM) run from Python.

The files it keeps in its data dir are listed in :mod:`metaq._zk._state`.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path

from kazoo.client import KazooClient

from metaq._errors import ConfigError, LauncherError
from metaq._zk._classpath import find_java, find_zookeeper_classpath
from metaq._zk._process import (
    four_letter_word,
    free_port,
    port_is_free,
    read_pidfile,
    server_mode,
    stop_pid,
)
from metaq._zk._state import (
    CONFIG_FILE,
    HOST,
    LOG_FILE,
    OUT_FILE,
    PID_FILE,
    ZooKeeperConfig,
    read_client_port,
    status,
)

__all__ = ["ZooKeeperServer"]

log = logging.getLogger(__name__)

MAIN_CLASS = "org.apache.zookeeper.server.quorum.QuorumPeerMain"


def _tied_to_this_process() -> list[str]:
    """A prefix that makes the JVM die with this process, even when this process is
    killed with SIGKILL and runs no ``atexit`` (a test run, a script): util-linux's
    ``setpriv --pdeathsig KILL`` sets the parent-death signal, then runs the JVM in its
    place.  Linux only, and only from the main thread: the signal comes when the
    *thread* that started the child ends.  Elsewhere: nothing (the ``atexit`` stop and
    the pid file are what is left)."""
    if not sys.platform.startswith("linux") \
            or threading.current_thread() is not threading.main_thread():
        return []
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--"] if setpriv else []


def _log4j2_properties(log_path: Path) -> str:
    return "\n".join([
        "status = warn",
        "appender.file.type = File",
        "appender.file.name = FILE",
        f"appender.file.fileName = {log_path}",
        "appender.file.append = true",
        "appender.file.immediateFlush = true",
        "appender.file.layout.type = PatternLayout",
        "appender.file.layout.pattern = %d{ISO8601} [myid:%X{myid}] %-5p [%t] %c{1}@%L - %m%n",
        "rootLogger.level = INFO",
        "rootLogger.appenderRef.file.ref = FILE",
        "",
    ])


def _stop_at_exit(ref: weakref.ref[ZooKeeperServer]) -> None:
    server = ref()
    if server is not None and server.pid is not None:
        try:
            server.stop()
        except Exception:  # pragma: no cover - best effort at interpreter exit
            log.exception("stopping ZooKeeper at exit failed")


class ZooKeeperServer:
    """One ZooKeeper server in its own JVM, serving clients on ``127.0.0.1:port``.

    ``port`` None picks a free port (kept across restarts).  ``data_dir`` None uses a fresh
    temporary dir, removed by :meth:`stop`; a given data dir is kept.  ``stop_at_exit``
    stops the JVM when the Python process exits (the CLI turns it off to leave the server
    running).  ``quorum`` and ``server_id`` are set by :class:`ZooKeeperEnsemble`.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(
        self,
        port: int | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        config: ZooKeeperConfig | None = None,
        java: str | os.PathLike[str] | None = None,
        classpath: list[Path] | None = None,
        stop_at_exit: bool = True,
        quorum: list[tuple[int, int, int, int]] | None = None,
        server_id: int | None = None,
    ) -> None:
        if port is not None and (not isinstance(port, int) or not 0 < port < 65536):
            raise ConfigError(f"port must be an int in 1..65535, got {port!r}")
        if (quorum is None) != (server_id is None):
            raise ConfigError("quorum and server_id go together")
        self.config = config or ZooKeeperConfig()
        self._fixed_port = port is not None
        self._port = port
        self._owns_dir = data_dir is None
        self._data_dir = None if data_dir is None else Path(data_dir).expanduser().resolve()
        self._java = Path(java) if java is not None else None
        self._classpath = classpath
        self._quorum = quorum
        self._server_id = server_id
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_name = LOG_FILE  # OUT_FILE when the classpath logs with slf4j-simple
        self._stop_at_exit = stop_at_exit
        if stop_at_exit:
            atexit.register(_stop_at_exit, weakref.ref(self))

    # -- properties -------------------------------------------------------------------
    @property
    def port(self) -> int:
        if self._port is None:
            raise LauncherError("the server has no port yet: start() it first")
        return self._port

    @property
    def hosts(self) -> str:
        """The connect string ``127.0.0.1:PORT``."""
        return f"{HOST}:{self.port}"

    @property
    def data_dir(self) -> Path:
        if self._data_dir is None:
            raise LauncherError("the server has no data dir yet: start() it first")
        return self._data_dir

    @property
    def log_path(self) -> Path:
        """The server's log: ``zookeeper.log`` with log4j 2 on the classpath; with
        slf4j-simple (Debian's jars) the server logs to stderr, kept in the JVM's output."""
        return self.data_dir / self._log_name

    @property
    def pid(self) -> int | None:
        """Pid of the running JVM, None when stopped."""
        if self._proc is None or self._proc.poll() is not None:
            return None
        return self._proc.pid

    def __repr__(self) -> str:
        return f"ZooKeeperServer(port={self._port}, data_dir={self._data_dir}, pid={self.pid})"

    # -- logs -------------------------------------------------------------------------
    def log_size(self) -> int:
        """Current size of the log file: pass it to :meth:`read_log` to read what came after."""
        try:
            return self.log_path.stat().st_size
        except (OSError, LauncherError):
            return 0

    def read_log(self, since: int = 0) -> str:
        """The log from byte ``since`` on (empty when there is no log)."""
        try:
            with self.log_path.open("rb") as f:
                f.seek(since)
                return f.read().decode("utf-8", "replace")
        except (OSError, LauncherError):
            return ""

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the log and of the JVM's stdout/stderr."""
        parts = []
        for name in dict.fromkeys((self._log_name, OUT_FILE)):
            try:
                text = (self.data_dir / name).read_text(errors="replace")
            except (OSError, LauncherError):
                continue
            if text.strip():
                tail = "\n".join(text.splitlines()[-lines:])
                parts.append(f"--- {self.data_dir / name} (last {lines} lines) ---\n{tail}")
        return "\n".join(parts) or "(no server output)"

    # -- lifecycle --------------------------------------------------------------------
    def __enter__(self) -> ZooKeeperServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, *, wait: bool = True) -> ZooKeeperServer:
        """Launch the JVM and (``wait``) return once the server serves a client."""
        if self.pid is not None:
            raise LauncherError(f"ZooKeeper already running: pid {self.pid} on {self.hosts}")
        java = self._java or find_java()
        classpath = self._classpath or find_zookeeper_classpath()
        if self._data_dir is None:
            self._data_dir = Path(tempfile.mkdtemp(prefix="metaq-zk-")).resolve()
        self._data_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_in_data_dir(java, classpath, wait)
        except BaseException:
            self._kill_quietly()
            if self._owns_dir and self._data_dir is not None:
                shutil.rmtree(self._data_dir, ignore_errors=True)
                self._data_dir = None
            raise
        return self

    def _start_in_data_dir(self, java: Path, classpath: list[Path], wait: bool) -> None:
        current = status(self.data_dir)
        if current.running:
            raise LauncherError(
                f"a ZooKeeper server already runs on data dir {self.data_dir}: "
                f"pid {current.pid}, {current.hosts}")
        if not self._fixed_port and self._port is None:
            # Restarting on an old data dir: keep its port (and so its connect string) if free.
            previous = read_client_port(self.data_dir / CONFIG_FILE)
            if previous and port_is_free(previous):
                self._port = previous
        attempts = 1 if self._fixed_port else 3
        for attempt in range(1, attempts + 1):
            if not self._fixed_port and (self._port is None or attempt > 1):
                self._port = free_port()
            if not port_is_free(self.port):
                if attempt < attempts:
                    continue
                raise LauncherError(f"port {self.port} on {HOST} is already in use")
            self._launch(java, classpath)
            if not wait:
                return
            try:
                self.wait_serving(self.config.start_timeout)
                return
            except _PortTaken:
                self._kill_quietly()
                if attempt == attempts:
                    raise LauncherError(
                        f"port {self.port} was taken while ZooKeeper started:\n"
                        f"{self.log_tail()}") from None

    def _write_config(self) -> Path:
        d = self.data_dir
        (d / "data").mkdir(exist_ok=True)
        c = self.config
        lines = [
            f"tickTime={c.tick_time_ms}",
            f"initLimit={c.init_limit}",
            f"syncLimit={c.sync_limit}",
            f"dataDir={d / 'data'}",
            f"clientPort={self.port}",
            f"clientPortAddress={HOST}",
            f"minSessionTimeout={c.min_session_timeout_ms}",
            f"maxSessionTimeout={c.max_session_timeout_ms}",
            "admin.enableServer=false",
            "4lw.commands.whitelist=*",
            "maxClientCnxns=0",
            f"forceSync={'yes' if c.force_sync else 'no'}",
        ]
        if self._quorum is not None:
            (d / "data" / "myid").write_text(f"{self._server_id}\n")
            lines.append("standaloneEnabled=false")
            lines.extend(f"server.{sid}={HOST}:{q}:{e}" for sid, _, q, e in self._quorum)
        path = d / CONFIG_FILE
        path.write_text("\n".join(lines) + "\n")
        (d / "log4j2.properties").write_text(_log4j2_properties(d / LOG_FILE))
        return path

    def _launch(self, java: Path, classpath: list[Path]) -> None:
        config_path = self._write_config()
        d = self.data_dir
        props = d / "log4j2.properties"
        cmd = [
            str(java),
            f"-Xmx{self.config.heap_mb}m", "-Xms16m", "-Xss512k",
            "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-XX:-UsePerfData",
            "-Djava.net.preferIPv4Stack=true",
            f"-Dlog4j2.configurationFile={props}", f"-Dlog4j.configurationFile={props}",
            f"-Dzookeeper.log.dir={d}",
            "-Dzookeeper.admin.enableServer=false",
            "-Dzookeeper.4lw.commands.whitelist=*",
            "-Dzookeeper.jmx.log4j.disable=true",
            "-cp", os.pathsep.join(str(p) for p in classpath),
            MAIN_CLASS, str(config_path),
        ]
        if self._stop_at_exit:
            cmd = _tied_to_this_process() + cmd
        log.info("starting ZooKeeper on %s:%d, data dir %s", HOST, self.port, d)
        log.debug("command: %s", cmd)
        self._log_name = (LOG_FILE if any(p.name.startswith("log4j-core") for p in classpath)
                          else OUT_FILE)
        with (d / OUT_FILE).open("ab") as out:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                cwd=d, start_new_session=True, close_fds=True,
            )
        (d / PID_FILE).write_text(f"{self._proc.pid}\n")

    def wait_serving(self, timeout: float) -> None:
        """Block until the server answers ``ruok``, ``srvr`` and a kazoo session, or ``timeout``.

        Raises :class:`LauncherError` with the log tail if the JVM exits or the deadline passes.
        """
        deadline = time.monotonic() + timeout
        delay = 0.02
        last = "no answer yet"
        expected_dir = str(self.data_dir / "data")
        while True:
            proc = self._proc
            if proc is None or proc.poll() is not None:
                code = None if proc is None else proc.returncode
                tail = self.log_tail()
                if "Address already in use" in tail and not self._fixed_port:
                    raise _PortTaken()
                raise LauncherError(
                    f"ZooKeeper exited early (exit code {code}) on port {self.port}, "
                    f"data dir {self.data_dir}:\n{tail}")
            try:
                if four_letter_word(HOST, self.port, "ruok", timeout=1.0).strip() != "imok":
                    raise OSError("ruok not answered imok")
                if server_mode(HOST, self.port, timeout=1.0) is None:
                    raise OSError("srvr: not currently serving requests")
                conf = four_letter_word(HOST, self.port, "conf", timeout=1.0)
                if "dataDir=" not in conf:
                    raise OSError("conf: not currently serving requests")
                if expected_dir not in conf:
                    raise LauncherError(
                        f"port {self.port} is served by another ZooKeeper (its conf: "
                        f"{conf.strip()[:200]!r})")
                self._kazoo_probe(min(5.0, max(0.5, deadline - time.monotonic())))
                log.info("ZooKeeper serving on %s (pid %d)", self.hosts, proc.pid)
                return
            except (OSError, _ProbeFailed) as e:
                last = str(e) or type(e).__name__
            if time.monotonic() >= deadline:
                raise LauncherError(
                    f"ZooKeeper on port {self.port} did not serve within {timeout:.0f}s "
                    f"(last: {last}):\n{self.log_tail()}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.25)

    def _kazoo_probe(self, timeout: float) -> None:
        client = KazooClient(hosts=self.hosts, timeout=max(timeout, 1.0))
        try:
            client.start(timeout=timeout)
            client.exists("/")
        except Exception as e:
            raise _ProbeFailed(f"kazoo could not connect: {e!r}") from e
        finally:
            try:
                client.stop()
                client.close()
            except Exception:  # pragma: no cover - best effort
                pass

    def _kill_quietly(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            try:
                stop_pid(self._proc.pid, timeout=2.0)
            except LauncherError:  # pragma: no cover
                pass
        if self._proc is not None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:  # pragma: no cover
                pass
        self._remove_own_pidfile()

    def _remove_own_pidfile(self) -> None:
        """Remove the pid file if it names our JVM (never another server's)."""
        if self._data_dir is None or self._proc is None:
            return
        path = self._data_dir / PID_FILE
        if read_pidfile(path) == self._proc.pid:
            path.unlink(missing_ok=True)

    def stop(self, *, clean: bool | None = None) -> None:
        """Stop the JVM (SIGTERM, then SIGKILL after ``config.stop_timeout``).

        ``clean`` removes the data dir; it defaults to True for a temporary data dir only.
        """
        proc = self._proc
        if proc is not None:
            if proc.poll() is None:
                stop_pid(proc.pid, timeout=self.config.stop_timeout)
            try:
                proc.wait(timeout=self.config.stop_timeout)
            except subprocess.TimeoutExpired:  # pragma: no cover - stop_pid killed it
                pass
            log.info("ZooKeeper on port %s stopped (exit code %s)", self._port, proc.returncode)
        self._remove_own_pidfile()
        if clean is None:
            clean = self._owns_dir
        if clean and self._data_dir is not None:
            shutil.rmtree(self._data_dir, ignore_errors=True)
            if self._owns_dir:
                self._data_dir = None


class _PortTaken(Exception):
    pass


class _ProbeFailed(Exception):
    pass
