"""A consumer-group member as a service: one listener call per message, clean shutdown on SIGTERM.

    python examples/consumer_service.py --zk 127.0.0.1:2181 --topic orders --group billing

Run several copies: they share the topic's partitions and rebalance as they come and go.
"""

from __future__ import annotations

import argparse
import signal
import threading

from metaq import Message, MessageConsumer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--zk", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--count", type=int, default=None, help="stop after N messages")
    args = ap.parse_args()

    done = threading.Event()
    seen = 0
    lock = threading.Lock()

    def handle(message: Message) -> None:
        nonlocal seen
        # do the work here; raising makes the consumer retry this message later
        with lock:
            seen += 1
            if args.count is not None and seen >= args.count:
                done.set()

    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    with MessageConsumer(args.group, args.zk, commit_period=1.0) as consumer:
        consumer.subscribe(args.topic, handle)
        consumer.start()
        while not done.wait(1.0):
            consumer.check()  # raise any background failure here, in the main thread
        print(f"assignment at exit: {consumer.assignment()}")
    # leaving the with block committed offsets, released partitions and unregistered
    print(f"handled {seen} messages")


if __name__ == "__main__":
    main()
