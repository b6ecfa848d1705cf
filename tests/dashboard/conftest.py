"""The dashboard room: ``metaq dashboard`` run as a real subprocess on a free port
against the test's ZooKeeper chroot and real brokers, and a small HTTP client for it.

``dashboard(*args)`` starts one (``--port 0 --sample-interval 0.3`` plus ``args``),
waits for the line saying where it listens, and stops it after the test; its stderr
(the write actions' log lines) is in ``.log()``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from metaq import MessageConsumer, Producer, Rewind
from metaq.testing import wait_until

pytest.importorskip("aiohttp", reason="the dashboard extra (aiohttp) is not installed")

ROOT = Path(__file__).resolve().parents[2]
TOPIC, GROUP = "dash", "g"


class Dash:
    """A running ``metaq dashboard`` process and an HTTP client for it."""

    def __init__(self, zk: str, args: tuple[str, ...], log_path: Path) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        self._log_path = log_path
        self._err = log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "metaq", "dashboard", "--zk", zk, "--port", "0",
             "--sample-interval", "0.3", "--timeout", "3", *args],
            stdout=subprocess.PIPE, stderr=self._err, text=True, env=env)
        self.url = ""
        got: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                got.append(line)

        threading.Thread(target=read, name="dash-stdout", daemon=True).start()
        wait_until(lambda: any("http://" in s for s in got) or self.proc.poll() is not None,
                   timeout=60, what="the dashboard to listen")
        lines = [s for s in got if "http://" in s]
        if not lines:
            raise AssertionError(f"the dashboard did not start: {self.log()}")
        self.url = lines[0].split()[2].rstrip("/")
        self.stdout = got

    def log(self) -> str:
        self._err.flush()
        return self._log_path.read_text()

    def request(self, path: str, *, data: dict[str, Any] | None = None, as_json: bool = False
                ) -> tuple[int, str, str]:
        """(status, content type, body) of a GET, or a POST of ``data`` (a form, or JSON)."""
        body = None
        headers = {}
        if data is not None:
            if as_json:
                body = json.dumps(data).encode()
                headers["Content-Type"] = "application/json"
            else:
                body = urllib.parse.urlencode(data).encode()
                headers["Content-Type"] = "application/x-www-form-urlencoded"
        req = urllib.request.Request(self.url + path, data=body, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, r.headers.get("Content-Type", ""), r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.headers.get("Content-Type", ""), e.read().decode()

    def json(self, path: str, status: int = 200) -> Any:
        code, ctype, body = self.request(path)
        assert code == status, (path, code, body)
        assert ctype.startswith("application/json"), (path, ctype)
        return json.loads(body)

    def page(self, path: str, status: int = 200) -> str:
        code, ctype, body = self.request(path)
        assert code == status, (path, code, body[:2000])
        assert ctype.startswith("text/html"), (path, ctype)
        return body

    def post(self, path: str, data: dict[str, Any], as_json: bool = True
             ) -> tuple[int, Any]:
        code, ctype, body = self.request(path, data=data, as_json=as_json)
        return code, json.loads(body) if ctype.startswith("application/json") else body

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._err.close()


@pytest.fixture
def dashboard(zk_connect, tmp_path):
    """``dashboard(*args)`` starts ``metaq dashboard`` on the test's chroot."""
    started: list[Dash] = []

    def start(*args: str) -> Dash:
        d = Dash(zk_connect, args, tmp_path / f"dashboard{len(started)}.log")
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop()


@pytest.fixture
def cluster(zk_connect, broker_factory):
    """Two broker processes serving ``dash`` (2 partitions each), 40 msgpack messages
    written (dict bodies: the producer's default codec sends them as msgpack)."""
    brokers = [broker_factory({TOPIC: 2}, broker_id=b, zk_connect=zk_connect, process=True,
                              zk_session_timeout=30.0)
               for b in (0, 1)]
    with Producer(zk_connect) as p:
        for f in [p.send_async(TOPIC, {"n": i, "who": "dashboard-test"}) for i in range(40)]:
            f.result(timeout=30)
    return brokers


class Member:
    """A live group member whose handler holds every message until released: its
    partitions stay owned and lagging for as long as the test wants."""

    def __init__(self, zk_connect: str, name: str) -> None:
        self.gate = threading.Event()
        self.consumer = MessageConsumer(GROUP, zk_connect, consumer_id=name, commit_period=0.1)
        self.consumer.subscribe(TOPIC, self._hold)
        self.consumer.start()
        self.id = f"{GROUP}_{name}"

    def _hold(self, message: object) -> None:
        # a message is left for later (Rewind: no failure counted) rather than held
        # for long: a partition busy in a listener could not move in a rebalance
        if not self.gate.wait(0.2):
            raise Rewind()

    def close(self) -> None:
        self.gate.set()
        self.consumer.close()


@pytest.fixture
def members(zk_connect):
    """``members(*names)`` starts held members of group ``g``; all closed after the test."""
    made: list[Member] = []

    def start(*names: str) -> list[Member]:
        new = [Member(zk_connect, n) for n in names]
        made.extend(new)
        return new

    yield start
    for m in made:
        m.close()
