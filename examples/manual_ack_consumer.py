"""Manual acknowledgement: commit only what was really written, roll back on failure.

    python examples/manual_ack_consumer.py --zk 127.0.0.1:2181 --topic orders --group ledger \
        --count 100

Messages are collected into small transactions; after a successful "write" the last message
is acked (everything before it in its partition counts as done). If a write fails, rollback
delivers the unacked messages again.
"""

from __future__ import annotations

import argparse
import threading
from collections import defaultdict

from metaq import Message, MessageConsumer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--zk", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--fail-first-write", action="store_true",
                    help="make the first write fail, to show a rollback")
    args = ap.parse_args()

    pending: dict[str, list[Message]] = defaultdict(list)
    written: set[bytes] = set()
    rollbacks = [0]
    done = threading.Event()
    consumer = MessageConsumer(args.group, args.zk, commit_period=0.5)

    def write(batch: list[Message]) -> None:
        if args.fail_first_write and rollbacks[0] == 0:
            raise OSError("database unavailable")
        written.update(m.raw_body for m in batch)

    def on_message(message: Message) -> None:
        batch = pending[message.partition]
        batch.append(message)
        if len(batch) < 10 and len(written) + sum(map(len, pending.values())) < args.count:
            return
        try:
            write(batch)
        except OSError:
            rollbacks[0] += 1
            batch.clear()
            consumer.rollback(message.topic, message.partition)  # deliver them again
            return
        consumer.ack(batch[-1])  # everything up to here in this partition is done
        batch.clear()
        if len(written) >= args.count:
            done.set()

    with consumer:
        consumer.subscribe(args.topic, on_message, auto_ack=False)
        consumer.start()
        done.wait(120)
    print(f"wrote {len(written)} messages with {rollbacks[0]} rollback(s)")


if __name__ == "__main__":
    main()
