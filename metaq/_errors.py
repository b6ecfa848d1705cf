"""The one error tree of metaq.

Every error raised on purpose by metaq derives from :class:`MetaqError`, so
``except metaq.MetaqError`` catches them all.  Errors about bad values also
derive from :class:`ValueError` so that callers validating input can catch the
builtin type.

::

    MetaqError
    ├── ConfigError (ValueError)            a config field or CLI flag is wrong
    ├── LauncherError                       the embedded ZooKeeper cannot run
    │   ├── JavaNotFoundError               no ``java`` on PATH / JAVA_HOME
    │   └── ZooKeeperJarsNotFoundError      no ZooKeeper jars in any known place
    ├── CoordinationError                   ZooKeeper said no, or is unreachable
    │   └── NodeDataError (ValueError)      garbage in a node (zk_layout.NodeDataError)
    ├── ProtocolError (ValueError)          a malformed protocol line or reply
    ├── MessageError (ValueError)           message bytes that cannot be used
    │   ├── MessageTooLargeError            body over the configured limit
    │   └── ChecksumError                   CRC32 of the payload does not match
    │       └── DamagedMessageError         a consumer met damaged bytes in a log
    ├── StorageError                        the broker's log cannot be used
    │   ├── CorruptLogError                 bad bytes found where none may be
    │   └── ReplicaDivergedError            bytes copied from a master do not fit the
    │                                       copy (``topic``, ``partition``, ``offset``)
    ├── BrokerError                         a broker answered a non-200 result
    │   └── (``code`` attribute: 301/400/401/403/404/500/503/504)
    ├── BrokerUnavailableError              a broker cannot be reached, or its connection
    │   │                                   failed (``address``; the OSError or timeout
    │   │                                   as ``__cause__``): the one transport error
    │   ├── ConnectionClosedError           the connection to a broker went away
    │   └── MalformedReplyError (ProtocolError)  a broker's reply cannot be parsed:
    │                                       the connection is dropped
    ├── ProducerError
    │   ├── NoBrokerAvailableError          no partition of the topic can be written
    │   ├── SendTimeoutError                retries exhausted within the send timeout
    │   ├── BatchSendError                  some messages of a batch were not stored
    │   └── TransactionError                a transaction could not be done (rolled back)
    │       └── XAError                     an XA request failed (``code``: XAException's)
    └── ConsumerError
        ├── ConsumerClosedError             the consumer was used after close()
        ├── DataLossError                   wanted messages are gone (retention, short log)
        ├── OffsetOutOfRangeError           a position outside the log (offset_reset)
        ├── MemberFailedError               a member's coordinator failed and gave up
        └── DuplicateInstanceError          another live process has this instance_id

``zk_layout`` does not import ``metaq``, so its :class:`zk_layout.NodeDataError`
(a ``ValueError``) is registered here as a virtual subclass of
:class:`CoordinationError` (and so of :class:`MetaqError`), and its
:class:`zk_layout.InvalidNameError` (a bad topic, group or id) as one of
:class:`ConfigError`: ``except metaq.MetaqError`` catches both.
"""

from __future__ import annotations

from abc import ABCMeta

from zk_layout import InvalidNameError, NodeDataError

__all__ = [
    "MetaqError",
    "ConfigError",
    "LauncherError",
    "JavaNotFoundError",
    "ZooKeeperJarsNotFoundError",
    "CoordinationError",
    "NodeDataError",
    "ProtocolError",
    "MessageError",
    "MessageTooLargeError",
    "ChecksumError",
    "StorageError",
    "CorruptLogError",
    "ReplicaDivergedError",
    "BrokerError",
    "BrokerUnavailableError",
    "ConnectionClosedError",
    "MalformedReplyError",
    "ProducerError",
    "NoBrokerAvailableError",
    "SendTimeoutError",
    "BatchSendError",
    "TransactionError",
    "XAError",
    "ConsumerError",
    "ConsumerClosedError",
    "DataLossError",
    "DamagedMessageError",
    "OffsetOutOfRangeError",
    "MemberFailedError",
    "DuplicateInstanceError",
]


class MetaqError(Exception, metaclass=ABCMeta):
    """Base of every error metaq raises on purpose."""


class ConfigError(MetaqError, ValueError):
    """A configuration field, option or command-line flag has a wrong value."""


class LauncherError(MetaqError):
    """The embedded ZooKeeper server could not be started, found or stopped."""


class JavaNotFoundError(LauncherError):
    """No ``java`` executable: install Java 17+ or set JAVA_HOME."""


class ZooKeeperJarsNotFoundError(LauncherError):
    """No ZooKeeper jars in $ZOOKEEPER_HOME, Debian's package or the pyspark wheel."""


class CoordinationError(MetaqError):
    """ZooKeeper refused an operation or could not be reached."""


class ProtocolError(MetaqError, ValueError):
    """A protocol line or reply is malformed; the message names what was wrong."""


class MessageError(MetaqError, ValueError):
    """Message bytes or a message body that cannot be used."""


class MessageTooLargeError(MessageError):
    """A message body is over the configured size limit."""


class ChecksumError(MessageError):
    """The CRC32 of a message payload does not match its header."""


class StorageError(MetaqError):
    """The broker's log cannot be opened, read or written."""


class CorruptLogError(StorageError):
    """Bad bytes were found in a part of the log where none may be."""


class ReplicaDivergedError(StorageError):
    """Bytes a master served cannot be copied into its slave's log as they are: they
    were served from another offset than where the copy ends, or a message among
    them is bad (impossible length, checksum mismatch, an all-zero header).

    ``topic`` and ``partition`` name the log, ``offset`` the offset concerned (where
    the bad message starts, or where the bytes were served from).
    """

    def __init__(self, message: str, *, topic: str, partition: int, offset: int) -> None:
        super().__init__(message)
        self.topic = topic
        self.partition = partition
        self.offset = offset


class BrokerError(MetaqError):
    """A broker answered with a non-200 result.

    ``code`` is the numeric result code and ``detail`` the reply body as text.
    """

    def __init__(self, code: int, detail: str = "", *, broker: str = "") -> None:
        self.code = code
        self.detail = detail
        self.broker = broker
        where = f" from {broker}" if broker else ""
        super().__init__(f"broker error {code}{where}: {detail}" if detail else
                         f"broker error {code}{where}")


class BrokerUnavailableError(MetaqError):
    """A broker could not be reached, or the connection to it failed: refused, reset,
    timed out, closed by the peer, or left unusable by a malformed reply.

    ``metaq.net`` is the one place that turns ``OSError`` and socket timeouts into
    this error (the original is its ``__cause__``), so callers catch one kind.
    ``address`` is the broker's ``(host, port)`` when known.
    """

    def __init__(self, message: str, *, address: tuple[str, int] | None = None) -> None:
        super().__init__(message)
        self.address = address


class ConnectionClosedError(BrokerUnavailableError):
    """The connection to a broker closed while requests were outstanding."""


class MalformedReplyError(BrokerUnavailableError, ProtocolError):
    """A broker's reply could not be parsed (a bad reply line, an opaque that does not
    match, a body that is not what the request expects): the connection can no longer
    be trusted and was closed."""


class ProducerError(MetaqError):
    """A message could not be sent."""


class NoBrokerAvailableError(ProducerError):
    """No writable partition of the topic is known (no broker publishes it)."""


class SendTimeoutError(ProducerError):
    """Every retry failed or the total send timeout passed."""


class BatchSendError(ProducerError):
    """Some messages of a ``Producer.send_batch`` call were not stored (each after
    its own retries); the others were.

    ``errors`` maps the index (in the batch) of every failed message to its
    exception; ``results`` has, at each index, the message's ``SendResult``
    when it was stored, ``None`` when it failed.
    """

    def __init__(self, message: str, *, results: list, errors: dict[int, BaseException]) -> None:
        super().__init__(message)
        self.results = results
        self.errors = errors


class TransactionError(ProducerError):
    """A transaction was refused or failed; when raised by a commit, nothing of it
    was stored (the broker rolled it back) unless the message says the outcome is
    unknown."""


class XAError(TransactionError):
    """An XA request failed; ``code`` is the broker's ``javax.transaction.xa.
    XAException`` error code (-4 XAER_NOTA: no such branch, -6 XAER_PROTO: not
    now, 100..107 XA_RB*: rolled back...)."""

    def __init__(self, message: str, *, code: int) -> None:
        super().__init__(message)
        self.code = code


class ConsumerError(MetaqError):
    """A consumer-side failure, including background-thread failures handed to the user."""


class ConsumerClosedError(ConsumerError):
    """The consumer was used after it was closed."""


class DataLossError(ConsumerError):
    """Messages a reader was asked for are gone: deleted by retention, or the
    log is shorter or more damaged than when the read was planned."""


class DamagedMessageError(ChecksumError):
    """A consumer met bytes in a partition's log that are no valid message, and moved
    past them: ``topic``, ``partition``, ``offset`` (where they start) and
    ``next_offset`` (where delivery resumed; ``next_offset - offset`` bytes skipped)."""

    def __init__(self, message: str, *, topic: str, partition: str, offset: int,
                 next_offset: int) -> None:
        super().__init__(message)
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.next_offset = next_offset


class OffsetOutOfRangeError(ConsumerError):
    """A partition's position (a committed offset, a seek) is outside its log: above
    the end, below the start after retention, or inside a message.  ``offset`` is
    the position, ``log_start``/``log_end`` the log's bounds (``None`` when not
    known), ``action`` what ``offset_reset`` did: ``earliest``, ``latest``,
    ``boundary`` (moved to the start of the message holding it) or ``fail``
    (the partition is not fetched until a seek)."""

    def __init__(self, message: str, *, topic: str, partition: str, offset: int,
                 log_start: int | None, log_end: int | None, action: str) -> None:
        super().__init__(message)
        self.topic = topic
        self.partition = partition
        self.offset = offset
        self.log_start = log_start
        self.log_end = log_end
        self.action = action


class MemberFailedError(ConsumerError):
    """An unexpected failure in a member's coordinator: the member gave up its
    partitions and its registration (the group rebalances without it), and either
    rejoins after a backoff or, after repeated failures, closes."""


class DuplicateInstanceError(ConsumerError):
    """A static member's ``instance_id`` is held by another live process of the group:
    this member stays out (it owns nothing) and closes; the other keeps its partitions."""


CoordinationError.register(NodeDataError)
ConfigError.register(InvalidNameError)
