"""The embedded ZooKeeper launcher: jar/java discovery, Python API and the ``metaq zk`` CLI."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kazoo.client import KazooClient

import metaq
from metaq._zk import (
    PYSPARK_JAR_PREFIXES,
    ZooKeeperConfig,
    ZooKeeperServer,
    find_java,
    find_zookeeper_classpath,
    four_letter_word,
    status,
    stop,
)
from metaq._zk._process import pid_alive
from metaq.testing import free_port, wait_until

pytestmark = pytest.mark.zk


def _metaq_cmd() -> list[str]:
    script = Path(sys.executable).parent / "metaq"
    return [str(script)] if script.exists() else [sys.executable, "-m", "metaq"]


def _cli(*args: str, env: dict[str, str] | None = None,
         timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*_metaq_cmd(), *args], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def _touch(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


# -- discovery ----------------------------------------------------------------------

def test_classpath_from_pyspark_wheel_has_one_jar_per_prefix() -> None:
    jars = find_zookeeper_classpath(zookeeper_home=None, debian_java_dir=None)
    names = [j.name for j in jars]
    assert len(jars) == len(PYSPARK_JAR_PREFIXES)
    assert all(j.is_file() and j.parent.name == "jars" for j in jars)
    assert any(n.startswith("zookeeper-3.") for n in names), names
    assert any(n.startswith("zookeeper-jute-") for n in names), names
    assert any(n.startswith("snappy-java-") for n in names), names


def test_classpath_picks_by_prefix_not_version(tmp_path: Path) -> None:
    for prefix in PYSPARK_JAR_PREFIXES:
        _touch(tmp_path / f"{prefix}-7.1.2.jar")
    _touch(tmp_path / "zookeeper-3.1.0.jar")  # an older one lying around: the highest wins
    _touch(tmp_path / "unrelated-1.0.jar")
    jars = find_zookeeper_classpath(zookeeper_home=None, debian_java_dir=None,
                                    pyspark_jars=tmp_path)
    assert [j.name for j in jars] == [f"{p}-7.1.2.jar" for p in PYSPARK_JAR_PREFIXES]


def test_classpath_from_zookeeper_home_wins(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "apache-zookeeper-3.9.9-bin"
    main = _touch(home / "lib" / "zookeeper-3.9.9.jar")
    dep = _touch(home / "lib" / "netty-handler-4.1.jar")
    monkeypatch.setenv("ZOOKEEPER_HOME", str(home))
    assert find_zookeeper_classpath() == [dep, main]


def test_classpath_from_debian_layout(tmp_path: Path) -> None:
    for name in ("zookeeper.jar", "zookeeper-jute.jar", "slf4j-simple.jar", "other.jar"):
        _touch(tmp_path / name)
    jars = find_zookeeper_classpath(zookeeper_home=None, debian_java_dir=tmp_path,
                                    pyspark_jars=None)
    assert [j.name for j in jars] == ["zookeeper.jar", "zookeeper-jute.jar", "slf4j-simple.jar"]


def test_missing_jars_names_all_three_places(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    empty_home = tmp_path / "zkhome"
    empty_home.mkdir()
    monkeypatch.setenv("ZOOKEEPER_HOME", str(empty_home))
    with pytest.raises(metaq.ZooKeeperJarsNotFoundError) as err:
        find_zookeeper_classpath(debian_java_dir=tmp_path / "usr-share-java",
                                 pyspark_jars=tmp_path / "no-pyspark")
    text = str(err.value)
    assert str(empty_home) in text
    assert "Debian" in text and "zookeeper.jar" in text
    assert "pyspark" in text
    assert isinstance(err.value, metaq.LauncherError)


def test_missing_jars_when_pyspark_not_installed(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZOOKEEPER_HOME", raising=False)
    with pytest.raises(metaq.ZooKeeperJarsNotFoundError, match="pyspark is not installed"):
        find_zookeeper_classpath(debian_java_dir=tmp_path, pyspark_jars=None)


def test_java_from_java_home_then_path(tmp_path: Path) -> None:
    fake = tmp_path / "jdk" / "bin" / "java"
    _touch(fake).chmod(0o755)
    assert find_java({"JAVA_HOME": str(tmp_path / "jdk"), "PATH": ""}) == fake
    on_path = find_java({"JAVA_HOME": str(tmp_path / "nojdk"), "PATH": str(fake.parent)})
    assert on_path == fake


def test_java_missing_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(metaq.JavaNotFoundError, match="JAVA_HOME"):
        find_java({"JAVA_HOME": str(tmp_path), "PATH": str(tmp_path)})
    monkeypatch.setenv("JAVA_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(metaq.JavaNotFoundError):
        ZooKeeperServer().start()


def test_cli_reports_missing_java(tmp_path: Path) -> None:
    env = {**os.environ, "JAVA_HOME": str(tmp_path / "nojdk"), "PATH": str(tmp_path)}
    result = _cli("zk", "start", "--data-dir", str(tmp_path / "zk"), env=env)
    assert result.returncode == 1, result
    assert "no java executable" in result.stderr
    assert result.stdout == ""


# -- Python API ---------------------------------------------------------------------

def test_config_is_validated() -> None:
    with pytest.raises(metaq.ConfigError, match="tick_time_ms"):
        ZooKeeperConfig(tick_time_ms=0)
    with pytest.raises(metaq.ConfigError, match="min_session_timeout_ms"):
        ZooKeeperConfig(min_session_timeout_ms=5000, max_session_timeout_ms=4000)
    with pytest.raises(metaq.ConfigError, match="port"):
        ZooKeeperServer(port=70000)


def test_server_start_status_stop_and_restart(tmp_path: Path) -> None:
    data_dir = tmp_path / "zk"
    server = ZooKeeperServer(data_dir=data_dir)
    with server:
        st = status(data_dir)
        assert st.running and st.serving and st.mode == "standalone"
        assert st.pid == server.pid and st.hosts == server.hosts
        assert (data_dir / "zookeeper.pid").read_text().strip() == str(server.pid)
        assert four_letter_word("127.0.0.1", server.port, "ruok") == "imok"
        client = KazooClient(hosts=server.hosts)
        client.start(timeout=10)
        client.create("/kept", b"v1")
        client.stop()
        with pytest.raises(metaq.LauncherError, match="already running"):
            server.start()
        with pytest.raises(metaq.LauncherError, match="already runs on data dir"):
            ZooKeeperServer(data_dir=data_dir).start()
        pid, port = server.pid, server.port
    assert server.pid is None and not pid_alive(pid)
    st = status(data_dir)
    assert not st.running and st.pid is None and not st.serving
    assert not (data_dir / "zookeeper.pid").exists()
    assert "QuorumPeerMain" in server.log_path.read_text() or server.log_path.stat().st_size > 0

    # Restart on the kept data dir: same port, the data is still there.
    with ZooKeeperServer(data_dir=data_dir) as again:
        assert again.port == port
        client = KazooClient(hosts=again.hosts)
        client.start(timeout=10)
        assert client.get("/kept")[0] == b"v1"
        client.stop()


def test_temporary_data_dir_is_removed() -> None:
    with ZooKeeperServer() as server:
        data_dir = server.data_dir
        assert data_dir.is_dir()
    assert not data_dir.exists()


def test_port_in_use_is_an_error() -> None:
    with ZooKeeperServer() as server, pytest.raises(metaq.LauncherError, match="in use"):
        ZooKeeperServer(port=server.port).start()


def test_jvm_exiting_early_raises_with_log_tail(tmp_path: Path) -> None:
    # without the server's own jar (zookeeper-3.9.x.jar from pyspark, Debian's zookeeper.jar)
    jars = [j for j in find_zookeeper_classpath()
            if not re.fullmatch(r"zookeeper(-3[\d.]*)?\.jar", j.name)]
    server = ZooKeeperServer(data_dir=tmp_path, classpath=jars)
    with pytest.raises(metaq.LauncherError, match="exited early") as err:
        server.start()
    assert "QuorumPeerMain" in str(err.value)  # java: could not find or load main class
    assert server.pid is None and not (tmp_path / "zookeeper.pid").exists()


# -- the metaq zk CLI ---------------------------------------------------------------

def test_cli_start_survives_exit_status_stop(tmp_path: Path) -> None:
    data_dir = tmp_path / "zk"
    port = free_port()
    started = _cli("zk", "start", "--port", str(port), "--data-dir", str(data_dir))
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip().splitlines()[-1] == f"127.0.0.1:{port}"
    try:
        # The CLI process has exited; the server must still serve.
        st = status(data_dir)
        assert st.running and st.serving and st.port == port
        client = KazooClient(hosts=f"127.0.0.1:{port}")
        client.start(timeout=10)
        client.ensure_path("/cli")
        client.stop()

        shown = _cli("zk", "status", "--data-dir", str(data_dir))
        assert shown.returncode == 0
        assert f"127.0.0.1:{port}" in shown.stdout and str(st.pid) in shown.stdout

        twice = _cli("zk", "start", "--data-dir", str(data_dir))
        assert twice.returncode == 0
        assert twice.stdout.strip().splitlines()[-1] == f"127.0.0.1:{port}"
        assert "already running" in twice.stderr
        assert status(data_dir).pid == st.pid

        other_port = _cli("zk", "start", "--port", str(free_port()), "--data-dir", str(data_dir))
        assert other_port.returncode == 2 and "already runs" in other_port.stderr
    finally:
        stopped = _cli("zk", "stop", "--data-dir", str(data_dir))
    assert stopped.returncode == 0 and "stopped" in stopped.stdout
    wait_until(lambda: not pid_alive(st.pid), timeout=10, what="the server's JVM to exit")
    after = _cli("zk", "status", "--data-dir", str(data_dir))
    assert after.returncode == 1 and "not running" in after.stdout
    again = _cli("zk", "stop", "--data-dir", str(data_dir))
    assert again.returncode == 0 and "not running" in again.stdout


def test_cli_default_data_dir_follows_xdg_state_home(tmp_path: Path) -> None:
    env = {**os.environ, "XDG_STATE_HOME": str(tmp_path)}
    env.pop("METAQ_ZK_DATA_DIR", None)
    result = _cli("zk", "status", env=env)
    assert result.returncode == 1
    assert str(tmp_path / "metaq" / "zk") in result.stdout
    helped = _cli("zk", "start", "--help", env=env)
    assert "XDG_STATE_HOME" in helped.stdout and "~/.local/state/metaq/zk" in helped.stdout


def test_cli_rejects_bad_port(tmp_path: Path) -> None:
    result = _cli("zk", "start", "--port", "99999", "--data-dir", str(tmp_path))
    assert result.returncode == 2
    assert "port must be in 1..65535" in result.stderr


def test_status_ignores_a_stale_or_foreign_pid_file(tmp_path: Path) -> None:
    (tmp_path / "zoo.cfg").write_text("clientPort=2\n")
    (tmp_path / "zookeeper.pid").write_text(f"{os.getpid()}\n")  # alive, but not ZooKeeper
    st = status(tmp_path)
    assert not st.running and st.pid is None and st.port == 2
    assert not stop(tmp_path, timeout=1.0)  # must not signal that process
    assert pid_alive(os.getpid())
    (tmp_path / "zookeeper.pid").write_text("garbage\n")
    assert not status(tmp_path).running



ORPHAN_SCRIPT = """
import signal, sys
from metaq._zk import ZooKeeperServer
zk = ZooKeeperServer(data_dir=sys.argv[1]).start()
print(zk.pid, flush=True)
signal.pause()  # until the test kills it
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("setpriv") is None,
                    reason="the parent-death signal needs Linux and util-linux's setpriv")
def test_the_jvm_dies_with_a_process_killed_with_sigkill(tmp_path: Path) -> None:
    """A script that started a server and is killed with SIGKILL (no atexit runs) leaves
    no ZooKeeper JVM behind."""
    import signal

    proc = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT, str(tmp_path / "zk")],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = proc.stdout.readline()  # printed once the server serves
        assert line.strip().isdigit(), line
        jvm = int(line)
        assert pid_alive(jvm)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        wait_until(lambda: not pid_alive(jvm), timeout=30,
                   what="the JVM of a server whose process was killed to go")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
