"""Metaq's transactions on the broker (Java's ``TransactionalCommandProcessor``,
``LocalTransaction``, ``XATransaction``, ``TransactionProcessor``).

A transaction collects puts that carry its key; none of them is visible to any
``get`` until the commit appends them, together and in the order they were put,
to their partitions' logs.  Rolled back or timed out, they never appear.

- **Local** transactions (``TX:<session>:<n>``) belong to the connection that began
  them, as in Java: another connection cannot see or finish them, and a closed
  connection rolls back the ones it left open.  They have no prepare.
- **XA** branches (``XID:...:<uniqueQualifier>``) belong to the broker: any
  connection may finish them, and a prepared branch survives a crash (the
  journal, :mod:`metaq.broker._txjournal`) until its transaction manager commits
  or rolls it back; RECOVER lists the prepared branches of a unique qualifier.

States (Java's ``Transaction``)::

    START --put--> IN_USE --PREPARE (XA)--> PREPARED
      |              |                         |
      +--------------+--COMMIT / ROLLBACK------+--> FINISHED (forgotten)
                                               |                ^
                                               +--COMMIT--> COMMITTING (its decision
                                                   being fsynced, then appended)

PREPARE of a branch with no put answers XA_RDONLY and finishes it; COMMIT_TWO_PHASE
needs PREPARED (else XAER_PROTO); COMMIT_ONE_PHASE commits START or IN_USE (and,
as Java does, PREPARED); a timeout given at BEGIN (capped by
``max_transaction_timeout``) rolls back a transaction not prepared by then.

A **pipelined** local commit (``puts=<n>``, offered as ``+txpipe``: the producer wrote
BEGIN, the puts and COMMIT together without waiting for any answer) commits only a
transaction holding exactly ``n`` messages none of whose puts was refused (each
refusal is remembered on the transaction); otherwise it rolls it back and answers
``COMMIT FAILED: ...``.  A commit without ``puts=`` (Java's) keeps Java's rule.

Each put is assigned its msgId when it arrives (the producer is told it, with
offset -1, as Java answers), so a committed transaction's messages carry times
up to its duration before the messages appended around its commit.

Durability follows the broker's flush rules: with group commit every answer waits
for the journal's (and, for a commit, the partitions') fsync, but for a local
transaction's puts (journaled only with its commit, whose answer waits); otherwise only
PREPARE and the commit of a prepared branch wait for the journal's fsync, the
rest is written at once (kill -9 loses nothing: the page cache keeps it).

The commit of a prepared branch, under any flush rule, first makes its decision
durable (the journal's ``D`` record, fsynced off the event loop; the branch is
COMMITTING meanwhile and refuses any other request) and only then appends its
messages: were they appended first, the OS could write them to disk before the
journal's record, and a power loss between the two would leave them in the log
with the branch still prepared, which its transaction manager then commits
again.  A ``D`` without the ``C`` that follows the appends is finished at
recovery: the messages are looked for (by their bytes, msgId included) from the
``D``'s lower bounds, and appended where missing, never twice.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import operator
import struct
from dataclasses import dataclass, field
from itertools import repeat
from typing import TYPE_CHECKING, Any

from metaq._errors import ProtocolError, StorageError
from metaq.broker._replies import Gate, answer, result
from metaq.broker._txfeed import TxFeed
from metaq.broker._txjournal import (
    COMPACT_AT,
    Replayed,
    TxJournal,
    decide_record,
    prepare_record,
    put_record,
)
from metaq.protocol import (
    CHECKSUM_MASK,
    HEADER,
    HEADER_SIZE,
    INT32_MAX,
    XA_OK,
    XA_RBOTHER,
    XA_RDONLY,
    XAER_NOTA,
    XAER_PROTO,
    XAER_RMERR,
    PutRequest,
    TransactionRequest,
    TxPut,
    crc32,
    parse_transaction_key,
    scan_messages,
    tx_answers,
)

if TYPE_CHECKING:
    from metaq.broker._connection import Connection
    from metaq.broker._replicas import ReplicaSet
    from metaq.broker._storage import PartitionLog, Storage
    from metaq.protocol import MsgIdGenerator

__all__ = ["Transactions"]

log = logging.getLogger(__name__)

START, IN_USE, PREPARED, FINISHED = "START", "IN_USE", "PREPARED", "FINISHED"
#: a prepared branch whose commit is decided, its decision being fsynced (then appended)
COMMITTING = "COMMITTING"


class TxError(Exception):
    """A request a transaction refuses: answered ``result 500`` with ``text``."""

    def __init__(self, text: str, code: int | None = None) -> None:
        super().__init__(text)
        self.text = text if code is None else f"XAException:code={code},msg={text}"


@dataclass
class Tx:
    key: str
    xa: bool
    unique_qualifier: str | None
    conn: Any = None                       # the owning connection (local transactions)
    state: str = START
    #: ``(log, topic, partition, message bytes)`` in the order they were put
    puts: list[tuple[PartitionLog, str, int, bytes]] = field(default_factory=list)
    size: int = 0
    timer: asyncio.TimerHandle | None = None
    #: prepared: ``(topic, partition, the log's end then, length)`` per partition
    bounds: list[tuple[str, int, int, int]] | None = None
    #: committing: the ``D``'s places
    decided: list[tuple[str, int, int, int]] | None = None
    #: why a put of it was refused (the first), if one was: a pipelined commit
    #: (``puts=<n>``, ``+txpipe``) then rolls it back instead
    refused: str | None = None


class Transactions:
    """Every open transaction of one broker (event loop thread only)."""

    def __init__(self, storage: Storage, ids: MsgIdGenerator, *, group_commit: bool,
                 max_message_size: int, max_timeout: float, max_size: int,
                 stats: collections.Counter, max_hold: float = 0.0) -> None:
        self.storage = storage
        self.ids = ids
        self.group_commit = group_commit
        self.max_message_size = max_message_size
        self.max_timeout = max_timeout
        self.max_size = max_size
        self.stats = stats
        self.journal = TxJournal(storage.data_dir / "transactions")
        self.xa: dict[str, Tx] = {}
        self.local: dict[Any, dict[str, Tx]] = {}
        self._keys: dict[str, Any] = {}  # parsed transaction keys of recent puts
        self._closed = False
        #: the feed of prepared branches to this broker's slaves (``_txfeed``)
        self.feed = TxFeed(max_hold=max_hold, stats=stats, snapshot=self._snapshot)
        #: while this broker is a master with slaves: what answers wait for
        #: (``Role.become_master``); None otherwise
        self.replicas: ReplicaSet | None = None
        #: a slave's journal is its master's copy: :meth:`take_over` replays it
        self.following = False
        #: bumped by :meth:`step_down`: a commit in flight from before does nothing more
        self._generation = 0

    # -- start and stop --------------------------------------------------------------------
    def recover(self) -> None:
        """Replay the journal: finish commits a crash cut short, prepare the prepared
        branches again, roll back what was in flight; rewrite it with the prepared."""
        keep: list[Replayed] = []
        rolled = 0
        for tx in self.journal.replay():
            if tx.committed is not None or tx.decided is not None:
                self._redo(tx)
            elif tx.rolled_back:
                continue
            elif tx.prepared and parse_transaction_key(tx.key).is_xa:
                if tx.prepared_at is not None and self._was_committed(tx):
                    continue
                branch = self._restore(tx)
                if branch is not None:
                    self.xa[tx.key] = branch
                    keep.append(tx)
            else:
                rolled += 1
        if rolled:
            log.warning("%d transaction(s) in flight when the broker stopped were rolled back",
                        rolled)
        if self.xa:
            log.info("%d prepared XA branch(es) recovered: %s", len(self.xa),
                     ", ".join(self.xa))
        self.journal.rewrite(keep)

    def _was_committed(self, tx: Replayed) -> bool:
        """A prepared branch whose messages a log holds after its ``R``'s lower bounds
        was committed (by a master whose ``D`` this replica never got: ``_txfeed``):
        finish it (append what is missing, never twice) rather than prepare it again."""
        assert tx.prepared_at is not None
        by_part: dict[tuple[str, int], bytes] = {}
        for topic, partition, message in tx.puts:
            by_part.setdefault((topic, partition), message)
        for topic, partition, start, _length in tx.prepared_at:
            plog = self.storage.get(topic, partition)
            first = by_part.get((topic, partition))
            if plog is None or first is None:
                continue
            if _find_appended(plog, start, first) is not None:
                log.warning("prepared branch %s: its messages are in %s-%d: it was "
                            "committed (by the master before a failover); finished, not "
                            "prepared again", tx.key, topic, partition)
                tx.decided = tx.prepared_at
                self._redo(tx)
                self.stats["tx_found_committed"] += 1
                return True
        return False

    def _restore(self, tx: Replayed) -> Tx | None:
        key = parse_transaction_key(tx.key)
        branch = Tx(tx.key, True, key.unique_qualifier, state=PREPARED,
                    bounds=tx.prepared_at)
        for topic, partition, message in tx.puts:
            plog = self.storage.get(topic, partition)
            if plog is None:
                log.error("prepared branch %s puts to %s-%d, which this broker no longer "
                          "serves: the branch is dropped", tx.key, topic, partition)
                return None
            branch.puts.append((plog, topic, partition, message))
            branch.size += len(message)
        return branch

    def _redo(self, tx: Replayed) -> None:
        """A commit the journal has: append what the logs lack (a crash between the
        journal's record and the appends), never twice.  With only its decision
        (``D``, no ``C``), where the messages start is looked for from the decision's
        lower bounds (:func:`_find_appended`)."""
        exact = tx.committed is not None
        places = tx.committed if exact else tx.decided
        assert places is not None
        by_part: dict[tuple[str, int], list[bytes]] = collections.defaultdict(list)
        for topic, partition, message in tx.puts:
            by_part[(topic, partition)].append(message)
        for topic, partition, start, length in places:
            plog = self.storage.get(topic, partition)
            data = b"".join(by_part.get((topic, partition), []))
            if plog is None or len(data) != length or not data:
                log.error("committed transaction %s: cannot finish its part in %s-%d",
                          tx.key, topic, partition)
                continue
            if not exact:
                found = _find_appended(plog, start, data)
                if found is None:  # nothing of it reached the log
                    plog.append(data, _count(data))
                    log.warning("transaction %s, committed (decided) before a crash: "
                                "appended its %d bytes to %s-%d", tx.key, len(data), topic,
                                partition)
                    continue
                start = found
            have = plog.end - start
            if have >= length:
                continue
            if have < 0 or not _at_boundary(data, have):
                log.error("committed transaction %s: %s-%d ends at %d, not inside its "
                          "messages at %d..%d; not appended again", tx.key, topic,
                          partition, plog.end, start, start + length)
                continue
            rest = data[have:]
            plog.append(rest, _count(rest))
            log.warning("committed transaction %s: appended the %d bytes a crash left out "
                        "of %s-%d", tx.key, len(rest), topic, partition)

    # -- replication -----------------------------------------------------------------------
    def _snapshot(self) -> bytes:
        """The feed's snapshot: every branch prepared or committing now."""
        out = []
        for tx in self.xa.values():
            if tx.state not in (PREPARED, COMMITTING):
                continue
            out.extend(put_record(tx.key, t, p, m) for _plog, t, p, m in tx.puts)
            out.append(prepare_record(tx.key, tx.bounds))
            if tx.decided is not None:
                out.append(decide_record(tx.key, tx.decided))
        return b"".join(out)

    def _replicated(self, seq: int | None, plogs: list[PartitionLog]) -> list:
        """What an answer waits for with sync replication: the in-sync slaves hold
        ``plogs`` to their ends and feed event ``seq``."""
        replicas = self.replicas
        if replicas is None:
            return []
        out = []
        if plogs:
            fut = replicas.wait(plogs)
            if fut is not None:
                out.append(fut)
        if seq is not None and replicas.mode == "sync":
            fut = self.feed.wait(seq)
            if fut is not None:
                out.append(fut)
        return out

    def lead(self, replicas: ReplicaSet, listed: tuple[int, ...]) -> None:
        """This broker is master: a slave's journal is replayed first (:meth:`take_over`);
        the feed starts a new incarnation."""
        self.take_over()
        self.replicas = replicas
        self.feed.lead(lambda: replicas.in_sync, listed)

    def take_over(self) -> None:
        """A slave taking over: its journal (its master's feed) is replayed as after a
        restart: prepared branches prepared again, decided commits finished."""
        if not self.following:
            return
        self.following = False
        self.journal.write()
        self.recover()

    def step_down(self, why: str) -> None:
        """No longer master: every open transaction is dropped from memory (its
        connections' next request finds none), a commit in flight stops where it is
        (the journal keeps its decision), and the journal becomes a copy of the new
        master's feed (replaced by its snapshot)."""
        self.replicas = None
        self.following = True
        self._generation += 1
        dropped = list(self.xa.values()) + [t for m in self.local.values() for t in m.values()]
        for tx in dropped:
            if tx.timer is not None:
                tx.timer.cancel()
                tx.timer = None
            tx.state = FINISHED
        if dropped:
            log.warning("%d open transaction(s) dropped: %s", len(dropped), why)
        self.xa.clear()
        self.local.clear()
        self.feed.restart()

    def close(self) -> None:
        self._closed = True
        self.feed.fail("broker stopping")
        for tx in list(self.xa.values()) + [t for m in self.local.values() for t in m.values()]:
            if tx.timer is not None:
                tx.timer.cancel()
        self.journal.close()

    # -- requests --------------------------------------------------------------------------
    def handle(self, conn: Connection, r: TransactionRequest) -> None:
        """One ``transaction`` request; its answer is queued on ``conn`` (END: none)."""
        self.stats["cmd_transaction"] += 1
        try:
            if r.type == "END":
                return  # Java ignores END and does not answer it
            if r.type == "RECOVER":
                keys = [k for k, t in self.xa.items() if t.state == PREPARED and (
                    r.unique_qualifier is None or t.unique_qualifier == r.unique_qualifier)]
                conn.send(answer("\r\n".join(keys).encode(), r.opaque))
                return
            key = r.key
            if key.kind == "null":
                raise TxError(f"{r.type} needs a transaction key", XAER_NOTA)
            if r.type == "BEGIN":
                self._begin(conn, r)
                conn.send(result(200, "", r.opaque))
            elif r.type == "PREPARE":
                self._prepare(conn, r)
            elif r.type in ("COMMIT_ONE_PHASE", "COMMIT_TWO_PHASE"):
                self._commit(conn, r, r.type == "COMMIT_ONE_PHASE")
            elif r.type == "ROLLBACK":
                tx = self._find(conn, key.text, key.is_xa)
                if tx.state == COMMITTING:
                    raise TxError("Cannot call rollback now: the branch is committing.",
                                  XAER_PROTO)
                prepared = tx.state == PREPARED
                rec = self._finish(tx, committed=False)
                self.stats["tx_rolled_back"] += 1
                waits = self._replicated(self.feed.emit(rec), []) if prepared and rec \
                    else []
                self._reply(conn, r.opaque, b"", sync=self.group_commit, also=waits)
            elif r.type == "FORGET":
                if not key.is_xa:
                    raise TxError(f"{key.text} is not a valid xid", XAER_NOTA)
                conn.send(result(200, "", r.opaque))  # no heuristic outcomes to forget
        except TxError as e:
            self.stats["tx_errors"] += 1
            conn.send(result(500, e.text, r.opaque))
        except StorageError as e:
            log.error("transaction %s: %s", r.key.text, e)
            conn.send(result(500, f"XAException:code={XA_RBOTHER},msg={e}", r.opaque))

    def puts(self, conn: Connection, run: list) -> None:
        """A run of puts carrying transaction keys (:class:`~metaq.protocol.PutRequest`, or
        the put loop's :class:`~metaq.protocol.TxPut`): kept (an XA branch's journaled)
        until their commit; answered with one send (with group commit, after the
        journal's fsync when an XA branch's are among them: a local transaction's
        reach the journal only at its commit).  Their msgIds are taken together; each
        payload's CRC32 is computed once."""
        ids = self.ids.next_ids(len(run))
        data = self._same_tx(conn, run, ids) if len(run) >= _COLUMNAR_MIN else None
        if data is None:
            put = self._put
            data = b"".join([put(conn, p, msg_id) for p, msg_id in zip(run, ids, strict=True)])
        if self.group_commit and any(map(_is_xa_key, run)):
            opaques = [p.opaque if type(p) is PutRequest else int(p[4]) for p in run]
            self._reply(conn, opaques[0], data, sync=True, ok_is_body=True, opaques=opaques)
        else:
            conn.send(data)

    def _same_tx(self, conn: Connection, run: list, ids: list[int]) -> bytes | None:
        """The usual run: the put loop's puts of one transaction to one partition, every
        one accepted (their checksums right, the sizes within the limits), kept with
        whole-list steps; their answers.  None, with nothing done, for any other run
        (:meth:`_put` then takes each put, and says what is wrong)."""
        m = len(run)
        first = run[0]
        target, tx_key = first[0], first[6]
        if (type(first) is not TxPut or target.log is None
                or list(map(type, run)).count(TxPut) != m):
            return None
        targets, lengths, flags, checks, opaques, payloads, keys = zip(*run, strict=True)
        if targets.count(target) != m or keys.count(tx_key) != m:
            return None
        key = self._keys.get(tx_key)
        if key is None:
            try:
                key = parse_transaction_key(tx_key.decode())
            except ProtocolError:
                return None
            if len(self._keys) > 10_000:
                self._keys.clear()
            self._keys[tx_key] = key
        tx = self.xa.get(key.text) if key.is_xa else self.local.get(conn, {}).get(key.text)
        if tx is None or tx.state not in (START, IN_USE):
            return None
        crcs = list(map(CHECKSUM_MASK.__and__, map(crc32, payloads)))  # once per put
        if crcs != list(checks) and checks.count(-1) != m and any(
                c != -1 and c != a for c, a in zip(checks, crcs, strict=True)):
            return None
        size = sum(lengths) + HEADER_SIZE * m
        if max(lengths) > self.max_message_size or tx.size + size > self.max_size:
            return None
        plog = target.log
        topic, partition = plog.topic, plog.partition
        messages = None
        if lengths.count(lengths[0]) == m:  # the usual: one size, each message one pack
            try:
                messages = list(map(_message_struct(lengths[0]).pack, lengths, crcs, ids,
                                    flags, payloads))
            except struct.error:  # a payload that is not bytes (a view)
                pass
        if messages is None:
            messages = list(map(bytes.__add__, map(_pack_header, lengths, crcs, ids, flags),
                                payloads))
        if key.is_xa:  # a local transaction's are journaled at its commit (_append)
            self.journal.puts(key.text, topic, partition, messages)
        tx.puts += zip(repeat(plog), repeat(topic), repeat(partition), messages)
        tx.size += size
        tx.state = IN_USE
        self.stats["cmd_put"] += m
        self.stats["tx_puts"] += m
        return tx_answers(opaques, ids, b" %d -1" % partition)  # all in one (C)

    def _put(self, conn: Connection, p: PutRequest | TxPut, msg_id: int) -> bytes:
        self.stats["cmd_put"] += 1
        plog: PartitionLog | None
        if type(p) is TxPut:  # the put loop's: its target (a PickTarget for partition -1)
            target, _length, flag, check, opaque_token, payload, tx_key = p
            opaque = int(opaque_token)
            plog = target.log
            if plog is None:
                topic, partition = target.topic, -1
            else:
                topic, partition = plog.topic, plog.partition
        else:
            topic, partition, _length, flag, check, tx_key, opaque, payload = p
            plog = None
        tx: Tx | None = None
        try:
            key = self._keys.get(tx_key)
            if key is None:
                try:
                    key = parse_transaction_key(
                        tx_key.decode() if type(tx_key) is bytes else tx_key)
                except ProtocolError as e:  # Java's decoder would close the connection
                    return result(400, str(e), opaque)
                if len(self._keys) > 10_000:
                    self._keys.clear()
                self._keys[tx_key] = key
            tx = self._find(conn, key.text, key.is_xa)
            if tx.state not in (START, IN_USE):
                raise TxError(f"transaction {key.text} is {tx.state.lower()}: no more puts",
                              XAER_PROTO)
            if partition < 0:
                raise TxError(f"Invalid partition for transaction command:{partition}")
            if plog is None:
                plog = self.storage.get(topic, partition)
                if plog is None:
                    return _refused(tx, 404, f"topic {topic} partition {partition} not "
                                             f"found", opaque)
            actual = crc32(payload) & CHECKSUM_MASK  # once
            if check != -1 and check != actual:  # -1: not given (Java's)
                return _refused(tx, 400, "checksum mismatch", opaque)
            if len(payload) > self.max_message_size:
                return _refused(tx, 400, f"message of {len(payload)} bytes is over "
                                         f"max_message_size {self.max_message_size}", opaque)
            if tx.size + len(payload) > self.max_size:
                raise TxError(f"transaction {key.text} would hold more than "
                              f"max_transaction_size={self.max_size} bytes", XAER_RMERR)
            message = _pack_header(len(payload), actual, msg_id, flag) + payload
            if key.is_xa:  # a local transaction's are journaled at its commit (_append)
                self.journal.put(key.text, topic, partition, message)
            tx.puts.append((plog, topic, partition, message))
            tx.size += len(message)
            tx.state = IN_USE
            self.stats["tx_puts"] += 1
            return answer(b"%d %d -1" % (msg_id, partition), opaque)
        except TxError as e:
            self.stats["put_failed"] += 1
            return _refused(tx, 500, e.text, opaque) if tx is not None \
                else result(500, e.text, opaque)
        except StorageError as e:
            self.stats["put_failed"] += 1
            return _refused(tx, 500, f"write failed: {e}", opaque) if tx is not None \
                else result(500, f"write failed: {e}", opaque)

    def connection_closed(self, conn: Connection) -> None:
        """Roll back the local transactions ``conn`` left open (Java's
        LocalTransactionRollbackListener)."""
        self.feed.connection_closed(conn)
        mine = self.local.pop(conn, None)
        for tx in (mine or {}).values():
            log.info("connection from %s closed: its open local transaction %s is rolled "
                     "back", getattr(conn, "peer", "?"), tx.key)
            self._finish(tx, committed=False, drop=False)
            self.stats["tx_rolled_back"] += 1

    # -- the steps -------------------------------------------------------------------------
    def _find(self, conn: Connection, key: str, xa: bool) -> Tx:
        tx = self.xa.get(key) if xa else self.local.get(conn, {}).get(key)
        if tx is not None:
            return tx
        if xa:
            raise TxError(f"XA transaction '{key}' has not been started.", XAER_NOTA)
        raise TxError(f"Local transaction '{key}' has not been started.")

    def _begin(self, conn: Connection, r: TransactionRequest) -> None:
        key = r.key
        if key.is_xa:
            if key.text in self.xa:
                return
            tx = self.xa[key.text] = Tx(key.text, True, key.unique_qualifier)
        else:
            mine = self.local.setdefault(conn, {})
            if key.text in mine:
                return
            tx = mine[key.text] = Tx(key.text, False, r.unique_qualifier, conn=conn)
        self.stats["tx_begun"] += 1
        if r.timeout > 0:
            delay = float(r.timeout)
            if self.max_timeout > 0:
                delay = min(delay, self.max_timeout)
            tx.timer = asyncio.get_running_loop().call_later(delay, self._timed_out, tx)

    def _timed_out(self, tx: Tx) -> None:
        tx.timer = None
        if tx.state in (START, IN_USE):
            log.warning("transaction %s timed out: rolled back", tx.key)
            self._finish(tx, committed=False)
            self.stats["tx_timed_out"] += 1

    def _prepare(self, conn: Connection, r: TransactionRequest) -> None:
        key = r.key
        if not key.is_xa:
            self._find(conn, key.text, False)
            raise TxError("Prepare not implemented on Local Transactions.", XAER_RMERR)
        tx = self._find(conn, key.text, True)
        if tx.state == START:  # nothing to commit
            self._finish(tx, committed=False, journal=False)
            conn.send(answer(b"%d" % XA_RDONLY, r.opaque))
            return
        if tx.state != IN_USE:
            raise TxError("Cannot call prepare now.", XAER_PROTO)
        tx.bounds = [(topic, partition, plog.end, len(data))
                     for plog, (topic, partition, data, _n) in _by_partition(tx).items()]
        rec = self.journal.prepare(tx.key, tx.bounds)
        seq = self.feed.emit(b"".join([put_record(tx.key, t, p, m) for _l, t, p, m in tx.puts])
                             + rec)
        tx.state = PREPARED
        if tx.timer is not None:
            tx.timer.cancel()
            tx.timer = None
        self.stats["tx_prepared"] += 1
        self._reply(conn, r.opaque, answer(b"%d" % XA_OK, r.opaque), sync=True,
                    ok_is_body=True, also=self._replicated(seq, []))

    def _commit(self, conn: Connection, r: TransactionRequest, one_phase: bool) -> None:
        key = r.key
        tx = self._find(conn, key.text, key.is_xa)
        if tx.state == IN_USE and not one_phase:
            raise TxError("Cannot do 2 phase commit if the transaction has not been prepared.",
                          XAER_PROTO)
        if tx.state not in (START, IN_USE, PREPARED):
            raise TxError("Cannot call commit now.", XAER_PROTO)
        if r.puts is not None and (tx.refused is not None or len(tx.puts) != r.puts):
            # a pipelined commit (``+txpipe``): sent without waiting for the puts'
            # answers, so it must not commit a transaction one of them is missing from
            why = (f"a put in it was refused ({tx.refused})" if tx.refused is not None
                   else f"it holds {len(tx.puts)} of the {r.puts} messages sent")
            self._finish(tx, committed=False)
            self.stats["tx_rolled_back"] += 1
            raise TxError(f"COMMIT FAILED: {why}; transaction {key.text} rolled back")
        closed = [f"{plog.topic}-{plog.partition}"
                  for plog in dict.fromkeys(map(_target_of, tx.puts)) if plog.closed]
        if closed:
            self._finish(tx, committed=False)
            raise TxError(f"COMMIT FAILED: partition {closed[0]} is closed; transaction "
                          f"rolled back", XA_RBOTHER)
        if tx.state == PREPARED:
            self._commit_prepared(conn, r, tx)
            return
        written, _rec = self._append(tx)
        self._finish(tx, committed=True)
        self.stats["tx_committed"] += 1
        futs = [plog.request_flush() for plog in written] if self.group_commit else []
        futs += self._replicated(None, written)
        self._reply(conn, r.opaque, b"", sync=self.group_commit, also=futs)

    def _commit_prepared(self, conn: Connection, r: TransactionRequest, tx: Tx) -> None:
        """The commit of a prepared branch (module docstring): its decision (``D``)
        fsynced off the event loop, the branch COMMITTING meanwhile; then the appends
        and ``C`` (:meth:`_append`); answered (in its place among the connection's
        replies) after the journal's fsync, and the partitions' with group commit."""
        tx.state = COMMITTING
        groups = _by_partition(tx)
        tx.decided = [(topic, partition, plog.end, len(data))
                      for plog, (topic, partition, data, _n) in groups.items()]
        self.feed.emit(self.journal.decide(tx.key, tx.decided))
        generation = self._generation
        loop = asyncio.get_running_loop()
        out: asyncio.Future = loop.create_future()
        conn.send_gated(Gate(out, result(200, "", r.opaque), [r.opaque]))
        decided = loop.run_in_executor(self.storage.executor, self.journal.sync)

        def answer_with(data: bytes | None) -> None:
            if not out.done():
                out.set_result(data)

        def synced(g: asyncio.Future) -> None:
            err = g.exception()
            answer_with(None if err is None else result(
                500, f"message written but not synced: {err}", r.opaque))

        def append(f: asyncio.Future) -> None:
            err = f.exception()
            if err is not None:  # the decision may be on disk all the same: carry it out
                log.error("transaction %s: fsync of the journal %s failed: %s; its commit is "
                          "carried out", tx.key, self.journal.path, err)
            if self._closed:  # stopping: recovery finishes it from the decision
                return
            if generation != self._generation:  # no longer master: the journal keeps
                answer_with(result(503, "the broker stopped leading before the commit "  # its
                                        "was carried out", r.opaque))  # decision
                return
            try:
                written, rec = self._append(tx)
            except StorageError as e:
                log.error("transaction %s: commit cut short (%s); the branch stays "
                          "committing until a restart finishes it from the journal",
                          tx.key, e)
                self.stats["tx_errors"] += 1
                answer_with(result(500, f"XAException:code={XAER_RMERR},msg={e}", r.opaque))
                return
            self._finish(tx, committed=True)
            self.stats["tx_committed"] += 1
            waits = [plog.request_flush() for plog in written] if self.group_commit else []
            waits += self._replicated(self.feed.emit(rec), written)
            self.journal.write()
            waits.append(loop.run_in_executor(self.storage.executor, self.journal.sync))
            asyncio.gather(*waits).add_done_callback(synced)

        decided.add_done_callback(append)

    def _append(self, tx: Tx) -> tuple[list[PartitionLog], bytes]:
        """The commit itself: the journal's ``C`` record (where each partition's
        messages go), then one append per partition, in put order; the logs written
        and the record."""
        groups = _by_partition(tx)
        if not tx.xa:
            self._journal_local(tx, groups)
        rec = self.journal.commit(tx.key, [(topic, partition, plog.end, len(data))
                                           for plog, (topic, partition, data, _n)
                                           in groups.items()])
        for plog, (_topic, _partition, data, n) in groups.items():
            plog.append(data, n)
        return list(groups), rec

    def _journal_local(self, tx: Tx, groups: dict[PartitionLog, tuple[str, int, bytes, int]]
                       ) -> None:
        """A local transaction's messages, journaled only at its commit (one that never
        commits needs none: recovery rolls back whatever has no ``C``), written with
        the ``C`` in one write: per partition, ``P`` records each holding a run of
        whole messages (at most :data:`_P_RUN` bytes of them, a message over it alone),
        which the redo after a crash joins again as it joins single puts."""
        for plog, (topic, partition, data, _n) in groups.items():
            if len(data) <= _P_RUN:
                self.journal.put(tx.key, topic, partition, data)
                continue
            run: list[bytes] = []
            size = 0
            for target, _t, _p, message in tx.puts:
                if target is not plog:
                    continue
                if run and size + len(message) > _P_RUN:
                    self.journal.put(tx.key, topic, partition, b"".join(run))
                    run, size = [], 0
                run.append(message)
                size += len(message)
            if run:
                self.journal.put(tx.key, topic, partition, b"".join(run))

    def _finish(self, tx: Tx, *, committed: bool, journal: bool = True,
                drop: bool = True) -> bytes | None:
        """``tx`` is over; the ``X`` record written for a rollback, if one was."""
        rec = None
        if tx.timer is not None:
            tx.timer.cancel()
            tx.timer = None
        if not committed and journal and tx.puts:
            rec = self.journal.rollback(tx.key)
        tx.state = FINISHED
        if tx.xa:
            self.xa.pop(tx.key, None)
        elif drop:
            mine = self.local.get(tx.conn)
            if mine is not None:
                mine.pop(tx.key, None)
                if not mine:
                    self.local.pop(tx.conn, None)
        if not self.xa and not self.local and self.journal.size > COMPACT_AT:
            self._compact()
        return rec

    def _compact(self) -> None:
        """Nothing open: start the journal afresh once the partitions hold what the
        commits appended (their fsync), if still nothing is open then."""
        logs = self.storage.logs()
        futs = [p.request_flush() for p in logs]

        def done(_f: asyncio.Future) -> None:
            if not self.xa and not self.local:
                try:
                    self.journal.rewrite([])
                    log.info("transaction journal compacted")
                except StorageError as e:
                    log.error("%s", e)

        if futs:
            asyncio.gather(*futs, return_exceptions=True).add_done_callback(done)

    def _reply(self, conn: Connection, opaque: int, body: bytes, *, sync: bool,
               ok_is_body: bool = False, also: list | None = None,
               opaques: list[int] | None = None) -> None:
        """``body`` (or an empty 200) to ``conn``, after the journal's fsync when
        ``sync`` (and the futures ``also``)."""
        data = body if ok_is_body else result(200, "", opaque)
        if not sync and not also:
            conn.send(data)
            return
        loop = asyncio.get_running_loop()
        waits = list(also or [])
        if sync:
            self.journal.write()
            waits.append(loop.run_in_executor(self.storage.executor, self.journal.sync))
        fut = asyncio.gather(*waits) if len(waits) > 1 else waits[0]
        conn.send_gated(Gate(fut, data, opaques or [opaque]))


def _is_xa_key(p: PutRequest | TxPut) -> bool:
    """Whether put ``p`` names an XA branch (``XID:...``)."""
    key = p[6] if type(p) is TxPut else p.tx_key
    return (key if type(key) is bytes else str(key).encode()).startswith(b"XID:")


def _refused(tx: Tx, code: int, text: str, opaque: int) -> bytes:
    """A put of ``tx`` refused: the answer; ``tx`` remembers the first refusal."""
    if tx.refused is None:
        tx.refused = text
    return result(code, text, opaque)


def _by_partition(tx: Tx) -> dict[PartitionLog, tuple[str, int, bytes, int]]:
    """``tx``'s messages per partition, in put order: ``log -> (topic, partition, their
    bytes, how many)``."""
    puts = tx.puts
    if puts and len(dict.fromkeys(map(_target_of, puts))) == 1:  # the usual: one partition
        plog, topic, partition, _m = puts[0]
        return {plog: (topic, partition, b"".join(map(_message_of, puts)), len(puts))}
    groups: dict[PartitionLog, tuple[str, int, list[bytes]]] = {}
    for plog, topic, partition, message in puts:
        g = groups.get(plog)
        if g is None:
            g = groups[plog] = (topic, partition, [])
        g[2].append(message)
    return {plog: (t, p, b"".join(msgs), len(msgs)) for plog, (t, p, msgs) in groups.items()}


_pack_header = HEADER.pack


@functools.lru_cache(maxsize=64)
def _message_struct(length: int) -> struct.Struct:
    """A message of a ``length``-byte payload, header and payload packed at once (the
    header's fields then the payload: what ``_pack_header(...) + payload`` makes)."""
    return struct.Struct(HEADER.format + f"{length}s")

_target_of = operator.itemgetter(0)
_message_of = operator.itemgetter(3)
#: Most message bytes in one ``P`` record of a local transaction (``_journal_local``).
_P_RUN = 8 << 20
#: Smallest run worth :meth:`Transactions._same_tx`'s whole-list steps.
_COLUMNAR_MIN = 8
_SEARCH_CHUNK = 4 << 20


def _find_appended(plog: PartitionLog, start: int, data: bytes) -> int | None:
    """Where ``data`` (whole messages) starts in ``plog``, looked for from ``start``
    (the log's end when the commit was decided, or when the branch was prepared) by
    the bytes of its first message, whole (its msgId, assigned once by this broker
    id, makes them unique); None when it is not there.  Read in chunks of
    :data:`_SEARCH_CHUNK` (a message never spans two segments or a damaged range:
    a short read ends one)."""
    first = data[:HEADER_SIZE + HEADER.unpack_from(data, 0)[0]]
    n = len(first)
    pos = start
    end = plog.end
    while pos + n <= end:
        chunk = plog.read_bytes(pos, max(_SEARCH_CHUNK, 2 * n))
        if not chunk:
            damage = plog.damage_at(pos)
            if damage is None:
                return None
            pos = damage[1]
            continue
        i = chunk.find(first)
        if i >= 0:
            return pos + i
        if len(chunk) < max(_SEARCH_CHUNK, 2 * n):  # the end of a segment (or a damage)
            pos += len(chunk)
        else:
            pos += len(chunk) - n + 1
    return None


def _count(data: bytes) -> int:
    return scan_messages(data, max_payload=INT32_MAX)[1]


def _at_boundary(data: bytes, pos: int) -> bool:
    """Whether ``pos`` is 0, the end, or a message start in ``data`` (whole messages)."""
    b = 0
    while b < pos:
        b += HEADER_SIZE + HEADER.unpack_from(data, b)[0]
    return b == pos

