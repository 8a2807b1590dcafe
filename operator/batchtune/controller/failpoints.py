"""Crash points for the failover tests: `BATCHTUNE_FAILPOINTS=name[,name]` in the operator's environment makes it
SIGKILL itself the first time it reaches a named point (each point fires once per process).

Only the operator's own environment arms them (the chart sets none; a BatchTuning cannot): they let a test kill
the operator in windows too short to hit from outside, such as between a production patch and its status write.
"""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)
ARMED = {name.strip() for name in os.environ.get("BATCHTUNE_FAILPOINTS", "").split(",") if name.strip()}


def reach(name: str) -> None:
    if name in ARMED:
        ARMED.discard(name)
        log.warning("Failpoint %s reached: SIGKILL", name)
        logging.shutdown()
        os.kill(os.getpid(), signal.SIGKILL)
