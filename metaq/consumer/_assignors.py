"""Partition assignment strategies: pure functions, one share per consumer.

Every member of a consumer group computes its own share from the same ZooKeeper
view (the group's consumer ids and the topic's partition names), exactly as
Metaq does, so the strategies must be deterministic functions of their inputs.
Inputs are de-duplicated and sorted here, in Java's ``String.compareTo`` order
(:func:`java_string_key`), whatever order the caller passes them in; that is
the order Metaq's ``Collections.sort`` gives, which makes a mixed Java/Python
group agree.

Strategies (names as in :data:`STRATEGIES`):

``default``
    Metaq's ``DefaultLoadBalanceStrategy`` (range): consecutive runs of the
    sorted partitions, the first ``P % C`` consumers getting one more.
``consist``
    Metaq's ``ConsisHashStrategy`` (ketama consistent hash, 160 points per
    consumer).  Not balanced; Metaq calls it "uneven, not recommended".
``roundrobin``
    Sorted partition ``i`` goes to sorted consumer ``i % C``.  Python only.
``sticky``
    Balanced like ``default`` but keeps partitions with their current owners
    (``previous``, read from the owner nodes) and moves the fewest.  Python
    only: every member of the group must run it.
``cooperative``
    Balanced like ``default`` and, like it, computed from the member ids and
    partition names alone (no owner reads: it settles as fast as
    ``default``), but by consistent hashing with exactly bounded loads, so a
    join or a leave leaves most partitions where they are.  It moves more
    than ``sticky``'s fewest: measured, about 1.2-1.5 times as many for 3-8
    members, 2-2.9 times for 31-64 members (``default``: up to 30 times).
    Python only.

All strategies share one signature, ``strategy(consumer_ids, partitions, *,
me, previous=None) -> list[str]``; only ``sticky`` reads ``previous``.

>>> parts = [f"0-{i}" for i in range(8)]
>>> assign_default(["c1", "c2", "c3"], parts, me="c3")
['0-6', '0-7']
>>> assign_all(["c2", "c1"], ["0-1", "0-0", "0-2"], strategy="roundrobin")
{'c1': ['0-0', '0-2'], 'c2': ['0-1']}
>>> get_strategy("sticky").name
'sticky'
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from metaq._errors import ConfigError

__all__ = [
    "AssignFunction",
    "Strategy",
    "STRATEGIES",
    "get_strategy",
    "assign_all",
    "assign_default",
    "assign_consist",
    "assign_roundrobin",
    "assign_sticky",
    "assign_cooperative",
    "java_string_key",
    "java_utf8",
    "ketama_hash",
]

#: Virtual nodes per consumer on the consistent-hash ring (Metaq's ``NUM_REPS``).
RING_POINTS_PER_CONSUMER = 160

#: Ring points per consumer for ``cooperative`` (its own ring, not Metaq's).
COOPERATIVE_POINTS_PER_CONSUMER = 100


class AssignFunction(Protocol):
    def __call__(self, consumer_ids: Sequence[str], partitions: Sequence[str], *,
                 me: str, previous: Mapping[str, str] | None = None) -> list[str]: ...


# --------------------------------------------------------------------------- Java string rules

def java_string_key(s: str) -> bytes:
    """Sort key giving Java's ``String.compareTo`` order.

    Java compares UTF-16 code units, Python compares code points; they differ
    once a string holds a character above U+FFFF (a surrogate pair, 0xD800..)
    next to one in U+E000..U+FFFF.  Big-endian UTF-16 bytes compared as bytes
    are exactly the code units compared one by one, shorter prefix first.

    >>> sorted(["0-2", "0-10", "0-1"], key=java_string_key)
    ['0-1', '0-10', '0-2']
    >>> sorted(["\\U0001F600", "\\uFFFD"])   # Python: by code point
    ['\\ufffd', '😀']
    >>> sorted(["\\U0001F600", "\\uFFFD"], key=java_string_key)   # Java: 0xD83D < 0xFFFD
    ['😀', '\\ufffd']
    """
    return s.encode("utf-16-be", "surrogatepass")


def java_utf8(s: str) -> bytes:
    """The bytes of Java's ``s.getBytes("utf-8")``.

    Same as ``s.encode("utf-8")`` for every well-formed string; a lone
    surrogate (possible in a Python ``str``) becomes ``?`` as Java's encoder
    replaces it, and two adjacent surrogate code points forming a pair are
    encoded as the one character Java would see.

    >>> java_utf8("0-1")
    b'0-1'
    >>> java_utf8("a\\ud800b")
    b'a?b'
    >>> java_utf8("\\ud83d\\ude00") == "\\U0001F600".encode("utf-8")
    True
    """
    try:
        return s.encode("utf-8")
    except UnicodeEncodeError:
        as_java = s.encode("utf-16-be", "surrogatepass").decode("utf-16-be", "surrogatepass")
        return as_java.encode("utf-8", "replace")


def ketama_hash(key: str) -> int:
    """Metaq's ``HashAlgorithm.KETAMA_HASH``: little-endian uint32 of ``MD5(key)[0:4]``.

    (Values here and in :func:`assign_consist` are what the Java model in
    ``tests/golden/AssignGolden.java`` prints.)

    >>> ketama_hash("0-0")
    53638855
    """
    return int.from_bytes(hashlib.md5(java_utf8(key)).digest()[:4], "little")


# --------------------------------------------------------------------------- input handling

def _names(values: Iterable[str], what: str) -> list[str]:
    """Validate, de-duplicate and sort (Java order) consumer ids or partition names."""
    if isinstance(values, str | bytes):
        raise TypeError(f"{what} must be a sequence of strings, not a single "
                        f"{type(values).__name__} {values!r}")
    seen: set[str] = set()
    for v in values:
        if not isinstance(v, str):
            raise TypeError(f"{what} must hold strings, got {type(v).__name__} {v!r}")
        if not v:
            raise ValueError(f"{what} must not hold an empty string")
        seen.add(v)
    return sorted(seen, key=java_string_key)


def _me(me: str) -> str:
    if not isinstance(me, str):
        raise TypeError(f"me must be a consumer id string, got {type(me).__name__} {me!r}")
    return me


def _previous(previous: Mapping[str, str] | None) -> dict[str, str]:
    if previous is None:
        return {}
    if not isinstance(previous, Mapping):
        raise TypeError("previous must be a mapping partition -> owner consumer id, "
                        f"got {type(previous).__name__}")
    for part, owner in previous.items():
        if not isinstance(part, str) or not isinstance(owner, str):
            raise TypeError("previous must map partition names (str) to consumer ids (str), "
                            f"got {part!r} -> {owner!r}")
    return dict(previous)


# --------------------------------------------------------------------------- global plans

_Plan = Callable[[list[str], list[str], dict[str, str]], dict]


def _plan_default(consumers: list[str], parts: list[str], previous: dict[str, str]) -> dict:
    """Range plan; ``consumers`` and ``parts`` already sorted and unique."""
    plan: dict[str, list[str]] = {}
    if not consumers:
        return plan
    per, extra = divmod(len(parts), len(consumers))
    for pos, consumer in enumerate(consumers):
        start = per * pos + min(pos, extra)
        count = per + (1 if pos < extra else 0)
        plan[consumer] = parts[start:start + count]
    return plan


def _ring(consumers: list[str]) -> tuple[list[int], list[str]]:
    """The ketama ring: sorted points and the owner of each.

    Consumers are added in (Java-sorted) list order, and a later consumer's
    point overwrites an earlier one's on collision, as ``TreeMap.put`` does.
    """
    owner_of: dict[int, str] = {}
    for consumer in consumers:
        for i in range(RING_POINTS_PER_CONSUMER // 4):
            digest = hashlib.md5(java_utf8(f"{consumer}-{i}")).digest()
            for h in range(4):
                owner_of[int.from_bytes(digest[4 * h:4 * h + 4], "little")] = consumer
    points = sorted(owner_of)
    return points, [owner_of[p] for p in points]


def _plan_consist(consumers: list[str], parts: list[str], previous: dict[str, str]) -> dict:
    plan: dict[str, list[str]] = {c: [] for c in consumers}
    if not consumers:
        return plan
    points, owners = _ring(consumers)
    for part in parts:
        i = bisect.bisect_left(points, ketama_hash(part))   # first point >= hash
        plan[owners[i % len(points)]].append(part)          # past the last: wrap
    return plan


def _plan_roundrobin(consumers: list[str], parts: list[str], previous: dict[str, str]) -> dict:
    plan: dict[str, list[str]] = {c: [] for c in consumers}
    if not consumers:
        return plan
    for i, part in enumerate(parts):
        plan[consumers[i % len(consumers)]].append(part)
    return plan


def _plan_sticky(consumers: list[str], parts: list[str], previous: dict[str, str]) -> dict:
    """Balanced plan keeping the most partitions with their current owners.

    1. ``held[m]``: partitions ``previous`` gives to member ``m`` (owners no
       longer in the group, and partitions no longer listed, are ignored).
    2. Quotas: ``P // C`` each, plus one for ``P % C`` members chosen by most
       held first, then by id.  This maximises what can be kept.
    3. Each member keeps its first ``quota`` held partitions (sorted order).
    4. The rest (orphans and excess), in sorted order, fill the members short
       of their quota, in sorted member order.

    With no ``previous`` this is exactly the ``default`` plan.
    """
    plan: dict[str, list[str]] = {c: [] for c in consumers}
    if not consumers:
        return plan
    held: dict[str, list[str]] = {c: [] for c in consumers}
    for part in parts:
        owner = previous.get(part)
        if owner in held:
            held[owner].append(part)
    per, extra = divmod(len(parts), len(consumers))
    by_preference = sorted(consumers, key=lambda c: (-len(held[c]), java_string_key(c)))
    quota = {c: per + (1 if rank < extra else 0) for rank, c in enumerate(by_preference)}
    kept: set[str] = set()
    for c in consumers:
        plan[c] = held[c][:quota[c]]
        kept.update(plan[c])
    pool = [p for p in parts if p not in kept]
    it = iter(pool)
    for c in consumers:
        for _ in range(quota[c] - len(plan[c])):
            plan[c].append(next(it))
        plan[c].sort(key=java_string_key)
    return plan


# The cooperative ring.  These bytes are part of the plan: every member of a
# group must compute the same one, so changing a prefix, the point count or the
# hash breaks mixed-version groups (test_cooperative_exact_plan pins them).
_COOP_MEMBER_PREFIX = b"metaq.cooperative.member\x00"
_COOP_PARTITION_PREFIX = b"metaq.cooperative.partition\x00"
_COOP_UNPACK_POINTS = struct.Struct(f">{COOPERATIVE_POINTS_PER_CONSUMER}Q").unpack
_MASK64 = (1 << 64) - 1


def _cooperative_ring(consumers: list[str]) -> tuple[list[int], list[int]]:
    """Sorted ring points and, for each, the index of its owner in ``consumers``.

    A member's points are the big-endian uint64s of SHAKE-128 of its id's UTF-8
    bytes (after a fixed prefix), so they depend on the id alone: a join or a
    leave adds or removes one member's points and leaves everyone else's.  Two
    members on one point (odds 2**-64) are ordered by their sorted position.
    """
    packed: list[int] = []
    for index, consumer in enumerate(consumers):
        digest = hashlib.shake_128(_COOP_MEMBER_PREFIX + java_utf8(consumer)).digest(
            8 * COOPERATIVE_POINTS_PER_CONSUMER)
        packed.extend((point << 32) | index for point in _COOP_UNPACK_POINTS(digest))
    packed.sort()
    return [v >> 32 for v in packed], [v & 0xFFFFFFFF for v in packed]


def _cooperative_key(part: str) -> int:
    """A partition's place on the ring: uint64 of SHAKE-128 of its name."""
    return int.from_bytes(
        hashlib.shake_128(_COOP_PARTITION_PREFIX + java_utf8(part)).digest(8), "big")


def _plan_cooperative(consumers: list[str], parts: list[str], previous: dict[str, str]) -> dict:
    """Consistent hashing with exactly bounded loads, placed nearest first.

    1. Ring: each member has 100 points on a 64-bit ring; each partition a key
       (:func:`_cooperative_ring`, :func:`_cooperative_key`).  Walking
       clockwise from its key, a partition meets the members in its own order
       of preference; the first is its consistent-hash owner.
    2. Caps: every member may take ``P // C``; the first ``P % C`` members to
       reach that may take one more.  The caps add up to ``P``, so every member
       ends with ``P // C`` or ``P // C + 1``.
    3. Placement, nearest first: among all unplaced partitions, the one whose
       next point is the shortest walk from its key takes that point's member
       if it has room; a member without room is passed, and the partition walks
       on to the next point of a member with room.  Every partition thus
       ends at the nearest member, clockwise, that still had room when its
       turn came.

    A join or a leave changes one member's points and nothing else, so most
    partitions keep their place; what moves beyond the minimum comes from the
    caps: a member that a joiner takes from, or that inherits from a leaver,
    is rarely the one whose share has to shrink or grow, and the overflow
    walks on.  No history-free strategy avoids that entirely: if every join
    and every leave moved only the minimum, each partition's owner would be
    the first member of the group in a fixed order of preference (rendezvous
    hashing), and no fixed preferences give every group an exactly balanced
    share.  ``previous`` is ignored.

    Cost: sorting the ``100 * C`` ring points plus a heap of ``P``
    partitions; measured with ``timeit`` (CPython 3.11): 3.4 ms for the
    whole plan of 64 members and 1024 partitions, 26 ms for 256 and 8192
    (``default``: under 0.1 ms).
    """
    plan: dict[str, list[str]] = {c: [] for c in consumers}
    if not consumers or not parts:
        return plan
    base, extra = divmod(len(parts), len(consumers))
    points, owners = _cooperative_ring(consumers)
    n = len(points)
    keys = [_cooperative_key(part) for part in parts]
    # (distance walked to the next candidate point, partition index, point index)
    heap = []
    for j, key in enumerate(keys):
        i = bisect.bisect_left(points, key)             # first point at or after the key
        heap.append(((points[i % n] - key) & _MASK64, j, i))
    heapq.heapify(heap)
    count = [0] * len(consumers)
    full = [False] * len(consumers)                     # once full, full for good
    extras_taken = 0
    shares: list[list[int]] = [[] for _ in consumers]
    while heap:
        _, j, i = heapq.heappop(heap)
        owner = owners[i % n]
        if full[owner]:
            # Walk on to the next point of a member with room.  Some member
            # has room while a partition is unplaced, and members only fill
            # up, so the walk ends within one lap of the key: the distance
            # below, taken modulo 2**64, keeps growing along it.
            i += 1
            while full[owners[i % n]]:
                i += 1
            heapq.heappush(heap, ((points[i % n] - keys[j]) & _MASK64, j, i))
            continue
        shares[owner].append(j)
        count[owner] += 1
        if count[owner] > base:
            full[owner] = True
            extras_taken += 1
            if extras_taken == extra:                   # the extra places are gone
                for m, held in enumerate(count):
                    if held == base:
                        full[m] = True
        elif count[owner] == base and extras_taken == extra:
            full[owner] = True
    for index, consumer in enumerate(consumers):
        plan[consumer] = [parts[j] for j in sorted(shares[index])]
    return plan


# --------------------------------------------------------------------------- public API

@dataclass(frozen=True, kw_only=True)
class Strategy:
    """A named assignment strategy.

    ``strategy(consumer_ids, partitions, me=..., previous=...)`` returns
    ``me``'s share; :meth:`assign_all` the whole group's.  ``balanced``: every
    share holds ``P // C`` or ``P // C + 1`` partitions.  ``java_compatible``:
    a Java Metaq consumer with the same strategy type computes the same plan.
    """

    name: str
    balanced: bool
    java_compatible: bool
    uses_previous: bool
    _plan: _Plan

    def __call__(self, consumer_ids: Sequence[str], partitions: Sequence[str], *,
                 me: str, previous: Mapping[str, str] | None = None) -> list[str]:
        me = _me(me)
        consumers = _names(consumer_ids, "consumer_ids")
        parts = _names(partitions, "partitions")
        prev = _previous(previous)
        if me not in consumers:
            return []
        return list(self._plan(consumers, parts, prev).get(me, []))

    def assign_all(self, consumer_ids: Sequence[str], partitions: Sequence[str], *,
                   previous: Mapping[str, str] | None = None) -> dict[str, list[str]]:
        """Every member's share, keyed by consumer id in Java-sorted order."""
        consumers = _names(consumer_ids, "consumer_ids")
        parts = _names(partitions, "partitions")
        plan = self._plan(consumers, parts, _previous(previous))
        return {c: list(plan.get(c, [])) for c in consumers}


DEFAULT = Strategy(name="default", balanced=True, java_compatible=True,
                   uses_previous=False, _plan=_plan_default)
CONSIST = Strategy(name="consist", balanced=False, java_compatible=True,
                   uses_previous=False, _plan=_plan_consist)
ROUNDROBIN = Strategy(name="roundrobin", balanced=True, java_compatible=False,
                      uses_previous=False, _plan=_plan_roundrobin)
STICKY = Strategy(name="sticky", balanced=True, java_compatible=False,
                  uses_previous=True, _plan=_plan_sticky)
COOPERATIVE = Strategy(name="cooperative", balanced=True, java_compatible=False,
                       uses_previous=False, _plan=_plan_cooperative)

#: Strategy by name (read-only).
STRATEGIES: Mapping[str, Strategy] = MappingProxyType(
    {s.name: s for s in (DEFAULT, CONSIST, ROUNDROBIN, STICKY, COOPERATIVE)})


def get_strategy(name: str) -> Strategy:
    """The strategy called ``name``; :class:`metaq.ConfigError` for an unknown one.

    >>> get_strategy("consist").java_compatible
    True
    >>> get_strategy("range")
    Traceback (most recent call last):
    ...
    metaq._errors.ConfigError: unknown assignment strategy 'range'; \
expected one of: consist, cooperative, default, roundrobin, sticky
    """
    try:
        return STRATEGIES[name]
    except (KeyError, TypeError):
        raise ConfigError(f"unknown assignment strategy {name!r}; expected one of: "
                          f"{', '.join(sorted(STRATEGIES))}") from None


def assign_default(consumer_ids: Sequence[str], partitions: Sequence[str], *,
                   me: str, previous: Mapping[str, str] | None = None) -> list[str]:
    """Metaq's range assignment (``DefaultLoadBalanceStrategy``); ``previous`` is ignored.

    ``n = P // C``, ``extra = P % C``, ``pos`` = index of ``me`` among the
    sorted consumers; the share is ``count = n + (pos < extra)`` partitions
    from ``start = n * pos + min(pos, extra)``.  A consumer not in the list
    gets nothing.

    >>> parts = [f"0-{i}" for i in range(8)]
    >>> [assign_default(["c3", "c1", "c2"], parts, me=c) for c in ("c1", "c2", "c3")]
    [['0-0', '0-1', '0-2'], ['0-3', '0-4', '0-5'], ['0-6', '0-7']]
    >>> twelve = [f"0-{i}" for i in range(12)]     # string order: 0-0, 0-1, 0-10, 0-11, 0-2, ...
    >>> assign_default(["c1", "c2", "c3", "c4", "c5"], twelve, me="c1")
    ['0-0', '0-1', '0-10']
    >>> assign_default(["c1"], parts, me="stranger")
    []
    """
    return DEFAULT(consumer_ids, partitions, me=me, previous=previous)


def assign_consist(consumer_ids: Sequence[str], partitions: Sequence[str], *,
                   me: str, previous: Mapping[str, str] | None = None) -> list[str]:
    """Metaq's consistent hash (``ConsisHashStrategy``); ``previous`` is ignored.

    Each consumer ``c`` puts 160 points on a ring: for ``i`` in 0..39 the MD5
    of ``f"{c}-{i}"`` (UTF-8) gives four little-endian uint32 points.  A
    partition goes to the first point at or after :func:`ketama_hash` of its
    name, wrapping round.  The share is returned in sorted order (Java returns
    it in ``HashSet`` order, which has no meaning).

    >>> parts = [f"0-{i}" for i in range(8)]
    >>> assign_consist(["c1", "c2", "c3"], parts, me="c1")
    ['0-1', '0-4', '0-6']
    >>> assign_consist(["c1", "c2", "c3"], parts, me="c2")
    ['0-0', '0-3']
    >>> assign_consist(["c1", "c2", "c3"], parts, me="c3")
    ['0-2', '0-5', '0-7']
    """
    return CONSIST(consumer_ids, partitions, me=me, previous=previous)


def assign_roundrobin(consumer_ids: Sequence[str], partitions: Sequence[str], *,
                      me: str, previous: Mapping[str, str] | None = None) -> list[str]:
    """Sorted partition ``i`` goes to sorted consumer ``i % C``; ``previous`` is ignored.

    >>> parts = [f"0-{i}" for i in range(5)]
    >>> assign_roundrobin(["b", "a"], parts, me="a"), assign_roundrobin(["b", "a"], parts, me="b")
    (['0-0', '0-2', '0-4'], ['0-1', '0-3'])
    """
    return ROUNDROBIN(consumer_ids, partitions, me=me, previous=previous)


def assign_sticky(consumer_ids: Sequence[str], partitions: Sequence[str], *,
                  me: str, previous: Mapping[str, str] | None = None) -> list[str]:
    """Balanced assignment that keeps partitions with their current owners.

    ``previous`` maps partition -> current owner (the data of its owner node).
    Every member computing this from the same view gets the same global plan:
    each partition has exactly one owner, shares differ by at most one, and
    only the fewest partitions needed for balance change owner.

    >>> parts = [f"0-{i}" for i in range(6)]
    >>> before = assign_all(["a", "b"], parts, strategy="sticky")
    >>> before
    {'a': ['0-0', '0-1', '0-2'], 'b': ['0-3', '0-4', '0-5']}
    >>> owners = {p: c for c, ps in before.items() for p in ps}
    >>> assign_sticky(["a", "b", "c"], parts, me="c", previous=owners)   # c joins: 2 move
    ['0-2', '0-5']
    >>> assign_sticky(["a", "b", "c"], parts, me="a", previous=owners)
    ['0-0', '0-1']
    """
    return STICKY(consumer_ids, partitions, me=me, previous=previous)


def assign_cooperative(consumer_ids: Sequence[str], partitions: Sequence[str], *,
                       me: str, previous: Mapping[str, str] | None = None) -> list[str]:
    """Balanced consistent hashing with bounded loads; ``previous`` is ignored.

    Each member has 100 points on a ring, each partition a key; partitions go,
    nearest first, to the next member clockwise with room left under its cap
    of ``P // C`` (or one more, for the first ``P % C`` to get there).  The
    plan depends on the member ids and partition names only, so every member
    computes it at once, and a member joining takes partitions from the
    others without reshuffling the rest:

    >>> parts = [f"0-{i}" for i in range(8)]
    >>> before = assign_all(["a", "b", "c"], parts, strategy="cooperative")
    >>> before
    {'a': ['0-0', '0-4'], 'b': ['0-2', '0-5', '0-7'], 'c': ['0-1', '0-3', '0-6']}
    >>> assign_cooperative(["a", "b", "c", "z"], parts, me="z")   # z joins: 2 move
    ['0-2', '0-6']
    >>> assign_cooperative(["a", "b", "c", "z"], parts, me="b")
    ['0-5', '0-7']

    Not always the fewest, though: a member the joiner takes from is not
    always one whose share has to shrink, and the overflow then moves on.
    """
    return COOPERATIVE(consumer_ids, partitions, me=me, previous=previous)


def assign_all(consumer_ids: Sequence[str], partitions: Sequence[str], *,
               strategy: str | Strategy = "default",
               previous: Mapping[str, str] | None = None) -> dict[str, list[str]]:
    """Every consumer's share under ``strategy`` (a name or a :class:`Strategy`).

    >>> assign_all(["c1", "c2", "c3"], [f"0-{i}" for i in range(8)])
    {'c1': ['0-0', '0-1', '0-2'], 'c2': ['0-3', '0-4', '0-5'], 'c3': ['0-6', '0-7']}
    >>> assign_all([], ["0-0"])
    {}
    """
    if not isinstance(strategy, Strategy):
        strategy = get_strategy(strategy)
    return strategy.assign_all(consumer_ids, partitions, previous=previous)
