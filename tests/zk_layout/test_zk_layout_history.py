"""The rebalance history's node, codec, reader, bound and timeline (``zk_layout._history``).

Records are made by hand here (what members write is tested with real members in
tests/consumer/test_rebalance_history.py); the reader and the bound run against the
real ZooKeeper, garbage planted with literal bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from zk_layout import (
    HISTORY_VERSION,
    Layout,
    NodeDataError,
    NodeKind,
    RebalanceRecord,
    decode_history,
    encode_history,
    holder_at,
    ownership_timeline,
    parse_since,
    prune_history,
    read_history,
    select_history,
    take_snapshot,
    timeline_to_json,
)

L = Layout()
G = "g"


def rec(cid: str, gen: int, at: int, trigger: str, *, ms: int = 10, plan=(), released=(),
        claimed=(), waiting=(), detail: str = "") -> RebalanceRecord:
    return RebalanceRecord(consumer_id=cid, generation=gen, time_ms=at, duration_ms=ms,
                           trigger=trigger, detail=detail, state="stable", strategy="default",
                           plan=tuple(plan), released=tuple(released), claimed=tuple(claimed),
                           waiting=tuple(waiting))


def test_paths_are_classified_beside_the_static_records():
    assert L.history(G) == "/meta/consumers/g/history"
    assert L.history_member(G, "g_a") == "/meta/consumers/g/history/g_a"
    assert L.classify("/meta/consumers/g/history").kind is NodeKind.HISTORY
    ref = L.classify("/meta/consumers/g/history/g_a")
    assert (ref.kind, ref.group, ref.consumer_id) == (NodeKind.HISTORY_MEMBER, G, "g_a")
    assert L.classify("/meta/consumers/g/history/g_a/x") is None


def test_codec_round_trip_is_compact_versioned_json():
    records = [rec("g_a", 1, 1000, "started", plan=["t/0-0", "t/0-1", "u/1-0"],
                   claimed=["t/0-0", "t/0-1", "u/1-0"]),
               rec("g_a", 2, 2000, "member_joined", plan=["t/0-0"],
                   released=["t/0-1", "u/1-0"], detail="joined: g_b")]
    data = encode_history("g_a", records)
    obj = json.loads(data)
    assert obj["v"] == HISTORY_VERSION and obj["consumerId"] == "g_a"
    assert obj["records"][0]["plan"] == {"t": ["0-0..1"], "u": ["1-0"]}
    assert b" " not in data.replace(b"joined: ", b"")
    path = L.history_member(G, "g_a")
    assert decode_history(data, path) == [
        RebalanceRecord(**{**r.__dict__, "path": path}) for r in records]
    back = decode_history(data)[1].to_json()
    assert back["time"] == "1970-01-01T00:00:02.000Z" and back["released"] == ["t/0-1", "u/1-0"]
    assert list(back) == ["consumer_id", "generation", "time", "time_ms", "duration_ms",
                          "trigger", "detail", "state", "strategy", "plan", "released",
                          "claimed", "waiting", "truncated", "error", "path"]


def test_a_brokers_consecutive_partitions_are_written_as_one_run():
    share = [f"t/0-{i}" for i in (0, 1, 2, 3, 10, 11, 12, 5)] + ["t/1-7", "t/1-8", "u/0-4"]
    data = encode_history("g_a", [rec("g_a", 1, 1, "started", plan=share)])
    assert json.loads(data)["records"][0]["plan"] == {"t": ["0-0..3", "0-5", "0-10..12",
                                                            "1-7..8"], "u": ["0-4"]}
    (back,) = decode_history(data)
    assert sorted(back.plan) == sorted(share)
    # 1,024 partitions of one broker: one run, not 1,024 names
    whole = [f"t/0-{i}" for i in range(1024)]
    assert len(encode_history("g_a", [rec("g_a", 1, 1, "started", plan=whole)])) < 300
    for bad in ('"0-5..5"', '"0-9..2"', '"0-0..99999999"'):
        data = (b'{"v":1,"consumerId":"g_a","records":[{"gen":1,"at":1,"ms":0,'
                b'"trigger":"started","plan":{"t":[' + bad.encode() + b']}}]}')
        (flagged,) = decode_history(data)
        assert flagged.damaged and "bad run" in flagged.error


def test_encoding_keeps_the_newest_records_within_count_and_bytes():
    records = [rec("g_a", i, 1000 * i, "unchanged",
                   plan=[f"t/0-{j}" for j in range(0, 40, 2)]) for i in range(1, 31)]
    kept = decode_history(encode_history("g_a", records, max_records=10))
    assert [r.generation for r in kept] == list(range(21, 31))
    data = encode_history("g_a", records, max_bytes=2048)
    kept = decode_history(data)
    assert len(data) <= 2048 and kept[-1].generation == 30
    assert [r.generation for r in kept] == list(range(31 - len(kept), 31))
    # one record too big alone: its partition lists are cut, and it says so
    every_other = [f"t/0-{j}" for j in range(0, 10000, 2)]  # no runs to shorten it
    huge = rec("g_a", 99, 5000, "started", plan=every_other, claimed=every_other)
    data = encode_history("g_a", [huge], max_bytes=1024)
    (cut,) = decode_history(data)
    assert len(data) <= 1024 and cut.truncated and 0 < len(cut.plan) < 5000
    assert cut.plan == huge.plan[:len(cut.plan)]
    with pytest.raises(ValueError, match="max_bytes"):
        encode_history("g_a", records, max_bytes=100)
    with pytest.raises(ValueError):
        encode_history("bad/id", records)


@pytest.mark.parametrize("data, reason", [
    (b"\xff\xfe", "UTF-8"),
    (b"[1,2]", "JSON object"),
    (b'{"v":1,"consumerId":"g_a"}', "records"),
    (b'{"v":2,"consumerId":"g_a","records":[]}', "newer"),
    (b'{"v":"1","consumerId":"g_a","records":[]}', "version"),
    (b'{"v":1,"consumerId":"g_b","records":[]}', "node's name"),
    (b'{"v":1,"consumerId":"g_a","records":{}}', "list"),
])
def test_a_node_that_is_not_a_history_is_a_node_data_error(data, reason):
    with pytest.raises(NodeDataError, match=reason):
        decode_history(data, L.history_member(G, "g_a"))


def test_one_bad_record_is_flagged_among_the_good_ones():
    good = json.loads(encode_history("g_a", [rec("g_a", 1, 1000, "started")]))["records"][0]
    data = json.dumps({"v": 1, "consumerId": "g_a", "records": [
        good, {"gen": -1}, "x", {**good, "plan": {"t": [1]}}]}).encode()
    out = decode_history(data, "", mtime_ms=777)
    assert [r.trigger for r in out] == ["started", "damaged", "damaged", "damaged"]
    assert [r.time_ms for r in out[1:]] == [777] * 3
    assert "record 1: gen" in out[1].error and "record 3: plan" in out[3].error


def put(client, cid: str, data: bytes) -> None:
    client.create(L.history_member(G, cid), data, makepath=True)


def test_read_history_merges_members_by_time_and_flags_garbage(zk_client):
    assert read_history(zk_client, L, G) == []  # no group, no history
    put(zk_client, "g_a", encode_history("g_a", [rec("g_a", 1, 1000, "started"),
                                                  rec("g_a", 2, 3000, "member_joined")]))
    put(zk_client, "g_b", encode_history("g_b", [rec("g_b", 1, 2000, "started")]))
    put(zk_client, "g_bin", b"\x00\x01garbage")
    put(zk_client, "g_new", b'{"v":9,"consumerId":"g_new","records":[]}')
    zk_client.create(f"{L.history(G)}/not a consumer id", encode_history("g_c", []))
    out = read_history(zk_client, L, G)
    good = [(r.consumer_id, r.generation, r.trigger) for r in out if not r.damaged]
    assert good == [("g_a", 1, "started"), ("g_b", 1, "started"), ("g_a", 2, "member_joined")]
    bad = {r.consumer_id: r for r in out if r.damaged}
    assert set(bad) == {"g_bin", "g_new", "not a consumer id"}
    assert all(r.trigger == "damaged" and r.time_ms > 1_600_000_000_000 for r in bad.values())
    assert "newer" in bad["g_new"].error and bad["g_new"].path == L.history_member(G, "g_new")
    assert [r.trigger for r in read_history(zk_client, L, G, since=2500)
            if not r.damaged] == ["member_joined"]
    # the inspector's snapshot knows the node (not an unknown child of the group)
    snap = take_snapshot(zk_client, L)
    assert not [u for u in snap.unknown if "/history" in u]


def test_prune_keeps_the_bound_deleting_the_oldest_gone_members_first(zk_client):
    for i in range(6):
        put(zk_client, f"g_{i}", encode_history(f"g_{i}", [rec(f"g_{i}", 1, i, "started")]))
    # nothing over the bound: nothing deleted (and no stat needed)
    assert prune_history(zk_client, L, G, max_members=6) == []
    # g_0 (the oldest) is live: the gone ones go first, oldest written first
    assert prune_history(zk_client, L, G, keep=["g_0", "g_5"], protect="g_5",
                         max_members=3) == ["g_1", "g_2", "g_3"]
    assert sorted(zk_client.get_children(L.history(G))) == ["g_0", "g_4", "g_5"]
    size = zk_client.exists(L.history_member(G, "g_4")).dataLength
    # bytes: room for two nodes; the caller's own is never deleted, live ones last
    assert prune_history(zk_client, L, G, keep=["g_0"], protect="g_5",
                         max_total_bytes=2 * size, node_bytes=size) == ["g_4"]
    # the caller's node not written yet is counted (as node_bytes), never deleted
    assert prune_history(zk_client, L, G, protect="g_new", max_members=2,
                         node_bytes=size) == ["g_0"]
    assert prune_history(zk_client, L, "nogroup") == []


def test_timeline_hand_over_kill_expiry_and_what_came_before():
    recs = [
        # a had 0-0 and 0-1 before its kept history begins (kept in its plan)
        rec("g_a", 5, 1000, "unchanged", plan=["t/0-0", "t/0-1"]),
        # b joins: its rebalance begins before a's, its claim waits for a's release
        rec("g_b", 1, 2000, "started", ms=5, plan=["t/0-1"], waiting=["t/0-1"]),
        rec("g_a", 6, 2002, "member_joined", ms=3, plan=["t/0-0"], released=["t/0-1"]),
        rec("g_b", 1, 2010, "owner_vanished", ms=1, plan=["t/0-1"], claimed=["t/0-1"]),
        # b killed: never says; a takes 0-1 when b's session expires
        rec("g_a", 7, 9000, "member_left", ms=4, plan=["t/0-0", "t/0-1"], claimed=["t/0-1"]),
        # a's session expires, then it rejoins
        rec("g_a", 8, 9500, "session_expired", ms=0, released=["t/0-0", "t/0-1"]),
        rec("g_a", 9, 9600, "session_expired", ms=7, plan=["t/0-0", "t/0-1"],
            claimed=["t/0-0", "t/0-1"]),
        rec("g_z", 1, 100, "damaged"),
    ]
    recs[-1] = RebalanceRecord(**{**recs[-1].__dict__, "error": "garbage"})
    tl = ownership_timeline(recs)
    assert list(tl) == ["t/0-0", "t/0-1"]
    assert tl["t/0-1"] == [
        (None, 2002, "g_a", None, "member_joined"),
        (2011, 9000, "g_b", "owner_vanished", "member_left"),
        (9004, 9500, "g_a", "member_left", "session_expired"),
        (9607, None, "g_a", "session_expired", None)]
    assert tl["t/0-0"] == [(None, 9500, "g_a", None, "session_expired"),
                           (9607, None, "g_a", "session_expired", None)]
    assert holder_at(tl, "t/0-1", 5000).consumer_id == "g_b"
    assert holder_at(tl, "t/0-1", 2005) is None  # between a's release and b's claim
    assert holder_at(tl, "t/0-1", 10**13).consumer_id == "g_a"
    doc = timeline_to_json(tl)
    assert doc["t/0-1"][1] == {"start_ms": 2011, "end_ms": 9000,
                               "start": "1970-01-01T00:00:02.011Z",
                               "end": "1970-01-01T00:00:09.000Z", "consumer_id": "g_b",
                               "trigger_in": "owner_vanished", "trigger_out": "member_left"}
    # what the command shows for one partition since a time
    records, window = select_history(recs, since=9200, partition="0-0")
    assert [r.generation for r in records] == [8, 9]
    assert window == {"t/0-0": [(None, 9500, "g_a", None, "session_expired"),
                                (9607, None, "g_a", "session_expired", None)]}


def test_parse_since():
    now = 1_800_000_000_000
    assert parse_since("10m", now) == now - 600_000
    assert parse_since("1.5h", now) == now - 5_400_000
    assert parse_since("2d", now) == now - 2 * 86_400_000
    assert parse_since("30s", now) == now - 30_000
    assert parse_since("2026-11-25T14:00:00Z") == 1_795_615_200_000
    assert parse_since("2026-11-25T14:00:00") == 1_795_615_200_000
    assert parse_since("1795615200000") == 1_795_615_200_000
    with pytest.raises(ValueError, match="30s, 10m"):
        parse_since("yesterday")


def test_inspector_shows_a_groups_history(zk_connect, zk_client):
    zk_client.ensure_path(L.consumer_ids(G))
    put(zk_client, "g_a", encode_history("g_a", [
        rec("g_a", 1, 1000, "started", plan=["t/0-0"], claimed=["t/0-0"]),
        rec("g_a", 2, 2000, "closing", released=["t/0-0"])]))
    put(zk_client, "g_bad", b"garbage")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "zk_layout", "--zk", zk_connect,
                               "history", *args], capture_output=True, text=True, timeout=60)

    r = run(G)
    assert r.returncode == 0, r.stderr
    assert "started" in r.stdout and "closing" in r.stdout and "DAMAGED" in r.stdout
    r = run(G, "--json", "--partition", "t/0-0")
    doc = json.loads(r.stdout)
    assert [x["trigger"] for x in doc["records"]] == ["started", "closing", "damaged"]
    assert doc["timeline"]["t/0-0"][0]["trigger_out"] == "closing"
    assert run("nogroup").returncode == 1
    assert run(G, "--since", "yesterday").returncode == 2


def test_a_claim_won_by_a_retry_without_a_reason_keeps_the_reason_that_planned_it():
    """A member killed with SIGKILL: the survivor plans its partition at member_left,
    finds the holder's node still there (waiting), wins it on a retry whose record says
    ``unchanged``; the hand-over is member_left's.  A retry with a reason of its own
    (owner_vanished) keeps that reason."""
    records = [
        rec("g_k", 1, 1000, "started", plan=["t/0-0", "t/0-1"], claimed=["t/0-0", "t/0-1"]),
        rec("g_a", 2, 5000, "member_left", plan=["t/0-0", "t/0-1"],
            waiting=["t/0-0", "t/0-1"]),
        rec("g_a", 2, 5100, "unchanged", plan=["t/0-0", "t/0-1"], claimed=["t/0-0"],
            waiting=["t/0-1"]),
        rec("g_a", 2, 5200, "owner_vanished", plan=["t/0-0", "t/0-1"], claimed=["t/0-1"]),
    ]
    tl = ownership_timeline(records)
    k0, a0 = tl["t/0-0"]
    assert (k0.consumer_id, k0.trigger_out, a0.consumer_id, a0.trigger_in) == \
        ("g_k", "member_left", "g_a", "member_left")
    k1, a1 = tl["t/0-1"]
    assert (k1.trigger_out, a1.trigger_in) == ("owner_vanished", "owner_vanished")


def test_the_next_rebalance_starting_in_the_millisecond_a_claim_ended_does_not_move_it():
    """Seen in CI: a survivor's member_left claim ended at 5004 and its next rebalance
    (``unchanged``, keeping everything) began at 5004.  The keep must not be taken
    first: it would end the killed member's holding for ``unchanged``, or (a partition
    its holder had released) open the survivor's holding before its history."""
    records = [
        rec("g_k", 1, 1000, "started", plan=["t/0-0"], claimed=["t/0-0"]),
        rec("g_b", 1, 1000, "started", plan=["t/0-1"], claimed=["t/0-1"]),
        rec("g_b", 2, 4000, "closing", released=["t/0-1"]),
        rec("g_a", 2, 5000, "member_left", ms=4, plan=["t/0-0", "t/0-1"],
            claimed=["t/0-0", "t/0-1"]),
        rec("g_a", 3, 5004, "unchanged", ms=2, plan=["t/0-0", "t/0-1"]),
    ]
    tl = ownership_timeline(records)
    assert tl["t/0-0"] == [(1010, 5000, "g_k", "started", "member_left"),
                           (5004, None, "g_a", "member_left", None)]
    assert tl["t/0-1"] == [(1010, 4000, "g_b", "started", "closing"),
                           (5004, None, "g_a", "member_left", None)]
