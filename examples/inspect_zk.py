"""Read a Metaq ZooKeeper tree (ours or a Java cluster's) with zk_layout, no broker needed.

    python examples/inspect_zk.py --zk 127.0.0.1:2181 [--zk-root /meta]
"""

from __future__ import annotations

import argparse

from kazoo.client import KazooClient

from zk_layout import DEFAULT_ROOT, Layout, take_snapshot


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--zk", required=True)
    ap.add_argument("--zk-root", "--root", dest="zk_root", default=DEFAULT_ROOT)
    args = ap.parse_args()

    client = KazooClient(hosts=args.zk, read_only=True)
    client.start(timeout=15)
    try:
        snap = take_snapshot(client, Layout(args.zk_root))
    finally:
        client.stop()
    for b in snap.brokers:
        print(f"broker {b.broker_id}: {b.master}")
    for t in snap.topics:
        print(f"topic {t.topic}: {len(t.partitions)} partitions")
    for g in snap.groups:
        print(f"group {g.group}: {len(g.members)} members")
        for gt in g.topics:
            for p in gt.partitions:
                committed = p.offset.offset if p.offset else None
                print(f"  {gt.topic} {p.partition}: owner={p.owner} committed={committed}")
    for d in snap.damaged:
        print(f"damaged node {d.path}: {d.error}")


if __name__ == "__main__":
    main()
