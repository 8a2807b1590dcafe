"""The BatchTuning v1alpha1 API: typed models, parsing with field-level errors, file loading.

    from batchtune.api import parse_batchtuning, InvalidBatchTuning
    try:
        bt = parse_batchtuning(obj)
    except InvalidBatchTuning as exc:
        for e in exc.errors: print(e.path, e.value, e.message)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from batchtune import API_GROUP, API_VERSION, KIND, PLURAL
from batchtune.api.errors import MISSING, FieldError, InvalidBatchTuning, from_validation_error
from batchtune.api.models import (
    API_VERSION_FULL,
    AppliedRecord,
    ApplyMode,
    ApplySpec,
    Baseline,
    BatchTuning,
    BatchTuningSpec,
    BatchTuningStatus,
    Condition,
    ConditionStatus,
    ContainerArgs,
    EngineLimitsRecord,
    Generator,
    GpuLabels,
    Knee,
    LoadSpec,
    LoadStepRecord,
    MaxNumSeqsSpec,
    MetricNames,
    ObjectiveSpec,
    ObjectiveType,
    ObjectMeta,
    Percentile,
    PlanRecord,
    PrometheusSpec,
    PrunedSetting,
    Recommendation,
    RunRecord,
    SearchSpec,
    SecretKeyRef,
    Setting,
    SloSpec,
    StrategySpec,
    StrategyType,
    TargetRef,
    TrialRecord,
    TrialSpec,
    VllmLabels,
    WorkloadRecord,
)
from batchtune.core.verify import InconclusivePolicy
from batchtune.core.vocabulary import ConditionType, Phase, Reason, TrialState, Verdict

__all__ = [
    "API_GROUP", "API_VERSION", "API_VERSION_FULL", "KIND", "PLURAL", "MISSING",
    "ApplyMode", "ApplySpec", "AppliedRecord", "Baseline", "BatchTuning", "BatchTuningSpec",
    "BatchTuningStatus", "Condition", "ContainerArgs", "EngineLimitsRecord", "LoadStepRecord", "PlanRecord",
    "WorkloadRecord", "ConditionStatus", "ConditionType", "FieldError", "Generator",
    "GpuLabels", "InvalidBatchTuning", "Knee", "LoadSpec", "MaxNumSeqsSpec", "MetricNames",
    "ObjectMeta", "ObjectiveSpec", "ObjectiveType", "Percentile", "Phase", "PrometheusSpec",
    "PrunedSetting", "Recommendation", "SearchSpec", "SecretKeyRef", "Setting", "SloSpec",
    "StrategySpec", "StrategyType", "TargetRef", "RunRecord", "InconclusivePolicy", "Reason", "TrialRecord", "TrialSpec",
    "TrialState", "Verdict", "VllmLabels",
    "parse_batchtuning", "parse_spec", "parse_status", "load_file", "iter_documents",
]


def parse_spec(spec: dict[str, Any]) -> BatchTuningSpec:
    """Validate a spec (camelCase keys); errors are named `spec.<path>`."""
    if not isinstance(spec, dict):
        raise InvalidBatchTuning([FieldError("spec", spec, "must be an object")])
    try:
        return BatchTuningSpec.model_validate(spec)
    except ValidationError as exc:
        raise InvalidBatchTuning(from_validation_error(exc, ("spec",), spec)) from None


def parse_status(status: dict[str, Any] | None) -> BatchTuningStatus:
    """Validate a status (camelCase keys); None or {} gives an empty status."""
    try:
        return BatchTuningStatus.model_validate(status or {})
    except ValidationError as exc:
        raise InvalidBatchTuning(from_validation_error(exc, ("status",), status)) from None


def parse_batchtuning(obj: dict[str, Any]) -> BatchTuning:
    """Validate a whole object: apiVersion, kind, metadata, spec and status."""
    if not isinstance(obj, dict):
        raise InvalidBatchTuning([FieldError("", obj, "a BatchTuning must be a mapping")])
    errors: list[FieldError] = []
    if obj.get("apiVersion") != API_VERSION_FULL:
        errors.append(FieldError("apiVersion", obj.get("apiVersion", MISSING), f"must be {API_VERSION_FULL}"))
    if obj.get("kind") != KIND:
        errors.append(FieldError("kind", obj.get("kind", MISSING), f"must be {KIND}"))
    if errors:
        # Another kind's fields would only produce noise; naming the kind is the useful error.
        raise InvalidBatchTuning(errors)
    try:
        return BatchTuning.model_validate(obj)
    except ValidationError as exc:
        raise InvalidBatchTuning(from_validation_error(exc, (), obj)) from None


def iter_documents(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(index, document) for each non-empty YAML document in the file; index counts from 1."""
    import yaml

    text = Path(path).read_text()
    try:
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        raise InvalidBatchTuning([FieldError("", MISSING, f"not valid YAML: {exc}")], source=str(path)) from None
    index = 0
    for doc in docs:
        if doc is None:
            continue
        index += 1
        yield index, doc


def load_file(path: str | Path) -> list[BatchTuning]:
    """Every BatchTuning in a (multi-document) YAML file; the first invalid document raises.

    A document of another kind is an error naming that kind, not skipped: a file handed to
    batchtune is meant to hold BatchTunings.
    """
    out: list[BatchTuning] = []
    documents = list(iter_documents(path))
    for index, doc in documents:
        try:
            out.append(parse_batchtuning(doc))
        except InvalidBatchTuning as exc:
            where = str(path) if len(documents) == 1 else f"{path} (document {index})"
            raise InvalidBatchTuning(exc.errors, source=where) from None
    return out
