"""A Metaq 1.4-compatible broker: storage, text-protocol server, ZooKeeper registration.

::

    from metaq.broker import Broker, BrokerConfig

    cfg = BrokerConfig(broker_id=0, data_dir="/var/lib/metaq", port=0,
                       topics={"orders": 4}, zk_connect="127.0.0.1:2181")
    with Broker(cfg) as broker:          # event loop on a named thread
        print(broker.port)

``Broker.run_forever()`` runs in the calling thread until SIGTERM/SIGINT (the CLI).

One concept per module:

================  ==============================================================
``_broker``       :class:`Broker`, the facade: wiring, event-loop thread, timers,
                  run-time operations
``_config``       :class:`BrokerConfig`: validated settings, TOML loading
``_server``       :class:`BrokerServer`: the TCP server, admission of connections,
                  dispatch of requests, gets, ``offset``, ``version``, ``stats``
``_connection``   one client connection: parsing reads, replies in request order,
                  backpressure (what it needs of its server: ``Host``)
``_replies``      every reply's bytes; replies that wait (fsync, sendfile)
``_puts``         storing puts: one step from parsed puts to appended messages and
                  their replies
``_producers``    the idempotent producers' table: per partition, which runs of
                  whose sequence are stored where (``producers.jnl``)
``_topics``       where a put goes: targets by ``<topic> <partition>``, partition
                  -1's round robin, topic creation
``_hold``         held gets (the ``hold=<ms>`` long-polling extension)
``_storage``      partition logs: appends, group commit, reads, retention, a
                  slave's copies (``append_copy``, ``truncate``, ``reset``)
``_segment``      one segment file: writes, recovery, damaged ranges, boundaries
``_registry``     the broker's registration in ZooKeeper, and the decisions of
                  who leads a replicated broker id (promotion, stepping down)
``_role``         master, slave or fenced on the event loop side: the epoch,
                  the lease, the marker file of a data directory
``_replicas``     a master's slaves: copy positions, the in-sync set, the puts
                  waiting for sync replication
``_follower``     a slave's copy of its master, partition by partition
``_transactions`` Metaq's local and XA transactions: states, commits, recovery
``_txjournal``    the transaction journal's records, replay and compaction
``_txfeed``       prepared branches between replicas: the master's feed, a
                  slave's copy of it (``txlog``)
``_timeindex``    per segment, msgId times to offsets (offset for a time)
================  ==============================================================
"""

from metaq.broker._broker import Broker
from metaq.broker._config import BrokerConfig, load_config, parse_topic_spec
from metaq.broker._registry import promote
from metaq.broker._server import VERSION, BrokerServer
from metaq.broker._storage import LogSlice, PartitionLog, Storage

__all__ = [
    "Broker",
    "BrokerConfig",
    "BrokerServer",
    "LogSlice",
    "PartitionLog",
    "Storage",
    "VERSION",
    "load_config",
    "parse_topic_spec",
    "promote",
]
