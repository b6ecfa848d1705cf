"""Transactional sends: a local transaction, then one XA branch driven as a transaction
manager would drive it (start, send, end, prepare, commit), then recovery of a branch
left prepared.

    python examples/transactional_producer.py --zk 127.0.0.1:2181 --topic orders

Nothing of a transaction is visible to consumers until it commits; then all of it is,
in the order it was sent.  A local transaction's messages go to one broker.
"""

from __future__ import annotations

import argparse
import os

from metaq import Producer, TransactionError, Xid


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--zk", required=True)
    ap.add_argument("--topic", required=True)
    args = ap.parse_args()

    with Producer(args.zk) as producer:
        # a local transaction: committed at the end of the block
        with producer.transaction(timeout=30) as tx:
            for i in range(3):
                tx.send(args.topic, f"order {i} created".encode())
        print("local transaction committed: 3 messages")

        # an exception inside the block rolls it back: nothing is stored
        try:
            with producer.transaction() as tx:
                tx.send(args.topic, b"this one is never seen")
                raise TransactionError("the order was cancelled")
        except TransactionError as e:
            print(f"local transaction rolled back: {e}")

        # an XA branch, as a transaction manager drives it (two-phase commit)
        with producer.xa_resource("example-app", topic=args.topic) as xa:
            xid = Xid(1, os.urandom(8), b"branch-1")
            xa.start(xid)
            xa.send(args.topic, b"paid")
            xa.end(xid)
            vote = xa.prepare(xid)  # durable on the broker from here on
            xa.commit(xid)
            print(f"XA branch prepared (vote {vote}) and committed")

            # a branch left prepared (a transaction manager that crashed): recover() lists
            # it after any restart of the broker, and the manager finishes it
            left = Xid(1, os.urandom(8), b"branch-2")
            xa.start(left)
            xa.send(args.topic, b"refunded")
            xa.end(left)
            xa.prepare(left)
            for found in xa.recover():
                if found == left:
                    xa.rollback(found)
                    print("recovered a prepared branch and rolled it back")


if __name__ == "__main__":
    main()
