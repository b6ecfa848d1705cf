"""AsyncConsumer in groups: kill -9 of an async member process (no gaps), a rebalance
while coroutines are in flight (nothing committed unfinished, nothing committed
delivered again), and a group mixing async and threaded members."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
from helpers.delivery import check_contiguous
from helpers.procs import MemberProc
from test_consumer_aio import make, until

from metaq import MessageConsumer, Producer
from metaq.testing import wait_until
from zk_layout import Layout, decode_offset

pytestmark = pytest.mark.broker

TOPIC = "aiogroup"
MEMBER = str(Path(__file__).parent / "_aio_member.py")
L = Layout()


def produce(zk_connect, n, start=0):
    with Producer(zk_connect) as p:
        return [f.result(timeout=30) for f in
                [p.send_async(TOPIC, f"m{i}".encode()) for i in range(start, start + n)]]


def committed(zk_client, group) -> dict[str, int]:
    d = L.offsets_dir(group, TOPIC)
    return {p: decode_offset(zk_client.get(f"{d}/{p}")[0]).offset
            for p in zk_client.get_children(d)} if zk_client.exists(d) else {}


def Member(*args: str) -> MemberProc:  # noqa: N802 - reads as the class it makes
    return MemberProc(MEMBER, *args)


@pytest.mark.parametrize("mode", ["orderly", "concurrent"])
def test_kill_9_of_an_async_member_leaves_no_gap(zk_connect, zk_client, broker_factory,
                                                 mode):
    broker_factory({TOPIC: 2}, zk_connect=zk_connect, process=True)
    sent = produce(zk_connect, 3000)
    offsets = defaultdict(set)
    for r in sent:
        offsets[r.partition].add(r.offset)
    group = f"k9{mode}"
    args = ("--zk", zk_connect, "--group", group, "--topic", TOPIC, "--mode", mode,
            "--threads", "16", "--commit-period", "0.05")
    proc = Member(*args, "--sleep-ms-max", "2" if mode == "orderly" else "5")
    try:
        wait_until(lambda: len(proc.done()) > 1200, timeout=60, what="half-way")
        proc.kill()  # in the middle: coroutines in flight, slices waiting in the loop
    finally:
        proc.kill()
    final = committed(zk_client, group)
    assert final, "it committed something before the kill"
    processed = {(p, o) for p, o, _ in proc.done()}
    for part, upto in final.items():
        missing = [o for o in offsets[part] if o < upto and (part, o) not in processed]
        assert not missing, f"{part}: {len(missing)} committed but never finished"
    proc2 = Member(*args)
    try:
        wait_until(lambda: {(p, o) for p, o, _ in proc.done() + proc2.done()} >=
                   {(p, o) for p in offsets for o in offsets[p]}, timeout=60,
                   what="everything finished by one or the other")
        for part, off, _ in proc2.done():
            assert off >= final.get(part, 0), "delivered again below the commit"
    finally:
        proc2.stop()


@pytest.mark.asyncio
async def test_rebalance_with_coroutines_in_flight_commits_only_finished(
        zk_connect, broker_factory, tmp_path):
    broker_factory({TOPIC: 4}, zk_connect=zk_connect)
    produce(zk_connect, 400)
    done_a: list[tuple[str, int]] = []
    done_b: list[tuple[str, int]] = []
    release = asyncio.Event()
    held: list[tuple[str, int]] = []

    async def slow_a(m):
        # one handler of A stays in flight, in a partition B will get (the default
        # strategy gives "b" the last two partitions of four)
        if not held and m.partition == "0-3" and \
                sum(1 for p, _ in done_a if p == "0-3") >= 10:
            held.append((m.partition, m.offset))
            await release.wait()
        await asyncio.sleep(0.002)
        done_a.append((m.partition, m.offset))

    async def handle_b(m):
        done_b.append((m.partition, m.offset))

    a = make(zk_connect, "rb", tmp_path, consumer_id="a", drain_timeout=0.3,
             consume_mode="concurrent", consume_threads=4)
    b = make(zk_connect, "rb", tmp_path, consumer_id="b")
    a.subscribe(TOPIC, slow_a)
    b.subscribe(TOPIC, handle_b)
    try:
        await a.start()
        await until(lambda: held, what="a handler of A in flight")
        await b.start()  # the group rebalances: A gives up 2 partitions, one maybe held
        await until(lambda: len(b.assignment().get(TOPIC, [])) == 2, what="B's share")
        await until(lambda: len(set(done_a) | set(done_b)) == 400, timeout=60,
                    what="everything finished by A or B")
    finally:
        release.set()
        await asyncio.gather(a.close(), b.close())
    first_b: dict[str, int] = {}
    for part, off in done_b:
        first_b.setdefault(part, off)
    for part, start in first_b.items():
        # B starts where A committed: everything below was finished by A
        below = [o for p, o in done_a if p == part and o < start]
        a_parts = {o for p, o in done_a if p == part}
        assert all(o in a_parts for o in below)
        assert len(below) == len(set(below))
        # nothing A committed comes again from B
        assert all(o >= start for p, o in done_b if p == part)
    # the held message's partition moved with its handler in flight: A's commit
    # stopped exactly at it (all before it had finished), so B starts there
    assert "0-3" in first_b
    assert first_b["0-3"] == held[0][1]


@pytest.mark.asyncio
async def test_a_group_of_async_and_threaded_members(zk_connect, broker_factory, tmp_path):
    broker_factory({TOPIC: 4}, zk_connect=zk_connect)
    got_a: list = []
    got_t: list = []
    lock = threading.Lock()

    async def handle(m):
        got_a.append((m.partition, m.offset, m.next_offset, bytes(m.body)))

    def listen(m):
        with lock:
            got_t.append((m.partition, m.offset, m.next_offset, bytes(m.body)))

    threaded = MessageConsumer("mix", zk_connect, consumer_id="t", commit_period=0.1,
                               recover_dir=str(tmp_path / "rt"))
    threaded.subscribe(TOPIC, listen)
    async with make(zk_connect, "mix", tmp_path, consumer_id="a") as a:
        a.subscribe(TOPIC, handle)
        await asyncio.gather(a.start(), asyncio.to_thread(threaded.start))
        try:
            await until(lambda: len(a.assignment().get(TOPIC, [])) == 2 and
                        len(threaded.assignment().get(TOPIC, [])) == 2, what="2 + 2")
            # sent once both hold their share: a member that started first cannot have
            # read them all before the other joined
            await asyncio.to_thread(produce, zk_connect, 300)
            await until(lambda: len(got_a) + len(got_t) == 300, what="all 300")
            assert got_a and got_t
            assert not {p for p, *_ in got_a} & {p for p, *_ in got_t}
            check_contiguous(got_a + got_t, {f"m{i}".encode() for i in range(300)})
        finally:
            await asyncio.to_thread(threaded.close)


@pytest.mark.asyncio
async def test_session_lost_with_a_handler_in_flight_keeps_one_handler_per_partition(
        zk_connect, zk_server, broker_factory, tmp_path):
    from kazoo.client import KazooClient

    from metaq.testing import expire_session

    broker_factory({TOPIC: 1}, zk_connect=zk_connect)
    produce(zk_connect, 40)
    spans: list[tuple[int, float, float]] = []  # (offset, start, end) of every call
    release = asyncio.Event()
    held: list[int] = []

    async def handle(m):
        start = time.monotonic()
        if not held and m.offset > 0 and len(spans) >= 10:
            held.append(m.offset)
            await release.wait()  # in flight across the session's loss
        spans.append((m.offset, start, time.monotonic()))

    client = KazooClient(hosts=zk_connect, timeout=4.0)
    client.start(timeout=20)
    c = make(zk_connect=client, group="sl", tmp_path=tmp_path, zk_session_timeout=4.0,
             drain_timeout=30.0)
    try:
        c.subscribe(TOPIC, handle)
        await c.start()
        await until(lambda: held, what="a handler held")
        gen, old = c.generation, client.client_id[0]
        await asyncio.to_thread(expire_session, client, zk_server.hosts)
        await until(lambda: client.client_id and client.client_id[0] != old and
                    c.generation > gen and c.assignment(), timeout=30,
                    what="claimed again in a new session")
        await asyncio.sleep(0.3)  # the new claim's worker would have started by now
        assert [s for s in spans if s[0] >= held[0]] == []  # it waits for the held one
        release.set()
        await until(lambda: len({o for o, *_ in spans}) == 40, what="every message")
    finally:
        release.set()
        await c.close()
        client.stop()
        client.close()
    # one handler at a time in the partition, across the two claims
    ordered = sorted(spans, key=lambda s: s[1])
    for (_, _, end), (_, start, _) in itertools.pairwise(ordered):
        assert start >= end
