"""Metaq 1.4's bytes and text protocol: everything both ends agree on, and no I/O.

One concept per module:

========================  =====================================================
``_constants``            the numbers: header size, masks, limits, flags
``_message``              message bytes: encode, decode, walk, checksums, msgIds
``_commands``             request and reply types, name checks, encoders
``_parsers``              incremental parsers: requests (broker), replies (clients)
``_codec``                body codecs (a library convention over opaque bytes)
``_idempotence``          metaq-py's idempotent puts: the ``idem`` mark, the
                          ``producers`` command, producer records
``_txlog``                metaq-py's transaction feed to slaves: ``txlog``
``_watermark``            metaq-py's high watermarks to slaves: ``watermarks``
``_fast``                 the per-message work, C (``_speedups.c``) or Python,
                          chosen once: ``crc32``, ``scan``, ``take``, ``deliver``
                          (read by a ``PartitionReader``), ``encode_puts``,
                          ``put_request``, ``untrack`` / ``track``, ``complete_acks``,
                          ``ack_result``, ``put_ack``, ``put_round_trip``,
                          ``submit_put``, ``take_acks``, ``bind_send_async``,
                          ``bind_send_result``,
                          ``tx_acks`` (the producer); ``tx_answers`` (the broker)
========================  =====================================================

The broker, the client connections (:mod:`metaq.net`), the producer, the
consumer and the Spark source import these names from here, never from the
modules.  The stable, user-facing API is :data:`metaq.__all__`; this layer is for
tools that speak Metaq's protocol themselves.
"""

from metaq.protocol._codec import CODECS, Codec, get_codec
from metaq.protocol._commands import (
    BadRequest,
    GetRequest,
    OffsetRequest,
    PutRequest,
    QuitRequest,
    Result,
    StatsRequest,
    SyncRequest,
    TxPut,
    Value,
    VersionRequest,
    check_group,
    check_topic,
    encode_get,
    encode_get_head,
    encode_offset,
    encode_put,
    encode_result,
    encode_stats,
    encode_sync,
    encode_tx_puts,
    encode_value_header,
    encode_version,
    parse_put_result,
)
from metaq.protocol._constants import (
    BOUNDARY_CAPABILITY,
    CHECKSUM_MASK,
    DEFAULT_MAX_BODY,
    DEFAULT_MAX_PAYLOAD,
    FLAG_HAS_ATTRIBUTE,
    HEADER_SIZE,
    HOLD_CAPABILITY,
    IDEMPOTENT_CAPABILITY,
    INT32_MAX,
    MAX_LINE,
    MAX_MESSAGE_SIZE,
    MAX_PAYLOAD,
    MAX_PAYLOAD_SIZE,
    MSG_ID_EPOCH_MS,
    OPAQUE_MASK,
    QUIT,
    RECORDS_CAPABILITY,
    REPLICA_GROUP,
    TIME_INDEX_CAPABILITY,
    is_unwritten_partition,
    replica_group,
    replica_of_group,
    unwritten_partition_text,
)
from metaq.protocol._fast import (
    CRC32_IMPL,
    SPEEDUPS_IN_USE,
    SPEEDUPS_STATUS,
    ST_BAD,
    ST_END,
    ST_ERROR,
    ST_LATER,
    ST_LIMIT,
    PartitionReader,
    ack_result,
    bind_send_async,
    bind_send_result,
    complete_acks,
    crc32,
    deliver,
    encode_puts,
    prepare,
    put_ack,
    put_request,
    put_round_trip,
    scan,
    slot_fields,
    submit_put,
    take,
    take_acks,
    track,
    tx_acks,
    tx_answers,
    untrack,
)
from metaq.protocol._idempotence import (
    GAP_CODE,
    RECORD_SIZE,
    TOO_OLD_CODE,
    IdemMark,
    ProducerRecord,
    ProducersRequest,
    decode_producer_records,
    encode_idem_mark,
    encode_producer_records,
    encode_producers,
)
from metaq.protocol._message import (
    HEADER,
    MsgIdGenerator,
    RawMessage,
    build_payload,
    checksum,
    encode_message,
    iter_messages,
    msg_id_parts,
    scan_messages,
    scan_problem,
    split_payload,
)
from metaq.protocol._parsers import ReplyParser, RequestParser
from metaq.protocol._transaction import (
    TX_TYPES,
    TXPIPE_CAPABILITY,
    XA_OK,
    XA_RBOTHER,
    XA_RDONLY,
    XAER_NOTA,
    XAER_PROTO,
    XAER_RMERR,
    TransactionKey,
    TransactionRequest,
    encode_transaction,
    local_key,
    parse_transaction_key,
    xa_key,
)
from metaq.protocol._txlog import (
    TXLOG_CAPABILITY,
    TXLOG_HEAD,
    TxLogChunk,
    TxLogRequest,
    decode_txlog_body,
    encode_txlog,
    encode_txlog_body,
)
from metaq.protocol._watermark import (
    WATERMARK_CAPABILITY,
    WATERMARK_HEAD,
    WatermarkRequest,
    decode_watermark_body,
    encode_watermark_body,
    encode_watermarks,
)

__all__ = [
    # constants
    "INT32_MAX", "CHECKSUM_MASK", "OPAQUE_MASK", "HEADER_SIZE", "MAX_PAYLOAD",
    "MAX_MESSAGE_SIZE", "MAX_PAYLOAD_SIZE", "MSG_ID_EPOCH_MS", "FLAG_HAS_ATTRIBUTE",
    "MAX_LINE", "DEFAULT_MAX_PAYLOAD", "DEFAULT_MAX_BODY", "QUIT", "HOLD_CAPABILITY",
    "REPLICA_GROUP", "replica_group", "replica_of_group",
    "TIME_INDEX_CAPABILITY", "BOUNDARY_CAPABILITY", "is_unwritten_partition",
    "unwritten_partition_text",
    # message bytes
    "HEADER", "RawMessage", "MsgIdGenerator", "checksum", "build_payload", "split_payload",
    "encode_message", "iter_messages", "scan_messages", "scan_problem", "msg_id_parts",
    # commands
    "PutRequest", "TxPut", "SyncRequest", "GetRequest", "OffsetRequest", "StatsRequest",
    "VersionRequest", "QuitRequest", "BadRequest", "Result", "Value", "encode_put",
    "encode_tx_puts",
    "encode_sync", "encode_get",
    "encode_offset", "encode_stats", "encode_version", "encode_result",
    "encode_value_header", "parse_put_result", "check_topic", "check_group",
    "encode_get_head",
    # parsers
    "RequestParser", "ReplyParser",
    # codecs
    "Codec", "get_codec", "CODECS",
    # C or Python, chosen once
    "SPEEDUPS_STATUS", "SPEEDUPS_IN_USE", "crc32", "CRC32_IMPL", "scan", "take", "deliver",
    "prepare", "PartitionReader", "ST_END", "ST_LIMIT", "ST_BAD", "ST_LATER", "ST_ERROR",
    "slot_fields",
    "encode_puts", "put_request", "untrack", "track", "complete_acks",
    "ack_result", "put_ack", "put_round_trip", "submit_put", "take_acks", "bind_send_async",
    "bind_send_result",
    "tx_acks", "tx_answers",
    "TX_TYPES", "TXPIPE_CAPABILITY",
    "XA_OK", "XA_RBOTHER", "XA_RDONLY", "XAER_NOTA", "XAER_PROTO", "XAER_RMERR",
    "TransactionKey", "TransactionRequest", "encode_transaction", "local_key",
    "parse_transaction_key", "xa_key",
    # the transaction feed to slaves
    "TXLOG_CAPABILITY", "TXLOG_HEAD", "TxLogChunk", "TxLogRequest", "decode_txlog_body",
    "encode_txlog", "encode_txlog_body",
    # high watermarks to slaves
    "WATERMARK_CAPABILITY", "WATERMARK_HEAD", "WatermarkRequest", "decode_watermark_body",
    "encode_watermark_body", "encode_watermarks",
    # idempotent puts
    "IDEMPOTENT_CAPABILITY", "RECORDS_CAPABILITY", "IdemMark", "ProducersRequest",
    "ProducerRecord", "RECORD_SIZE",
    "GAP_CODE", "TOO_OLD_CODE", "encode_idem_mark", "encode_producers",
    "encode_producer_records", "decode_producer_records",
]
