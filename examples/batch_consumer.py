"""A batch listener: on_messages(batch) gets every fetched batch of one partition, in order.

    python examples/batch_consumer.py --zk 127.0.0.1:2181 --topic orders --group reports
"""

from __future__ import annotations

import argparse
import threading

from metaq import Message, MessageConsumer


class Totals:
    """Sums message sizes per partition; a batch either fully succeeds or is retried whole."""

    def __init__(self, stop_after: int) -> None:
        self.count = 0
        self.bytes = 0
        self.stop_after = stop_after
        self.done = threading.Event()
        self.lock = threading.Lock()

    def on_messages(self, batch: list[Message]) -> None:
        with self.lock:
            self.count += len(batch)
            self.bytes += sum(len(m.raw_body) for m in batch)
            if self.count >= self.stop_after:
                self.done.set()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--zk", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--count", type=int, required=True)
    args = ap.parse_args()

    totals = Totals(args.count)
    with MessageConsumer(args.group, args.zk) as consumer:
        consumer.subscribe(args.topic, totals, max_size=1024 * 1024)
        consumer.start()
        totals.done.wait(120)
    print(f"{totals.count} messages, {totals.bytes} bytes")


if __name__ == "__main__":
    main()
