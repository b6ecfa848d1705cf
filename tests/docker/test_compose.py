"""docker/compose.yaml brought up for real: ZooKeeper, two brokers, the one-shot producer
and the consumer group of three, each test in its own Compose project.

- messages flow end to end: the producer's acknowledged count is what the group's
  three members consume, and its committed offsets reach the log ends;
- a broker container killed (SIGKILL) while a producer is sending and then restarted
  loses no acknowledged message: each is in its log and read back by a fresh group;
- ``down -v`` leaves no container, volume (named or anonymous) or network behind.

Every read of the topology (``metaq group describe --json``, ``metaq topic describe
--json``) runs inside one of its containers.  Skipped, saying what is missing, without
a Docker engine, without Compose (``docker-compose``, or ``docker compose``) or without
the images (``python docker/prepare.py images`` builds them with no registry).  Never
builds: ``up --no-build``.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from metaq.testing import WaitTimeout, wait_until

pytestmark = pytest.mark.docker

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker" / "compose.yaml"
GROUP = "orders-service"
TOPIC = "orders"
MEMBERS = {f"{GROUP}_consumer{i}" for i in (1, 2, 3)}
LONG_RUNNING = ("zookeeper", "broker0", "broker1", "consumer1", "consumer2", "consumer3")
PROJECT_LABEL = "com.docker.compose.project"
ACKED = re.compile(r"^acknowledged (\d+) of (\d+) messages$", re.M)

T = TypeVar("T")


# -- what this machine has -------------------------------------------------------------------
def _quiet(*cmd: str, timeout: float = 30) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None


def _compose_command() -> list[str]:
    """docker-compose (v1, Debian's), else the v2 plugin; skip naming what is missing."""
    if shutil.which("docker") is None:
        pytest.skip("no docker command line on PATH (and so no Docker engine to talk to)")
    info = _quiet("docker", "info", "--format", "{{.ServerVersion}}")
    if info is None or info.returncode != 0:
        why = "timed out" if info is None else (info.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"no Docker engine is reachable (`docker info`: {why}); "
                    "`python docker/prepare.py engine` starts one where it can")
    for cmd in (["docker-compose"], ["docker", "compose"]):
        if shutil.which(cmd[0]) is None:
            continue
        r = _quiet(*cmd, "version")
        if r is not None and r.returncode == 0:
            break
    else:
        pytest.skip("no Docker Compose: neither `docker-compose` (Debian: apt-get install "
                    "docker-compose) nor the `docker compose` plugin answers `version`")
    images = [os.environ.get("METAQ_IMAGE") or "metaq-py:test",
              os.environ.get("METAQ_ZK_IMAGE") or "metaq-zookeeper:test"]
    missing = [i for i in images
               if (r := _quiet("docker", "image", "inspect", i)) is None or r.returncode != 0]
    if missing:
        pytest.skip(f"image(s) {', '.join(missing)} missing: build them with "
                    "`python docker/prepare.py images` (works with no registry)")
    return cmd


@pytest.fixture(scope="module")
def compose_cmd() -> list[str]:
    return _compose_command()


# -- one Compose project ---------------------------------------------------------------------
def wait_for(what: str, check: Callable[[], T | None], timeout: float,
             explain: Callable[[], str] = lambda: "", every: float = 0.5) -> T:
    """Poll ``check`` (``metaq.testing.wait_until``) until it returns something other
    than None or False (0 counts); fail at the deadline saying what was awaited (and
    ``explain()``)."""
    found: list[T] = []

    def got() -> bool:
        value = check()
        if value is not None and value is not False:
            found.append(value)
            return True
        return False

    try:
        wait_until(got, timeout, interval=every, what=what)
    except WaitTimeout:
        try:
            more = explain()
        except (Exception, pytest.fail.Exception) as e:  # noqa: BLE001
            more = f"(diagnostics failed: {e})"
        pytest.fail(f"timed out after {timeout:g}s waiting for {what}\n{more}")
    return found[0]


class Topology:
    def __init__(self, cmd: list[str], project: str, env: dict[str, str]) -> None:
        self.cmd = cmd
        self.project = project
        self.env = {**os.environ, **env}
        self.produce_count = int(env["METAQ_PRODUCE_COUNT"])

    # compose and docker
    def compose_args(self, *args: str) -> list[str]:
        return [*self.cmd, "-f", str(COMPOSE_FILE), "-p", self.project, *args]

    def compose(self, *args: str, timeout: float = 120, check: bool = True
                ) -> subprocess.CompletedProcess:
        r = subprocess.run(self.compose_args(*args), capture_output=True, text=True,
                           env=self.env, cwd=ROOT, timeout=timeout)
        if check and r.returncode != 0:
            pytest.fail(f"{' '.join(r.args)} exited {r.returncode}:\n{r.stdout}{r.stderr}"
                        f"\n{self.explain()}")
        return r

    def popen(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(self.compose_args(*args), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=self.env, cwd=ROOT)

    @staticmethod
    def docker(*args: str, timeout: float = 60) -> str:
        r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            raise RuntimeError(f"docker {' '.join(args)}: {r.stderr.strip()}")
        return r.stdout

    def label(self) -> str:
        return f"label={PROJECT_LABEL}={self.project}"

    def container(self, service: str) -> str:
        ids = self.docker("ps", "-aq", "--no-trunc", "--filter", self.label(), "--filter",
                          f"label=com.docker.compose.service={service}", "--filter",
                          "label=com.docker.compose.oneoff=False").split()
        assert len(ids) == 1, f"{service}: containers {ids}"
        return ids[0]

    def state(self, service: str) -> dict[str, Any]:
        return json.loads(self.docker("inspect", "-f", "{{json .State}}",
                                      self.container(service)))

    def logs(self, service: str, tail: str = "all") -> str:
        r = subprocess.run(["docker", "logs", "--tail", tail, self.container(service)],
                           capture_output=True, text=True, timeout=60)
        return r.stdout + r.stderr

    def explain(self) -> str:
        """What each container is doing, and the end of its log (for failure messages)."""
        out = []
        try:
            out.append(self.compose("ps", check=False, timeout=30).stdout)
            for service in (*LONG_RUNNING, "producer"):
                out.append(f"--- {service} (last lines)\n{self.logs(service, '15')}")
        except Exception as e:  # noqa: BLE001 - a diagnostic must not hide the failure
            out.append(f"(diagnostics failed: {e})")
        return "\n".join(out)

    # waiting
    def up(self) -> None:
        self.compose("up", "-d", "--no-build", timeout=180)

    def wait_healthy(self, *services: str, timeout: float = 90,
                     started_after: dict[str, str] | None = None) -> None:
        def healthy() -> bool:
            for s in services:
                st = self.state(s)
                if started_after and st["StartedAt"] == started_after.get(s):
                    return False
                if not st["Running"] or st.get("Health", {}).get("Status") != "healthy":
                    return False
            return True
        wait_for(f"{', '.join(services)} healthy", healthy, timeout, self.explain)

    def wait_exited(self, service: str, timeout: float = 90) -> int:
        st = wait_for(f"{service} to exit", lambda: (s := self.state(service))["Status"]
                      == "exited" and s, timeout, self.explain)
        return st["ExitCode"]

    # metaq inside the topology (broker1: never killed here)
    def metaq_json(self, *args: str, check: bool = True) -> Any:
        """``metaq ARGS --json`` run in broker1; None on failure when not ``check``."""
        r = self.compose("exec", "-T", "broker1", "metaq", *args, "--zk", "zookeeper:2181",
                         "--json", timeout=60, check=check)
        return json.loads(r.stdout) if r.returncode == 0 else None

    def group(self, check: bool = True) -> dict[str, Any] | None:
        return self.metaq_json("group", "describe", GROUP, check=check)

    def log_ends(self) -> dict[str, dict[str, Any]]:
        return {p["partition"]: p for p in self.metaq_json("topic", "describe",
                                                           TOPIC)["partitions"]}


class Lines:
    """A process's stdout lines, read on a thread so a deadline applies to each wait."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.q: queue.Queue[str | None] = queue.Queue()
        self.stderr = ""
        threading.Thread(target=self._pump, daemon=True).start()
        threading.Thread(target=self._err, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.q.put(line.rstrip("\n"))
        self.q.put(None)

    def _err(self) -> None:
        self.stderr = self.proc.stderr.read()

    def until(self, what: str, done: Callable[[str], bool], timeout: float,
              explain: Callable[[], str] = lambda: "") -> None:
        """Feed each line to ``done`` until it says True; fail at the deadline or EOF."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"timed out after {timeout:g}s waiting for {what}: {explain()}")
            if line is None:
                self.proc.wait(timeout=30)
                pytest.fail(f"output ended (exit {self.proc.returncode}) before {what}: "
                            f"{explain()}\n{self.stderr}")
            if done(line):
                return

    def rest(self, timeout: float) -> list[str]:
        """Every remaining line, once the process has exited."""
        self.proc.wait(timeout=timeout)
        out = []
        while (line := self.q.get(timeout=30)) is not None:
            out.append(line)
        return out


@pytest.fixture
def topology(compose_cmd: list[str]) -> Iterator[Topology]:
    project = "metaqtest" + uuid.uuid4().hex[:8]
    topo = Topology(compose_cmd, project, {"METAQ_PRODUCE_COUNT": "20000"})
    try:
        topo.up()
        yield topo
    finally:
        topo.compose("down", "-v", "--remove-orphans", "-t", "10", check=False, timeout=180)


def _consumed(logs: str) -> int:
    return sum(int(n) for n in re.findall(r"^consumed (\d+) messages$", logs, re.M))


# -- the tests -------------------------------------------------------------------------------
def test_messages_flow_from_the_producer_to_the_group_of_three(topology: Topology) -> None:
    t = topology
    assert t.wait_exited("producer") == 0, t.logs("producer")
    acked = ACKED.findall(t.logs("producer"))
    assert acked == [(str(t.produce_count), str(t.produce_count))], t.logs("producer")
    t.wait_healthy(*LONG_RUNNING)

    def caught_up() -> dict[str, Any] | None:
        g = t.group(check=False)
        if g is None:
            return None
        parts = g["partitions"]
        done = (set(g["members"]) == MEMBERS and len(parts) == 8
                and {p["owner"] for p in parts} == MEMBERS  # each member has a share
                and all(p["log_end"] is not None and p["committed"] == p["log_end"]
                        for p in parts))
        return g if done else None

    group = wait_for("the group's 3 members, each owning partitions, to commit every "
                     "partition at its log end", caught_up, 60,
                     lambda: json.dumps(t.group(), indent=1))
    assert {m["state"] for m in group["member_states"]} == {"live"}
    assert group["status"] == "ok" and group["total_lag"] == 0
    # every partition got messages; the bytes are the acknowledged messages' and no more:
    # all of one size (20-byte header + the generated 100-byte body)
    sizes = [p["log_end"] - p["log_start"] for p in group["partitions"]]
    assert min(sizes) > 0 and sum(sizes) == t.produce_count * 120, sizes
    # a clean stop commits, leaves the group and prints how many each member consumed
    t.compose("stop", "-t", "20", "consumer1", "consumer2", "consumer3")
    counts = {s: _consumed(t.logs(s)) for s in ("consumer1", "consumer2", "consumer3")}
    for s in counts:
        assert t.state(s)["ExitCode"] == 0, t.logs(s)
    assert sum(counts.values()) >= t.produce_count, counts  # at least once, all of them
    print(f"{t.produce_count} acknowledged; consumed by member: {counts}")
    assert t.metaq_json("group", "describe", GROUP)["members"] == []


def test_a_killed_broker_loses_no_acknowledged_message(topology: Topology) -> None:
    t = topology
    assert t.wait_exited("producer") == 0, t.logs("producer")
    t.wait_healthy(*LONG_RUNNING)
    before = t.state("broker0")
    # a second producer, each acknowledgement printed ("<partition> <offset> <msgId>");
    # broker0 is killed once it has acknowledged 1000 of them, the producer still sending
    count = 150_000
    prod = Lines(t.popen("run", "--rm", "--no-deps", "-T", "--name", f"{t.project}_produce",
                         "producer", "produce", "--zk", "zookeeper:2181", "--topic", TOPIC,
                         "--count", str(count), "--max-in-flight", "32", "--print"))
    acks: list[str] = []
    on_broker0 = 0

    def note(line: str) -> bool:
        nonlocal on_broker0
        acks.append(line)
        on_broker0 += line.startswith("0-")
        return on_broker0 >= 1000

    prod.until("broker0 to acknowledge 1000 messages", note, 90)
    t.docker("kill", t.container("broker0"))  # SIGKILL
    acked_before_kill = len(acks)  # as far as read: the output comes in 8 KB blocks
    lines = prod.rest(timeout=120)
    summary = ACKED.findall("\n".join(lines[-1:]))
    acks += lines[:-1]
    assert summary and int(summary[0][1]) == count, prod.stderr + "\n".join(lines[-3:])
    assert int(summary[0][0]) == len(acks), "acknowledged count != lines printed"
    assert prod.proc.returncode in (0, 1), prod.stderr  # 1: some sends failed, not acked
    assert t.state("broker0")["ExitCode"] == 137
    acked = {}
    for line in acks:
        part, offset, msg_id = line.split()
        acked[(part, int(offset))] = int(msg_id)
    assert len(acked) == len(acks), "two acknowledgements for one position"
    on0 = sum(p.startswith("0-") for p, _ in acked)
    # round robin would have given broker0 half: it died while the producer was sending
    assert 1000 <= on0 < count // 2, on0
    print(f"broker0 killed after {acked_before_kill} acknowledgements; in all {len(acked)} "
          f"of {count} acknowledged, {on0} by broker0; producer exit {prod.proc.returncode}")

    t.compose("start", "broker0")
    # healthy by its own word: registered again, after its predecessor's session expired
    t.wait_healthy("broker0", timeout=60, started_after={"broker0": before["StartedAt"]})
    ends = t.log_ends()
    assert set(ends) == {f"{b}-{i}" for b in (0, 1) for i in range(4)}
    for (part, offset), _ in acked.items():
        end = ends[part]["log_end"]
        assert end is not None and offset + 120 <= end, (part, offset, ends[part])
    assert all(p["damaged"] == 0 for p in ends.values()), ends

    # read everything back with a fresh group: every acknowledged message, same msgId
    total = t.produce_count + len(acked)
    reader = Lines(t.popen("run", "--rm", "--no-deps", "-T", "--name", f"{t.project}_read",
                           "producer", "consume", "--zk", "zookeeper:2181", "--group",
                           "verify", "--topic", TOPIC, "--print"))
    seen: dict[tuple[str, int], int] = {}
    missing = set(acked)

    def read(line: str) -> bool:
        part, offset, msg_id, _body = line.split(" ", 3)
        key = (part, int(offset))
        seen[key] = int(msg_id)
        missing.discard(key)
        return not missing and len(seen) >= total

    try:
        reader.until(f"all {len(acked)} acknowledged messages read back", read, 90,
                     lambda: f"{len(missing)} not read, e.g. {sorted(missing)[:5]}; "
                             f"{len(seen)} read of at least {total}")
    finally:
        _quiet("docker", "stop", "-t", "20", f"{t.project}_read")  # SIGTERM: a clean close
    reader.rest(timeout=60)
    assert all(seen[k] == v for k, v in acked.items())
    print(f"read back {len(seen)} messages, all {len(acked)} acknowledged among them")

    # and the group of three, through the kill, consumes it all too
    def caught_up() -> bool:
        g = t.group(check=False)
        return g is not None and (set(g["members"]) == MEMBERS and len(g["partitions"]) == 8
                and all(p["committed"] == p["log_end"] for p in g["partitions"]))

    wait_for("the group to commit every partition at its log end after the restart",
             caught_up, 90, lambda: json.dumps(t.group(), indent=1))


def test_down_v_leaves_nothing_behind(topology: Topology) -> None:
    t = topology
    t.wait_healthy(*LONG_RUNNING)
    assert t.wait_exited("producer") == 0, t.logs("producer")
    # a one-off container too, like the admin commands a user runs
    t.compose("run", "--rm", "--no-deps", "-T", "producer", "topic", "list",
              "--zk", "zookeeper:2181")
    ids = t.docker("ps", "-aq", "--no-trunc", "--filter", t.label()).split()
    assert len(ids) == 7, ids  # 6 services and the producer; the run --rm one is gone
    volumes = {m["Name"]
               for line in t.docker("inspect", "-f", "{{json .Mounts}}", *ids).splitlines()
               for m in json.loads(line) if m["Type"] == "volume"}
    named = {f"{t.project}_{v}" for v in ("zookeeper", "broker0", "broker1")}
    assert named <= volumes
    assert len(volumes) > len(named)  # the anonymous ones of the image's VOLUME too
    networks = t.docker("network", "ls", "-q", "--filter", t.label()).split()
    assert networks

    t.compose("down", "-v", "--remove-orphans", "-t", "10", timeout=180)
    assert t.docker("ps", "-aq", "--filter", t.label()).split() == []
    assert t.docker("volume", "ls", "-q", "--filter", t.label()).split() == []
    left = set(t.docker("volume", "ls", "-q").split()) & volumes
    assert not left, f"volumes left behind: {left}"
    assert t.docker("network", "ls", "-q", "--filter", t.label()).split() == []
    left = [n for n in networks if (r := _quiet("docker", "network", "inspect", n)) is None
            or r.returncode == 0]
    assert not left, f"networks left behind: {left}"
