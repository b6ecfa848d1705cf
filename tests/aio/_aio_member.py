"""An AsyncConsumer process for kill -9 tests: prints a line per message AFTER its
async handler finished it.

    python tests/aio/_aio_member.py --zk Z --group G --topic T [--mode concurrent]
        [--threads N] [--sleep-ms-max MS] [--commit-period S] [--id ID]

Output lines: ``ready`` once started, ``done <partition> <offset> <body>`` (stdout,
flushed per line).  SIGTERM closes it.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys

from metaq.aio import AsyncConsumer


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def handle(m) -> None:  # noqa: ANN001
        if args.sleep_ms_max:
            await asyncio.sleep(rng.random() * args.sleep_ms_max / 1000.0)
        sys.stdout.write(f"done {m.partition} {m.offset} {m.raw_body.decode()}\n")
        sys.stdout.flush()

    async with AsyncConsumer(args.group, args.zk, consumer_id=args.id,
                             consume_mode=args.mode, consume_threads=args.threads,
                             commit_period=args.commit_period, zk_session_timeout=4.0,
                             recover_dir=args.recover_dir) as c:
        c.subscribe(args.topic, handle)
        await c.start()
        print("ready", flush=True)
        await stop.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--zk", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--topic", required=True)
    ap.add_argument("--id", default=None)
    ap.add_argument("--mode", default="orderly")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--sleep-ms-max", type=float, default=0.0)
    ap.add_argument("--commit-period", type=float, default=0.2)
    ap.add_argument("--recover-dir", default=None)
    ap.add_argument("--seed", type=int, default=0)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
