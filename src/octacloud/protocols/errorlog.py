"""Bounded logging of unexpected errors, so that a client repeating a request that trips a bug cannot fill the
replica's log: at most ``burst`` tracebacks per ``window_s``; beyond that the errors are counted and one line
per window says how many were not shown. Expected errors (bad requests, a failing model) are never logged
here: they are answered with their status (:func:`octacloud.serving.status_of`)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class BoundedErrorLog:
    def __init__(
        self,
        logger: logging.Logger,
        burst: int = 10,
        window_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.burst = burst
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._window_start = -float("inf")
        self._shown = 0
        self._suppressed = 0

    def exception(self, what: str, error: BaseException) -> None:
        """Log ``error`` (with its traceback) if this window's budget allows, else count it."""
        now = self._clock()
        with self._lock:
            if now - self._window_start >= self.window_s:
                if self._suppressed:
                    self.logger.error(
                        "%d more internal errors in the last %.0f s were not logged", self._suppressed, self.window_s
                    )
                self._window_start, self._shown, self._suppressed = now, 0, 0
            show = self._shown < self.burst
            if show:
                self._shown += 1
            else:
                self._suppressed += 1
        if show:
            self.logger.error("internal error in %s", what, exc_info=error)
