"""The idempotent producer's sequence numbers: a producer id and, per partition, the
next sequence number (``ProducerConfig(idempotent=True)``).

Every message sent to a broker that offers ``+idempotent`` carries ``(pid, seq)``
in an ``idem`` mark before its put (``metaq.protocol``): ``seq`` counts the
messages of this producer to that partition, and a resend (the retry of an
attempt whose answer was lost) carries the same pair, so the broker stores it
once and answers it with the original msgId and offset.  A batch chunk takes
``n`` consecutive seqs and one mark.

Seqs are taken with the partition's :class:`Sequence` locked, around the very call
that queues the put on the connection (:attr:`Sequence.lock`), so that puts leave
in seq order and a seq is used only when its put was queued.  When a message with
a seq fails for good (its retries or time ran out) the broker may or may not
hold it, and the seqs after it would wait for it for ever (a gap): the
partition's sequence then restarts under a new producer id
(:meth:`Sequences.restart`); messages of the old id still in flight that the
broker refuses as a gap were not stored, and take seqs of the new one.
"""

from __future__ import annotations

import secrets
import threading

from zk_layout import Partition

__all__ = ["Sequences", "Sequence", "new_pid"]


def new_pid() -> int:
    """A random producer id in 1..2**63-1: two producers picking the same one is as
    likely as a collision of 63 random bits, and nothing has to be asked of anyone
    (a ZooKeeper counter would cost a round trip and tie the producer to one
    ensemble; a process restarted gets a new id either way)."""
    return secrets.randbits(63) or 1


class Sequence:
    """One partition's producer id and next seq.

    :attr:`lock` orders the puts: hold it from :meth:`take` through queueing the put
    and :meth:`taken` (it may then be held while a put waits for room in the
    window).  :attr:`state` ``(pid, next)`` changes only under a short lock of its
    own, never held while anything waits, so that a connection's reader thread may
    :meth:`restart` it (a refusal it reads) without waiting for a sender."""

    __slots__ = ("state", "lock", "_state_lock")

    def __init__(self, pid: int) -> None:
        self.state = (pid, 0)
        self.lock = threading.Lock()
        self._state_lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self.state[0]

    def take(self) -> tuple[int, int]:
        """``(pid, seq)`` for the next put (``lock`` held)."""
        return self.state

    def taken(self, pid: int, seq: int, n: int) -> None:
        """``n`` puts from ``(pid, seq)`` were queued: the next one follows them (unless
        the sequence restarted meanwhile)."""
        with self._state_lock:
            if self.state[0] == pid:
                self.state = (pid, seq + n)

    def restart(self, pid: int) -> None:
        """Restart under a new id, unless ``pid`` is no longer the current one."""
        with self._state_lock:
            if self.state[0] == pid:
                self.state = (new_pid(), 0)


class Sequences:
    """The producer's sequences, one per partition (made on first use)."""

    def __init__(self) -> None:
        #: the id every partition starts with (restarts take new ones)
        self.pid = new_pid()
        self._by_part: dict[Partition, Sequence] = {}
        self._lock = threading.Lock()

    def of(self, part: Partition) -> Sequence:
        """``part``'s sequence."""
        s = self._by_part.get(part)
        if s is None:
            with self._lock:
                s = self._by_part.setdefault(part, Sequence(self.pid))
        return s

    def restart(self, part: Partition, pid: int) -> None:
        """A message of ``pid`` to ``part`` failed for good: restart the partition's
        sequence under a new id (unless that happened already)."""
        self.of(part).restart(pid)

    def current(self, part: Partition) -> int:
        """The id ``part``'s sequence uses now."""
        return self.of(part).pid
