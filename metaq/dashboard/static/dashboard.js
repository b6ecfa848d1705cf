// metaq dashboard: refreshes the group page in place (every second) and redraws its lag
// chart; every page works without this script.  No third-party code.
"use strict";
(function () {
  var body = document.body;
  if (body.dataset.page !== "group") return;
  var group = body.dataset.group;
  var base = "/api/groups/" + encodeURIComponent(group);

  function esc(v) {
    if (v === null || v === undefined) return "-";
    return String(v).replace(/[&<>"']/g, function (c) {
      return {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c];
    });
  }
  function state(s) {
    return '<span class="state state-' + esc(s.replace(/ /g, "-")) + '">' + esc(s) + "</span>";
  }
  function setText(id, v) { var el = document.getElementById(id); if (el) el.textContent = v === null ? "-" : v; }

  function members(g) {
    var rows = g.member_states.map(function (m) {
      return '<tr' + (m.state !== "live" ? ' class="flagged"' : "") + ' data-member="' + esc(m.consumer_id) + '">' +
        "<td>" + esc(m.consumer_id) + "</td><td>" + esc(m.text) + "</td><td>" + (m.static ? "yes" : "no") +
        "</td><td>" + esc(m.instance_id) + "</td><td>" + esc(m.host) + "</td><td>" + esc(m.topics.join(",")) + "</td></tr>";
    });
    if (!rows.length) rows = ['<tr class="empty"><td colspan="6">no member</td></tr>'];
    document.querySelector("#members tbody").innerHTML = rows.join("");
  }
  function partitions(g) {
    var rows = g.partitions.map(function (p) {
      var key = p.topic + "/" + p.partition;
      var href = "/messages?topic=" + encodeURIComponent(p.topic) + "&partition=" +
        encodeURIComponent(p.partition) + "&offset=" + (p.committed || 0);
      var msgs = p.lag_messages === null ? "-" : (p.lag_messages_estimated ? "~" : "") + p.lag_messages;
      return '<tr' + (p.flagged ? ' class="flagged"' : "") + ' data-partition="' + esc(key) + '">' +
        "<td>" + esc(p.topic) + '</td><td><a href="' + esc(href) + '">' + esc(p.partition) + "</a></td>" +
        '<td><span class="owner">' + esc(p.owner) + "</span></td><td>" + esc(p.committed) + "</td><td>" +
        esc(p.msg_id) + "</td><td>" + esc(p.log_end) + '</td><td><span class="lag">' + esc(p.lag) +
        "</span></td><td>" + esc(msgs) + "</td><td>" + esc(p.lag_seconds) + "</td><td>" + state(p.state) +
        (p.note ? " <small>" + esc(p.note) + "</small>" : "") + "</td></tr>";
    });
    if (!rows.length) rows = ['<tr class="empty"><td colspan="10">no partition</td></tr>'];
    document.querySelector("#partitions tbody").innerHTML = rows.join("");
  }
  function status(g) {
    var el = document.querySelector("#group-status .state");
    if (el) el.outerHTML = state(g.status);
    setText("total-lag", g.total_lag);
    setText("total-lag-messages", g.total_lag_messages);
    setText("max-lag-seconds", g.max_lag_seconds);
  }

  var SVG = "http://www.w3.org/2000/svg";
  function chart(points) {
    var svg = document.getElementById("lag-chart");
    if (!svg) return;
    var W = 720, H = 180, L = 60, R = 60, T = 10, B = 24, w = W - L - R, h = H - T - B;
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    function add(tag, attrs, text) {
      var el = document.createElementNS(SVG, tag);
      for (var k in attrs) el.setAttribute(k, attrs[k]);
      if (text !== undefined) el.textContent = text;
      svg.appendChild(el);
      return el;
    }
    add("rect", {x: L, y: T, width: w, height: h, "class": "plot"});
    if (!points.length) { add("text", {x: L + 10, y: T + h / 2}, "no sample yet"); return; }
    var t0 = points[0].time_ms, span = Math.max(1, points[points.length - 1].time_ms - t0);
    var topM = Math.max(1, Math.max.apply(null, points.map(function (p) { return p.lag_messages || 0; })));
    var topS = Math.max(1, Math.max.apply(null, points.map(function (p) { return p.lag_seconds || 0; })));
    function x(p) { return (L + w * (p.time_ms - t0) / span).toFixed(1); }
    function y(v, top) { return (T + h - h * v / top).toFixed(1); }
    [["series-messages", "lag_messages", topM], ["series-seconds", "lag_seconds", topS]].forEach(function (s) {
      add("polyline", {"class": s[0], points: points.map(function (p) { return x(p) + "," + y(p[s[1]] || 0, s[2]); }).join(" ")});
      points.forEach(function (p) {
        var c = add("circle", {"class": "point " + s[0], cx: x(p), cy: y(p[s[1]] || 0, s[2]), r: 2});
        var title = document.createElementNS(SVG, "title"); title.textContent = String(p[s[1]]); c.appendChild(title);
      });
    });
    add("text", {"class": "axis", x: 4, y: T + 10}, topM + " msgs");
    add("text", {"class": "axis", x: W - R + 4, y: T + 10}, topS + " s");
    add("text", {"class": "axis", x: L, y: H - 6}, points.length + " samples over " + (span / 60000).toFixed(1) + " min");
  }

  function poll() {
    fetch(base, {cache: "no-store"}).then(function (r) { return r.ok ? r.json() : null; })
      .then(function (g) { if (g) { members(g); partitions(g); status(g); body.dataset.updated = Date.now(); } })
      .catch(function () {});
  }
  function pollChart() {
    fetch(base + "/lag", {cache: "no-store"}).then(function (r) { return r.ok ? r.json() : null; })
      .then(function (s) { if (s) chart(s.points); }).catch(function () {});
  }
  var every = Math.max(1, parseFloat(body.dataset.sampleInterval || "5")) * 1000;
  setInterval(poll, 1000);
  setInterval(pollChart, every);
})();
