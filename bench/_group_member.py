"""One process of bench_group_scale.py: a few MessageConsumers of one group, driven over stdin.

Commands on stdin, one JSON object a line:
``{"cmd": "start", "ids": ["m0", ...]}`` starts members (one after the other),
``{"cmd": "close", "id": "m3"}`` closes one gracefully, ``{"cmd": "restart", "id": "m3"}``
closes it and starts it again (``restarted`` reported once started), ``{"cmd": "exit"}``
closes all and exits.  End of stdin (the parent gone) exits at once without closing anything.

Reports on stdout, one JSON object a line, each with ``t`` = ``time.time()``:
``action`` (just before a start/close call), ``started`` (with ``cid``, the consumer id as
written into owner nodes), ``assigned`` / ``revoked`` (from the consumer's callbacks, with
``p`` = partition), ``state`` (a change of ``consumer.state``, polled every 2 ms), ``closed``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time

from metaq import MessageConsumer

_out = threading.Lock()


def emit(**ev: object) -> None:
    ev.setdefault("t", time.time())
    line = json.dumps(ev) + "\n"
    with _out:
        sys.stdout.write(line)
        sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--zk", required=True)
    ap.add_argument("--group", default="g")
    ap.add_argument("--topic", default="bench")
    ap.add_argument("--strategy", default="default")
    ap.add_argument("--session-timeout", type=float, default=4.0)
    ap.add_argument("--static-grace", type=float, default=0.0,
                    help="> 0: members are static (instance_id = their name), this grace")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    members: dict[str, MessageConsumer] = {}
    states: dict[str, str] = {}
    lock = threading.Lock()
    stop = threading.Event()

    def poll_states() -> None:
        while not stop.is_set():
            with lock:
                current = list(members.items())
            for mid, c in current:
                s = c.state.value
                if states.get(mid) != s:
                    states[mid] = s
                    emit(ev="state", id=mid, state=s)
            time.sleep(0.002)

    def make(mid: str) -> MessageConsumer:
        ident = ({"instance_id": mid, "static_grace": args.static_grace}
                 if args.static_grace > 0 else {"consumer_id": mid})
        c = MessageConsumer(
            args.group, args.zk, strategy=args.strategy, **ident,
            fetch_runner_count=1, commit_period=60.0, zk_session_timeout=args.session_timeout,
            on_assigned=lambda topic, p: emit(ev="assigned", id=mid, p=p),
            on_revoked=lambda topic, p: emit(ev="revoked", id=mid, p=p),
            on_error=lambda e: emit(ev="error", id=mid, error=repr(e)))
        c.subscribe(args.topic, lambda m: None)
        return c

    threading.Thread(target=poll_states, daemon=True).start()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "start":
            for mid in cmd["ids"]:
                c = make(mid)
                with lock:
                    members[mid] = c
                emit(ev="action", id=mid, what="start")
                c.start()
                emit(ev="started", id=mid, cid=c.consumer_id)
        elif cmd["cmd"] == "close":
            mid = cmd["id"]
            emit(ev="action", id=mid, what="close")
            members[mid].close()
            emit(ev="closed", id=mid)
            with lock:
                members.pop(mid)
        elif cmd["cmd"] == "restart":  # close (held for it if static), start again
            mid = cmd["id"]
            emit(ev="action", id=mid, what="restart")
            members[mid].close()
            emit(ev="closed", id=mid)
            c = make(mid)
            with lock:
                members[mid] = c
            c.start()
            emit(ev="restarted", id=mid)
        elif cmd["cmd"] == "exit":
            break
    else:
        os._exit(0)  # stdin gone: the parent died; leave the sessions to expire
    stop.set()
    for c in list(members.values()):
        c.close()
    emit(ev="exited")


if __name__ == "__main__":
    main()
