"""kopf wiring: one timer per BatchTuning takes the next step; status is the only checkpoint.

Run with `batchtune operator` or `kopf run -m batchtune.controller.handlers`.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import datetime, timezone

import kopf

from batchtune import API_GROUP, API_VERSION, PLURAL
from batchtune.controller import kube, metrics
from batchtune.controller.flow import Reconcile, TERMINAL_PHASES, on_delete

# Read at import: kopf fixes a timer's interval when the decorator runs.
TICK_SECONDS = float(os.environ.get("BATCHTUNE_TICK_SECONDS", "2"))


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, logger: logging.Logger, **_) -> None:
    # Our finalizer and bookkeeping annotations live under our own domain, not kopf's defaults.
    settings.persistence.finalizer = "batchtune.io/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="batchtune.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="batchtune.io", key="last-handled-configuration")
    # Our own Events are explicit and on transitions; kopf posts only its warnings and errors.
    settings.posting.level = logging.WARNING
    # Long watches with a client-side timeout, so a silently broken stream is noticed.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.networking.request_timeout = 30
    # Reconcile steps call blocking clients; enough threads for many BatchTunings at once.
    settings.execution.max_workers = int(os.environ.get("BATCHTUNE_WORKERS", "16"))
    kube.load_config()
    logger.info("Configured the operator (tick %.1fs)", TICK_SECONDS)


@kopf.timer(API_GROUP, API_VERSION, PLURAL, interval=TICK_SECONDS, id="reconcile")
def reconcile(body: kopf.Body, patch: kopf.Patch, logger: kopf.Logger, **_) -> None:
    if (body.get("status") or {}).get("phase") in TERMINAL_PHASES and \
            (body.get("status") or {}).get("observedGeneration") == body["metadata"].get("generation"):
        return
    started = time.perf_counter()
    try:
        Reconcile(body, patch, logger, datetime.now(timezone.utc)).run()
    finally:
        metrics.RECONCILE_SECONDS.observe(time.perf_counter() - started)


@kopf.on.delete(API_GROUP, API_VERSION, PLURAL, id="cleanup")
def cleanup(body: kopf.Body, logger: kopf.Logger, **_) -> None:
    on_delete(body, logger)
