"""The producer: :class:`Producer`, its :class:`ProducerConfig`, :class:`SendResult`
and (from ``Producer.send_batch``) :class:`BatchResults`.

One concept per module:

=================  ==========================================================
``_config``        :class:`ProducerConfig`: the options, validated
``_partitioner``   choosing a partition: round-robin, key hash, a user function
``_router``        which partitions of which brokers exist: :class:`TopicRoute`
                   per topic, following ZooKeeper
``_connections``   the brokers: one pipelined connection each, and which
                   failed lately
``_message``       a message's payload: codec, size limit, attribute header
``_send``          one message on its way (:class:`Send`, the user's future and
                   the connection's request) and its :class:`SendResult`
``_path``          the send path shared by single sends and batches: route,
                   pick, connection, attempts, the retry step and its thread
``_batch``         batches: encoded in one pass, written in chunks to one
                   partition, one future (:class:`BatchResults`)
``_idempotence``   the idempotent producer's id and per-partition sequence
                   numbers (``ProducerConfig.idempotent``)
``_transaction``   transactional sends: :class:`LocalTransaction` and the
                   :class:`XAResource` of a two-phase commit (:class:`Xid`)
``_producer``      the :class:`Producer` facade: arguments, payloads, lifecycle
=================  ==========================================================

Other packages import from here only.
"""

from metaq.producer._batch import BatchResults
from metaq.producer._config import ProducerConfig
from metaq.producer._producer import Producer
from metaq.producer._send import Send, SendResult
from metaq.producer._transaction import LocalTransaction, XAResource, Xid

__all__ = ["BatchResults", "Producer", "ProducerConfig", "Send", "SendResult",
           "LocalTransaction", "XAResource", "Xid"]
