"""Client connections to Metaq brokers: sockets, requests in flight, replies matched.

One concept per module:

====================  =======================================================
``_connection``       :class:`BrokerConnection`: blocking, one request at a
                      time, one ``get`` pipelined ahead (fetchers, tools)
``_multiplex``        :class:`MultiplexedConnection`: non-blocking, many
                      held ``get`` requests out at once, replies matched
                      by opaque, driven by its owner's selector loop
``_pipeline``         :class:`PipelinedConnection`: many ``put`` requests in
                      flight on one socket, its writer thread
``_reader``           the pipelined connection's reader thread: replies
                      parsed in bulk and matched to requests by opaque
``_acks``             who waits for a put's reply (:class:`Pending`,
                      :class:`MultiPending`, :class:`PutFuture`) and the
                      put-reply parsers
``_future``           :class:`LightFuture`, a ``Future`` cheap to complete
``_timeseek``         :func:`offset_for_time`: the offset for a time, by a
                      binary search over a partition's bytes (:class:`TimeSeek`);
                      :func:`time_at` / :func:`header_at`: the time (and size)
                      of the message at an offset
====================  =======================================================

Built on :mod:`metaq.protocol` (the bytes); used by the producer, the consumer's
fetchers and long poller, the Spark source and the admin tools, which import from
here only.  This package is also the transport error boundary: an ``OSError`` or
a socket timeout never leaves it, it becomes a :class:`~metaq.BrokerUnavailableError`
(with the broker's address and the ``OSError`` as its cause).
"""

from metaq.net._acks import (
    MultiPending,
    Pending,
    PutAck,
    PutFuture,
    check_partial,
    parse_put_ack,
    scan_acks,
    scan_results,
)
from metaq.net._connection import BrokerConnection, parse_meta_uri
from metaq.net._future import LAZY_OK, LightFuture
from metaq.net._multiplex import MultiplexedConnection
from metaq.net._pipeline import READER_PREFIX, PipelinedConnection
from metaq.net._timeseek import TimeSeek, header_at, offset_for_time, time_at

__all__ = [
    "BrokerConnection", "parse_meta_uri",
    "MultiplexedConnection",
    "PipelinedConnection", "READER_PREFIX",
    "Pending", "MultiPending", "PutAck", "PutFuture", "check_partial", "parse_put_ack",
    "scan_acks", "scan_results",
    "LightFuture", "LAZY_OK",
    "TimeSeek", "offset_for_time", "time_at", "header_at",
]
