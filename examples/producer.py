"""Send messages to a topic: blocking sends, then pipelined sends for throughput.

    python examples/producer.py --zk 127.0.0.1:2181 --topic orders --count 1000
"""

from __future__ import annotations

import argparse

from metaq import Producer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--zk", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--count", type=int, default=1000)
    args = ap.parse_args()

    with Producer(args.zk) as producer:
        # one at a time: returns once a broker acknowledged the message
        first = producer.send(args.topic, b"hello", attribute="source=example")
        print(f"first message: msgId={first.msg_id} partition={first.partition} "
              f"offset={first.offset}")
        # many in flight on one connection per broker; results arrive as futures
        futures = [producer.send_async(args.topic, {"order": i, "amount": i * 10})
                   for i in range(1, args.count)]
        results = [f.result(timeout=30) for f in futures]
    print(f"acknowledged {len(results) + 1} messages")


if __name__ == "__main__":
    main()
