"""The CLI's one view of a BatchTuning: its status parsed once into the typed model (`batchtune.api`), and the few
names it prints from metadata and spec. A status that does not parse (a status writer may write anything there) is
refused with one line per field, naming it; nothing in the CLI reads status as dicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from batchtune.terminal import clean, safe

if TYPE_CHECKING:
    from batchtune.api import InvalidBatchTuning
    from batchtune.api.models import BatchTuningSpec, BatchTuningStatus
    from batchtune.report import Tuning


@dataclass(frozen=True)
class Shown:
    """A BatchTuning as the CLI shows it: its status parsed once into the typed model, and the names it prints."""

    namespace: str
    name: str
    created: str | None
    """metadata.creationTimestamp as the API server wrote it."""
    target: str
    """spec.targetRef.name."""
    percentile: str
    """spec.slo.percentile (P95 when unset)."""
    objective: str
    """spec.objective.type."""
    uid: str | None
    status: BatchTuningStatus
    written: bool
    """Whether the operator has written any status yet."""


def _spec_text(spec: Any, *keys: str) -> str:
    # The spec is the author's and the API server's schema checked it; only the names printed are read.
    for key in keys:
        spec = spec.get(key) if isinstance(spec, Mapping) else None
    return safe(spec) if isinstance(spec, (str, int, float)) and not isinstance(spec, bool) else ""


def shown(bt: Mapping[str, Any] | Shown) -> Shown:
    """The BatchTuning with its status parsed once (a Shown is passed through); InvalidBatchTuning naming every
    status field of the wrong type or out of bounds (a status writer can write anything there)."""
    from batchtune.api import FieldError, InvalidBatchTuning, parse_status

    if isinstance(bt, Shown):
        return bt
    raw = bt.get("status")
    if raw is not None and not isinstance(raw, dict):
        raise InvalidBatchTuning([FieldError("status", raw, "must be an object")])
    try:
        status = parse_status(clean(raw))
    except InvalidBatchTuning:
        parse_status(raw)  # raises with the values as written (FieldError shows them escaped once)
        raise
    obj: dict[str, Any] = clean(dict(bt))
    meta: dict[str, Any] = obj["metadata"] if isinstance(obj.get("metadata"), dict) else {}
    spec = obj.get("spec")
    uid = meta.get("uid")
    return Shown(namespace=_spec_text(meta, "namespace"), name=_spec_text(meta, "name"),
                 created=_spec_text(meta, "creationTimestamp") or None, target=_spec_text(spec, "targetRef", "name"),
                 percentile=_spec_text(spec, "slo", "percentile") or "P95",
                 objective=_spec_text(spec, "objective", "type"),
                 uid=uid if isinstance(uid, str) else None, status=status, written=bool(raw))


def typed(bt: Mapping[str, Any]) -> dict[str, Any]:
    """The BatchTuning with its status as the typed model writes it (`to_wire`): what the report's renderers are
    given, so that only fields of the model's types and bounds reach them; InvalidBatchTuning as `shown`."""
    view = shown(bt)
    return {"metadata": {"name": view.name, "namespace": view.namespace, "uid": view.uid},
            "spec": clean(bt.get("spec") if isinstance(bt.get("spec"), dict) else {}),
            "status": view.status.to_wire() if view.written else {}}


def reported(bt: Mapping[str, Any], view: Shown | None = None) -> Tuning:
    """What the report is drawn from: the status parsed once (`view`, else `shown(bt)`) and the spec parsed by the
    model (`report_spec`); InvalidBatchTuning as `shown`."""
    from batchtune.report import Tuning

    view = view or shown(bt)
    spec = bt.get("spec")
    return Tuning(view.namespace, view.name, report_spec(clean(spec if isinstance(spec, dict) else {})), view.status,
                  written=view.written)


def report_spec(spec: dict[str, Any]) -> BatchTuningSpec:
    """The spec as the report reads it. The API server's schema checked it, so it parses; one this CLI's model
    refuses anyway (another version's, or a hand-made object) still gets its report: each part the report reads
    that parses is kept, the rest is the model's default, and the target is named as written."""
    from pydantic import ValidationError

    from batchtune.api import InvalidBatchTuning, parse_spec
    from batchtune.api.models import (
        BatchTuningSpec,
        LoadSpec,
        ObjectiveSpec,
        ReportSpec,
        SloSpec,
        StrategySpec,
        TargetRef,
    )

    try:
        return parse_spec(spec)
    except InvalidBatchTuning:
        pass
    parts: dict[str, Any] = {"target_ref": TargetRef.model_construct(name=_spec_text(spec, "targetRef", "name"))}
    for key, model in (("slo", SloSpec), ("load", LoadSpec), ("objective", ObjectiveSpec),
                       ("strategy", StrategySpec), ("report", ReportSpec)):
        try:
            parts[key] = model.model_validate(spec.get(key) or {})
        except ValidationError:
            parts[key] = model.model_construct()  # defaults, unchecked: SloSpec's validator wants a target
    # model_construct: the parts the report does not read (search space, Prometheus, ...) stay unset.
    return BatchTuningSpec.model_construct(**parts)


def status_error(bt: Mapping[str, Any], exc: InvalidBatchTuning) -> str:
    """One line per field: `error: BatchTuning NS/NAME: status.trials[0].index: must be an integer (got ...)`."""
    meta = bt.get("metadata") if isinstance(bt.get("metadata"), dict) else {}
    where = f"{_spec_text(meta, 'namespace')}/{_spec_text(meta, 'name')}"
    return "\n".join(f"error: BatchTuning {where}: {e}" for e in exc.errors)


def when(moment: datetime | None) -> str:
    """A status timestamp as the API server writes it (2025-01-01T10:40:00Z)."""
    if moment is None:
        return "-"
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


