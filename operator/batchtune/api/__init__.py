"""The BatchTuning v1alpha1 API: typed models, parsing with field-level errors, file loading.

    from batchtune.api import parse_batchtuning, InvalidBatchTuning
    try:
        bt = parse_batchtuning(obj)
    except InvalidBatchTuning as exc:
        for e in exc.errors: print(e.path, e.value, e.message)

Parsing refuses, beyond the models, what the API server refuses and the models alone would let
through (unknown top-level fields, snake_case spellings, metadata the server rejects), and explicit
nulls in the spec, which the server silently drops (so `mode:` with nothing after it would mean the
default) and which are refused here so an empty value never quietly means Auto.

File loading (`load_file`, `read_documents`) reads YAML the way `kubectl` does where that is
unambiguous, and refuses, naming the field and the line, what YAML readers disagree on; see
`read_documents`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from batchtune import API_GROUP, API_VERSION, KIND, PLURAL
from batchtune.api.errors import MISSING, FieldError, InvalidBatchTuning, from_validation_error, join_path
from batchtune.api.models import (
    API_VERSION_FULL,
    DNS_LABEL,
    DNS_SUBDOMAIN,
    MAX_PRUNED_IN_STATUS,
    MAX_TRIAL_INDEX,
    AppliedRecord,
    ApplyMode,
    ApplySpec,
    Baseline,
    BatchTuning,
    BatchTuningSpec,
    BatchTuningStatus,
    Condition,
    ConditionStatus,
    ConfigMapKeyRef,
    ContainerArgs,
    CurveLoadRecord,
    CurveLoadSpec,
    CurveLoadType,
    DriftSpec,
    EngineLimitsRecord,
    ForgeSpec,
    Generator,
    GitSpec,
    GpuLabels,
    Knee,
    LengthBucket,
    LengthDistributionRecord,
    LoadSpec,
    LoadStepRecord,
    MaxNumSeqsSpec,
    MetricNames,
    ObjectiveSpec,
    ObjectiveType,
    ObjectMeta,
    Percentile,
    PlanRecord,
    ProductionWorkloadSpec,
    PrometheusSpec,
    PrunedSetting,
    PullRequestRecord,
    Recommendation,
    ReportSpec,
    RetuneRecord,
    RetuneSpec,
    RoundRecord,
    RunRecord,
    ScrapeIntervalRecord,
    SearchSpec,
    SecretKeyRef,
    Setting,
    SloSpec,
    StrategySpec,
    StrategyType,
    TargetRef,
    TrialPrediction,
    TrialRecord,
    TrialSpec,
    TwinPredictionRecord,
    TwinRecord,
    VllmLabels,
    WorkloadRecord,
    camel,
    steps_on_the_wire,
)
from batchtune.core.verify import InconclusivePolicy
from batchtune.core.vocabulary import ConditionType, Phase, Reason, StepPurpose, TrialState, Verdict

__all__ = [
    "API_GROUP", "API_VERSION", "API_VERSION_FULL", "KIND", "PLURAL", "MISSING", "MAX_PRUNED_IN_STATUS",
    "MAX_TRIAL_INDEX", "steps_on_the_wire",
    "ApplyMode", "ApplySpec", "AppliedRecord", "Baseline", "BatchTuning", "BatchTuningSpec",
    "BatchTuningStatus", "Condition", "ContainerArgs", "EngineLimitsRecord", "LoadStepRecord", "PlanRecord",
    "ScrapeIntervalRecord",
    "WorkloadRecord", "LengthBucket", "LengthDistributionRecord", "ProductionWorkloadSpec", "ConfigMapKeyRef", "DriftSpec",
    "RetuneRecord", "RetuneSpec", "RoundRecord", "ConditionStatus", "ConditionType", "FieldError", "Generator",
    "GpuLabels", "InvalidBatchTuning", "Knee", "LoadSpec", "MaxNumSeqsSpec", "MetricNames",
    "ObjectMeta", "ObjectiveSpec", "ObjectiveType", "Percentile", "Phase", "PrometheusSpec",
    "PrunedSetting", "Recommendation", "SearchSpec", "SecretKeyRef", "Setting", "SloSpec",
    "StrategySpec", "StrategyType", "TargetRef", "RunRecord", "InconclusivePolicy", "Reason", "TrialRecord", "TrialSpec",
    "TrialState", "Verdict", "VllmLabels", "TrialPrediction", "TwinPredictionRecord", "TwinRecord",
    "TrialState", "Verdict", "VllmLabels", "CurveLoadRecord", "CurveLoadSpec", "CurveLoadType", "ReportSpec",
    "StepPurpose", "GitSpec", "ForgeSpec", "PullRequestRecord",
    "parse_batchtuning", "parse_spec", "parse_status", "load_file", "iter_documents", "read_documents", "Document",
    "MAX_FILE_BYTES", "MAX_DEPTH", "MAX_ALIAS_NODES", "NULL_MESSAGE",
]


# ---------------------------------------------------------------------------------------------
# Parsing: the models, plus what the API server refuses that the models alone would let through


ROOT_FIELDS = ("apiVersion", "kind", "metadata", "spec", "status")
"""The top-level fields of a BatchTuning; the API server (strict field validation) refuses others."""

METADATA_FIELDS = frozenset({
    "name", "generateName", "namespace", "selfLink", "uid", "resourceVersion", "generation",
    "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "labels", "annotations",
    "ownerReferences", "finalizers", "managedFields",
})
"""ObjectMeta's fields; the API server refuses others under strict field validation."""

NULL_MESSAGE = ("is empty (null): the API server drops a null as if the key were not there, so the field would be "
                "unset (its default, or missing if required) without saying so; remove the key, or give a value")

_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_MAX_ANNOTATIONS_BYTES = 256 * 1024


def parse_spec(spec: dict[str, Any]) -> BatchTuningSpec:
    """Validate a spec (camelCase keys); errors are named `spec.<path>`."""
    if not isinstance(spec, dict):
        raise InvalidBatchTuning([FieldError("spec", spec, "must be an object")])
    first = _spec_errors(spec)
    try:
        parsed = BatchTuningSpec.model_validate(spec)
    except ValidationError as exc:
        raise InvalidBatchTuning(_merge(first, from_validation_error(exc, ("spec",), spec))) from None
    if first:
        raise InvalidBatchTuning(first)
    return parsed


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
    first = [FieldError(str(key), MISSING, "unknown field") for key in obj if key not in ROOT_FIELDS]
    clean = dict(obj)
    if isinstance(obj.get("metadata"), dict):
        first += _metadata_errors(obj["metadata"])
        # The API server reads a null in metadata as absent (`kubectl create --dry-run -o yaml` writes some).
        clean["metadata"] = {k: v for k, v in obj["metadata"].items() if v is not None}
    if "status" in obj and obj["status"] is None:
        del clean["status"]  # the server drops it too
    if isinstance(obj.get("spec"), dict):
        first += _spec_errors(obj["spec"])
    try:
        parsed = BatchTuning.model_validate(clean)
    except ValidationError as exc:
        raise InvalidBatchTuning(_merge(first, from_validation_error(exc, (), clean))) from None
    if first:
        raise InvalidBatchTuning(first)
    return parsed


def _under(path: str, ancestor: str) -> bool:
    return path == ancestor or path.startswith(ancestor + ".") or path.startswith(ancestor + "[")


def _merge(first: list[FieldError], model: list[FieldError]) -> list[FieldError]:
    """`first`, then the model's errors that are not about a field `first` already names."""
    return first + [e for e in model if not any(_under(e.path, f.path) for f in first)]


def _spec_errors(spec: dict[str, Any]) -> list[FieldError]:
    """Nulls (the server would drop them) and snake_case keys (the server does not know them) in a spec."""
    out: list[FieldError] = []

    def walk(value: Any, path: tuple[str | int, ...]) -> None:
        if isinstance(value, dict):
            for key, sub in value.items():
                where = path + (str(key),)
                if isinstance(key, str) and "_" in key and camel(key) != key:
                    out.append(FieldError(join_path(where), MISSING, f"unknown field (the API spells it {camel(key)})"))
                elif sub is None:
                    out.append(FieldError(join_path(where), None, NULL_MESSAGE))
                else:
                    walk(sub, where)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(item, path + (i,))

    walk(spec, ("spec",))
    return out


def _dns_error(value: str, pattern: str, limit: int, what: str) -> str | None:
    if len(value) > limit:
        return f"must be at most {limit} characters"
    if not re.fullmatch(pattern.strip("^$"), value):
        return f"must be a {what}"
    return None


def _qualified_name_error(key: str) -> str | None:
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or _dns_error(prefix, DNS_SUBDOMAIN, 253, "DNS subdomain")):
        return "must be a qualified name: its prefix before '/' must be a DNS subdomain"
    if not name or len(name) > 63 or not _QUALIFIED_NAME.match(name):
        return ("must be a qualified name: at most 63 letters, digits, '-', '_' or '.', starting and ending "
                "with a letter or digit, with an optional DNS-subdomain prefix and '/'")
    return None


def _metadata_errors(meta: dict[str, Any]) -> list[FieldError]:
    """What the API server's ObjectMeta validation refuses for a namespaced custom resource."""
    out = [FieldError(f"metadata.{key}", MISSING, "unknown field") for key in meta if key not in METADATA_FIELDS]
    out += _name_errors(meta)
    # Label and annotation errors name the map, with the key in the message, as the API server does.
    labels = meta.get("labels")
    if isinstance(labels, dict):
        out += _label_errors(labels)
    annotations = meta.get("annotations")
    if isinstance(annotations, dict):
        out += _annotation_errors(annotations)
    return out


def _name_errors(meta: dict[str, Any]) -> list[FieldError]:
    """metadata.name, generateName and namespace, each as the API server checks it."""
    dns = "DNS subdomain name (lowercase letters, digits, '-' and '.')"
    checks = (("name", DNS_SUBDOMAIN, 253, dns), ("generateName", DNS_SUBDOMAIN, 253, dns),
              ("namespace", DNS_LABEL, 63, "DNS label (lowercase letters, digits and '-')"))
    out = []
    for key, pattern, limit, what in checks:
        value = meta.get(key)
        if not isinstance(value, str) or not value:
            continue
        # The server appends five random characters to generateName, so a trailing '-' is fine.
        checked = value[:-1] + "a" if key == "generateName" and value.endswith("-") else value
        problem = _dns_error(checked, pattern, limit, what)
        if problem:
            out.append(FieldError(f"metadata.{key}", value, problem))
    return out


def _label_errors(labels: dict[Any, Any]) -> list[FieldError]:
    out = []
    for key, value in labels.items():
        problem = _qualified_name_error(key) if isinstance(key, str) else "must be a string"
        if problem:
            out.append(FieldError("metadata.labels", key, "a label key " + problem))
        if isinstance(value, str) and (len(value) > 63 or not _LABEL_VALUE.match(value)):
            out.append(FieldError("metadata.labels", value,
                                  f"the value of label {key!r} must be at most 63 letters, digits, '-', '_' or "
                                  "'.', starting and ending with a letter or digit"))
    return out


def _annotation_errors(annotations: dict[Any, Any]) -> list[FieldError]:
    out = []
    size = 0
    for key, value in annotations.items():
        problem = _qualified_name_error(key.lower()) if isinstance(key, str) else "must be a string"
        if problem:
            out.append(FieldError("metadata.annotations", key, "an annotation key " + problem))
        size += len(str(key)) + (len(value) if isinstance(value, str) else 0)
    if size > _MAX_ANNOTATIONS_BYTES:
        out.append(FieldError("metadata.annotations", MISSING,
                              f"must be at most {_MAX_ANNOTATIONS_BYTES} bytes in all (keys and values)"))
    return out


# ---------------------------------------------------------------------------------------------
# Files

MAX_FILE_BYTES = 1 << 20
"""Largest file read: a BatchTuning is a few KiB, a `kubectl get -o yaml` dump with status a few hundred."""
MAX_DEPTH = 100
"""Deepest nesting of collections (aliases included); a BatchTuning with status nests about ten deep."""
MAX_ALIAS_NODES = 10_000
"""Most nodes aliases may add to a document: anchors for reuse work, a billion laughs does not."""

_STR_TAG = "tag:yaml.org,2002:str"
_PLAIN_TAG = "tag:batchtune,plain"  # an untagged, unquoted scalar, resolved by _plain below
_SEQ_TAG = "tag:yaml.org,2002:seq"
_MAP_TAG = "tag:yaml.org,2002:map"
_MERGE_TAG = "tag:yaml.org,2002:merge"

_NULLS = frozenset({"", "~", "null", "Null", "NULL"})
_TRUE = frozenset({"true", "True", "TRUE"})
_FALSE = frozenset({"false", "False", "FALSE"})
_YAML11_TRUE = frozenset({"y", "Y", "yes", "Yes", "YES", "on", "On", "ON"})
_YAML11_FALSE = frozenset({"n", "N", "no", "No", "NO", "off", "Off", "OFF"})
_DECIMAL = re.compile(r"[-+]?(0|[1-9][0-9]*)")
_HEX = re.compile(r"0x[0-9a-fA-F]+")
_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")  # YAML 1.2 core = go-yaml's
_INF = re.compile(r"[-+]?\.(inf|Inf|INF)")
_NAN = re.compile(r"\.(nan|NaN|NAN)")
_LEADING_ZERO = re.compile(r"[-+]?0[0-9]+")
_OCTAL_12 = re.compile(r"[-+]?0o[0-7]+")
_BINARY = re.compile(r"[-+]?0b[01_]+")
_SIGNED_HEX = re.compile(r"[-+]0x[0-9a-fA-F_]+")
_UNDERSCORED = re.compile(r"[-+]?(0x)?[0-9a-fA-F]*_[0-9a-fA-F_]*(\.[0-9_]*)?([eE][-+]?[0-9]+)?")


@dataclass
class Document:
    """One non-empty YAML document of a file."""

    index: int
    """Position among the file's non-empty documents, from 1."""
    line: int
    """Line the document starts on, from 1."""
    value: Any = None
    """The document as JSON-like data; None when `errors` is not empty."""
    errors: list[FieldError] = field(default_factory=list)
    """Why the document could not be read (each names the field and the line)."""


class _Refused(Exception):
    def __init__(self, message: str, mark: Any = None) -> None:
        super().__init__(message)
        self.message = message
        self.mark = mark


def _at(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "an unknown place"


@cache
def _loader_class() -> type:
    """A YAML loader: libyaml's parser when there is one, a composer that caps nesting, no implicit typing."""
    from yaml.composer import Composer
    from yaml.nodes import Node, ScalarNode, SequenceNode
    from yaml.resolver import BaseResolver

    try:
        from yaml._yaml import CParser as Parser
    except ImportError:  # pragma: no cover - PyYAML built without libyaml
        from yaml.parser import Parser as PyParser
        from yaml.reader import Reader
        from yaml.scanner import Scanner

        class Parser(Reader, Scanner, PyParser):  # type: ignore[no-redef]
            def __init__(self, stream: str) -> None:
                Reader.__init__(self, stream)
                Scanner.__init__(self)
                PyParser.__init__(self)

    class Loader(Composer, Parser, BaseResolver):
        def __init__(self, stream: str) -> None:
            Parser.__init__(self, stream)
            Composer.__init__(self)
            BaseResolver.__init__(self)
            self.depth = 0

        def compose_node(self, parent: Node | None, index: Any) -> Node | None:
            self.depth += 1
            try:
                if self.depth > MAX_DEPTH:
                    event = self.peek_event()
                    raise _Refused(f"nested deeper than {MAX_DEPTH} levels", getattr(event, "start_mark", None))
                return super().compose_node(parent, index)
            finally:
                self.depth -= 1

        def resolve(self, kind: type, value: Any, implicit: tuple[bool, bool]) -> str:
            # No implicit types: plain scalars are resolved by _plain, with the field's path at hand.
            if kind is ScalarNode:
                return _PLAIN_TAG if implicit[0] else _STR_TAG
            return _SEQ_TAG if kind is SequenceNode else _MAP_TAG

    return Loader


def _read_text(path: str | Path) -> str:
    """The file's text: at most MAX_FILE_BYTES, UTF-8 (or UTF-16 with a byte-order mark, as kubectl reads)."""
    with open(path, "rb") as fh:
        data = fh.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise InvalidBatchTuning([FieldError("", MISSING, f"larger than {MAX_FILE_BYTES // 1024} KiB: not read "
                                             "(a BatchTuning is a few KiB)")], source=str(path))
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError:
            pass
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        start = exc.start + (3 if data.startswith(b"\xef\xbb\xbf") else 0)
        line = data[:start].count(b"\n") + 1
        raise InvalidBatchTuning([FieldError("", MISSING, f"not UTF-8 text: byte 0x{data[start]:02x} on line {line}")],
                                 source=str(path)) from None


def _yaml_problem(exc: Exception, text: str) -> str:
    """One line saying what is wrong with the YAML and where."""
    position, character = getattr(exc, "position", None), getattr(exc, "character", None)
    if isinstance(position, int) and character is not None:  # a ReaderError: a character YAML does not allow
        code = character if isinstance(character, int) else ord(character[:1] or "\0")
        line = text.count("\n", 0, position) + 1
        column = position - (text.rfind("\n", 0, position) + 1) + 1
        return f"the character U+{code:04X} is not allowed in YAML (a control character?) at line {line}, column {column}"
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem and mark is not None:
        text = f"{problem} at {_at(mark)}"
        context, context_mark = getattr(exc, "context", None), getattr(exc, "context_mark", None)
        if context and context_mark is not None:
            text += f" ({context} at {_at(context_mark)})"
        return text
    return " ".join(str(exc).split())


def read_documents(path: str | Path) -> list[Document]:
    """Every non-empty YAML document in the file, each read as `kubectl` would send it to the API server.

    Reading rules (YAML 1.1 readers such as kubectl's and YAML 1.2 readers disagree on some plain scalars;
    where the reading is unambiguous it is kept, where it is not the document is refused, naming the field):
    - true/false, null/~/empty, decimal integers, unsigned hex, and floats (`1.5`, `1e3`) read as JSON does;
      a float with no fraction is an integer (`8.0` is 8, as kubectl's YAML-to-JSON sends it);
    - `yes`/`no`/`on`/`off`/`y`/`n`, `010`, `0o10`, `0b10`, `1_000`, `-0x1F`: refused (quote for a string);
    - `.inf`/`.nan`: refused (JSON, and so kubectl, cannot carry them);
    - `1:30` and dates stay strings (kubectl and YAML 1.2 read them so; YAML 1.1 would make 90 and a date);
    - a key repeated in a mapping is refused, naming it and both lines (kubectl refuses it too);
    - explicit tags other than `!!str` are refused; keys must be strings;
    - aliases may add at most MAX_ALIAS_NODES nodes, nesting stops at MAX_DEPTH, files at MAX_FILE_BYTES.

    Raises OSError when the file cannot be read, InvalidBatchTuning (source: the file) when it is not
    YAML at all; a document that cannot be read has `errors` and the other documents are still read.
    """
    import yaml

    text = _read_text(path)
    loader = _loader_class()(text)
    out: list[Document] = []
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is None or (node.tag == _PLAIN_TAG and node.value in _NULLS):
                continue  # an empty document, as kubectl skips it
            doc = Document(index=len(out) + 1, line=node.start_mark.line + 1)
            out.append(doc)
            try:
                _measure(node)
                doc.value = _Builder(doc.errors).build(node, ())
            except _Refused as exc:
                doc.errors.append(FieldError("", MISSING, f"{exc.message} at {_at(exc.mark)}"))
            if doc.errors:
                doc.value = None
    except _Refused as exc:
        where = f" (document {len(out) + 1})"
        raise InvalidBatchTuning([FieldError("", MISSING, f"{exc.message} at {_at(exc.mark)}{where}")],
                                 source=str(path)) from None
    except yaml.YAMLError as exc:
        raise InvalidBatchTuning([FieldError("", MISSING, f"not valid YAML: {_yaml_problem(exc, text)}")],
                                 source=str(path)) from None
    except RecursionError:  # pragma: no cover - MAX_DEPTH keeps well below the interpreter's limit
        raise InvalidBatchTuning([FieldError("", MISSING, "nested too deeply")], source=str(path)) from None
    finally:
        dispose = getattr(loader, "dispose", None)
        if dispose is not None:
            dispose()
    return out


def _children(node: Any) -> list[Any]:
    from yaml.nodes import MappingNode, SequenceNode

    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _measure(root: Any) -> None:
    """Refuse a node graph whose aliases loop, nest past MAX_DEPTH or add more than MAX_ALIAS_NODES nodes.

    Iterative and memoised on the (shared) nodes, so a billion laughs costs what its text costs.
    """
    size: dict[int, int] = {}
    height: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        if done:
            on_path.discard(key)
            kids = _children(node)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            height[key] = 1 + max((height[id(k)] for k in kids), default=0)
            if height[key] > MAX_DEPTH:
                raise _Refused(f"nested deeper than {MAX_DEPTH} levels (through aliases)", node.start_mark)
            if size[key] - len(size) > MAX_ALIAS_NODES:
                raise _Refused(f"aliases expand to more than {MAX_ALIAS_NODES} extra nodes (a YAML bomb?)",
                               node.start_mark)
            continue
        if key in size:
            continue
        if key in on_path:
            raise _Refused("an alias refers to a node that contains it (a loop)", node.start_mark)
        on_path.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in _children(node) if id(k) not in size)


class _Builder:
    """Nodes to JSON-like data with the reading rules of `read_documents`; errors go to `errors`."""

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = errors

    def fail(self, path: tuple[str | int, ...], value: Any, message: str, node: Any | None) -> None:
        where = f" (line {node.start_mark.line + 1})" if node is not None else ""
        self.errors.append(FieldError(join_path(path), value, message + where))

    def build(self, node: Any, path: tuple[str | int, ...]) -> Any:
        from yaml.nodes import MappingNode, SequenceNode

        if isinstance(node, SequenceNode):
            if node.tag != _SEQ_TAG:
                self.fail(path, MISSING, f"the tag {node.tag} is not supported", node)
            return [self.build(item, path + (i,)) for i, item in enumerate(node.value)]
        if isinstance(node, MappingNode):
            if node.tag != _MAP_TAG:
                self.fail(path, MISSING, f"the tag {node.tag} is not supported", node)
            return self.mapping(node, path)
        return self.scalar(node, path)

    def scalar(self, node: Any, path: tuple[str | int, ...]) -> Any:
        if node.tag == _STR_TAG:
            return node.value
        if node.tag != _PLAIN_TAG:
            self.fail(path, node.value, f"the tag {node.tag} is not supported (quote the value instead)", node)
            return node.value
        value, problem = _plain(node.value)
        if problem:
            self.fail(path, node.value, problem, node)
        return value

    def key(self, node: Any, path: tuple[str | int, ...]) -> str | None:
        from yaml.nodes import ScalarNode

        if not isinstance(node, ScalarNode):
            self.fail(path, MISSING, "a mapping key must be a string, not a collection", node)
            return None
        if node.tag == _STR_TAG:
            return str(node.value)
        value, problem = _plain(node.value) if node.tag == _PLAIN_TAG else (node.value, None)
        if problem or not isinstance(value, str) or node.tag != _PLAIN_TAG:
            self.fail(path + (str(node.value),), MISSING, problem or "a mapping key must be a plain or quoted "
                      "string: quote it", node)
            return None
        return value

    def mapping(self, node: Any, path: tuple[str | int, ...]) -> dict[str, Any]:
        from yaml.nodes import MappingNode, ScalarNode, SequenceNode

        out: dict[str, Any] = {}
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            line = key_node.start_mark.line + 1
            if isinstance(key_node, ScalarNode) and (
                    key_node.tag == _MERGE_TAG or (key_node.tag == _PLAIN_TAG and key_node.value == "<<")):
                sources = value_node.value if isinstance(value_node, SequenceNode) else [value_node]
                merged: dict[str, Any] = {}
                for source in sources:
                    if not isinstance(source, MappingNode):
                        self.fail(path, MISSING, "a merge (<<) takes a mapping or a list of mappings", value_node)
                        continue
                    for k, v in self.mapping(source, path).items():
                        merged.setdefault(k, v)  # the first source wins, as YAML's merge says
                for k, v in merged.items():
                    if k in lines:
                        self.fail(path + (k,), MISSING, f"set at line {lines[k]} and again by the merge (<<) at line "
                                  f"{line}: YAML readers disagree on which wins; set it in one place", None)
                    else:
                        out[k] = v
                continue
            key = self.key(key_node, path)
            if key is None:
                continue
            if key in lines:
                self.fail(path + (key,), MISSING, f"duplicate key: first at line {lines[key]}, again at line {line} "
                          "(kubectl refuses the file; other YAML readers silently keep one)", None)
                continue
            lines[key] = line
            out[key] = self.build(value_node, path + (key,))
        return out


def _plain(text: str) -> tuple[Any, str | None]:
    """An untagged, unquoted scalar as kubectl would send it, or (text, why it is refused)."""
    for read in (_plain_word, _plain_integer, _plain_number):
        found = read(text)
        if found is not None:
            return found
    return text, None


def _plain_word(text: str) -> tuple[Any, str | None] | None:
    """Null and the booleans, refusing YAML 1.1's yes/no/on/off; None: not one of these words."""
    if text in _NULLS:
        return None, None
    if text in _TRUE:
        return True, None
    if text in _FALSE:
        return False, None
    if text in _YAML11_TRUE or text in _YAML11_FALSE:
        word = "true" if text in _YAML11_TRUE else "false"
        return text, (f"is read as the boolean {word} by kubectl (YAML 1.1) but as a string by YAML 1.2 readers: "
                      f"write {word}, or quote it for a string")
    return None


def _plain_integer(text: str) -> tuple[Any, str | None] | None:
    """Decimal and hex integers, refusing what YAML 1.1 reads as octal; None: not written as an integer."""
    if (_DECIMAL.fullmatch(text) or _HEX.fullmatch(text)) and len(text) > 40:
        # int() refuses past 4300 digits (a ValueError, no field named); the API server's integers are 64-bit
        return text, "is too large a number: the API server's integers are 64-bit"
    if _DECIMAL.fullmatch(text):
        return int(text), None
    if _HEX.fullmatch(text):
        return int(text, 16), None
    if _LEADING_ZERO.fullmatch(text):
        digits = text.lstrip("+-")
        if set(digits) <= set("01234567"):
            return text, (f"is read as the octal number {int(digits, 8)} by kubectl (YAML 1.1) but as {int(digits)} "
                          "by YAML 1.2 readers: write it without the leading zero, or quote it for a string")
        return text, ("has a leading zero, which YAML 1.1 readers take for octal: write it without, or quote it "
                      "for a string")
    return None


def _plain_number(text: str) -> tuple[Any, str | None] | None:
    """Floats, refusing the forms YAML readers disagree on and what JSON cannot carry; None: not a number."""
    if _OCTAL_12.fullmatch(text) or _BINARY.fullmatch(text) or _SIGNED_HEX.fullmatch(text) or (
            "_" in text and _UNDERSCORED.fullmatch(text)):
        return text, ("is read as a number by some YAML readers and as a string by others: write the number in "
                      "decimal, or quote it for a string")
    if _INF.fullmatch(text) or _NAN.fullmatch(text):
        return text, "is not a finite number: JSON, and so the API server, cannot carry it"
    if _FLOAT.fullmatch(text):
        number = float(text)
        if math.isinf(number):
            return text, "is too large a number: JSON, and so the API server, cannot carry it"
        if number.is_integer() and abs(number) < 2 ** 63:
            return int(number), None  # kubectl's YAML-to-JSON writes 8.0 as 8
        return number, None
    return None


def iter_documents(path: str | Path) -> Iterator[tuple[int, Any]]:
    """(index, document) for each non-empty YAML document in the file; index counts from 1.

    A document that cannot be read raises InvalidBatchTuning naming the file and, when the file holds
    several, the document.
    """
    documents = read_documents(path)
    for doc in documents:
        if doc.errors:
            where = str(path) if len(documents) == 1 else f"{path} (document {doc.index})"
            raise InvalidBatchTuning(doc.errors, source=where)
        yield doc.index, doc.value


def load_file(path: str | Path) -> list[BatchTuning]:
    """Every BatchTuning in a (multi-document) YAML file; the first invalid document raises.

    A document of another kind is an error naming that kind, not skipped: a file handed to
    batchtune is meant to hold BatchTunings.
    """
    out: list[BatchTuning] = []
    documents = read_documents(path)
    for doc in documents:
        where = str(path) if len(documents) == 1 else f"{path} (document {doc.index})"
        if doc.errors:
            raise InvalidBatchTuning(doc.errors, source=where)
        try:
            out.append(parse_batchtuning(doc.value))
        except InvalidBatchTuning as exc:
            raise InvalidBatchTuning(exc.errors, source=where) from None
    return out
