"""Field-level errors of a BatchTuning, named by their CRD path (`spec.searchSpace.maxNumSeqs.values[2]`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from batchtune.api.models import DNS_LABEL, DNS_SUBDOMAIN, PROM_LABEL_NAME, PROM_METRIC_NAME, SECRET_KEY


class _Missing:
    """The value of a field that was not given at all (distinct from an explicit null)."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()


# C0 and C1 controls, DEL, lone surrogates (unprintable in UTF-8), line/paragraph separators and the
# bidirectional overrides and isolates (they reorder what follows on the line: "Trojan Source").
_UNPRINTABLE = "\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff"
_UNPRINTABLE_TEXT = re.compile(f"[{_UNPRINTABLE}]")
_UNPRINTABLE_LINE = re.compile(f"[\t\n{_UNPRINTABLE}]")
_NAMED_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    if char in _NAMED_ESCAPES:
        return _NAMED_ESCAPES[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(value: Any, multiline: bool = False) -> str:
    """`value` as text that is safe to print on a terminal: every control character shown as an escape.

    ESC (so colour, cursor, screen-clearing and window-title sequences), CR, BEL, DEL, C1 controls, lone
    surrogates and the bidirectional controls become `\\x1b`, `\\r`, `\\u202e` and so on; newline and tab
    too, unless `multiline`. The one helper for anything printed from a file or a cluster object.
    """
    text = value if isinstance(value, str) else str(value)
    return (_UNPRINTABLE_TEXT if multiline else _UNPRINTABLE_LINE).sub(_escape, text)


def render_value(value: Any, limit: int = 80) -> str:
    """A value as the user wrote it (JSON-like), cut to `limit` characters; control characters escaped."""
    try:
        text = json.dumps(value, default=str, sort_keys=False)
    except (TypeError, ValueError):
        text = repr(value)
    text = printable(text)  # json.dumps escapes C0 and non-ASCII, but not DEL; repr may leave others
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class FieldError:
    """One thing wrong with one field."""

    path: str
    """CRD path in camelCase, dotted, with list indexes: spec.searchSpace.maxNumSeqs.values[2]."""
    value: Any
    """The offending value; MISSING when the field was not given."""
    message: str
    """What is wrong, in words."""

    def __str__(self) -> str:
        message = printable(self.message)
        if not self.path and self.value is MISSING:
            return message  # about the file or document as a whole
        where = printable(self.path) or "(object)"
        if self.value is MISSING:
            return f"{where}: {message}"
        return f"{where}: {message} (got {render_value(self.value)})"


class InvalidBatchTuning(Exception):
    """A BatchTuning that does not validate; `.errors` lists every field error found."""

    def __init__(self, errors: list[FieldError], source: str | None = None) -> None:
        self.errors = list(errors)
        self.source = source
        super().__init__(str(self))

    def __str__(self) -> str:
        head = f"{printable(self.source)}: " if self.source else ""
        lines = [f"invalid BatchTuning ({len(self.errors)} error{'s' if len(self.errors) != 1 else ''})"]
        lines += [f"  {e}" for e in self.errors]
        return head + "\n".join(lines)

    @property
    def paths(self) -> list[str]:
        """The field paths named, in order."""
        return [e.path for e in self.errors]


def join_path(parts: tuple[str | int, ...] | list[str | int]) -> str:
    """("spec", "searchSpace", "values", 2) -> "spec.searchSpace.values[2]"."""
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part:
            out += f".{part}" if out else str(part)
    return out


def _lookup(data: Any, loc: tuple[str | int, ...]) -> Any:
    for part in loc:
        if isinstance(data, dict):
            if part not in data:
                return MISSING
            data = data[part]
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        else:
            return MISSING
    return data


_MESSAGES = {
    "missing": "required field is missing",
    "extra_forbidden": "unknown field",
    "int_type": "must be an integer",
    "string_type": "must be a string",
    "bool_type": "must be true or false",
    "list_type": "must be a list",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "dict_type": "must be an object",
}


_PATTERNS = {
    DNS_SUBDOMAIN: "must be a DNS subdomain name (lowercase letters, digits, '-' and '.')",
    DNS_LABEL: "must be a DNS label (lowercase letters, digits and '-')",
    PROM_METRIC_NAME: "must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*)",
    PROM_LABEL_NAME: "must be a Prometheus label name ([a-zA-Z_][a-zA-Z0-9_]*)",
    SECRET_KEY: "must be a Secret key (letters, digits, '-', '_' and '.')",
}


def _message(kind: str, ctx: dict[str, Any], default: str) -> str:
    if kind in _MESSAGES:
        return _MESSAGES[kind]
    if kind == "greater_than_equal":
        return f"must be at least {ctx['ge']}"
    if kind == "less_than_equal":
        return f"must be at most {ctx['le']}"
    if kind == "too_short":
        return f"must have at least {ctx['min_length']} item{'s' if ctx['min_length'] != 1 else ''}"
    if kind == "too_long":
        return f"must have at most {ctx['max_length']} items"
    if kind == "string_too_short":
        return "must not be empty" if ctx["min_length"] == 1 else f"must be at least {ctx['min_length']} characters"
    if kind == "string_too_long":
        return f"must be at most {ctx['max_length']} characters"
    if kind == "string_pattern_mismatch":
        return _PATTERNS.get(ctx["pattern"], f"must match {ctx['pattern']}")
    if kind == "enum":
        return f"must be one of {ctx['expected']}"
    return default


def from_validation_error(exc: ValidationError, prefix: tuple[str, ...] = (), data: Any = None) -> list[FieldError]:
    """Turn pydantic's errors into FieldErrors with CRD paths under `prefix`."""
    out: list[FieldError] = []
    for err in exc.errors(include_url=False):
        loc = tuple(err["loc"])
        ctx = err.get("ctx") or {}
        if err["type"] == "cross_field":
            for field, value, message in ctx["violations"]:
                sub = loc + ((field,) if field else ())
                if value is None:
                    found = _lookup(data, sub) if data is not None else MISSING
                    value = MISSING if found is MISSING or isinstance(found, dict) else found
                out.append(FieldError(join_path(prefix + sub), value, message))
            continue
        message = _message(err["type"], ctx, err["msg"])
        value = MISSING if err["type"] == "missing" else err.get("input", MISSING)
        if isinstance(value, dict) and not err["type"].endswith("_type"):
            # A whole object makes a poor "got" value; the path already says where.
            value = MISSING
        out.append(FieldError(join_path(prefix + loc), value, message))
    return out
