"""What ``megascale launch`` restarts so that a healthy job survives the loss of a part of the
local control plane (called from the launcher's ``Monitor`` loop, in its only thread).

* **etcd**: when the embedded server exits by itself (killed, crashed), it is started again from
  its data directory on the same ports, as the ``etcd-restart`` injection does; agents and the
  controller reconnect. If it cannot be started again within ``etcd_grace_s``, the job is stopped
  with that reason (``final.json``'s ``reason``).
* **controller**: when no controller process is left while the job is neither finished nor
  failed, a new one is started; it wins the election once the dead leader's lease expires and
  resumes from the state snapshot in etcd, as a standby does. At most ``max_controller_restarts``
  times, then the job is stopped with that reason.
"""

from __future__ import annotations

import logging
import time
from typing import Any

logger = logging.getLogger("megascale.launch")


class Supervisor:
    """Restarts etcd and the controller of one ``LocalCluster`` (see the module docstring)."""

    def __init__(
        self, cluster: Any, etcd_grace_s: float = 60.0, max_controller_restarts: int = 5
    ) -> None:
        self.cluster = cluster
        self.etcd_grace_s = etcd_grace_s
        self.max_controller_restarts = max_controller_restarts
        self.controller_restarts = 0
        self._etcd_down_since: float | None = None

    def check(self) -> str | None:
        """Restart what has died; a reason to stop the job (logged) when that is not possible."""
        reason = self._check_etcd() or self._check_controllers()
        if reason:
            logger.error("stopping the job: %s", reason)
        return reason

    def _check_etcd(self) -> str | None:
        from megascale.etcd.server import EtcdStartError

        etcd = self.cluster.etcd
        if etcd.running:
            self._etcd_down_since = None
            return None
        if self._etcd_down_since is None:
            self._etcd_down_since = time.monotonic()
            logger.warning("etcd exited; starting it again from its data directory")
        try:
            etcd.start()
        except (EtcdStartError, OSError) as e:
            if time.monotonic() - self._etcd_down_since > self.etcd_grace_s:
                return (
                    f"etcd exited and could not be started again within {self.etcd_grace_s:.0f} s: "
                    + str(e).splitlines()[0]
                )
            logger.warning("etcd did not start again (%s); retrying", str(e).splitlines()[0])
            return None
        logger.info("etcd is back on %s", etcd.endpoint)
        self._etcd_down_since = None
        return None

    def _check_controllers(self) -> str | None:
        controllers = self.cluster.controllers
        if any(p.is_alive() for p in controllers.values()):
            return None
        if self.cluster.job_state() in ("finished", "failed"):
            return None
        if self.controller_restarts >= self.max_controller_restarts:
            return f"every controller exited, {self.controller_restarts} times; not restarting"
        self.controller_restarts += 1
        codes = {name: p.exitcode for name, p in controllers.items()}
        name = f"controller-{len(controllers)}"
        logger.warning("every controller has exited %s: starting %s", codes, name)
        self.cluster.spawn_controller(name)
        return None
