"""Watching an event loop for handlers that block it.

:class:`StallWatch` is a named thread that pings the loop every ``threshold / 2``
seconds; when a ping is not answered within ``threshold`` the loop is stalled,
and the thread looks at the loop thread's stack (``sys._current_frames``) for a
handler's code: the first time each handler is found there, it is reported once,
by name (a ``logging`` warning and the consumer's error sink).  Nothing runs per
message.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import Callable
from types import CodeType

__all__ = ["StallWatch", "BlockingHandlerWarning"]

log = logging.getLogger(__name__)


class BlockingHandlerWarning(RuntimeWarning):
    """An async handler blocked the event loop (a blocking call inside it)."""


class StallWatch:
    """The thread watching one loop (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, *, threshold: float, name: str,
                 handlers: Callable[[], dict[CodeType, str]],
                 report: Callable[[BaseException], None]) -> None:
        self._loop = loop
        self._threshold = threshold
        self._handlers = handlers
        self._report = report
        self._stop = threading.Event()
        self._pong = threading.Event()
        self._loop_thread = threading.get_ident()
        self.reported: dict[str, float] = {}  # handler name -> stall seen (s)
        self.stalls = 0
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(2 * self._threshold + 1)

    def _run(self) -> None:
        period = self._threshold / 2
        while not self._stop.wait(period):
            self._pong.clear()
            try:
                self._loop.call_soon_threadsafe(self._pong.set)
            except RuntimeError:
                return  # the loop closed
            if self._pong.wait(self._threshold):
                continue
            self.stalls += 1
            self._inspect()
            while not self._pong.wait(0.1):  # one report a stall: wait for the loop
                if self._stop.is_set():
                    return

    def _inspect(self) -> None:
        frame = sys._current_frames().get(self._loop_thread)
        codes = self._handlers()
        while frame is not None:
            name = codes.get(frame.f_code)
            if name is not None:
                if name not in self.reported:
                    self.reported[name] = self._threshold
                    warning = BlockingHandlerWarning(
                        f"handler {name} blocked the event loop for over "
                        f"{self._threshold * 1000:.0f} ms (a blocking call in an async "
                        f"handler: use await, or asyncio.to_thread)")
                    log.warning("%s", warning)
                    self._report(warning)
                return
            frame = frame.f_back
