"""``metaq dashboard``'s JSON API and pages against real ZooKeeper, broker processes and a
live group: every endpoint, the write actions' guards, garbage in ZooKeeper and a dead
broker as flagged rows (never a 500), credentials never shown."""

from __future__ import annotations

import json

import pytest
from kazoo.client import KazooClient

from metaq import Producer
from metaq.testing import free_port, wait_until
from zk_layout import Layout, StoredOffset, decode_offset, encode_offset

pytestmark = pytest.mark.broker

L = Layout()
TOPIC, GROUP = "dash", "g"


def _ends(cluster) -> dict[str, int]:
    out = {}
    for b in cluster:
        with b.connection() as c:
            for i in range(2):
                out[f"{b.broker_id}-{i}"] = c.offset(TOPIC, "x", i, 2**63 - 1)
    return out


def _group_ready(d, want_owners: set[str]):
    """The group as the dashboard shows it once every partition is owned by one of
    ``want_owners`` and the sampler has the log ends and lag times."""
    def ready():
        code, _, body = d.request(f"/api/groups/{GROUP}")
        if code == 404:
            return None  # not registered yet
        assert code == 200, body
        g = json.loads(body)
        rows = g["partitions"]
        if len(rows) == 4 and all(r["owner"] in want_owners for r in rows) and \
                all(r["log_end"] is not None and r["lag_seconds"] is not None for r in rows):
            return g
        return None
    return wait_until(ready, timeout=60, what=f"group owned by {want_owners} and sampled")


def test_every_json_endpoint_on_a_live_group(zk_connect, cluster, members, dashboard):
    ends = _ends(cluster)
    one, two = members("one", "two")
    d = dashboard()
    g = _group_ready(d, {one.id, two.id})
    # the group: owners, lag in bytes, messages and seconds, state, status
    assert g["group"] == GROUP and sorted(g["members"]) == sorted([one.id, two.id])
    assert {m["consumer_id"]: m["state"] for m in g["member_states"]} == {
        one.id: "live", two.id: "live"}
    rows = {r["partition"]: r for r in g["partitions"]}
    assert set(rows) == set(ends)
    for part, r in rows.items():
        assert r["topic"] == TOPIC and r["log_end"] == ends[part] and r["log_start"] == 0
        assert r["committed"] in (None, 0)  # held: nothing consumed yet
        assert r["lag"] == r["lag_bytes"] == ends[part] > 0
        assert r["lag_messages"] >= 1 and r["lag_seconds"] >= 0
        assert r["state"] == "lagging" and not r["flagged"]
    assert g["total_lag"] == sum(ends.values()) and g["status"] == "warn"
    assert {r["owner"] for r in rows.values()} == {one.id, two.id}
    # the lag series: points sampled while it runs
    lag = wait_until(lambda: (s := d.json(f"/api/groups/{GROUP}/lag"))["points"] and
                     len(s["points"]) >= 3 and s, timeout=30, what="lag points")
    assert lag["group"] == GROUP and lag["seconds"] == 3600
    assert lag["points"][-1]["lag"] == sum(ends.values())
    assert all(set(p) >= {"time_ms", "lag", "lag_messages", "lag_seconds", "status"}
               for p in lag["points"])
    # the cluster, brokers, topics
    c = d.json("/api/cluster")
    assert c["exists"] and c["read_only"] and c["zk_reads"] > 0
    assert {(b["broker_id"], b["role"], b["reachable"]) for b in c["brokers"]} == {
        (0, "master", True), (1, "master", True)}
    assert [t["topic"] for t in c["topics"]] == [TOPIC]
    assert [x["group"] for x in c["groups"]] == [GROUP] and c["damaged"] == []
    assert d.json("/api/brokers") == c["brokers"]
    topics = d.json("/api/topics")
    assert topics[0]["partitions"] == 4 and topics[0]["bytes"] == sum(ends.values())
    t = d.json(f"/api/topics/{TOPIC}")
    assert {p["partition"]: p["log_end"] for p in t["partitions"]} == ends
    groups = d.json("/api/groups")
    assert groups[0]["members"] == 2 and groups[0]["lag"] == sum(ends.values())
    stats = d.json("/api/brokers/0")
    assert stats["brokers"][0]["reachable"] and stats["brokers"][0]["stats"]
    status = d.json("/api/status")
    assert status["samples"] >= 1 and "write_token" not in status
    # the message browser: msgpack bodies decoded, msgId times, around an offset
    part = "0-0"
    m = d.json(f"/api/messages?topic={TOPIC}&partition={part}&offset=0&count=5")
    assert m["log_end"] == ends[part] and len(m["messages"]) == 5
    first = m["messages"][0]
    assert first["offset"] == 0 and first["codec"] == "msgpack"
    assert first["body"]["who"] == "dashboard-test" and first["time_ms"] > 0
    second = m["messages"][1]["offset"]
    around = d.json(f"/api/messages?topic={TOPIC}&partition={part}&offset={second}"
                    "&before=1&count=1&codec=hex")
    assert [x["offset"] for x in around["messages"]] == [0, second]
    assert around["messages"][0]["before_target"] and around["messages"][1]["codec"] == "hex"
    by_time = d.json(f"/api/messages?topic={TOPIC}&partition={part}"
                     f"&time={first['time_ms']}&count=1")
    assert by_time["messages"][0]["offset"] == 0
    tail = d.json(f"/api/messages?topic={TOPIC}&partition={part}&before=2")
    assert tail["messages"] and tail["messages"][-1]["next_offset"] == ends[part]
    # the plug-in views answer either way (their data, or "not available in this build")
    for view in ("history", "what-if", "audit", "capacity"):
        out = d.json(f"/api/groups/{GROUP}/{view}")
        assert out["group"] == GROUP and isinstance(out["available"], bool)
        if not out["available"]:
            assert "not available in this build" in out["error"]
    # unknowns are 404s, bad arguments 400s, as JSON
    assert "no consumer group" in d.json("/api/groups/nope", status=404)["error"]
    assert "no topic" in d.json("/api/topics/nope", status=404)["error"]
    assert d.json("/api/brokers/9", status=404)["status"] == 404
    assert "partition" in d.json(f"/api/messages?topic={TOPIC}", status=400)["error"]
    assert d.json(f"/api/messages?topic={TOPIC}&partition=0-0&offset=x", status=400)
    # the pages render from the same data
    html = d.page(f"/groups/{GROUP}")
    assert one.id in html and 'id="lag-chart"' in html and "<circle" in html
    for path in ("/", f"/topics/{TOPIC}", "/brokers/0", "/messages",
                 f"/messages?topic={TOPIC}&partition=0-0&offset=0",
                 f"/groups/{GROUP}/history", f"/groups/{GROUP}/what-if",
                 f"/groups/{GROUP}/audit", f"/groups/{GROUP}?target=10m"):
        d.page(path)
    assert "no consumer group" in d.page("/groups/nope", status=404)
    code, ctype, css = d.request("/static/dashboard.css")
    assert code == 200 and "text/css" in ctype
    assert d.request("/static/dashboard.js")[0] == 200


def test_a_member_leaving_moves_its_partitions_on_the_next_poll(zk_connect, cluster, members,
                                                               dashboard):
    one, two = members("one", "two")
    d = dashboard()
    _group_ready(d, {one.id, two.id})
    reads = d.json("/api/status")["zk_reads"]
    for _ in range(5):  # polling an unchanged group reads nothing from ZooKeeper
        d.json(f"/api/groups/{GROUP}")
    assert d.json("/api/status")["zk_reads"] == reads
    two.close()
    g = _group_ready(d, {one.id})
    assert g["members"] == [one.id]


def test_write_actions_are_guarded_confirmed_and_logged(zk_connect, zk_client, cluster,
                                                        members, dashboard):
    ends = _ends(cluster)
    ro = dashboard()
    code, out = ro.post(f"/api/groups/{GROUP}/reset-offsets",
                        {"topic": TOPIC, "to": "latest", "confirm": GROUP, "token": "x"})
    assert code == 403 and "read-only" in out["error"]
    assert "reset offsets" not in ro.page(f"/groups/{GROUP}", status=404)
    rw = dashboard("--allow-writes")
    token = rw.json("/api/status")["write_token"]
    (one,) = members("one")
    _group_ready(rw, {one.id})
    assert 'name="token"' in rw.page(f"/groups/{GROUP}")
    base = {"topic": TOPIC, "to": "latest", "confirm": GROUP, "token": token}
    code, out = rw.post(f"/api/groups/{GROUP}/reset-offsets", {**base, "token": "forged"})
    assert code == 409 and "token" in out["error"]
    code, out = rw.post(f"/api/groups/{GROUP}/reset-offsets", {**base, "confirm": "yes"})
    assert code == 409 and "confirm" in out["error"]
    code, out = rw.post(f"/api/groups/{GROUP}/reset-offsets", base)
    assert code == 409 and "live member" in out["error"]
    code, out = rw.post(f"/api/groups/{GROUP}/skip", {**base, "partition": "0-0"})
    assert code == 409 and "live member" in out["error"]
    assert zk_client.exists(L.offsets_dir(GROUP, TOPIC)) is None  # nothing written
    one.close()
    wait_until(lambda: rw.json(f"/api/groups/{GROUP}")["members"] == [], timeout=30,
               what="the member gone")
    def committed() -> dict[str, int]:
        d = L.offsets_dir(GROUP, TOPIC)
        return {p: decode_offset(zk_client.get(f"{d}/{p}")[0]).offset
                for p in zk_client.get_children(d)}

    before = committed()  # what the member committed as it closed
    with Producer(zk_connect) as p:
        for f in [p.send_async(TOPIC, {"n": i}) for i in range(20)]:
            f.result(timeout=30)
    ends = _ends(cluster)
    # skip: one partition's committed offset to its log end, the others untouched
    code, out = rw.post(f"/api/groups/{GROUP}/skip", {**base, "partition": "1-1"})
    assert code == 200, out
    assert out["partitions"] == {"1-1": {"old": before.get("1-1"), "new": ends["1-1"]}}
    assert committed() == {**before, "1-1": ends["1-1"]}
    code, out = rw.post(f"/api/groups/{GROUP}/skip", {**base, "partition": "5-5"})
    assert code == 400 and "no partition" in out["error"]
    # the form (no JavaScript): reset the whole topic to earliest
    code, _, html = rw.request(f"/groups/{GROUP}/reset-offsets",
                               data={**base, "to": "earliest"})
    assert code == 200 and 'id="done"' in html
    for part in ends:
        data, _ = zk_client.get(L.offset(GROUP, TOPIC, part))
        assert decode_offset(data).offset == 0
    code, _, html = rw.request(f"/groups/{GROUP}/reset-offsets",
                               data={**base, "to": "sideways"})
    assert code == 400 and "reset target" in html
    log = rw.log()
    assert "dashboard write by" in log and "skip" not in ro.log()
    assert "refused" in log and "live member" in log


def test_garbage_in_zookeeper_and_a_dead_broker_are_flagged_rows(zk_connect, zk_client,
                                                                 cluster, dashboard):
    zk_client.create(L.offset(GROUP, TOPIC, "0-0"), b"not an offset", makepath=True)
    zk_client.create(L.offset(GROUP, TOPIC, "0-1"),
                     encode_offset(StoredOffset(offset=3, msg_id=-1)), makepath=True)
    zk_client.create(L.owner(GROUP, TOPIC, "1-0"), b"\xff\xfe", makepath=True)
    zk_client.create(L.broker_master(5), b"garbage uri", makepath=True)
    zk_client.create(f"{L.topic_sub_dir(TOPIC)}/5-m", b"{not json", makepath=True)
    d = dashboard()
    cluster[1].kill()  # registered (its session outlives it: 30 s) but gone

    def dead_one_unknown_live_one_read() -> dict | None:
        # a sample with broker 1's partitions unknown and broker 0's bounds read (a
        # sample in which broker 0 was slow to answer, on a loaded machine, has its
        # bounds unknown too: the next one is taken)
        x = d.json(f"/api/groups/{GROUP}")
        rows = {r["partition"]: r for r in x["partitions"]} if x else {}
        if rows.get("1-1", {}).get("state") == "unknown" and \
                rows.get("0-1", {}).get("log_end") is not None:
            return x
        return None

    g = wait_until(dead_one_unknown_live_one_read, timeout=60,
                   what="broker 1's partitions unknown, broker 0's read")
    rows = {r["partition"]: r for r in g["partitions"]}
    assert rows["0-0"]["state"] == "damaged" and rows["0-0"]["flagged"]
    assert rows["1-1"]["flagged"] and rows["1-1"]["log_end"] is None
    assert rows["1-0"]["state"] == "damaged" and rows["1-0"]["flagged"]  # its owner node
    assert rows["0-1"]["committed"] == 3 and rows["0-1"]["log_end"] is not None
    assert g["status"] == "error"
    assert {x["path"] for x in g["damaged"]} >= {L.offset(GROUP, TOPIC, "0-0"),
                                                 L.owner(GROUP, TOPIC, "1-0")}
    c = wait_until(lambda: (x := d.json("/api/cluster")) and any(
        b["broker_id"] == 1 and b["reachable"] is False for b in x["brokers"]) and x,
        timeout=30, what="broker 1 unreachable")
    dead = [b for b in c["brokers"] if b["broker_id"] == 1]
    assert dead[0]["flagged"] and dead[0]["error"]
    assert any(b["broker_id"] == 5 and b["flagged"] for b in c["brokers"])
    damaged = {x["path"] for x in c["damaged"]}
    assert L.broker_master(5) in damaged and L.offset(GROUP, TOPIC, "0-0") in damaged
    assert c["topics"][0]["flagged"]
    # every page and endpoint still answers, with the flags, never a 500
    html = d.page("/")
    assert 'class="flagged"' in html and L.broker_master(5) in html
    assert 'class="flagged"' in d.page(f"/groups/{GROUP}")
    d.page(f"/topics/{TOPIC}")
    b1 = d.json("/api/brokers/1")
    assert b1["brokers"][0]["reachable"] is False and b1["brokers"][0]["error"]
    assert "did not answer" in d.page("/brokers/1")
    m = d.json(f"/api/messages?topic={TOPIC}&partition=1-0&offset=0")
    assert m["flagged"] and m["error"] and m["messages"] == []
    d.page(f"/messages?topic={TOPIC}&partition=1-0&offset=0")
    for path in ("/api/groups", "/api/topics", f"/api/topics/{TOPIC}",
                 f"/api/groups/{GROUP}/lag", "/api/status"):
        d.json(path)


def test_credentials_are_never_shown(zk_connect, cluster, dashboard, tmp_path):
    secret = "s3cr3t-pw"
    d = dashboard("--zk-auth", f"dash:{secret}", "--allow-writes")
    wait_until(lambda: d.json("/api/status")["samples"] >= 1, timeout=30, what="a sample")
    seen = []
    for path in ("/", "/api/status", "/api/cluster", "/api/topics", "/api/brokers",
                 "/api/brokers/0", f"/api/topics/{TOPIC}", "/messages", "/brokers/0",
                 f"/topics/{TOPIC}", f"/api/messages?topic={TOPIC}&partition=0-0"):
        code, _, body = d.request(path)
        assert code == 200, (path, body[:300])
        seen.append(body)
    assert not [s for s in seen if secret in s]
    assert secret not in d.log() and secret not in "".join(d.stdout)
    assert json.loads(seen[1])["zk"] == zk_connect


def test_bad_flags_and_a_busy_port(zk_connect, dashboard):
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "metaq", "dashboard", "--zk", zk_connect,
                               *args], capture_output=True, text=True, timeout=60)

    out = run("--port", "70000")
    assert out.returncode == 2 and "--port" in out.stderr
    out = run("--sample-interval", "0")
    assert out.returncode == 2 and "--sample-interval" in out.stderr
    d = dashboard()
    port = d.url.rsplit(":", 1)[1]
    out = run("--port", port)
    assert out.returncode == 2 and "cannot listen" in out.stderr
    assert d.url.startswith("http://127.0.0.1:")
    assert free_port()  # the helper is there for the browser tests too
    _ = KazooClient


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_the_dashboard_stops_cleanly_on_a_signal_even_when_started_ignoring_sigint(
        zk_connect, sig):
    """A shell's background job starts with SIGINT ignored, and Python then never raises
    KeyboardInterrupt: ``metaq dashboard`` still stops on SIGINT (and on SIGTERM, what
    ``docker stop`` and service managers send), exit status 0, at once."""
    import signal
    import subprocess
    import sys
    import threading

    from metaq.testing import wait_until

    proc = subprocess.Popen(
        [sys.executable, "-m", "metaq", "dashboard", "--zk", zk_connect, "--port", "0",
         "--sample-interval", "0.3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True,
                     name="dash-stdout").start()
    try:
        wait_until(lambda: any("http://" in s for s in lines) or proc.poll() is not None,
                   timeout=60, what="the dashboard to listen")
        assert proc.poll() is None, proc.stderr.read()
        proc.send_signal(getattr(signal, sig))
        assert proc.wait(timeout=10) == 0, proc.stderr.read()  # (a timeout raises)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
