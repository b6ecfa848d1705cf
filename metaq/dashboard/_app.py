"""The dashboard's web application (aiohttp): the HTML pages, the JSON API under
``/api/``, the static files shipped in the package, and the two write actions.

Every route answers from :class:`~metaq.dashboard._model.Dashboard`; what may block
(a broker asked, a write) runs in the default executor, never on the event loop.
Errors are answers, not tracebacks: an unknown group, topic or broker is a 404, a bad
argument a 400, a refused write a 403 (read-only) or 409 (live members, a wrong
confirmation), a broker failing during a write a 502, each with ``{"error": ...}``
(or the page with the message).

Writes (``--allow-writes`` only) are POSTs carrying ``confirm`` (the group's name) and
``token`` (this run's write token, in the pages' forms and in ``/api/status``): a page
of another site cannot read the token, so it cannot post one.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from html import escape
from pathlib import Path
from typing import Any
from urllib.parse import quote

from aiohttp import web

from metaq._errors import ConfigError, MetaqError
from metaq.dashboard import _pages as pages
from metaq.dashboard._model import Dashboard, NotFound, parse_target

__all__ = ["make_app", "STATIC_DIR"]

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).with_name("static")
_DASH = web.AppKey("dashboard", Dashboard)
_TOKEN = web.AppKey("token", str)


class _Refused(MetaqError):
    """A write refused before it was tried (409)."""


def _wants_json(request: web.Request) -> bool:
    return request.path.startswith("/api/")


@web.middleware
async def _errors(request: web.Request,
                  handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except NotFound as e:
        status, message = 404, str(e)
    except _Refused as e:
        status, message = 409, str(e)
    except ConfigError as e:
        live = "live member" in str(e)
        status = 409 if live else 403 if "read-only" in str(e) else 400
        message = str(e)
    except MetaqError as e:
        status, message = 502, str(e)
    except Exception as e:  # noqa: BLE001 - a bug: said, logged, never a traceback page
        log.exception("dashboard: %s %s failed", request.method, request.path)
        status, message = 500, f"internal error: {type(e).__name__}: {e}"
    if _wants_json(request):
        return web.json_response({"error": message, "status": status}, status=status)
    dash = request.app[_DASH]
    return _html(pages.page("error", pages.error_body(message), status=dash.status(),
                            page_name="error"), status=status)


def _html(text: str, status: int = 200) -> web.Response:
    return web.Response(text=text, content_type="text/html", charset="utf-8", status=status,
                        headers={"Cache-Control": "no-store"})


def _json(data: Any, status: int = 200) -> web.Response:
    return web.json_response(data, status=status, headers={"Cache-Control": "no-store"})


async def _blocking(fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    return await asyncio.get_running_loop().run_in_executor(
        None, functools.partial(fn, *args, **kw))


def _int(value: str | None, what: str, default: int | None = None) -> int | None:
    if value in (None, ""):
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{what} must be an integer, got {value!r}") from None


# -- JSON API -------------------------------------------------------------------------------
async def api_status(request: web.Request) -> web.Response:
    dash = request.app[_DASH]
    out = dash.status()
    if dash.allow_writes:
        out["write_token"] = request.app[_TOKEN]
    return _json(out)


async def api_cluster(request: web.Request) -> web.Response:
    return _json(request.app[_DASH].cluster())


async def api_brokers(request: web.Request) -> web.Response:
    return _json(request.app[_DASH].brokers())


async def api_broker(request: web.Request) -> web.Response:
    bid = _int(request.match_info["broker_id"], "broker id")
    return _json(await _blocking(request.app[_DASH].broker_stats, bid))


async def api_topics(request: web.Request) -> web.Response:
    return _json(request.app[_DASH].topics())


async def api_topic(request: web.Request) -> web.Response:
    return _json(request.app[_DASH].topic(request.match_info["topic"]))


async def api_groups(request: web.Request) -> web.Response:
    return _json(request.app[_DASH].groups())


async def api_group(request: web.Request) -> web.Response:
    return _json(request.app[_DASH].group(request.match_info["group"]))


async def api_lag(request: web.Request) -> web.Response:
    return _json(request.app[_DASH].lag_series(request.match_info["group"]))


def _unavailable(kind: str, group: str) -> dict[str, Any]:
    return {"group": group, "available": False, "error": f"{kind}: {pages.NOT_AVAILABLE}"}


async def api_history(request: web.Request) -> web.Response:
    g = request.match_info["group"]
    out = await _blocking(request.app[_DASH].history, g, request.query.get("since"))
    return _json(_unavailable("history", g) if out is None else {"available": True, **out})


def _what_if_args(request: web.Request) -> dict[str, Any]:
    q = request.query
    add = _int(q.get("add"), "add", 0) or 0
    if add < 0:
        raise ConfigError(f"add must be >= 0, got {add}")
    remove = [r for v in q.getall("remove", []) for r in v.split(",") if r.strip()]
    return {"add": add, "remove": remove, "strategy": q.get("strategy") or None}


async def api_what_if(request: web.Request) -> web.Response:
    g = request.match_info["group"]
    out = await _blocking(request.app[_DASH].what_if, g, **_what_if_args(request))
    return _json(_unavailable("what-if", g) if out is None else {"available": True, **out})


async def api_audit(request: web.Request) -> web.Response:
    g = request.match_info["group"]
    out = await _blocking(request.app[_DASH].audit, g)
    return _json(_unavailable("audit", g) if out is None else {"available": True, **out})


async def api_capacity(request: web.Request) -> web.Response:
    g = request.match_info["group"]
    out = await _blocking(request.app[_DASH].capacity, g, request.query.get("target"))
    return _json(_unavailable("capacity", g) if out is None else out)


def _browse_args(q: Any) -> dict[str, Any]:
    return {"offset": _int(q.get("offset"), "offset"), "when": q.get("time") or None,
            "count": _int(q.get("count"), "count", 20), "before": _int(q.get("before"),
                                                                      "before", 5),
            "codec": q.get("codec") or "auto"}


async def api_messages(request: web.Request) -> web.Response:
    q = request.query
    for need in ("topic", "partition"):
        if not q.get(need):
            raise ConfigError(f"{need} is required (?topic=T&partition=0-0)")
    return _json(await _blocking(request.app[_DASH].messages, q["topic"], q["partition"],
                                 **_browse_args(q)))


async def _write_fields(request: web.Request) -> dict[str, str]:
    dash = request.app[_DASH]
    if not dash.allow_writes:
        raise ConfigError("this dashboard is read-only: start it with --allow-writes")
    if request.content_type == "application/json":
        try:
            body = await request.json()
        except ValueError:
            raise ConfigError("the request body is not JSON") from None
        fields = {k: str(v) for k, v in body.items()} if isinstance(body, dict) else {}
    else:
        fields = {k: str(v) for k, v in (await request.post()).items()}
    group = request.match_info["group"]
    if not secrets.compare_digest(fields.get("token", ""), request.app[_TOKEN]):
        raise _Refused("missing or wrong write token (the group page's form carries it; "
                       "/api/status gives it)")
    if fields.get("confirm") != group:
        raise _Refused(f"not confirmed: 'confirm' must be the group's name {group!r}")
    if not fields.get("topic"):
        raise ConfigError("topic is required")
    return fields


def _who(request: web.Request) -> str:
    return f"{request.remote or '?'}"


async def _reset(request: web.Request) -> dict[str, Any]:
    fields = await _write_fields(request)
    group = request.match_info["group"]
    to = parse_target(fields.get("to", ""))
    done = await _blocking(request.app[_DASH].reset, group, fields["topic"], to,
                           who=_who(request))
    return {"group": group, "topic": fields["topic"], "action": "reset-offsets",
            "partitions": {p: {"old": old, "new": new} for p, (old, new) in done.items()}}


async def _skip(request: web.Request) -> dict[str, Any]:
    fields = await _write_fields(request)
    group = request.match_info["group"]
    part = fields.get("partition", "")
    if not part:
        raise ConfigError("partition is required (e.g. 0-3)")
    done = await _blocking(request.app[_DASH].reset, group, fields["topic"], "latest",
                           partitions=[part], who=_who(request))
    return {"group": group, "topic": fields["topic"], "action": "skip",
            "partitions": {p: {"old": old, "new": new} for p, (old, new) in done.items()}}


async def api_reset(request: web.Request) -> web.Response:
    return _json(await _reset(request))


async def api_skip(request: web.Request) -> web.Response:
    return _json(await _skip(request))


# -- pages ----------------------------------------------------------------------------------
def _page(request: web.Request, title: str, body: str, name: str,
          data: dict[str, str] | None = None) -> web.Response:
    return _html(pages.page(title, body, status=request.app[_DASH].status(), page_name=name,
                            data=data))


async def page_cluster(request: web.Request) -> web.Response:
    return _page(request, "cluster", pages.cluster_page(request.app[_DASH].cluster()),
                 "cluster")


async def page_group(request: web.Request) -> web.Response:
    dash = request.app[_DASH]
    g = request.match_info["group"]
    report = dash.group(g)
    points = dash.lag_series(g)["points"]
    token = request.app[_TOKEN] if dash.allow_writes else None
    try:
        capacity = dash.capacity(g, request.query.get("target"))
    except Exception as e:  # noqa: BLE001 - an optional line: never the page's failure
        log.warning("dashboard: capacity hint of %s failed: %s", g, e)
        capacity = {"available": False, "error": str(e)}
    return _page(request, f"group {g}",
                 pages.group_page(report, points, token=token, capacity=capacity), "group",
                 {"group": g, "sample-interval": str(dash.sample_interval)})


async def page_topic(request: web.Request) -> web.Response:
    t = request.match_info["topic"]
    return _page(request, f"topic {t}", pages.topic_page(request.app[_DASH].topic(t)), "topic")


async def page_broker(request: web.Request) -> web.Response:
    bid = _int(request.match_info["broker_id"], "broker id")
    data = await _blocking(request.app[_DASH].broker_stats, bid)
    return _page(request, f"broker {bid}", pages.broker_page(data), "broker")


async def page_messages(request: web.Request) -> web.Response:
    dash = request.app[_DASH]
    q = dict(request.query)
    result = None
    if q.get("topic") and q.get("partition"):
        result = await _blocking(dash.messages, q["topic"], q["partition"], **_browse_args(q))
    topics = [t.topic for t in dash.snapshot().topics]
    return _page(request, "messages", pages.messages_page(q, result, topics), "messages")


async def page_history(request: web.Request) -> web.Response:
    g = request.match_info["group"]
    since = request.query.get("since", "")
    data = await _blocking(request.app[_DASH].history, g, since)
    body = None if data is None else pages.history_page(g, data, since,
                                                        int(time.time() * 1000))
    return _page(request, f"history of {g}", pages.plugin_page("history", g, data, body=body),
                 "history")


async def page_what_if(request: web.Request) -> web.Response:
    g = request.match_info["group"]
    args = _what_if_args(request)
    data = await _blocking(request.app[_DASH].what_if, g, **args)
    form = (f'<form method="get"><label>add <input name="add" value="{args["add"]}" size="3">'
            '</label> <label>remove <input name="remove" placeholder="consumer id"></label> '
            '<label>strategy <input name="strategy" placeholder="e.g. roundrobin"></label> '
            "<button>compute</button></form>")
    body = None if data is None else pages.what_if_page(data)
    return _page(request, f"what-if for {g}",
                 pages.plugin_page("what-if", g, data, form, body=body), "what-if")


async def page_audit(request: web.Request) -> web.Response:
    g = request.match_info["group"]
    data = await _blocking(request.app[_DASH].audit, g)
    body = None if data is None else pages.audit_page(data)
    return _page(request, f"audit of {g}", pages.plugin_page("audit", g, data, body=body),
                 "audit")


async def _write_page(request: web.Request, fn: Callable[[web.Request], Awaitable[dict]]
                      ) -> web.Response:
    g = request.match_info["group"]
    try:
        done = await fn(request)
    except (_Refused, ConfigError, MetaqError) as e:
        status = 409 if isinstance(e, _Refused) or "live member" in str(e) else \
            403 if "read-only" in str(e) else 400 if isinstance(e, ConfigError) else 502
        back = f'<p><a href="/groups/{quote(g, safe="")}">back</a></p>'
        body = pages.error_body(f"refused: {e}")
        return _html(pages.page(f"group {g}", body + back,
                                status=request.app[_DASH].status(), page_name="write"),
                     status=status)
    rows = "".join(f"<li>{escape(p)}: {v['old']} -> {v['new']}</li>"
                   for p, v in done["partitions"].items())
    back = f'<p><a href="/groups/{quote(g, safe="")}">back</a></p>'
    return _page(request, f"group {g}: {done['action']} done",
                 f'<ul id="done">{rows}</ul>{back}', "write")


async def page_reset(request: web.Request) -> web.Response:
    return await _write_page(request, _reset)


async def page_skip(request: web.Request) -> web.Response:
    return await _write_page(request, _skip)


def make_app(dashboard: Dashboard, *, token: str | None = None) -> web.Application:
    """The aiohttp application over a started :class:`Dashboard`."""
    app = web.Application(middlewares=[_errors])
    app[_DASH] = dashboard
    app[_TOKEN] = token or secrets.token_urlsafe(24)
    r = app.router
    r.add_get("/", page_cluster)
    r.add_get("/groups/{group}", page_group)
    r.add_get("/groups/{group}/history", page_history)
    r.add_get("/groups/{group}/what-if", page_what_if)
    r.add_get("/groups/{group}/audit", page_audit)
    r.add_post("/groups/{group}/reset-offsets", page_reset)
    r.add_post("/groups/{group}/skip", page_skip)
    r.add_get("/topics/{topic}", page_topic)
    r.add_get("/brokers/{broker_id}", page_broker)
    r.add_get("/messages", page_messages)
    r.add_get("/api/status", api_status)
    r.add_get("/api/cluster", api_cluster)
    r.add_get("/api/brokers", api_brokers)
    r.add_get("/api/brokers/{broker_id}", api_broker)
    r.add_get("/api/topics", api_topics)
    r.add_get("/api/topics/{topic}", api_topic)
    r.add_get("/api/groups", api_groups)
    r.add_get("/api/groups/{group}", api_group)
    r.add_get("/api/groups/{group}/lag", api_lag)
    r.add_get("/api/groups/{group}/history", api_history)
    r.add_get("/api/groups/{group}/what-if", api_what_if)
    r.add_get("/api/groups/{group}/audit", api_audit)
    r.add_get("/api/groups/{group}/capacity", api_capacity)
    r.add_get("/api/messages", api_messages)
    r.add_post("/api/groups/{group}/reset-offsets", api_reset)
    r.add_post("/api/groups/{group}/skip", api_skip)
    r.add_static("/static", STATIC_DIR, show_index=False)
    return app
