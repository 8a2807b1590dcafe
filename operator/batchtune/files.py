"""The files a command is given, one reader per format: every failure is one `InputFileError` naming the file and
the line or field, never a traceback.

A file on the command line is the user's, or a colleague's, or a download: it may be empty, binary, nested a
hundred thousand levels deep (Python's JSON reader then raises RecursionError, which is no ValueError), carry
`Infinity`/`NaN` (Python's JSON reader accepts them; JSON does not) or `1e400` (read as infinity), or hold
several YAML documents. The readers refuse each with the file and where; the caller checks the shape it needs
with `expect`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MAX_FILE_BYTES = 64 * 1024 * 1024
"""Bigger files are not read (a trace of a million requests is about 60 MiB)."""
MAX_DEPTH = 100
"""Deeper nesting is refused: no input of batchtune's nests past ten levels."""


class InputFileError(ValueError):
    """A file that cannot be read as what the command needs; str() is one line: `FILE: where: what`."""

    def __init__(self, path: str | Path, message: str) -> None:
        from batchtune.api.errors import printable

        self.path = str(path)
        self.message = message
        super().__init__(printable(f"{path}: {message}"))


def read_text(path: str | Path, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The file as UTF-8 text (a byte-order mark skipped); InputFileError when unreadable, too big or binary."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(max_bytes + 1)
    except OSError as exc:
        raise InputFileError(path, f"cannot read: {exc.strerror or exc}") from None
    if len(data) > max_bytes:
        raise InputFileError(path, f"larger than {max_bytes // (1 << 20)} MiB: not read")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise InputFileError(path, f"line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x}): "
                                   "a binary file?") from None


def _path(parts: list[str | int]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out or "(the document)"


def _check(value: Any, nonfinite: bool) -> str | None:
    """Where the value nests too deep or holds a non-finite number (iterative: no recursion limit to hit)."""
    stack: list[tuple[Any, list[str | int]]] = [(value, [])]
    while stack:
        item, at = stack.pop()
        if len(at) > MAX_DEPTH:
            return f"{_path(at[:3])}...: nested deeper than {MAX_DEPTH} levels"
        if isinstance(item, dict):
            stack.extend((v, [*at, str(k)]) for k, v in item.items())
        elif isinstance(item, list):
            stack.extend((v, [*at, i]) for i, v in enumerate(item))
        elif isinstance(item, float) and not nonfinite and not math.isfinite(item):
            return f"{_path(at)}: {item!r} is not a finite number (JSON has no Infinity or NaN; 1e400 overflows)"
    return None


def parse_json(text: str, path: str | Path, where: str = "", nonfinite: bool = False) -> Any:
    """One JSON value; `where` (e.g. "line 3") is put before the problem. `nonfinite`: let Infinity and NaN
    through (`vllm bench serve` writes them; the caller checks each key)."""
    prefix = f"{where}: " if where else ""
    if not text.strip():
        raise InputFileError(path, f"{prefix}empty: expected JSON")
    try:
        value = json.loads(text)
    except RecursionError:
        raise InputFileError(path, f"{prefix}nested too deeply (more than {MAX_DEPTH} levels)") from None
    except json.JSONDecodeError as exc:
        at = f"line {exc.lineno}, column {exc.colno}" if not where else f"column {exc.colno}"
        raise InputFileError(path, f"{prefix}not JSON: {exc.msg} at {at}") from None
    except ValueError as exc:  # e.g. an integer of more than 4300 digits
        raise InputFileError(path, f"{prefix}not JSON ({exc})") from None
    problem = _check(value, nonfinite)
    if problem:
        raise InputFileError(path, prefix + problem)
    return value


def read_json(path: str | Path, nonfinite: bool = False, max_bytes: int = MAX_FILE_BYTES) -> Any:
    """The file's one JSON value."""
    return parse_json(read_text(path, max_bytes), path, nonfinite=nonfinite)


def json_lines(lines: Iterator[str] | list[str], path: str | Path, nonfinite: bool = False) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line of a JSON-lines text."""
    for number, raw in enumerate(lines, start=1):
        if raw.strip():
            yield number, parse_json(raw, path, f"line {number}", nonfinite)


def expect(value: Any, kind: type, path: str | Path, where: str = "") -> Any:
    """`value` when it is a `kind` (dict: "a JSON object", list: "a list"), else InputFileError naming it."""
    if isinstance(value, kind) and not isinstance(value, bool):
        return value
    names = {dict: "an object (a mapping)", list: "a list", str: "a string", int: "an integer"}
    got = "null" if value is None else type(value).__name__.replace("dict", "object").replace("NoneType", "null")
    raise InputFileError(path, f"{where + ': ' if where else ''}expected {names.get(kind, kind.__name__)}, got {got}")


def read_yaml_documents(path: str | Path) -> list[Any]:
    """Every non-empty YAML document of the file, read as kubectl reads it (batchtune.api.read_documents): nesting,
    aliases, duplicate keys and non-JSON scalars refused, naming the line."""
    from batchtune.api import InvalidBatchTuning, read_documents

    try:
        documents = read_documents(path)
    except OSError as exc:
        raise InputFileError(path, f"cannot read: {exc.strerror or exc}") from None
    except InvalidBatchTuning as exc:
        raise InputFileError(path, "; ".join(str(e) for e in exc.errors)) from None
    for doc in documents:
        if doc.errors:
            raise InputFileError(path, f"document {doc.index} (line {doc.line}): {doc.errors[0]}")
    return [doc.value for doc in documents]


def read_manifest(path: str | Path, kind: str) -> dict[str, Any]:
    """The one manifest of `kind` in a YAML file of one or more documents (a Deployment beside its Service);
    InputFileError saying which kinds were found when there is none, or more than one."""
    documents = read_yaml_documents(path)
    if not documents:
        raise InputFileError(path, f"empty: expected a {kind}")
    found = [d for d in documents if isinstance(d, dict) and d.get("kind") == kind]
    if len(found) == 1:
        return found[0]
    kinds = ", ".join(f"document {i} ({d.get('kind') if isinstance(d, dict) else type(d).__name__})"
                      for i, d in enumerate(documents, start=1))
    if not found:
        raise InputFileError(path, f"no {kind} among {len(documents)} document(s): {kinds}")
    raise InputFileError(path, f"{len(found)} {kind}s: give a file with one ({kinds})")
