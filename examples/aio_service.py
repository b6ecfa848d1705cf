"""An asyncio service: an async handler stores each order in sqlite and sends a reply.

    python examples/aio_service.py --zk 127.0.0.1:2181 --topic orders \\
        --group billing --reply-topic receipts --db orders.db

Each message is written to sqlite (in a thread: ``asyncio.to_thread``, the loop
keeps running) and answered with a message on the reply topic; only then does the
handler return, so only then can the message's offset be committed.  A crash
delivers again what was not committed: the insert is idempotent (keyed by
partition and offset), and the reply may be sent twice.  SIGTERM or Ctrl-C stops
it cleanly: handlers finish the message they are on, the rest is committed.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sqlite3

from metaq import Message
from metaq.aio import AsyncConsumer, AsyncProducer

SCHEMA = """CREATE TABLE IF NOT EXISTS orders (
    partition TEXT, msg_offset INTEGER, body BLOB, PRIMARY KEY (partition, msg_offset))"""


def store(db: str, message: Message) -> None:
    """One blocking sqlite write (run in a thread, never in the loop)."""
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT OR IGNORE INTO orders VALUES (?, ?, ?)",
                     (message.partition, message.offset, message.raw_body))


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--zk", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--reply-topic", required=True)
    ap.add_argument("--db", required=True)
    ap.add_argument("--count", type=int, default=None, help="stop after N messages")
    args = ap.parse_args()

    with sqlite3.connect(args.db) as conn:
        conn.execute(SCHEMA)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    handled = replies = 0

    async def handle(message: Message) -> None:
        nonlocal handled, replies
        await asyncio.to_thread(store, args.db, message)
        await producer.send(args.reply_topic, b"stored " + message.raw_body)  # acknowledged
        replies += 1
        handled += 1  # raising instead would retry this message, then recover it
        if args.count is not None and handled >= args.count:
            stop.set()

    async with AsyncProducer(args.zk) as producer, \
            AsyncConsumer(args.group, args.zk, commit_period=1.0) as consumer:
        consumer.subscribe(args.topic, handle)
        await consumer.start()
        while not stop.is_set():
            consumer.check()  # raise a background failure here
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass
        print(f"assignment at exit: {consumer.assignment()}")
    # leaving async with: handlers finished, offsets committed, partitions released, then
    # the producer closed (the consumer, entered last, leaves first)
    with sqlite3.connect(args.db) as conn:
        rows = conn.execute("SELECT COUNT(*) FROM orders").fetchone()[0]
    print(f"stored {rows} orders, sent {replies} replies")


if __name__ == "__main__":
    asyncio.run(main())
