"""metaq's web dashboard (``metaq dashboard``): brokers, topics, consumer groups with
their lag over the last hour, a message browser, and the same data as a JSON API.

Needs the ``dashboard`` extra (``pip install 'metaq-py[dashboard]'``: aiohttp).

One concept per module:

================  ===========================================================
``_tree``         :class:`ZkTreeCache`: the tree kept by watches (kazoo's
                  ``TreeCache``), every read counted; :class:`TreeView`, a
                  read-only kazoo-client look-alike over it
``_model``        :class:`Dashboard`: the cache, the broker sampler thread,
                  each group's lag history, and every query as JSON-ready dicts
``_messages``     :func:`browse`: a partition's messages around an offset or a
                  time, bodies decoded by codec
``_pages``        the HTML pages (server-rendered, work without JavaScript)
``_app``          :func:`make_app`: the aiohttp routes, errors as answers, the
                  guarded write actions
``static/``       ``dashboard.css`` and ``dashboard.js`` (no third-party code)
================  ===========================================================

:func:`serve` runs it: binds 127.0.0.1 unless told otherwise, read-only unless
``allow_writes``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable

from metaq.dashboard._app import STATIC_DIR, make_app
from metaq.dashboard._messages import CODEC_NAMES, browse, decode_body
from metaq.dashboard._model import Dashboard, NotFound, parse_target
from metaq.dashboard._tree import TreeView, ZkTreeCache

__all__ = ["Dashboard", "NotFound", "ZkTreeCache", "TreeView", "make_app", "serve",
           "browse", "decode_body", "parse_target", "CODEC_NAMES", "STATIC_DIR"]

log = logging.getLogger(__name__)


def serve(dashboard: Dashboard, *, host: str = "127.0.0.1", port: int = 8090,
          on_ready: Callable[[str], None] | None = None) -> None:
    """Serve ``dashboard`` (started) until SIGTERM or SIGINT (or KeyboardInterrupt);
    ``on_ready(url)`` once listening.

    Both signals stop it cleanly even where the process started with them ignored (a
    shell's background job ignores SIGINT, and Python then never raises
    KeyboardInterrupt); called from another thread than the main one, it serves until
    that thread is interrupted, as before."""
    from aiohttp import web

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        handled = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, stop.set)
                handled.append(sig)
            except (ValueError, RuntimeError, NotImplementedError):
                pass  # not the main thread, or no signals here (Windows)
        runner = web.AppRunner(make_app(dashboard), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0] if runner.addresses else (host, port)
        shown = f"[{bound[0]}]" if ":" in str(bound[0]) else bound[0]
        url = f"http://{shown}:{bound[1]}/"
        if on_ready is not None:
            on_ready(url)
        try:
            await stop.wait()
            log.info("dashboard stopping (signal)")
        finally:
            for sig in handled:
                loop.remove_signal_handler(sig)
            await runner.cleanup()

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass
