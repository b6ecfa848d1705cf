"""Consumer side of metaq: ZooKeeper-coordinated consumer groups.

One concept per module:

=================  ==========================================================
``_consumer``      MessageConsumer: the user's face; builds and wires the rest
``_config``        ConsumerConfig: the settings, validated
``_subscription``  subscription state: topics subscribed, and each owned
                   partition's state with its transitions
``_coordinator``   the coordinator thread: runs the state machine, drives the
                   parts below, does every ZooKeeper write
``_lifecycle``     State: the member's states, transitions and generation, one
                   writer, every transition numbered and waitable
``_membership``    our id node in the group, and its heartbeat
``_static``        static membership: our record, the holds for away members
``_view``          the group as read, re-read only where a watch fired
``_plan``          this member's share of a generation (pure: group -> plan)
``_owners``        owner nodes: claims, waits for held ones, fenced releases
``_handoff``       partitions in and out of fetching as a plan says, with the
                   user's on_assigned/on_revoked
``_commits``       the commit timer
``_history``       the rebalance history this member writes (each rebalance,
                   with why, in ZooKeeper after it is gone)
``_backoff``       retry timing: capped exponential backoff with jitter
``_lease``         the delivery lease a frozen member cannot outlive
``_assignors``     assignment strategies (pure functions)
``_offsets``       offset stores and the session fence of commits
``_fetcher``       FetchManager: runner threads and their delay queue
``_fetch``         one fetch of one partition; position checks, offset_reset
``_session``       the wire side of fetching: a runner's FetchSession (its
                   connections, gets, the get sent ahead) and a partition's
                   Readahead (receive buffer, bytes fetched ahead)
``_route``         BrokerRoute: which broker a partition is read from, and
                   what each broker offers (held gets)
``_longpoll``      held gets for partitions at their log end
``_processor``     the hot loop handing a batch to a listener
``_message``       the Message a listener receives
``_concurrent``    concurrent mode: the worker pool, in-flight tracking
``_reject``        reject policies for messages that keep failing
``_recover``       the local recover store
=================  ==========================================================

The stable API is :data:`__all__`; the modules are private.
"""

from metaq.consumer._assignors import STRATEGIES, Strategy, get_strategy
from metaq.consumer._concurrent import RECONSUME_LATER
from metaq.consumer._config import ConsumerConfig
from metaq.consumer._consumer import MessageConsumer
from metaq.consumer._lifecycle import State, Transition
from metaq.consumer._message import Message
from metaq.consumer._processor import Rewind

__all__ = [
    "MessageConsumer",
    "ConsumerConfig",
    "Message",
    "Rewind",
    "RECONSUME_LATER",
    "State",
    "Transition",
    "Strategy",
    "STRATEGIES",
    "get_strategy",
]
