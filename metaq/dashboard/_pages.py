"""The dashboard's HTML pages, rendered on the server from the same dicts the JSON API
returns, so that every page works without JavaScript (``dashboard.js`` only refreshes
the group page in place and redraws its lag chart).  Every value is escaped; flagged
rows carry ``class="flagged"`` and say why.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from html import escape
from typing import Any
from urllib.parse import quote, urlencode

__all__ = ["page", "cluster_page", "group_page", "topic_page", "broker_page",
           "messages_page", "plugin_page", "lag_svg", "error_body",
           "history_page", "what_if_page", "audit_page", "capacity_line", "timeline_svg",
           "json_table", "NOT_AVAILABLE"]

NOT_AVAILABLE = "not available in this build"


def _e(value: object) -> str:
    return "-" if value is None else escape(str(value))


def _q(value: str) -> str:
    return quote(value, safe="")


def _table(headers: Sequence[str], rows: Iterable[tuple[str, Sequence[str]]], *,
           id: str | None = None, empty: str = "none") -> str:
    """``rows``: (tr attributes, cells as HTML)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(f"<tr{attrs}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>"
                   for attrs, cells in rows)
    if not body:
        body = f'<tr class="empty"><td colspan="{len(headers)}">{escape(empty)}</td></tr>'
    ident = f' id="{id}"' if id else ""
    return f"<table{ident}><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _flag(flagged: bool, extra: str = "") -> str:
    classes = " ".join(c for c in ("flagged" if flagged else "", extra) if c)
    return f' class="{classes}"' if classes else ""


def page(title: str, body: str, *, status: dict[str, Any], page_name: str,
         data: dict[str, str] | None = None) -> str:
    attrs = "".join(f' data-{k}="{escape(v)}"' for k, v in (data or {}).items())
    mode = "read-only" if status.get("read_only", True) else "writes allowed"
    conn = "" if status.get("zk_connected", True) else \
        ' <span class="badge bad">ZooKeeper connection lost: data may be stale</span>'
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{escape(title)} - metaq dashboard</title>
<link rel="stylesheet" href="/static/dashboard.css">
</head><body data-page="{page_name}"{attrs}>
<header><a class="brand" href="/">metaq dashboard</a>
<nav><a href="/">cluster</a> <a href="/messages">messages</a></nav>
<span class="zk">ZooKeeper {_e(status.get("zk"))} {_e(status.get("root"))}
<span class="badge">{mode}</span>{conn}</span></header>
<main>
<h1>{escape(title)}</h1>
{body}
</main>
<footer>sampled {_e(status.get("sampled_at"))} every {_e(status.get("sample_interval"))} s;
ZooKeeper reads by this dashboard: <span id="zk-reads">{_e(status.get("zk_reads"))}</span>
</footer>
<script src="/static/dashboard.js" defer></script>
</body></html>"""


def error_body(message: str) -> str:
    return f'<p class="error flagged">{escape(message)}</p>'


def _status(s: str) -> str:
    return f'<span class="state state-{escape(s.replace(" ", "-"))}">{escape(s)}</span>'


def cluster_page(c: dict[str, Any]) -> str:
    brokers = _table(
        ["broker", "role", "address", "reachable", "in sync", "epoch", "mode", "note"],
        ((_flag(b["flagged"]),
          [f'<a href="/brokers/{b["broker_id"]}">{b["broker_id"]}</a>',
           _e(b["role"] + (f' {b["slave_no"]}' if b["slave_no"] is not None else "")),
           _e(b["address"]),
           _e({True: "yes", False: "NO", None: "?"}[b["reachable"]]),
           _e({True: "yes", False: "no", None: "-"}[b["in_sync"]]),
           _e(b["epoch"]), _e(b["replication_mode"]), _e(b["error"])])
         for b in c["brokers"]), id="brokers", empty="no broker registered")
    topics = _table(
        ["topic", "partitions", "brokers", "bytes", "note"],
        ((_flag(t["flagged"]),
          [f'<a href="/topics/{_q(t["topic"])}">{escape(t["topic"])}</a>',
           _e(t["partitions"]), _e(",".join(map(str, t["brokers"]))), _e(t["bytes"]),
           escape("; ".join([f'{t["unknown_partitions"]} partition(s) not answered']
                            * bool(t["unknown_partitions"])
                            + [f'{d["path"]}: {d["error"]}' for d in t["damaged"]]))])
         for t in c["topics"]), id="topics", empty="no topic")
    groups = _table(
        ["group", "status", "members", "away", "partitions", "lag bytes", "lag msgs",
         "lag s", "topics"],
        ((_flag(g["flagged"]) + f' data-group="{escape(g["group"])}"',
          [f'<a href="/groups/{_q(g["group"])}">{escape(g["group"])}</a>',
           _status(g["status"]), _e(g["members"]), _e(g["away"]), _e(g["partitions"]),
           _e(g["lag"]), _e(g["lag_messages"]), _e(g["lag_seconds"]),
           _e(",".join(g["topics"]))])
         for g in c["groups"]), id="groups", empty="no consumer group")
    damaged = _table(["path", "error", "data (hex)"],
                     ((' class="flagged"', [_e(d["path"]), _e(d["error"]), _e(d["data_hex"])])
                      for d in c["damaged"]), id="damaged", empty="none")
    missing = "" if c["exists"] else \
        f'<p class="flagged">no Metaq tree at {_e(c["root"])} (yet)</p>'
    unknown = "" if not c["unknown"] else (
        "<details><summary>nodes Metaq does not define "
        f'({len(c["unknown"])})</summary><ul>'
        + "".join(f"<li>{escape(u)}</li>" for u in c["unknown"][:200]) + "</ul></details>")
    return (f"{missing}<h2>Brokers</h2>{brokers}<h2>Topics</h2>{topics}"
            f"<h2>Consumer groups</h2>{groups}<h2>Damaged nodes</h2>{damaged}{unknown}")


def lag_svg(points: Sequence[dict[str, Any]], width: int = 720, height: int = 180) -> str:
    """The lag chart: messages (left axis, solid) and seconds (right axis, dashed)."""
    pad_l, pad_r, pad_t, pad_b = 60, 60, 10, 24
    w, h = width - pad_l - pad_r, height - pad_t - pad_b
    out = [f'<svg id="lag-chart" xmlns="http://www.w3.org/2000/svg" '
           f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'role="img" aria-label="lag over the last hour">',
           f'<rect x="{pad_l}" y="{pad_t}" width="{w}" height="{h}" class="plot"/>']
    if not points:
        out.append(f'<text x="{pad_l + 10}" y="{pad_t + h / 2}">no sample yet</text></svg>')
        return "".join(out)
    t0, t1 = points[0]["time_ms"], points[-1]["time_ms"]
    span = max(1, t1 - t0)
    top_m = max(1, max(p["lag_messages"] or 0 for p in points))
    top_s = max(1.0, max(p["lag_seconds"] or 0 for p in points))

    def x(p: dict[str, Any]) -> float:
        return round(pad_l + w * (p["time_ms"] - t0) / span, 1)

    def y(v: float, top: float) -> float:
        return round(pad_t + h - h * v / top, 1)

    for cls, key, top in (("series-messages", "lag_messages", top_m),
                          ("series-seconds", "lag_seconds", top_s)):
        pts = " ".join(f"{x(p)},{y(p[key] or 0, top)}" for p in points)
        out.append(f'<polyline class="{cls}" points="{pts}"/>')
        out += [f'<circle class="point {cls}" cx="{x(p)}" cy="{y(p[key] or 0, top)}" r="2">'
                f'<title>{escape(str(p[key]))}</title></circle>' for p in points]
    out.append(f'<text class="axis" x="4" y="{pad_t + 10}">{top_m} msgs</text>'
               f'<text class="axis" x="{width - pad_r + 4}" y="{pad_t + 10}">{top_s:g} s</text>'
               f'<text class="axis" x="{pad_l}" y="{height - 6}">{len(points)} samples over '
               f'{round(span / 60000, 1)} min</text></svg>')
    return "".join(out)


def _members(g: dict[str, Any]) -> str:
    return _table(
        ["member", "state", "static", "instance", "host", "topics"],
        ((_flag(m["state"] not in ("live",)) + f' data-member="{escape(m["consumer_id"])}"',
          [_e(m["consumer_id"]), _e(m["text"]), "yes" if m["static"] else "no",
           _e(m["instance_id"]), _e(m["host"]), _e(",".join(m["topics"]))])
         for m in g["member_states"]), id="members", empty="no member")


def _partitions(g: dict[str, Any], *, writes: bool) -> str:
    def rows():
        for p in g["partitions"]:
            key = f'{p["topic"]}/{p["partition"]}'
            browse = "/messages?" + urlencode({"topic": p["topic"], "partition": p["partition"],
                                               "offset": p["committed"] or 0})
            msgs = p["lag_messages"]
            msgs_text = _e(msgs) if msgs is None or not p["lag_messages_estimated"] \
                else f"~{msgs}"
            yield (_flag(p["flagged"]) + f' data-partition="{escape(key)}"',
                   [_e(p["topic"]), f'<a href="{escape(browse)}">{_e(p["partition"])}</a>',
                    f'<span class="owner">{_e(p["owner"])}</span>', _e(p["committed"]),
                    _e(p["msg_id"]), _e(p["log_end"]), f'<span class="lag">{_e(p["lag"])}</span>',
                    msgs_text, _e(p["lag_seconds"]),
                    _status(p["state"]) + (f' <small>{escape(p["note"])}</small>'
                                           if p["note"] else "")])
    return _table(["topic", "partition", "owner", "committed", "msgId", "log end",
                   "lag bytes", "lag msgs", "lag s", "state"], rows(), id="partitions",
                  empty="no partition")


def group_page(g: dict[str, Any], points: Sequence[dict[str, Any]], *, token: str | None,
               capacity: dict[str, Any] | None = None) -> str:
    name = g["group"]
    writes = ""
    if token is not None:
        topics = sorted({p["topic"] for p in g["partitions"]})
        options = "".join(f"<option>{escape(t)}</option>" for t in topics)
        writes = f"""<h2>Write actions</h2>
<p>Refused while the group has live members. Type the group's name to confirm.</p>
<form method="post" action="/groups/{_q(name)}/reset-offsets" class="write" id="reset-form">
<input type="hidden" name="token" value="{escape(token)}">
<label>topic <select name="topic">{options}</select></label>
<label>to <input name="to" value="earliest" size="24"
 title="earliest, latest, an offset, or time:2026-11-25T14:00:00Z"></label>
<label>confirm <input name="confirm" placeholder="{escape(name)}" required></label>
<button>reset offsets</button></form>
<form method="post" action="/groups/{_q(name)}/skip" class="write" id="skip-form">
<input type="hidden" name="token" value="{escape(token)}">
<label>topic <select name="topic">{options}</select></label>
<label>partition <input name="partition" placeholder="0-0" size="8" required></label>
<label>confirm <input name="confirm" placeholder="{escape(name)}" required></label>
<button>skip pending messages</button></form>"""
    damaged = "" if not g["damaged"] else "<h2>Damaged nodes</h2>" + _table(
        ["path", "error", "data (hex)"],
        ((' class="flagged"', [_e(d["path"]), _e(d["error"]), _e(d["data_hex"])])
         for d in g["damaged"]))
    links = " ".join(f'<a href="/groups/{_q(name)}/{p}">{p}</a>'
                     for p in ("history", "what-if", "audit"))
    return f"""<p id="group-status">status {_status(g["status"])}
lag <span id="total-lag">{_e(g["total_lag"])}</span> bytes,
<span id="total-lag-messages">{_e(g["total_lag_messages"])}</span> messages,
oldest <span id="max-lag-seconds">{_e(g["max_lag_seconds"])}</span> s
<span class="links">{links}</span></p>
{capacity_line(capacity)}
<h2>Members</h2>{_members(g)}
<h2>Lag over the last hour</h2>{lag_svg(points)}
<h2>Partitions</h2>{_partitions(g, writes=token is not None)}
{damaged}{writes}"""


def _browse_link(topic: str, partition: str) -> str:
    href = "/messages?" + urlencode({"topic": topic, "partition": partition})
    return f'<a href="{escape(href)}">{escape(partition)}</a>'


def topic_page(t: dict[str, Any]) -> str:
    parts = _table(
        ["partition", "broker", "log start", "log end", "bytes", "note"],
        ((_flag(p["flagged"]),
          [_browse_link(t["topic"], p["partition"]), _e(p["broker_id"]), _e(p["log_start"]),
           _e(p["log_end"]), _e(p["bytes"]), _e(p["note"])])
         for p in t["partitions"]), id="partitions", empty="no partition")
    brokers = _table(["broker", "slave", "pub parts", "sub parts", "legacy parts"],
                     (("", [_e(b["broker_id"]), _e(b["slave_no"]), _e(b["pub_parts"]),
                            _e(b["sub_parts"]), _e(b["legacy_parts"])])
                      for b in t["brokers"]))
    damaged = "" if not t["damaged"] else "<h2>Damaged nodes</h2>" + _table(
        ["path", "error", "data (hex)"],
        ((' class="flagged"', [_e(d["path"]), _e(d["error"]), _e(d["data_hex"])])
         for d in t["damaged"]))
    return f"<h2>Partitions</h2>{parts}<h2>Registrations</h2>{brokers}{damaged}"


def broker_page(b: dict[str, Any]) -> str:
    out = []
    for r in b["brokers"]:
        head = f'{r["role"]}{" " + str(r["slave_no"]) if r["slave_no"] is not None else ""}' \
               f' at {r["address"]}'
        if not r["reachable"]:
            out.append(f'<h2>{escape(head)}</h2><p class="flagged">did not answer: '
                       f'{_e(r["error"])}</p>')
            continue
        out.append(f"<h2>{escape(head)}</h2>" + _table(
            ["stat", "value"], (("", [_e(k), _e(v)]) for k, v in r["stats"].items()),
            id=f'stats-{r["role"]}{r["slave_no"] if r["slave_no"] is not None else ""}'))
    return "".join(out) or '<p class="flagged">no master or slave registered</p>'


def messages_page(q: dict[str, str], result: dict[str, Any] | None,
                  topics: Sequence[str]) -> str:
    from metaq.dashboard._messages import CODEC_NAMES

    codec_opts = "".join(f'<option{" selected" if c == q.get("codec", "auto") else ""}>'
                         f"{c}</option>" for c in CODEC_NAMES)
    topic_list = "".join(f'<option value="{escape(t)}">' for t in topics)
    form = f"""<form method="get" action="/messages" id="browse-form">
<label>topic <input name="topic" list="topic-names" value="{escape(q.get("topic", ""))}"
 required></label><datalist id="topic-names">{topic_list}</datalist>
<label>partition <input name="partition" value="{escape(q.get("partition", ""))}"
 placeholder="0-0" size="8" required></label>
<label>offset <input name="offset" value="{escape(q.get("offset", ""))}" size="12"></label>
<label>or time <input name="time" value="{escape(q.get("time", ""))}"
 placeholder="2026-11-25T14:00:00Z" size="24"></label>
<label>count <input name="count" value="{escape(q.get("count", "20"))}" size="4"></label>
<label>codec <select name="codec">{codec_opts}</select></label>
<button>show</button></form>"""
    if result is None:
        return form + "<p>Pick a partition; without an offset or a time the last messages " \
                      "are shown.</p>"
    info = (f'<p>log {_e(result.get("log_start"))} .. {_e(result.get("log_end"))}, '
            f'around offset {_e(result.get("target"))} on {_e(result.get("broker"))}</p>')
    if result.get("error"):
        info += f'<p class="flagged">{escape(result["error"])}</p>'
    nav = []
    for label, key in (("older", "older"), ("newer", "newer")):
        if result.get(key) is not None:
            args = {**{k: v for k, v in q.items() if k not in ("offset", "time")},
                    "offset": str(result[key])}
            nav.append(f'<a href="/messages?{escape(urlencode(args))}">{label}</a>')
    rows = []
    for m in result["messages"]:
        body = m["body"]
        text = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)
        cls = "before" if m["before_target"] else ""
        rows.append((_flag(bool(m["body_error"]), cls) + f' data-offset="{m["offset"]}"',
                     [_e(m["offset"]), _e(m["msg_id"]), _e(m["time"]), _e(m["attribute"]),
                      _e(m["codec"]) + (" (cut)" if m["truncated"] else ""),
                      f'<pre class="body">{escape(text)}</pre>'
                      + (f'<small>{escape(m["body_error"])}</small>'
                         if m["body_error"] else "")]))
    return form + info + " ".join(nav) + _table(
        ["offset", "msgId", "time", "attribute", "codec", "body"], rows, id="messages",
        empty="no message there")


def _cell(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return escape(", ".join(str(v) for v in value)) if value else "-"
    if isinstance(value, dict):
        return escape(json.dumps(value, ensure_ascii=False))
    return _e(value)


def json_table(rows: Sequence[dict[str, Any]], *, id: str | None = None,
               empty: str = "none", keys: Sequence[str] | None = None) -> str:
    """A list of JSON objects as a table (the union of their keys, in order)."""
    cols = list(keys or dict.fromkeys(k for r in rows for k in r))
    return _table(cols, ((_flag(bool(r.get("error") or r.get("damaged"))),
                          [_cell(r.get(k)) for k in cols]) for r in rows), id=id, empty=empty)


def _hue(name: str) -> int:
    import zlib

    return zlib.crc32(name.encode()) % 360


def timeline_svg(timeline: dict[str, list[dict[str, Any]]], now_ms: int,
                 width: int = 900) -> str:
    """Ownership over time: one row per partition, one bar per holding, coloured by
    member; each bar's title says who, from when to when, and why it came and went."""
    starts = [i["start_ms"] for iv in timeline.values() for i in iv if i["start_ms"]]
    ends = [i["end_ms"] for iv in timeline.values() for i in iv if i["end_ms"]]
    if not timeline or not (starts or ends):
        return '<p id="timeline">no ownership recorded</p>'
    t0 = min(starts + ends)
    t1 = max([now_ms] + ends)
    label, row_h, pad = 150, 16, 4
    w = width - label - 10
    span = max(1, t1 - t0)
    h = row_h * len(timeline) + 30
    out = [f'<svg id="timeline" xmlns="http://www.w3.org/2000/svg" width="{width}" '
           f'height="{h}" viewBox="0 0 {width} {h}" role="img" '
           f'aria-label="who held each partition when">']
    for k, (part, intervals) in enumerate(timeline.items()):
        y = 4 + k * row_h
        out.append(f'<text x="2" y="{y + row_h - pad}">{escape(part)}</text>')
        for i in intervals:
            a = t0 if i["start_ms"] is None else i["start_ms"]
            b = t1 if i["end_ms"] is None else i["end_ms"]
            x = label + w * (a - t0) / span
            bw = max(1.5, w * (b - a) / span)
            title = (f'{i["consumer_id"]}: {i.get("start") or "before the history"} .. '
                     f'{i.get("end") or "now"}; came by {i.get("trigger_in") or "?"}'
                     + (f', went by {i["trigger_out"]}' if i.get("trigger_out") else ""))
            out.append(f'<rect class="hold" x="{x:.1f}" y="{y}" width="{bw:.1f}" '
                       f'height="{row_h - pad}" fill="hsl({_hue(i["consumer_id"])},55%,60%)" '
                       f'data-member="{escape(i["consumer_id"])}"><title>{escape(title)}'
                       f'</title></rect>')
    from metaq._time import format_time_ms

    out.append(f'<text class="axis" x="{label}" y="{h - 6}">{format_time_ms(t0)}</text>'
               f'<text class="axis" x="{width - 200}" y="{h - 6}">{format_time_ms(t1)}'
               f'</text></svg>')
    return "".join(out)


def history_page(group: str, data: dict[str, Any], since: str, now_ms: int) -> str:
    form = (f'<form method="get"><label>since <input name="since" value="{escape(since)}" '
            'placeholder="2026-11-25T14:00:00Z or epoch ms"></label><button>show</button>'
            "</form>")
    members = sorted({i["consumer_id"] for iv in data["timeline"].values() for i in iv})
    legend = " ".join(f'<span class="swatch" style="background:hsl({_hue(m)},55%,60%)">'
                      f"{escape(m)}</span>" for m in members)
    keys = [k for k in ("time", "consumer_id", "generation", "trigger", "detail", "state",
                        "duration_ms", "released", "claimed", "waiting", "error")
            if any(k in r for r in data["records"])]
    return (form + "<h2>Ownership over time</h2>" + f"<p>{legend}</p>"
            + timeline_svg(data["timeline"], now_ms)
            + f'<h2>Rebalances ({len(data["records"])})</h2>'
            + json_table(data["records"], id="records", empty="no rebalance recorded",
                         keys=keys or None))


def what_if_page(data: dict[str, Any]) -> str:
    load = [{"member": m, "partitions": n} for m, n in data.get("load", {}).items()]
    notes = "".join(f"<li>{escape(str(n))}</li>" for n in data.get("notes", []))
    return (f'<p id="what-if-summary">strategy {_e(data.get("strategy"))}: '
            f'{_e(data.get("moved"))} of {_e(data.get("partitions"))} partition(s) would move; '
            f'added {_cell(data.get("added"))}, removed {_cell(data.get("removed"))}</p>'
            + (f"<ul>{notes}</ul>" if notes else "")
            + "<h2>Load per member</h2>" + json_table(load, id="load")
            + "<h2>Moves</h2>" + json_table(data.get("moves", []), id="moves",
                                            empty="nothing would move"))


def audit_page(data: dict[str, Any]) -> str:
    findings = data.get("findings", [])
    rows = [dict(f, error=True) for f in findings]
    return (f'<p id="audit-summary">{len(findings)} finding(s)</p>'
            + json_table(rows, id="findings", empty="no fault found",
                         keys=["kind", "topic", "partition", "member", "detail"]))


def capacity_line(data: dict[str, Any] | None) -> str:
    if data is None or data.get("available") is False:
        return ""
    need = data.get("members_needed")
    return (f'<p id="capacity">capacity: consuming {_e(data.get("consume_rate"))} B/s, '
            f'producing {_e(data.get("produce_rate"))} B/s; catch-up in '
            f'{_e(data.get("catch_up_seconds"))} s'
            + (f'; members needed for {_e(data.get("target_seconds"))} s: {_e(need)}'
               if data.get("target_seconds") is not None else "") + "</p>")


def plugin_page(kind: str, group: str, data: dict[str, Any] | None, form: str = "",
                body: str | None = None) -> str:
    back = f'<p><a href="/groups/{_q(group)}">back to {escape(group)}</a></p>'
    if data is None:
        return back + f'<p class="unavailable">{escape(kind)}: {NOT_AVAILABLE}</p>'
    return back + form + (body if body is not None else
                          f'<pre class="json">{escape(json.dumps(data, indent=1))}</pre>')
