"""One group member in its own process, for static membership tests (kill -9, SIGSTOP).

    python tests/helpers/static_member.py --zk Z --group G --topic T --instance I
        [--grace S] [--session-timeout S] [--consumer-id C]

Prints one JSON object a line (flushed): ``{"ev": "assigned"|"revoked", "p": part}``,
``{"ev": "error", "type": name, "error": text}``, ``{"ev": "state", "state": s}`` on
each change (polled), ``{"ev": "closed"}``.  stdin: ``close`` closes (the member stays
held for its grace), ``leave`` closes with ``leave=True``; end of stdin exits at once.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading

from metaq import MessageConsumer

_out = threading.Lock()


def emit(**ev: object) -> None:
    with _out:
        sys.stdout.write(json.dumps(ev) + "\n")
        sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--zk", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--instance", default=None)
    ap.add_argument("--consumer-id", default=None)
    ap.add_argument("--grace", type=float, default=30.0)
    ap.add_argument("--session-timeout", type=float, default=4.0)
    args = ap.parse_args()
    c = MessageConsumer(
        args.group, args.zk, instance_id=args.instance, consumer_id=args.consumer_id,
        static_grace=args.grace, zk_session_timeout=args.session_timeout,
        commit_period=0.5,
        on_assigned=lambda t, p: emit(ev="assigned", p=p),
        on_revoked=lambda t, p: emit(ev="revoked", p=p),
        on_error=lambda e: emit(ev="error", type=type(e).__name__, error=str(e)))
    c.subscribe(args.topic, lambda m: None)
    stop = threading.Event()

    def states() -> None:
        last = None
        while not stop.wait(0.01):
            s = c.state.value
            if s != last:
                last = s
                emit(ev="state", state=s)

    c.start()
    threading.Thread(target=states, daemon=True, name="static-member-states").start()
    for line in sys.stdin:
        cmd = line.strip()
        if cmd in ("close", "leave"):
            c.close(leave=cmd == "leave")
            stop.set()
            emit(ev="closed")
            return
    stop.set()


if __name__ == "__main__":
    main()
