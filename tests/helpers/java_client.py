"""The real Metaq 1.4 Java client's interop programs (``tests/interop/java/``): compiled
once per session against the client jars of ``../shared/tools/metaq-java`` (or
``$METAQ_JAVA_CLIENT``) and the Debian jars its README names, and run as processes whose
stdout lines the tests wait on (``JavaProc``).  The session fixture ``java_client`` and the
per-test ``java`` runner are in ``tests/interop/conftest.py``."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers.java_broker import (
    DEBIAN_COMMON_JARS,
    DEBIAN_JAVA,
    missing_debian_jars,
    shared_tool_dir,
)
from metaq.testing import wait_until

__all__ = ["JavaClient", "JavaProc", "JavaRunner", "compile_java_client", "RUN_TIMEOUT"]

JAVA_SRC = Path(__file__).resolve().parents[1] / "interop" / "java"
CLIENT_JARS = ("meta.jar", "gecko.jar", "zkclient.jar")
# jar in /usr/share/java -> the Debian package that installs it (tools/metaq-java/README.md)
DEBIAN_JARS = {
    **DEBIAN_COMMON_JARS,
    "spring3-beans.jar": "libspring-beans-java",
    "spring3-core.jar": "libspring-beans-java",  # libspring-core-java, its dependency
}
RUN_TIMEOUT = 25.0        # one Java program, JVM start included


def _client_dir() -> Path:
    """``$METAQ_JAVA_CLIENT``, else ``../shared/tools/metaq-java``."""
    return shared_tool_dir("METAQ_JAVA_CLIENT", "metaq-java")


@dataclass(frozen=True)
class JavaClient:
    """The compiled interop programs and how to run them."""

    java: str
    classpath: str     # client jars, Debian jars and the compiled programs
    log4j: Path

    def argv(self, program: str, *args: str) -> list[str]:
        return [self.java, f"-Dlog4j.configuration=file:{self.log4j}", "-Xshare:auto",
                "-cp", self.classpath, program, *args]


class JavaProc:
    """One Java program: its stdout lines collected by a thread, stderr to a file."""

    def __init__(self, argv: list[str], name: str, log_dir: Path) -> None:
        self.name = name
        self.stderr_path = log_dir / f"{name}.stderr"
        self.lines: list[str] = []
        self._lock = threading.Lock()
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err)
        self._reader = threading.Thread(target=self._read, daemon=True, name=f"java-{name}")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            with self._lock:
                self.lines.append(raw.decode("utf-8", "replace").rstrip("\r\n"))

    def output(self) -> list[str]:
        with self._lock:
            return list(self.lines)

    def _ended(self) -> bool:
        return self.proc.poll() is not None and not self._reader.is_alive()

    def wait_line(self, prefix: str, timeout: float = RUN_TIMEOUT) -> str:
        """The first stdout line starting with ``prefix``; fails at once if the program
        ends without printing it."""
        def found() -> str | None:
            ended = self._ended()   # before reading the lines: no line can come after
            for line in self.output():
                if line.startswith(prefix):
                    return line
            if ended:
                raise AssertionError(f"{self.name} ended without a {prefix!r} line\n"
                                     f"{self.describe()}")
            return None
        return wait_until(found, timeout, 0.02,  # type: ignore[return-value]
                          what=f"{self.name} to print {prefix!r}\n{self.describe()}")

    def proceed(self) -> None:
        """Answer an ``AWAITING`` line (the program reads one line from stdin)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = RUN_TIMEOUT) -> int:
        """Wait for the exit (killing it after ``timeout``); the exit code."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} still running after {timeout:g}s\n"
                                 f"{self.describe()}") from None
        self._reader.join(10)
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                f.close()

    def describe(self) -> str:
        try:
            err = self.stderr_path.read_text("utf-8", "replace").splitlines()[-40:]
        except OSError:
            err = []
        return (f"--- {self.name} (exit {self.proc.poll()}) stdout:\n" + "\n".join(self.output())
                + f"\n--- stderr (last lines, {self.stderr_path}):\n" + "\n".join(err))


class JavaRunner:
    """Starts the interop programs for one test; every one is killed at its end."""

    def __init__(self, client: JavaClient, zk_connect: str, log_dir: Path) -> None:
        self.client = client
        self.zk_connect = zk_connect
        self.log_dir = log_dir
        self.procs: list[JavaProc] = []

    def start(self, program: str, *args: str) -> JavaProc:
        name = f"{len(self.procs):02d}-{program}"
        proc = JavaProc(self.client.argv(program, self.zk_connect, *args), name, self.log_dir)
        self.procs.append(proc)
        return proc

    def run(self, program: str, *args: str, expect_rc: int | None = 0,
            timeout: float = RUN_TIMEOUT) -> JavaProc:
        """Start, wait for the exit; checks the exit code unless ``expect_rc`` is None."""
        proc = self.start(program, *args)
        rc = proc.finish(timeout)
        if expect_rc is not None:
            assert rc == expect_rc, f"{program} exited {rc}, not {expect_rc}\n{proc.describe()}"
        return proc

    def close(self) -> None:
        for p in self.procs:
            p.kill()


def compile_java_client(tmp_path_factory: pytest.TempPathFactory) -> JavaClient:
    """Skip unless javac, java, the client jars and the Debian jars are all there;
    compile the programs once per session."""
    missing: list[str] = []
    javac, java = shutil.which("javac"), shutil.which("java")
    if javac is None or java is None:
        missing.append("javac/java (a JDK 17) on PATH")
    client = _client_dir()
    absent = [j for j in CLIENT_JARS if not (client / j).is_file()]
    if absent:
        missing.append(f"the Metaq Java client jars {', '.join(absent)} in {client} "
                       "(set METAQ_JAVA_CLIENT to the folder holding meta.jar, gecko.jar, "
                       "zkclient.jar)")
    debian = missing_debian_jars(DEBIAN_JARS)
    if debian:
        missing.append(debian)
    if missing:
        pytest.skip("Java interop tests need " + "; ".join(missing))
    jars = [client / j for j in CLIENT_JARS] + [DEBIAN_JAVA / j for j in DEBIAN_JARS]
    out = tmp_path_factory.mktemp("metaq-java-classes")
    sources = sorted(JAVA_SRC.glob("*.java"))
    proc = subprocess.run([javac, "-encoding", "UTF-8", "-nowarn", "-Xlint:-path",
                           "-cp", os.pathsep.join(map(str, jars)), "-d", str(out),
                           *map(str, sources)],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        pytest.fail(f"javac failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return JavaClient(java=java,  # type: ignore[arg-type]
                      classpath=os.pathsep.join([*map(str, jars), str(out)]),
                      log4j=JAVA_SRC / "log4j.properties")


