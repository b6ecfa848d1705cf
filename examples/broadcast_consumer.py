"""Broadcast consumption: every copy of this program receives every message of the topic.

    python examples/broadcast_consumer.py --zk 127.0.0.1:2181 --topic config-updates \
        --group caches --id node1 --count 100

Each member keeps its own offsets in a local file (here under --state-dir), so a restarted
member continues where it stopped; the group registers in ZooKeeper as <group>-<ip>.
"""

from __future__ import annotations

import argparse
import threading

from metaq import Message, MessageConsumer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--zk", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--id", required=True, help="this member's id (names its offsets file)")
    ap.add_argument("--state-dir", default=".")
    ap.add_argument("--count", type=int, required=True)
    args = ap.parse_args()

    done = threading.Event()
    got: list[bytes] = []

    def on_update(message: Message) -> None:
        got.append(message.raw_body)  # e.g. refresh a local cache entry
        if len(got) >= args.count:
            done.set()

    with MessageConsumer(args.group, args.zk, consumer_id=args.id, broadcast=True,
                         offset_file=f"{args.state_dir}/{args.id}.offsets") as consumer:
        consumer.subscribe(args.topic, on_update)
        consumer.start()
        done.wait(120)
        print(f"member {args.id} of {consumer.zk_group} got {len(got)} messages")


if __name__ == "__main__":
    main()
