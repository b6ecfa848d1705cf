"""A consumer process for kill -9 tests: prints a line per message AFTER processing it.

    python tests/helpers/consumer_script.py --zk Z --group G --topic T [--mode concurrent]
        [--threads N] [--sleep-ms-max MS] [--fail-on BODY,...] [--hang-on-redelivery]
        [--recover-dir D] [--recover-interval S] [--commit-period S] [--seed N]

Output lines: ``done <partition> <offset> <body>`` (stdout, flushed per line), and
``ready`` once started.  ``--fail-on`` bodies always raise; ``--hang-on-redelivery``
makes a redelivery from the recover store block forever (to be killed there).
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import threading
import time

from metaq import MessageConsumer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--zk", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--id", default=None)
    ap.add_argument("--mode", default="orderly")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--sleep-ms-max", type=float, default=0.0)
    ap.add_argument("--fail-on", default="")
    ap.add_argument("--hang-on-redelivery", action="store_true")
    ap.add_argument("--recover-dir", default=None)
    ap.add_argument("--recover-interval", type=float, default=300.0)
    ap.add_argument("--commit-period", type=float, default=0.2)
    ap.add_argument("--max-retries", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    fail = {b.encode() for b in args.fail_on.split(",") if b}
    rng = random.Random(args.seed)
    out_lock = threading.Lock()
    stop = threading.Event()
    attempts: dict[tuple[str, int], int] = {}

    def listener(m) -> None:
        key = (m.partition, m.offset)
        attempts[key] = attempts.get(key, 0) + 1
        from_store = attempts[key] > args.max_retries + 1  # past the in-partition tries
        if m.raw_body in fail:
            if from_store and args.hang_on_redelivery:
                with out_lock:
                    sys.stdout.write(f"hanging {m.partition} {m.offset}\n")
                    sys.stdout.flush()
                threading.Event().wait()  # killed here
            raise RuntimeError(f"refusing {m.raw_body!r}")
        if args.sleep_ms_max:
            time.sleep(rng.random() * args.sleep_ms_max / 1000.0)
        with out_lock:
            sys.stdout.write(f"done {m.partition} {m.offset} {m.raw_body.decode()}\n")
            sys.stdout.flush()

    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    c = MessageConsumer(args.group, args.zk, consumer_id=args.id, consume_mode=args.mode,
                        consume_threads=args.threads, commit_period=args.commit_period,
                        zk_session_timeout=4.0, max_fetch_retries=args.max_retries,
                        recover_dir=args.recover_dir, recover_interval=args.recover_interval)
    with c:
        c.subscribe(args.topic, listener)
        c.start()
        print("ready", flush=True)
        while not stop.wait(0.2):
            pass


if __name__ == "__main__":
    main()
