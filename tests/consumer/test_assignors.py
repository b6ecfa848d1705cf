"""Partition assignment strategies: worked examples, Java golden data, properties.

The Java golden data comes from ``tests/golden/AssignGolden.java``, an
independent model of Metaq 1.4's DefaultLoadBalanceStrategy and
ConsisHashStrategy (and of the sorting its caller does), compiled with
``javac`` and run with ``java`` by these tests: a Python consumer and a Java
consumer in one group must compute the same assignment.
"""

from __future__ import annotations

import bisect
import doctest
import hashlib
import random
import shutil
import struct
import subprocess
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import metaq
from metaq.consumer import _assignors as assignors
from metaq.consumer._assignors import (
    STRATEGIES,
    Strategy,
    assign_all,
    assign_consist,
    assign_cooperative,
    assign_default,
    assign_roundrobin,
    assign_sticky,
    get_strategy,
    java_string_key,
    java_utf8,
    ketama_hash,
)

GOLDEN_SRC = Path(__file__).parents[1] / "golden" / "AssignGolden.java"
ALL_NAMES = ("default", "consist", "roundrobin", "sticky", "cooperative")


def parts_of(broker: int, n: int) -> list[str]:
    return [f"{broker}-{i}" for i in range(n)]


# --------------------------------------------------------------------------- doctests

def test_docstring_examples_run():
    result = doctest.testmod(assignors, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 20
    assert result.failed == 0


# --------------------------------------------------------------------------- worked examples

def test_default_reference_example_three_consumers_eight_parts():
    parts = parts_of(0, 8)
    assert assign_all(["c1", "c2", "c3"], parts) == {
        "c1": ["0-0", "0-1", "0-2"],
        "c2": ["0-3", "0-4", "0-5"],
        "c3": ["0-6", "0-7"],
    }


def test_default_uses_string_order_of_partitions():
    shares = assign_all([f"c{i}" for i in range(1, 6)], parts_of(0, 12))
    assert shares["c1"] == ["0-0", "0-1", "0-10"]
    assert shares["c2"] == ["0-11", "0-2", "0-3"]
    assert shares["c5"] == ["0-8", "0-9"]


def test_default_consumers_sorted_as_strings():
    # "c10" sorts before "c2": it takes the second slice.
    shares = assign_all(["c2", "c10", "c1"], parts_of(0, 3))
    assert shares == {"c1": ["0-0"], "c10": ["0-1"], "c2": ["0-2"]}


def test_more_consumers_than_partitions_default():
    shares = assign_all(["a", "b", "c", "d"], ["0-0", "0-1"])
    assert shares == {"a": ["0-0"], "b": ["0-1"], "c": [], "d": []}


def test_roundrobin_example():
    shares = assign_all(["b", "a", "c"], parts_of(0, 4) + parts_of(1, 3), strategy="roundrobin")
    assert shares == {"a": ["0-0", "0-3", "1-2"], "b": ["0-1", "1-0"], "c": ["0-2", "1-1"]}


@pytest.mark.parametrize("name", ALL_NAMES)
def test_unknown_me_gets_nothing(name):
    strategy = get_strategy(name)
    assert strategy(["c1", "c2"], parts_of(0, 4), me="c3") == []
    assert strategy([], parts_of(0, 4), me="c1") == []


@pytest.mark.parametrize("name", ALL_NAMES)
def test_no_consumers_or_no_partitions(name):
    assert assign_all([], parts_of(0, 3), strategy=name) == {}
    assert assign_all(["b", "a"], [], strategy=name) == {"a": [], "b": []}


# --------------------------------------------------------------------------- registry and errors

def test_registry_names_and_flags():
    assert set(STRATEGIES) == set(ALL_NAMES)
    for name, strategy in STRATEGIES.items():
        assert isinstance(strategy, Strategy) and strategy.name == name
        assert get_strategy(name) is strategy
    assert [n for n, s in STRATEGIES.items() if s.java_compatible] == ["default", "consist"]
    assert [n for n, s in STRATEGIES.items() if not s.balanced] == ["consist"]
    assert [n for n, s in STRATEGIES.items() if s.uses_previous] == ["sticky"]
    with pytest.raises(TypeError):
        STRATEGIES["mine"] = STRATEGIES["default"]  # type: ignore[index]


@pytest.mark.parametrize("bad", ["DEFAULT", "range", "", "sticky ", None, 3, ["default"]])
def test_get_strategy_unknown_raises_config_error(bad):
    with pytest.raises(metaq.ConfigError, match="unknown assignment strategy") as info:
        get_strategy(bad)
    assert isinstance(info.value, ValueError)
    assert "consist, cooperative, default, roundrobin, sticky" in str(info.value)


def test_assign_all_unknown_strategy_name():
    with pytest.raises(metaq.ConfigError, match="'hash'"):
        assign_all(["a"], ["0-0"], strategy="hash")


@pytest.mark.parametrize("name", ALL_NAMES)
def test_bad_inputs_are_named(name):
    s = get_strategy(name)
    with pytest.raises(TypeError, match="consumer_ids must be a sequence of strings"):
        s("c1", ["0-0"], me="c1")
    with pytest.raises(TypeError, match="partitions must be a sequence of strings"):
        s(["c1"], "0-0", me="c1")
    with pytest.raises(TypeError, match="partitions must hold strings, got int 7"):
        s(["c1"], ["0-0", 7], me="c1")
    with pytest.raises(TypeError, match="consumer_ids must hold strings, got bytes"):
        s.assign_all([b"c1"], ["0-0"])
    with pytest.raises(ValueError, match="partitions must not hold an empty string"):
        s(["c1"], ["0-0", ""], me="c1")
    with pytest.raises(ValueError, match="consumer_ids must not hold an empty string"):
        s.assign_all(["", "c1"], ["0-0"])
    with pytest.raises(TypeError, match="me must be a consumer id string"):
        s(["c1"], ["0-0"], me=None)
    with pytest.raises(TypeError, match="previous must be a mapping"):
        s(["c1"], ["0-0"], me="c1", previous=[("0-0", "c1")])
    with pytest.raises(TypeError, match="previous must map partition names"):
        s(["c1"], ["0-0"], me="c1", previous={"0-0": 1})


# --------------------------------------------------------------------------- Java string rules

def java_compare(a: str, b: str) -> int:
    """String.compareTo, spelled out over UTF-16 code units."""
    ua = a.encode("utf-16-be", "surrogatepass")
    ub = b.encode("utf-16-be", "surrogatepass")
    ca = [int.from_bytes(ua[i:i + 2], "big") for i in range(0, len(ua), 2)]
    cb = [int.from_bytes(ub[i:i + 2], "big") for i in range(0, len(ub), 2)]
    for x, y in zip(ca, cb, strict=False):
        if x != y:
            return x - y
    return len(ca) - len(cb)


java_chars = st.one_of(
    st.characters(max_codepoint=0x7F),
    st.characters(min_codepoint=0xE000, max_codepoint=0xFFFF),
    st.characters(min_codepoint=0x10000, max_codepoint=0x10FFFF),
    st.characters(categories=["Cs"]),  # lone surrogates
    st.characters(),
)


@given(st.text(java_chars, max_size=6), st.text(java_chars, max_size=6))
def test_java_string_key_matches_compare_to(a, b):
    expected = java_compare(a, b)
    got = (java_string_key(a) > java_string_key(b)) - (java_string_key(a) < java_string_key(b))
    assert got == (expected > 0) - (expected < 0)


def test_python_order_differs_from_java_above_bmp():
    a, b = "\U0001F600", "\uFFFD"
    assert sorted([a, b]) == [b, a]
    assert sorted([a, b], key=java_string_key) == [a, b]


# --------------------------------------------------------------------------- Java golden data

def _hex(s: str) -> str:
    return s.encode("utf-16-be", "surrogatepass").hex()


def _hexlist(items) -> str:
    return ",".join(_hex(s) for s in items) or "-"


def _unhex(h: str) -> str:
    return bytes.fromhex(h).decode("utf-16-be", "surrogatepass")


def _unhexlist(field: str) -> list[str]:
    return [] if field == "-" else [_unhex(h) for h in field.split(",")]


def jv(s: str) -> str:
    """The string as Java sees it: two surrogate code points in a row are one character."""
    return _unhex(_hex(s))


@pytest.fixture(scope="module")
def java_golden(tmp_path_factory):
    """Run AssignGolden with the given command lines, return its answer lines."""
    if shutil.which("javac") is None or shutil.which("java") is None:
        pytest.fail("javac/java not on PATH: Java 17 is required by this project")
    classes = tmp_path_factory.mktemp("golden-classes")
    subprocess.run(["javac", "-encoding", "UTF-8", "-d", str(classes), str(GOLDEN_SRC)],
                   check=True, capture_output=True, timeout=120)

    def run(lines: list[str]) -> list[str]:
        proc = subprocess.run(["java", "-cp", str(classes), "AssignGolden"],
                              input="\n".join(lines) + "\n", capture_output=True,
                              text=True, encoding="ascii", timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.splitlines()

    return run


WEIRD_STRINGS = [
    "0-0", "0-10", "0-2", "c1", "group_10.0.0.1-1234-1700000000000-1",
    "é", "ü-1", "中文消费者", "\uFFFD", "\uE000x", "\U0001F600", "a\U0001F600b",
    "\U00010000", "\U0010FFFF", "\ud800", "x\udfffy", "\udc00\ud800", "\ud83d\ude00",
]


def _random_string(rng: random.Random) -> str:
    pools = [(0x21, 0x7E), (0xA0, 0x7FF), (0x800, 0xD7FF), (0xD800, 0xDFFF),
             (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    out = []
    for _ in range(rng.randint(1, 6)):
        lo, hi = rng.choice(pools)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def test_java_utf8_hash_and_sort_match_java(java_golden):
    rng = random.Random(20240601)
    strings = WEIRD_STRINGS + [_random_string(rng) for _ in range(300)]
    lists = [rng.sample(strings, rng.randint(2, 12)) for _ in range(60)] + [WEIRD_STRINGS]
    lines = ([f"UTF8 {_hex(s)}" for s in strings] + [f"HASH {_hex(s)}" for s in strings]
             + [f"SORT {_hexlist(lst)}" for lst in lists])
    answers = java_golden(lines)
    assert len(answers) == len(lines)
    n = len(strings)
    for s, answer in zip(strings, answers[:n], strict=True):
        assert answer == f"UTF8 {java_utf8(s).hex()}", repr(s)
    for s, answer in zip(strings, answers[n:2 * n], strict=True):
        assert answer == f"HASH {ketama_hash(s)}", repr(s)
    for lst, answer in zip(lists, answers[2 * n:], strict=True):
        assert _unhexlist(answer.split()[1]) == [jv(s) for s in sorted(lst, key=java_string_key)]


def _golden_cases() -> list[tuple[list[str], list[str]]]:
    rng = random.Random(1884)
    cases: list[tuple[list[str], list[str]]] = [
        (["c1", "c2", "c3"], parts_of(0, 8)),
        ([f"c{i}" for i in range(1, 6)], parts_of(0, 12)),
        (["only"], parts_of(0, 3)),
        (["a", "b", "c", "d", "e", "f", "g", "h"], ["0-0", "0-1", "0-2"]),
        (["a", "b"], []),
        (["中文", "é", "\U0001F600", "\uFFFD", "ascii"], parts_of(0, 20) + parts_of(10, 4)),
        (["x\ud800", "y\udfff", "\ud83d\ude00z"], parts_of(1, 9)),
    ]
    id_styles = [
        lambda i: f"c{i}",
        lambda i: f"group_10.0.0.{i}-{rng.randint(1, 99999)}-1700000000{rng.randint(0, 999)}-1",
        lambda i: f"grp_consumer-{i}",
        lambda i: _random_string(rng) + str(i),
    ]
    for n_consumers in range(1, 9):
        for style in id_styles:
            consumers = [style(i) for i in range(n_consumers)]
            brokers = rng.sample(range(0, 13), rng.randint(1, 4))
            parts = [p for b in brokers for p in parts_of(b, rng.randint(1, 32))]
            dup = rng.sample(parts, min(3, len(parts)))       # Metaq de-duplicates
            cases.append((consumers, parts + dup))
    for n_consumers in (1, 3, 8):
        consumers = [f"big{i}" for i in range(n_consumers)]
        cases.append((consumers, [p for b in range(8) for p in parts_of(b, 64)]))
    return cases


def _java_plans(java_golden, cases):
    """Java's DEFAULT and CONSIST plans for each (consumers, partitions) case."""
    lines = []
    for i, (consumers, parts) in enumerate(cases):
        shuffled = random.Random(i).sample(consumers, len(consumers))   # Java sorts them too
        lines.append(f"CASE {i} {_hexlist(shuffled)} {_hexlist(parts)}")
    plans: dict[tuple[str, int], dict[str, list[str]]] = {}
    ended = set()
    for line in java_golden(lines):
        fields = line.split(" ")
        if fields[0] == "END":
            ended.add(int(fields[1]))
            continue
        plans.setdefault((fields[0], int(fields[1])), {})[_unhex(fields[2])] = \
            _unhexlist(fields[3])
    assert ended == set(range(len(cases)))
    return ([plans.get(("DEFAULT", i), {}) for i in range(len(cases))],
            [plans.get(("CONSIST", i), {}) for i in range(len(cases))])


def _check_against_java(java_golden, cases) -> int:
    java_default, java_consist = _java_plans(java_golden, cases)
    checked = 0
    for i, (consumers, parts) in enumerate(cases):
        py_default = assign_all(consumers, parts, strategy="default")
        py_consist = assign_all(consumers, parts, strategy="consist")
        assert {jv(c): share for c, share in py_default.items()} == java_default[i], i
        assert {jv(c) for c in py_consist} == set(java_consist[i])
        for c, share in py_consist.items():
            assert sorted(share) == sorted(java_consist[i][jv(c)]), f"case {i} {c!r}"
            assert share == sorted(share, key=java_string_key)
            assert assign_consist(consumers, parts, me=c) == share
            assert assign_default(consumers, parts, me=c) == py_default[c]
            checked += 1
    return checked


def test_default_and_consist_match_java(java_golden):
    assert _check_against_java(java_golden, _golden_cases()) > 100


def _points(consumer: str) -> list[int]:
    """Ring points of one consumer, computed here independently of the module."""
    out = []
    for i in range(40):
        d = hashlib.md5(f"{consumer}-{i}".encode()).digest()
        out += [int.from_bytes(d[4 * h:4 * h + 4], "little") for h in range(4)]
    return out


def _md5_le32(s: str) -> int:
    return int.from_bytes(hashlib.md5(s.encode()).digest()[:4], "little")


# Found by a search over ids c0..c2999 and names <b>-<p>: each pair of consumers
# has a ring point in common, and each partition's first point at or after its
# hash is that shared point.
COLLISIONS = [(("c140", "c2679"), ["0-215", "1-102"], "c2679"),
              (("c230", "c2001"), ["4-274", "6-50"], "c230"),    # "c2001" < "c230"
              (("c2625", "c2002"), ["1-217", "2-13"], "c2625")]
# Each partition hashes exactly onto a point of the first consumer, and the next
# point belongs to the second: "first point >= hash", not "> hash".
EXACT_HITS = [(("c609", "c0"), "3-376"), (("c2222", "c4"), "4-282"), (("c323", "c0"), "5-635")]


def test_consist_collisions_exact_hits_and_wrap_match_java(java_golden):
    cases = []
    for (a, b), parts, winner in COLLISIONS:
        shared = set(_points(a)) & set(_points(b))
        assert len(shared) == 1
        ring = sorted(set(_points(a)) | set(_points(b)))
        for part in parts:
            assert ring[bisect.bisect_left(ring, _md5_le32(part))] in shared
        # Later in Java's sorted order is put into the TreeMap last and wins.
        assert sorted([a, b], key=java_string_key)[1] == winner
        assert assign_all([a, b], parts, strategy="consist")[winner] == sorted(parts)
        cases.append(([a, b], parts + ["0-0", "0-1"]))
    for (owner, other), part in EXACT_HITS:
        assert _md5_le32(part) in _points(owner)
        assert assign_consist([owner, other], [part], me=owner) == [part]
        cases.append(([owner, other], [part, "0-0"]))
    # Partitions hashing past the last point wrap round to the first one.
    consumers = ["c1", "c2"]
    ring = sorted(_points("c1") + _points("c2"))
    wrapping = [p for p in parts_of(0, 3000) if _md5_le32(p) > ring[-1]]
    assert len(wrapping) >= 3
    first_owner = "c1" if ring[0] in _points("c1") else "c2"
    assert set(wrapping) <= set(assign_all(consumers, wrapping, strategy="consist")[first_owner])
    cases.append((consumers, wrapping + parts_of(1, 5)))
    assert _check_against_java(java_golden, cases) == 2 * len(cases)


# --------------------------------------------------------------------------- properties

consumer_ids = st.lists(st.text(java_chars, min_size=1, max_size=5), max_size=9)
partition_names = st.lists(
    st.one_of(st.builds(lambda b, p: f"{b}-{p}", st.integers(0, 12), st.integers(0, 40)),
              st.text(java_chars, min_size=1, max_size=4)),
    max_size=60)


def _owners(plan: dict[str, list[str]]) -> dict[str, str]:
    return {p: c for c, share in plan.items() for p in share}


def _check_exactly_once(plan: dict[str, list[str]], consumers, parts) -> None:
    counts = Counter(p for share in plan.values() for p in share)
    if set(consumers):
        assert set(counts) == set(parts)
        assert set(counts.values()) <= {1}
    else:
        assert plan == {}


def _check_balanced(plan: dict[str, list[str]], parts) -> None:
    if plan:
        sizes = [len(share) for share in plan.values()]
        per = len(set(parts)) // len(plan)
        assert max(sizes) - min(sizes) <= 1
        assert set(sizes) <= {per, per + 1}


@pytest.mark.parametrize("name", ALL_NAMES)
@settings(max_examples=60, deadline=None)
@given(consumers=consumer_ids, parts=partition_names, data=st.data())
def test_every_partition_once_and_deterministic(name, consumers, parts, data):
    strategy = get_strategy(name)
    previous = data.draw(st.dictionaries(
        st.sampled_from(parts) if parts else st.just("0-0"),
        st.sampled_from(consumers + ["gone"]) if consumers else st.just("gone"),
        max_size=len(parts)))
    plan = strategy.assign_all(consumers, parts, previous=previous)
    _check_exactly_once(plan, consumers, parts)
    if strategy.balanced:
        _check_balanced(plan, parts)
    # Each member computing its own share gets its slice of the same global plan.
    for c in set(consumers):
        assert strategy(consumers, parts, me=c, previous=previous) == plan[c]
    # Order and duplicates of the inputs do not matter.
    shuffled_c = data.draw(st.permutations(consumers + consumers[:2]))
    shuffled_p = data.draw(st.permutations(parts + parts[:3]))
    reordered_prev = dict(reversed(list(previous.items())))
    assert strategy.assign_all(shuffled_c, shuffled_p, previous=reordered_prev) == plan


# --------------------------------------------------------------------------- sticky

def _moves(before: dict[str, str], plan: dict[str, list[str]]) -> int:
    after = _owners(plan)
    return sum(1 for p, owner in after.items() if before.get(p) != owner)


@settings(max_examples=150, deadline=None)
@given(consumers=st.lists(st.sampled_from([f"m{i}" for i in range(10)]), min_size=1,
                          max_size=10, unique=True),
       n_parts=st.integers(0, 40), data=st.data())
def test_sticky_moves_the_fewest_possible(consumers, n_parts, data):
    parts = parts_of(0, n_parts)
    owners_pool = consumers + ["gone1", "gone2"]
    previous = {p: data.draw(st.sampled_from(owners_pool)) for p in parts
                if data.draw(st.booleans())}
    plan = assign_all(consumers, parts, strategy="sticky", previous=previous)
    _check_exactly_once(plan, consumers, parts)
    _check_balanced(plan, parts)
    # Lower bound of moves over every balanced plan, computed independently:
    # a member can keep at most base of what it holds, or base+1 if it is one
    # of the P % C members given an extra partition.
    held = Counter(previous[p] for p in parts if previous.get(p) in consumers)
    base, extra = divmod(n_parts, len(consumers))
    can_keep = sum(min(held[c], base) for c in consumers)
    can_keep += min(extra, sum(1 for c in consumers if held[c] > base))
    assert _moves(previous, plan) == n_parts - can_keep
    # Nothing moves when the plan is applied again.
    assert assign_all(consumers, parts, strategy="sticky", previous=_owners(plan)) == plan


@settings(max_examples=100, deadline=None)
@given(n_members=st.integers(2, 9), n_parts=st.integers(0, 50), data=st.data())
def test_sticky_member_leaving_moves_only_its_partitions(n_members, n_parts, data):
    members = [f"m{i}" for i in range(n_members)]
    parts = parts_of(0, n_parts)
    seed_prev = {p: data.draw(st.sampled_from(members)) for p in parts}
    before = _owners(assign_all(members, parts, strategy="sticky", previous=seed_prev))
    leaver = data.draw(st.sampled_from(members))
    rest = [m for m in members if m != leaver]
    plan = assign_all(rest, parts, strategy="sticky", previous=before)
    _check_balanced(plan, parts)
    after = _owners(plan)
    for p in parts:
        if before[p] != leaver:
            assert after[p] == before[p], p
    assert _moves(before, plan) == sum(1 for p in parts if before[p] == leaver)


@settings(max_examples=100, deadline=None)
@given(n_members=st.integers(1, 8), n_parts=st.integers(0, 50), data=st.data())
def test_sticky_member_joining_moves_only_its_new_quota(n_members, n_parts, data):
    members = [f"m{i}" for i in range(n_members)]
    parts = parts_of(0, n_parts)
    seed_prev = {p: data.draw(st.sampled_from(members)) for p in parts}
    before = _owners(assign_all(members, parts, strategy="sticky", previous=seed_prev))
    joiner = data.draw(st.sampled_from(["a-first", "m5x", "zz-last"]))
    plan = assign_all(members + [joiner], parts, strategy="sticky", previous=before)
    _check_balanced(plan, parts)
    assert len(plan[joiner]) == n_parts // (n_members + 1)
    assert _moves(before, plan) == len(plan[joiner])
    after = _owners(plan)
    assert all(after[p] == joiner for p in parts if after[p] != before[p])


@given(consumers=consumer_ids, parts=partition_names)
def test_sticky_without_previous_is_default(consumers, parts):
    assert (assign_all(consumers, parts, strategy="sticky")
            == assign_all(consumers, parts, strategy="default"))


def test_sticky_ignores_stale_entries():
    previous = {"0-0": "b", "0-1": "gone", "9-9": "a", "0-2": "b", "0-3": "b"}
    plan = assign_all(["a", "b"], parts_of(0, 4), strategy="sticky", previous=previous)
    # b held three, keeps two (its quota); the orphan and the excess go to a.
    assert plan == {"a": ["0-1", "0-3"], "b": ["0-0", "0-2"]}
    assert assign_sticky(["a", "b"], parts_of(0, 4), me="b", previous=previous) == ["0-0", "0-2"]


def test_sticky_extra_goes_to_member_holding_more():
    # 5 partitions, 2 members: the one already holding 3 keeps all 3.
    previous = {"0-0": "b", "0-1": "b", "0-2": "b", "0-3": "a"}
    plan = assign_all(["a", "b"], parts_of(0, 5), strategy="sticky", previous=previous)
    assert plan == {"a": ["0-3", "0-4"], "b": ["0-0", "0-1", "0-2"]}


def test_module_level_functions_agree_with_registry():
    consumers, parts = ["c2", "c1", "c3"], parts_of(0, 10) + parts_of(1, 5)
    for fn, name in ((assign_default, "default"), (assign_consist, "consist"),
                     (assign_roundrobin, "roundrobin"), (assign_sticky, "sticky"),
                     (assign_cooperative, "cooperative")):
        plan = assign_all(consumers, parts, strategy=STRATEGIES[name])
        for c in consumers:
            assert fn(consumers, parts, me=c) == plan[c]


# --------------------------------------------------------------------------- cooperative

def _coop(consumers, parts) -> dict[str, list[str]]:
    return assign_all(consumers, parts, strategy="cooperative")


def test_cooperative_exact_plan():
    """Pinned values: every member of a group must compute the same plan.

    Members on different versions of this library share one group, so a change
    to the hash, its prefixes or the 100 points per member splits such a group
    (two owners for a partition, or none): it must fail here, loudly, and be
    made on purpose.
    """
    # The hashes spelled out independently: SHAKE-128 of a prefix and the UTF-8 bytes.
    key = hashlib.shake_128(b"metaq.cooperative.partition\x00" + b"0-0").digest(8)
    assert assignors._cooperative_key("0-0") == int.from_bytes(key, "big") == 7858069922590168163
    points, owners = assignors._cooperative_ring(["a"])
    member = hashlib.shake_128(b"metaq.cooperative.member\x00" + b"a").digest(800)
    assert points == sorted(struct.unpack(">100Q", member)) and owners == [0] * 100
    assert points[:2] == [260203730776723316, 296220369067500857]
    assert _coop(["c", "a", "b"], parts_of(0, 8)) == {
        "a": ["0-0", "0-4"], "b": ["0-2", "0-5", "0-7"], "c": ["0-1", "0-3", "0-6"]}
    ids = ["grp_10.0.0.1-4242-1700000000000-1", "grp_10.0.0.2-4242-1700000000001-1",
           "grp_10.0.0.3-4242-1700000000002-1", "中文-\U0001F600"]
    assert _coop(ids, parts_of(1, 7) + parts_of(0, 7)) == {
        "grp_10.0.0.1-4242-1700000000000-1": ["0-1", "0-2", "0-3", "0-6"],
        "grp_10.0.0.2-4242-1700000000001-1": ["1-3", "1-5", "1-6"],
        "grp_10.0.0.3-4242-1700000000002-1": ["0-5", "1-1", "1-4"],
        "中文-\U0001F600": ["0-0", "0-4", "1-0", "1-2"],
    }


@settings(max_examples=100, deadline=None)
@given(consumers=consumer_ids, parts=partition_names, data=st.data())
def test_cooperative_balanced_deterministic_and_blind_to_owners(consumers, parts, data):
    plan = _coop(consumers, parts)
    _check_exactly_once(plan, consumers, parts)
    _check_balanced(plan, parts)
    if plan:
        base, extra = divmod(len(set(parts)), len(plan))
        assert sum(len(share) > base for share in plan.values()) == extra
    # A function of the ids and names alone: the owners, the input order and
    # a second run change nothing.
    previous = {p: data.draw(st.sampled_from(consumers + ["gone"])) for p in parts}
    assert assign_all(consumers, parts, strategy="cooperative", previous=previous) == plan
    assert _coop(data.draw(st.permutations(consumers)),
                 data.draw(st.permutations(parts))) == plan
    assert _coop(list(consumers), list(parts)) == plan


# Bounds on what one join or one leave moves.  They are empirical: the overflow
# of the caps has no closed-form bound.  Over 40,000 random groups of these
# sizes (2..10 members, up to 60 partitions, ids of several styles) a join moved
# at most ceil(P / (C + 1)) + 9, and 6 where ceil(P / (C + 1)) is 1 (P close
# to C: the fewest is then 0 or 1, which no plan made without the owners can
# reach every time); a leave moved at most the leaver's share plus 9, for
# ceil(P / C') = 6 (C' members left).  The bounds below leave at least 2
# partitions of headroom over those worst cases, and held for 20,000
# hypothesis examples each.
member_sets = st.lists(st.text(java_chars, min_size=1, max_size=6), min_size=2, max_size=10,
                       unique=True)
partition_sets = st.lists(st.builds(lambda b, p: f"{b}-{p}", st.integers(0, 12),
                                    st.integers(0, 40)), max_size=60, unique=True)


@settings(max_examples=150, deadline=None)
@given(members=member_sets, parts=partition_sets)
def test_cooperative_join_moves_few(members, parts):
    *group, joiner = members
    before = _owners(_coop(group, parts))
    plan = _coop(members, parts)
    fair = -(-len(parts) // len(members))      # ceil(P / (C + 1)): the joiner's share at most
    assert len(plan[joiner]) <= fair
    assert _moves(before, plan) <= 2 * fair + 8


@settings(max_examples=150, deadline=None)
@given(members=member_sets, parts=partition_sets, data=st.data())
def test_cooperative_leave_moves_the_leavers_share_and_few_more(members, parts, data):
    leaver = data.draw(st.sampled_from(members))
    rest = [m for m in members if m != leaver]
    before = _owners(_coop(members, parts))
    share = sum(1 for owner in before.values() if owner == leaver)
    moved = _moves(before, _coop(rest, parts))
    assert share <= moved <= share + -(-len(parts) // len(rest)) + 6


def _transition_moves(before_ids, after_ids, parts) -> tuple[int, int, int]:
    """Moves of cooperative, of the fewest possible (sticky), of default."""
    before = _owners(_coop(before_ids, parts))
    coop = _moves(before, _coop(after_ids, parts))
    fewest = _moves(before, assign_all(after_ids, parts, strategy="sticky", previous=before))
    default = _moves(_owners(assign_all(before_ids, parts)), assign_all(after_ids, parts))
    return coop, fewest, default


def test_cooperative_mean_movement_against_sticky():
    """Cooperative's moves against the fewest possible (sticky's) for one join and one leave.

    Measured on these inputs: 1.41, 1.43, 1.51, 2.18 and 2.29 times the fewest
    (mean 1.76); default moves 1.9, 2.9, 3.4, 14 and 29 times as many.  The
    aim was 1.3 on average; it is out of reach here, and for any strategy that
    does not read the owners: one whose every join and leave moved the fewest
    would need each partition's owner to be the group's first member in a
    fixed order of preference, and no fixed preferences balance every group
    exactly (a search finds none already for 4 partitions and 5 possible
    member ids).  The more members, the larger the overflow of the caps
    (2-2.9 times at 31-64 members).
    """
    ratios = []
    for n_members, n_parts in ((3, 10), (7, 100), (8, 64), (32, 256), (64, 1024)):
        rng = random.Random(n_members * 1000 + n_parts)
        parts = [f"{b}-{i}" for b in range(-(-n_parts // 32)) for i in range(32)][:n_parts]
        coop = fewest = default = 0
        for _ in range(8):
            ids = [f"grp_10.0.{rng.randint(0, 9)}.{rng.randint(1, 254)}-{rng.randint(1000, 99999)}"
                   f"-{rng.randint(1, 10**13)}-1" for _ in range(n_members + 1)]
            leaver = ids[rng.randrange(n_members + 1)]
            for before_ids, after_ids in ((ids[:-1], ids), (ids, [m for m in ids if m != leaver])):
                c, f, d = _transition_moves(before_ids, after_ids, parts)
                coop, fewest, default = coop + c, fewest + f, default + d
        ratios.append(coop / fewest)
        assert coop / fewest <= 2.5, (n_members, n_parts, coop / fewest)
        assert coop < default, (n_members, n_parts)
    assert sum(ratios) / len(ratios) <= 1.9, ratios
