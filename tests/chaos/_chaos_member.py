"""One member of the chaos suite's consumer group, run as a subprocess.

``python _chaos_member.py --zk HOSTS/CHROOT --group G --topic T --id ID ...``
or, for a static member (issue 15), ``... --instance ID --static-grace S`` (its
consumer id is ``<group>_<ID>`` either way: a slot keeps its id as static member).

A :class:`metaq.MessageConsumer` that writes one line per event to stdout
(line-flushed; every line starts with a kind letter and ``time.time()``, the
wall clock every process on the machine shares)::

    M <t> <partition> <offset> <msgId> <body>   a message handed to the listener
    A <t> <partition> <session>                 partition claimed (on_assigned)
    R <t> <partition> <session>                 partition released (on_revoked)
    Z <t> <STATE> <session>                     ZooKeeper connection state change
    D <t> <partition> <offset> <next offset>    damaged bytes reported and skipped
    O <t> <partition> <action>                  a position outside the log, reset
    I <t> <error>                               refused: another live process has
                                                this instance id (DuplicateInstanceError)
    E <t> <error>                               any other background error
    T <t> <count> <names>                       threads other than main left after close
    X <t> <exit code>                           clean exit

``metaq consume --print`` writes only the ``M`` lines; the audit also needs the
claim boundaries and session changes, so the suite runs this instead.  The
consumer is configured like the CLI would configure it.  SIGTERM closes it
cleanly (commit, release, unregister), then the thread census is printed.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time

from kazoo.client import KazooClient
from kazoo.exceptions import KazooException

from metaq import (
    DamagedMessageError,
    DuplicateInstanceError,
    MessageConsumer,
    OffsetOutOfRangeError,
)

_out = sys.stdout.buffer
_lock = threading.Lock()


def emit(kind: str, *fields: object) -> None:
    line = f"{kind} {time.time():.6f} " + " ".join(str(f) for f in fields) + "\n"
    with _lock:
        _out.write(line.encode("utf-8", "replace"))
        _out.flush()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--zk", required=True)
    p.add_argument("--group", required=True)
    p.add_argument("--topic", required=True)
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--id", help="a dynamic member's consumer id suffix")
    who.add_argument("--instance", help="a static member's instance id")
    p.add_argument("--static-grace", type=float, default=30.0)
    p.add_argument("--session-timeout", type=float, default=3.0)
    p.add_argument("--commit-period", type=float, default=0.5)
    p.add_argument("--fetch-runners", type=int, default=2)
    p.add_argument("--max-size", type=int, default=2048)
    p.add_argument("--max-fetch-delay", type=float, default=1.0)
    p.add_argument("--sigstop-on-assign", action="store_true",
                   help="SIGSTOP this process in on_assigned of the first claim: a freeze "
                        "after the claim, before fetching starts (for reproductions)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(created).3f %(levelname)s %(threadName)s %(name)s: %(message)s")

    client = KazooClient(hosts=args.zk, timeout=args.session_timeout)

    def session() -> str:
        cid = client.client_id
        return "-" if cid is None else f"{cid[0]:x}"

    def on_state(state: str) -> None:  # kazoo's event thread: print only, never block
        emit("Z", state, session())

    def listener(m) -> None:  # noqa: ANN001
        body = m.raw_body.replace(b"\n", b"\\n").decode("utf-8", "replace")
        with _lock:
            _out.write(b"M %.6f %s %d %d %s\n" % (time.time(), m.partition.encode(), m.offset,
                                                   m.msg_id, body.encode()))
            _out.flush()

    froze = threading.Event()

    def on_assigned(part: str) -> None:
        emit("A", part, session())
        if args.sigstop_on_assign and not froze.is_set():
            froze.set()
            os.kill(os.getpid(), signal.SIGSTOP)

    def on_error(e: BaseException) -> None:
        if isinstance(e, DamagedMessageError):
            emit("D", e.partition, e.offset, e.next_offset)
        elif isinstance(e, OffsetOutOfRangeError):
            emit("O", e.partition, e.action)
        elif isinstance(e, DuplicateInstanceError):
            emit("I", repr(e).replace("\n", " "))
        else:
            emit("E", repr(e).replace("\n", " "))

    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    client.add_listener(on_state)
    deadline = time.monotonic() + 60.0
    while True:  # a (re)start during a leader election: kazoo's chroot check can see a
        try:     # ConnectionLoss; ask again, as a supervisor would restart the process
            client.start(timeout=30)
            break
        except KazooException:
            if time.monotonic() > deadline:
                raise
            done_waiting = threading.Event()
            done_waiting.wait(0.2)  # between attempts, not a synchronisation
    emit("Z", "STARTED", session())
    identity = ({"consumer_id": args.id} if args.instance is None else
                {"instance_id": args.instance, "static_grace": args.static_grace})
    consumer = MessageConsumer(
        args.group, client, **identity, zk_session_timeout=args.session_timeout,
        commit_period=args.commit_period, fetch_runner_count=args.fetch_runners,
        max_fetch_delay=args.max_fetch_delay,
        on_error=on_error,
        on_assigned=lambda t, part: on_assigned(part),
        on_revoked=lambda t, part: emit("R", part, session()))
    with consumer:
        consumer.subscribe(args.topic, listener, max_size=args.max_size)
        consumer.start()
        while not done.wait(0.5):
            pass
    client.remove_listener(on_state)
    client.stop()
    client.close()
    deadline = time.monotonic() + 10.0
    while True:  # threads end asynchronously after close(): wait for them, bounded
        others = [t for t in threading.enumerate() if t is not threading.main_thread()]
        if not others or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    emit("T", len(others), ",".join(sorted(t.name for t in others)) or "-")
    emit("X", 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
