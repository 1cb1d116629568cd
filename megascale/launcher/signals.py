"""How a launcher process stops on a signal: SIGTERM (``timeout``, systemd, Kubernetes) and SIGHUP
(the terminal closed, the ssh session dropped) do what SIGINT (Ctrl-C) does.

``StopSignals`` (``megascale launch``): the first SIGTERM, SIGINT or SIGHUP raises
``KeyboardInterrupt`` in the main thread, which the launcher turns into its orderly stop (processes
stopped, etcd's temporary directory removed, ``final.json`` written); from then on, and from
``stopping()`` on, further signals are logged and otherwise ignored, so the stop is never cut short.

``reset_in_child`` restores the default dispositions (SIGHUP: ignored) in a forked child, which
would otherwise inherit the parent's handlers.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

logger = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopSignals:
    """SIGTERM/SIGINT/SIGHUP -> one ``KeyboardInterrupt(signal name)``, later ones ignored (see the
    module docstring). Install from the main thread."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._stopping = False
        self._previous: dict[int, Any] = {}

    def install(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def stopping(self) -> None:
        """The orderly stop has begun: signals from now on are only logged."""
        self._stopping = True

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if self._stopping:
            logger.warning("%s received while stopping: the stop goes on", name)
            return
        self._stopping, self.received = True, name
        raise KeyboardInterrupt(name)


def reset_in_child() -> None:
    """In a forked child: SIGTERM kills (the default), SIGINT raises KeyboardInterrupt, SIGHUP is
    ignored (a closed terminal hangs up the launcher's whole process group: the launcher stops
    its children in order, they do not die under it)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
