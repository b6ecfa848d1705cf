"""`metaq group ...` and `metaq topic ...` against real ZooKeeper, broker processes and a group."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

from metaq import MessageConsumer, Producer
from metaq.testing import free_port, wait_until
from zk_layout import (
    Layout,
    StaticMember,
    decode_offset,
    decode_static_member,
    encode_static_member,
)

pytestmark = pytest.mark.broker

L = Layout()
TOPIC, GROUP = "audit", "ops"


def metaq(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "metaq", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def cluster(zk_connect, broker_factory):
    brokers = [broker_factory({TOPIC: 2}, broker_id=b, zk_connect=zk_connect, process=True)
               for b in (0, 1)]
    with Producer(zk_connect) as p:
        for f in [p.send_async(TOPIC, f"m{i}".encode()) for i in range(400)]:
            f.result(timeout=30)
    return brokers


def _ends(brokers) -> dict[str, int]:
    out = {}
    for b in brokers:
        with b.connection() as c:
            for i in range(2):
                out[f"{b.broker_id}-{i}"] = c.offset(TOPIC, GROUP, i, 2**63 - 1)
    return out


def test_group_describe_shows_owner_committed_log_end_lag_and_state(
        zk_connect, zk_client, cluster):
    ends = _ends(cluster)
    seen = []
    with MessageConsumer(GROUP, zk_connect, consumer_id="one", commit_period=0.1) as c:
        c.subscribe(TOPIC, seen.append)
        c.start()
        wait_until(lambda: len(seen) == 400, timeout=30, what="all consumed")
        d = L.offsets_dir(GROUP, TOPIC)
        wait_until(lambda: zk_client.exists(d) and {
            p: decode_offset(zk_client.get(f"{d}/{p}")[0]).offset
            for p in zk_client.get_children(d)} == ends, timeout=30, what="committed")
        out = metaq("group", "describe", GROUP, "--zk", zk_connect, "--json")
        assert out.returncode == 0, out.stderr
        report = json.loads(out.stdout)
        assert report["members"] == [f"{GROUP}_one"]
        rows = {r["partition"]: r for r in report["partitions"]}
        assert set(rows) == set(ends)
        for part, row in rows.items():
            assert row["owner"] == f"{GROUP}_one"
            assert row["committed"] == row["log_end"] == ends[part]
            assert row["lag"] == 0 and row["state"] == "ok"
        text = metaq("group", "describe", GROUP, "--zk", zk_connect)
        assert text.returncode == 0 and f"{GROUP}_one" in text.stdout
        assert "lag" in text.stdout.splitlines()[1]
        # a reset is refused while the member lives
        refused = metaq("group", "reset-offsets", GROUP, "--zk", zk_connect, "--topic", TOPIC,
                        "--to-earliest")
        assert refused.returncode == 2 and "live member" in refused.stderr
    # with nobody left: reset to earliest, then describe shows the whole log as lag, unowned
    done = metaq("group", "reset-offsets", GROUP, "--zk", zk_connect, "--topic", TOPIC,
                 "--to-earliest")
    assert done.returncode == 0, done.stderr
    report = json.loads(metaq("group", "describe", GROUP, "--zk", zk_connect,
                              "--json").stdout)
    for row in report["partitions"]:
        assert row["committed"] == 0 and row["lag"] == ends[row["partition"]]
        assert row["owner"] is None and row["state"] == "unowned"
    listed = json.loads(metaq("group", "list", "--zk", zk_connect, "--json").stdout)
    assert listed == [{"group": GROUP, "members": 0, "topics": [TOPIC], "partitions": 4}]


def test_topic_list_and_describe(zk_connect, cluster):
    ends = _ends(cluster)
    listed = json.loads(metaq("topic", "list", "--zk", zk_connect, "--json").stdout)
    assert listed == [{"topic": TOPIC, "brokers": [0, 1], "partitions": 4}]
    described = json.loads(metaq("topic", "describe", TOPIC, "--zk", zk_connect,
                                 "--json").stdout)
    assert {r["partition"]: r["log_end"] for r in described["partitions"]} == ends
    assert all(r["log_start"] == 0 for r in described["partitions"])
    plain = metaq("topic", "describe", TOPIC, "--zk", zk_connect)
    assert plain.returncode == 0 and "log end" in plain.stdout


@pytest.mark.parametrize("args, code, needle", [
    (["group"], 2, "ACTION"),
    (["group", "describe", "nope", "--zk", "{zk}"], 2, "no consumer group"),
    (["topic", "describe", "nope", "--zk", "{zk}"], 2, "no topic"),
    (["group", "reset-offsets", "g", "--zk", "{zk}", "--topic", "t"], 2, "one of the arguments"),
    (["group", "reset-offsets", "g", "--zk", "{zk}", "--topic", "t", "--to-offset", "-5"], 2,
     "--to-offset"),
    (["consume", "--zk", "{zk}", "--group", "g", "--topic", "t", "--count", "0"], 2, "--count"),
    (["frobnicate"], 2, "invalid choice"),
])
def test_bad_arguments_are_named_with_exit_2(zk_connect, args, code, needle):
    out = metaq(*[a.replace("{zk}", zk_connect) for a in args])
    assert out.returncode == code, (out.stdout, out.stderr)
    assert needle in out.stderr


def test_unreachable_zookeeper_exits_1():
    out = metaq("group", "list", "--zk", f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert out.returncode == 1 and "cannot reach ZooKeeper" in out.stderr


def test_produce_progress_bar_and_rate(zk_connect, cluster):
    out = metaq("produce", "--zk", zk_connect, "--topic", TOPIC, "--count", "3000",
                "--progress")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "acknowledged 3000 of 3000 messages"
    last = out.stderr.split("\r")[-1]
    assert "[" + "#" * 30 + "] 3000/3000" in last and "acknowledged 3000" in last
    assert re.search(r"[\d,]+ msg/s", last)


def test_json_logs(zk_connect, cluster):
    out = metaq("--log-json", "-v", "consume", "--zk", zk_connect, "--group", "jl", "--topic",
                TOPIC, "--count", "5")
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in out.stderr.splitlines() if line.startswith("{")]
    assert records and all({"ts", "level", "logger", "thread", "message"} <= r.keys()
                           for r in records)
    assert any(r["logger"] == "metaq.consumer._coordinator" and "gen" in r["message"]
               for r in records)


def test_group_describe_shows_static_member_states(zk_connect, zk_client):
    """Written straight into ZooKeeper (no broker: log ends are unknown): a live plain
    member, a live static one, one away within its hold, one past it."""
    now_ms = int(time.time() * 1000)
    group, topic = "sg", "orders"

    def record(instance, away_since_ms=None, grace_ms=600_000):
        return StaticMember(instance_id=instance, consumer_id=f"{group}_{instance}",
                            topics=(topic,), grace_ms=grace_ms, session_timeout_ms=10_000,
                            away_since_ms=away_since_ms, host=f"host-{instance}")

    zk_client.create(L.topic_sub(topic, 0), b'{"numParts":3,"broker":"0-m"}', makepath=True)
    for cid in (f"{group}_plain", f"{group}_pod-1"):
        zk_client.create(L.consumer_id(group, cid), topic.encode(), makepath=True,
                         ephemeral=True)
    zk_client.create(L.owner(group, topic, "0-0"), f"{group}_pod-1".encode(), makepath=True,
                     ephemeral=True)
    zk_client.create(L.owner(group, topic, "0-1"), f"{group}_plain".encode(), makepath=True,
                     ephemeral=True)
    for rec in (record("pod-1"), record("pod-2", away_since_ms=now_ms - 1000),
                record("pod-3", away_since_ms=now_ms - 3_600_000, grace_ms=1000)):
        zk_client.create(L.static_member(group, rec.consumer_id), encode_static_member(rec),
                         makepath=True)
    zk_client.create(L.static_member(group, f"{group}_pod-9"), b"{garbage", makepath=True)

    out = metaq("group", "describe", group, "--zk", zk_connect)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == (f"group {group}: 2 member(s) {group}_plain {group}_pod-1; "
                        f"2 away static member(s) {group}_pod-2 {group}_pod-3")
    cells = {c[0]: c[1:] for c in (re.split(r"\s{2,}", ln) for ln in lines[1:6])}
    assert cells["member"] == ["instance", "host", "topics", "state"]
    assert cells[f"{group}_plain"] == ["-", "-", topic, "live"]
    assert cells[f"{group}_pod-1"] == ["pod-1", "host-pod-1", topic,
                                       "live, static (instance pod-1)"]
    assert cells[f"{group}_pod-2"][:3] == ["pod-2", "host-pod-2", topic]
    assert re.fullmatch(r"away, held until \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z "
                        r"\(in 5\d\d s\)", cells[f"{group}_pod-2"][3])
    assert re.fullmatch(r"away, hold expired at \S+Z \(awaiting cleanup\)",
                        cells[f"{group}_pod-3"][3])
    assert lines[6] == "" and "lag" in lines[7]
    (unowned,) = [ln for ln in lines[8:] if ln.split()[:2] == [topic, "0-2"]]
    assert unowned.endswith("unknown (may be held for an away static member)")

    report = json.loads(metaq("group", "describe", group, "--zk", zk_connect, "--json").stdout)
    assert report["members"] == [f"{group}_plain", f"{group}_pod-1"]
    states = {m["consumer_id"]: m for m in report["member_states"]}
    assert [(m["state"], m["static"], m["instance_id"]) for m in states.values()] == [
        ("live", False, None), ("live", True, "pod-1"), ("away", True, "pod-2"),
        ("hold_expired", True, "pod-3")]
    pod2 = states[f"{group}_pod-2"]
    assert pod2["held_until_ms"] == now_ms - 1000 + 600_000
    assert pod2["held_until"].endswith("Z") and pod2["host"] == "host-pod-2"
    assert pod2["text"].startswith(f"away, held until {pod2['held_until']} (in ")
    notes = {p["partition"]: p["note"] for p in report["partitions"]}
    assert notes == {"0-0": None, "0-1": None, "0-2": "may be held for an away static member"}


def test_consume_as_a_static_member_is_held_on_exit_or_leaves_with_leave(zk_connect,
                                                                        zk_client, cluster):
    """`metaq consume --instance-id`: its record says it is away after a plain exit (the
    group holds its partitions), and is gone after an exit with --leave."""
    path = L.static_member("st", "st_pod-1")
    for leave, expect_record in (([], True), (["--leave"], False)):
        out = metaq("consume", "--zk", zk_connect, "--group", "st", "--topic", TOPIC,
                    "--count", "5", "--instance-id", "pod-1", "--static-grace", "600",
                    *leave)
        assert out.returncode == 0, out.stderr
        assert "consumed 5 messages" in out.stderr
        if expect_record:
            rec = decode_static_member(zk_client.get(path)[0], path)
            assert rec.instance_id == "pod-1" and rec.away_since_ms is not None
            assert rec.grace_ms == 600_000
        else:
            assert zk_client.exists(path) is None
