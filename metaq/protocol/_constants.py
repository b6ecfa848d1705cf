"""Metaq 1.4's numbers (reference sections 5 and 6), defined once.

Every limit, mask and flag of the message bytes and the text protocol lives
here; the rest of the package and its callers import them by name.
"""

from __future__ import annotations

import re

#: ms timestamp Metaq subtracts before shifting it into a msgId (defined once, in
#: zk_layout, which reads msgIds in offset nodes too).
from zk_layout import MSG_ID_EPOCH_MS

__all__ = [
    "INT32_MAX",
    "INT32_MIN",
    "INT64_MAX",
    "INT64_MIN",
    "CHECKSUM_MASK",
    "OPAQUE_MASK",
    "HEADER_SIZE",
    "MAX_PAYLOAD",
    "MAX_MESSAGE_SIZE",
    "MAX_PAYLOAD_SIZE",
    "MSG_ID_EPOCH_MS",
    "FLAG_HAS_ATTRIBUTE",
    "MAX_LINE",
    "DEFAULT_MAX_PAYLOAD",
    "DEFAULT_MAX_BODY",
    "QUIT",
    "HOLD_CAPABILITY",
    "TIME_INDEX_CAPABILITY",
    "BOUNDARY_CAPABILITY",
    "IDEMPOTENT_CAPABILITY",
    "RECORDS_CAPABILITY",
    "unwritten_partition_text",
    "is_unwritten_partition",
]

#: Java's ``Integer.MAX_VALUE``: Metaq's lengths, opaques and offsets within a reply are int32.
INT32_MAX = 0x7FFFFFFF
INT32_MIN = -INT32_MAX - 1
#: Java's ``Long`` bounds: msgIds and offsets are int64.
INT64_MAX = (1 << 63) - 1
INT64_MIN = -INT64_MAX - 1
#: A message's stored checksum is ``CRC32(payload) & CHECKSUM_MASK`` (Java's
#: ``CheckSum.crc32`` drops the sign bit).
CHECKSUM_MASK = INT32_MAX
#: Opaques are non-negative int32s; a client's counter wraps through this mask.
OPAQUE_MASK = INT32_MAX
#: int32 length, int32 checksum, int64 msgId, int32 flag.
HEADER_SIZE = 20
#: Largest payload length a header can describe (an int32 length plus the header);
#: anything above it can only be corruption.
MAX_PAYLOAD = INT32_MAX - HEADER_SIZE
#: Largest message body a producer may send by default (4 MiB, as RocketMQ/Metaq clients).
MAX_MESSAGE_SIZE = 4 * 1024 * 1024
#: Default upper bound on a payload length read from bytes (body + attribute section);
#: anything larger is treated as corruption, not as a big message.
MAX_PAYLOAD_SIZE = 64 * 1024 * 1024
#: Flag bit 0: the payload starts with an attribute (int32 length, UTF-8 text).
FLAG_HAS_ATTRIBUTE = 1

#: Longest command line accepted (CRLF excluded).
MAX_LINE = 8192
#: Default largest put payload the request parser accepts (4 MiB body + room for an attribute).
DEFAULT_MAX_PAYLOAD = MAX_MESSAGE_SIZE + 64 * 1024
#: Default largest reply body the reply parser accepts.
DEFAULT_MAX_BODY = MAX_PAYLOAD_SIZE
QUIT = b"quit\r\n"
#: Token in a broker's ``version`` answer saying it honours ``get ... hold=<ms>``
#: (metaq-py's long-polling extension of Metaq 1.4; README, "Protocol").
HOLD_CAPABILITY = "+hold"
#: Token in a broker's ``version`` answer saying it answers ``offset ... time=<ms>``
#: from its segments' time index (metaq-py's extension; README, "Protocol").
TIME_INDEX_CAPABILITY = "+timeindex"
#: Token in a broker's ``version`` answer saying its ``offset`` answers are exact: for a
#: position inside the log, the start of the message holding it, and for the end, the
#: end it serves gets up to.  A Java Metaq 1.4 broker answers the start of the segment
#: holding a position (no message boundary), and its max offset is what it flushed,
#: which may lag what it serves.
BOUNDARY_CAPABILITY = "+boundary"
#: The consumer group a slave broker fetches its master's partitions with (Java's
#: ``slaveGroup`` default).  A metaq-py slave adds its replica number,
#: ``meta-slave-group-<N>``, so that its master knows how far each slave has copied
#: (the offset of a slave's get is what it holds); a Java master takes it as any group.
REPLICA_GROUP = "meta-slave-group"
_REPLICA_PREFIX = REPLICA_GROUP + "-"


def replica_group(replica: int) -> str:
    """The group replica ``replica`` fetches with: ``meta-slave-group-<N>``."""
    return f"{_REPLICA_PREFIX}{replica}"


def replica_of_group(group: str) -> int | None:
    """The replica number in a slave's group name, or None for any other group."""
    if not group.startswith(_REPLICA_PREFIX):
        return None
    tail = group[len(_REPLICA_PREFIX):]
    if not tail.isdigit() or not tail.isascii() or len(tail) > 10:
        return None
    return int(tail)


#: The 404 text a Java Metaq 1.4 broker answers ``offset`` (and ``get``) with for a
#: partition whose storage it has not created yet: it creates it on the first put.
_UNWRITTEN = re.compile(r"The topic `([^`]*)` in partition `(-?\d+)` is not exists")


def unwritten_partition_text(topic: str, partition: int) -> str:
    """Java Metaq's 404 text for a partition never written (see :data:`_UNWRITTEN`)."""
    return f"The topic `{topic}` in partition `{partition}` is not exists"


def is_unwritten_partition(text: str) -> bool:
    """Whether a 404's text is Java Metaq's "never written" answer: such a partition
    is empty (log start = log end = 0), as Metaq's own client takes it."""
    return _UNWRITTEN.search(text) is not None


#: Token in a broker's ``version`` answer saying it reads the ``idem`` mark before puts
#: and stores a resent put once (metaq-py's idempotent producer; ``_idempotence``).
IDEMPOTENT_CAPABILITY = "+idempotent"
#: Token in a broker's ``version`` answer saying it answers a slave's ``get ...
#: records=<opaque>`` with the producer records of what it serves, under that opaque,
#: right before the ``value`` (only when there are any; ``_idempotence``).
RECORDS_CAPABILITY = "+records"
