"""kill -9 in the middle of consumption: nothing below a committed offset is lost."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest
from helpers.procs import MemberProc

from metaq import Producer
from metaq.testing import wait_until
from zk_layout import Layout, decode_offset

pytestmark = pytest.mark.broker

L = Layout()
TOPIC = "crash"
SCRIPT = str(Path(__file__).parents[1] / "helpers" / "consumer_script.py")


def Proc(*args: str) -> MemberProc:  # noqa: N802 - reads as the class it makes
    return MemberProc(SCRIPT, *args)


@pytest.fixture
def broker(zk_connect, broker_factory):
    return broker_factory({TOPIC: 2}, zk_connect=zk_connect, process=True)


def produce(zk_connect, n):
    with Producer(zk_connect) as p:
        return [f.result(timeout=30) for f in
                [p.send_async(TOPIC, f"m{i}".encode()) for i in range(n)]]


def committed(zk_client, group) -> dict[str, int]:
    d = L.offsets_dir(group, TOPIC)
    return {p: decode_offset(zk_client.get(f"{d}/{p}")[0]).offset
            for p in zk_client.get_children(d)} if zk_client.exists(d) else {}


def test_concurrent_kill_9_leaves_nothing_below_the_commit_unprocessed(
        zk_connect, zk_client, broker):
    sent = produce(zk_connect, 3000)
    offsets = defaultdict(dict)  # partition -> offset -> body
    for r, i in zip(sent, range(3000), strict=True):
        offsets[r.partition][r.offset] = f"m{i}"
    proc = Proc("--zk", zk_connect, "--group", "cc", "--topic", TOPIC, "--mode", "concurrent",
                "--threads", "16", "--sleep-ms-max", "5", "--commit-period", "0.05")
    try:
        wait_until(lambda: len(proc.done()) > 1200, timeout=60, what="half-way")
        proc.kill()  # in the middle: workers busy, messages in flight
    finally:
        if proc.p.poll() is None:
            proc.kill()
    final = committed(zk_client, "cc")
    assert final, "it committed something before the kill"
    processed = {(p, o) for p, o, _ in proc.done()}
    for part, upto in final.items():
        below = [o for o in offsets[part] if o < upto]
        missing = [o for o in below if (part, o) not in processed]
        assert not missing, f"{part}: {len(missing)} committed but never processed"
    # the next member delivers the rest (and only re-delivers above the commit)
    proc2 = Proc("--zk", zk_connect, "--group", "cc", "--topic", TOPIC, "--mode",
                 "concurrent", "--threads", "16")
    try:
        wait_until(lambda: {(p, o) for p, o, _ in proc.done() + proc2.done()} >=
                   {(p, o) for p in offsets for o in offsets[p]}, timeout=60,
                   what="everything processed by one or the other")
        for part, off, _ in proc2.done():
            assert off >= final.get(part, 0), "re-delivered below the commit"
    finally:
        proc2.stop()


def test_kill_9_during_recover_store_redelivery_loses_nothing(
        zk_connect, zk_client, broker, tmp_path):
    produce(zk_connect, 20)
    store = str(tmp_path / "recover")
    common = ("--zk", zk_connect, "--group", "rs", "--topic", TOPIC, "--recover-dir", store,
              "--id", "one", "--recover-interval", "0.2", "--max-retries", "1")
    proc = Proc(*common, "--fail-on", "m7", "--hang-on-redelivery")
    try:
        wait_until(lambda: any(line.startswith("hanging") for line in proc.lines),
                   timeout=60, what="m7 redelivered from the store (and hanging)")
        wait_until(lambda: len(proc.done()) == 19, timeout=30, what="the other 19 done")
        proc.kill()
    finally:
        if proc.p.poll() is None:
            proc.kill()
    files = list(Path(store).rglob("*.rec"))
    assert len(files) == 1, files  # still stored: the interrupted redelivery kept it
    # its partition moved past m7 (it was safely stored before the skip) ...
    # ... and the next run of the same consumer redelivers it from the store
    proc2 = Proc(*common)
    try:
        wait_until(lambda: any(b == "m7" for _, _, b in proc2.done()), timeout=60,
                   what="m7 delivered after the restart")
        wait_until(lambda: not list(Path(store).rglob("*.rec")), timeout=30,
                   what="store emptied after success")
    finally:
        proc2.stop()
    everything = {b for _, _, b in proc.done() + proc2.done()}
    assert everything == {f"m{i}" for i in range(20)}
