"""The chaos suite's moving parts: group member processes and the producer loop.

- :class:`Member`: one slot of the consumer group (a fixed consumer id) run as
  ``_chaos_member.py`` subprocesses, one *incarnation* per start.  It talks to
  the ZooKeeper ensemble only through its own :class:`ZkProxy` per ensemble
  node, so :meth:`Member.block_zk` blackholes all of its ZooKeeper traffic and
  its session really expires on the server.  A reader thread parses its
  stdout into :class:`Event` records.  A static slot (``static_grace``) runs with
  ``--instance`` and keeps that instance id across incarnations;
  :meth:`Member.start_duplicate` runs a second process of a static slot (same
  instance id) beside the live one, which must be refused.
- :class:`ProducerLoop`: a thread sending ``seq-<n>`` bodies at a steady rate
  and recording, per sequence number, the acknowledged (partition, offset);
  ``idempotent`` (replicated runs): an idempotent producer that keeps retrying
  on the same partition through a failover (within 20 s).
- :func:`child_pids`: live children of this process (leak check).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from metaq import Producer
from metaq.testing import ZkProxy

MEMBER_SCRIPT = Path(__file__).with_name("_chaos_member.py")


@dataclass(frozen=True, slots=True)
class Event:
    """One line of a member's output.  ``who`` is ``<slot>#<incarnation>``, or
    ``<slot>#d<n>`` for the n-th duplicate process of a static slot."""

    kind: str          # M, A, R, Z, D, O, I, E, T, X (see _chaos_member.py)
    t: float           # the member's time.time() when it happened
    who: str
    slot: int
    part: str = ""     # M/A/R/D/O
    offset: int = -1   # M; D: where the damaged bytes start
    body: str = ""     # M; the state for Z; D: the next offset; O: the action; I/E/T/X: text
    session: str = ""  # A/R/Z


def _parse(line: str, who: str, slot: int) -> Event:
    kind, t, rest = (line.split(" ", 2) + ["", ""])[:3]
    ts = float(t)
    if kind == "M":
        part, offset, _msg_id, body = rest.split(" ", 3)
        return Event(kind, ts, who, slot, part=part, offset=int(offset), body=body)
    if kind in ("A", "R"):
        part, session = rest.split(" ", 1)
        return Event(kind, ts, who, slot, part=part, session=session)
    if kind == "Z":
        state, session = rest.split(" ", 1)
        return Event(kind, ts, who, slot, body=state, session=session)
    if kind == "D":
        part, offset, nxt = rest.split(" ", 2)
        return Event(kind, ts, who, slot, part=part, offset=int(offset), body=nxt)
    if kind == "O":
        part, action = rest.split(" ", 1)
        return Event(kind, ts, who, slot, part=part, body=action)
    return Event(kind, ts, who, slot, body=rest)


def is_duplicate(who: str) -> bool:
    """Whether ``who`` names a duplicate process (``<slot>#d<n>``)."""
    return who.split("#", 1)[-1].startswith("d")


def _pump(proc: subprocess.Popen[bytes], who: str, slot: int, sink: list[Event],
          lock: threading.Lock) -> None:
    """Parse a member process's stdout into ``sink`` until it ends."""
    assert proc.stdout is not None
    with proc.stdout:
        for raw in proc.stdout:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            try:
                event = _parse(line, who, slot)
            except (ValueError, IndexError):
                event = Event("?", time.time(), who, slot, body=line)
            with lock:
                sink.append(event)


class Member:
    """One consumer-id slot of the group; see the module doc."""

    def __init__(self, slot: int, *, group: str, topic: str, node_hosts: list[str],
                 chroot: str, log_dir: Path, session_timeout: float, commit_period: float,
                 max_size: int, sink: list[Event], sink_lock: threading.Lock,
                 static_grace: float | None = None, extra: tuple[str, ...] = ()) -> None:
        """``static_grace``: run as a static member (instance id ``c<slot>``, so the
        consumer id is the same as a dynamic slot's) with this grace."""
        self.slot = slot
        self.name = f"c{slot}"
        self.consumer_id = f"{group}_{self.name}"
        self.static_grace = static_grace
        self.proxies = [ZkProxy(h) for h in node_hosts]
        zk = ",".join(p.hosts for p in self.proxies) + chroot
        identity = (["--id", self.name] if static_grace is None else
                    ["--instance", self.name, "--static-grace", str(static_grace)])
        self.args = [sys.executable, str(MEMBER_SCRIPT), "--zk", zk, "--group", group,
                     "--topic", topic, *identity,
                     "--session-timeout", str(session_timeout),
                     "--commit-period", str(commit_period), "--max-size", str(max_size),
                     *extra]
        self.log_path = log_dir / f"member-{self.name}.log"
        self.incarnation = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.reader: threading.Thread | None = None
        self.stopped_pid: int | None = None  # SIGSTOPped and not yet resumed
        self.duplicates = 0
        self.duplicate: subprocess.Popen[bytes] | None = None  # the running one, if any
        self._dup_reader: threading.Thread | None = None
        self._sink = sink
        self._sink_lock = sink_lock

    @property
    def who(self) -> str:
        return f"{self.slot}#{self.incarnation}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        assert not self.alive, f"{self.name} is already running"
        self.incarnation += 1
        with open(self.log_path, "ab") as err:
            err.write(f"\n=== {self.who} {time.time():.6f}\n".encode())
            err.flush()
            self.proc = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=err,
                                         stdin=subprocess.DEVNULL)
        self.reader = threading.Thread(
            target=_pump, args=(self.proc, self.who, self.slot, self._sink, self._sink_lock),
            name=f"chaos-reader-{self.who}", daemon=True)
        self.reader.start()

    def start_duplicate(self) -> str:
        """Start a second process with this static slot's arguments (its instance id,
        through its proxies) beside the live one; returns its ``who`` (``<slot>#d<n>``)."""
        assert self.static_grace is not None, f"{self.name} is not a static member"
        assert self.duplicate is None or self.duplicate.poll() is not None
        self.duplicates += 1
        who = f"{self.slot}#d{self.duplicates}"
        with open(self.log_path, "ab") as err:
            err.write(f"\n=== {who} (duplicate) {time.time():.6f}\n".encode())
            err.flush()
            self.duplicate = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=err,
                                              stdin=subprocess.DEVNULL)
        self._dup_reader = threading.Thread(
            target=_pump, args=(self.duplicate, who, self.slot, self._sink, self._sink_lock),
            name=f"chaos-reader-{who}", daemon=True)
        self._dup_reader.start()
        return who

    def stop_duplicate(self, timeout: float = 30.0) -> int | None:
        """SIGTERM the duplicate (SIGKILL after ``timeout``); its exit code, or None
        when none was started."""
        proc, self.duplicate = self.duplicate, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
            code = -9
        if self._dup_reader is not None:
            self._dup_reader.join(30)
            assert not self._dup_reader.is_alive(), "reader of a duplicate did not end"
        return code

    def _join_reader(self) -> None:
        if self.reader is not None:
            self.reader.join(30)
            assert not self.reader.is_alive(), f"reader of {self.who} did not end"

    def kill(self) -> None:
        """SIGKILL, as a crash (a stopped process dies too)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self.stopped_pid = None
        self._join_reader()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM (resumed first when stopped); SIGKILL after ``timeout``."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.resume()
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            code = -9
        self._join_reader()
        return code

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        self.stopped_pid = self.proc.pid

    def stopped_by_itself(self) -> bool:
        """True when the process is in the stopped state (it SIGSTOPped itself)."""
        assert self.proc is not None
        try:
            with open(f"/proc/{self.proc.pid}/stat", "rb") as f:
                state = f.read().decode("ascii", "replace").rsplit(")", 1)[-1].split()[0]
        except OSError:
            return False
        if state == "T":
            self.stopped_pid = self.proc.pid
            return True
        return False

    def resume(self) -> None:
        if self.proc is not None and self.stopped_pid == self.proc.pid and self.alive:
            self.proc.send_signal(signal.SIGCONT)
        self.stopped_pid = None

    def block_zk(self) -> None:
        for p in self.proxies:
            p.pause()

    def unblock_zk(self) -> None:
        for p in self.proxies:
            p.resume()

    def close(self) -> None:
        """Never raises: resume, stop (a duplicate too), close the proxies."""
        self.unblock_zk()
        try:
            self.stop_duplicate(30)
        except Exception:  # noqa: BLE001 - last resort
            pass
        if self.alive:
            try:
                self.stop(30)
            except Exception:  # noqa: BLE001 - last resort
                if self.proc is not None:
                    self.proc.kill()
        for p in self.proxies:
            p.close()

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text("utf-8", "replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])


class ProducerLoop:
    """Send ``seq-<n>`` at ``rate`` messages/s in batches; record acks and failures."""

    def __init__(self, zk_connect: str, topic: str, rate: float, batch: int = 10, *,
                 idempotent: bool = False) -> None:
        self.topic = topic
        self.acked: dict[int, tuple[str, int]] = {}   # seq -> (partition, offset)
        self.failed: dict[int, str] = {}              # seq -> error
        self.sent = 0
        self._rate = rate
        self._batch = batch
        self._stop = threading.Event()
        self._lock = threading.Lock()
        # idempotent: a resent put whose answer was lost (its broker died, or was replaced)
        # is stored once; retries wait for the partition's broker id to have a master
        options = dict(idempotent=True, send_timeout=20.0, retries=100,
                       retry_backoff=0.1) if idempotent else {}
        self.producer = Producer(zk_connect, zk_session_timeout=10.0, **options)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="chaos-producer", daemon=True)

    def start(self) -> ProducerLoop:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            period = self._batch / self._rate
            next_at = time.monotonic()
            while not self._stop.is_set():
                seqs = range(self.sent, self.sent + self._batch)
                futures = [(s, self.producer.send_async(self.topic, b"seq-%d" % s))
                           for s in seqs]
                self.sent += self._batch
                for s, f in futures:
                    try:
                        r = f.result(timeout=30)
                    except Exception as e:  # noqa: BLE001 - a failed send is data here
                        with self._lock:
                            self.failed[s] = repr(e)
                    else:
                        with self._lock:
                            self.acked[s] = (r.partition, r.offset)
                next_at += period
                self._stop.wait(max(0.0, next_at - time.monotonic()))  # pacing, not sync
        except BaseException as e:  # noqa: BLE001 - reported by stop()
            self.error = e

    def acked_count(self) -> int:
        with self._lock:
            return len(self.acked)

    def stop(self) -> None:
        """Stop sending, wait for the last batch, close the producer (idempotent)."""
        if self._stop.is_set() and not self._thread.is_alive():
            return
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(60)
        assert not self._thread.is_alive(), "producer loop did not stop"
        self.producer.close()
        if self.error is not None:
            raise AssertionError(f"producer loop died: {self.error!r}") from self.error


def child_pids() -> set[int]:
    """Pids of this process's live (not zombie) children, from /proc."""
    me = os.getpid()
    out: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == me and fields[0] != "Z":
            out.add(int(entry))
    return out
