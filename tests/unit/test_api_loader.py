"""File loading that cannot surprise: YAML read as kubectl reads it or refused naming the field, and files
that try to exhaust memory, time or the stack refused with one line naming the file, never a traceback."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from batchtune.api import (
    MAX_ALIAS_NODES,
    MAX_DEPTH,
    MAX_FILE_BYTES,
    MISSING,
    InvalidBatchTuning,
    iter_documents,
    load_file,
    read_documents,
)
from batchtune.cli import main

REPO = Path(__file__).resolve().parents[2]
MINIMAL = (REPO / "manifests" / "samples" / "batchtuning-minimal.yaml").read_text()


def _read(tmp_path: Path, text: str | bytes) -> list[Any]:
    path = tmp_path / "x.yaml"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return read_documents(path)


def _value(tmp_path: Path, scalar: str) -> Any:
    (doc,) = _read(tmp_path, f"v: {scalar}\n")
    assert not doc.errors, doc.errors
    return doc.value["v"]


def _refusal(tmp_path: Path, text: str) -> str:
    (doc,) = _read(tmp_path, text)
    assert doc.value is None and doc.errors
    return "\n".join(str(e) for e in doc.errors)


# ---- scalars: read as kubectl reads them where every YAML reader agrees --------------------------

@pytest.mark.parametrize("scalar, expected", [
    pytest.param("8", 8, id="decimal"),
    pytest.param("-5", -5, id="negative"),
    pytest.param("+7", 7, id="plus-sign"),
    pytest.param("0", 0, id="zero"),
    pytest.param("8.0", 8, id="float-with-no-fraction-is-an-integer-as-kubectl-sends-it"),
    pytest.param("1e3", 1000, id="exponent-yaml-1.2-and-kubectl"),
    pytest.param("1.0e+2", 100, id="signed-exponent"),
    pytest.param("-0.0", 0, id="negative-zero"),
    pytest.param("1.5", 1.5, id="fraction"),
    pytest.param(".5", 0.5, id="leading-dot"),
    pytest.param("0x1F", 31, id="hex-every-reader-agrees"),
    pytest.param("true", True, id="true"),
    pytest.param("False", False, id="False"),
    pytest.param("~", None, id="tilde-null"),
    pytest.param("null", None, id="null"),
    pytest.param("", None, id="empty-null"),
    pytest.param("1:30", "1:30", id="sexagesimal-stays-a-string-as-kubectl-reads-it"),
    pytest.param("2025-01-01", "2025-01-01", id="date-stays-a-string"),
    pytest.param("2025-01-01T10:00:00Z", "2025-01-01T10:00:00Z", id="timestamp-stays-a-string"),
    pytest.param("'010'", "010", id="quoted-leading-zero"),
    pytest.param('"yes"', "yes", id="quoted-yes"),
    pytest.param("!!str 010", "010", id="str-tag"),
    pytest.param("llama-8b", "llama-8b", id="plain-string"),
    pytest.param("http://x:9090", "http://x:9090", id="url"),
    pytest.param("1e400x", "1e400x", id="not-a-number"),
])
def test_scalars_read_as_kubectl_reads_them(tmp_path: Path, scalar: str, expected: Any) -> None:
    value = _value(tmp_path, scalar)
    assert value == expected and type(value) is type(expected)


@pytest.mark.parametrize("scalar, needle", [
    pytest.param("yes", "boolean true by kubectl (YAML 1.1) but as a string by YAML 1.2", id="yes"),
    pytest.param("No", "boolean false", id="No"),
    pytest.param("on", "boolean true", id="on"),
    pytest.param("OFF", "boolean false", id="OFF"),
    pytest.param("y", "boolean true", id="y"),
    pytest.param("n", "boolean false", id="n"),
    pytest.param("010", "octal number 8 by kubectl (YAML 1.1) but as 10 by YAML 1.2", id="octal-1.1"),
    pytest.param("-010", "octal number 8", id="negative-octal"),
    pytest.param("08", "leading zero", id="leading-zero-not-octal"),
    pytest.param("0o17", "write the number in decimal", id="octal-1.2"),
    pytest.param("0b101", "write the number in decimal", id="binary"),
    pytest.param("1_000", "write the number in decimal", id="underscores"),
    pytest.param("-0x1F", "write the number in decimal", id="signed-hex"),
    pytest.param(".inf", "not a finite number", id="inf"),
    pytest.param("-.Inf", "not a finite number", id="minus-inf"),
    pytest.param(".nan", "not a finite number", id="nan"),
    pytest.param("1e400", "too large a number", id="overflow"),
    pytest.param("!!int 8", "tag tag:yaml.org,2002:int is not supported", id="int-tag"),
    pytest.param("!!binary aGk=", "is not supported", id="binary-tag"),
    pytest.param("!!python/object:os.system x", "is not supported", id="python-tag"),
    pytest.param("!custom x", "is not supported", id="local-tag"),
])
def test_scalars_yaml_readers_disagree_on_are_refused_naming_field_and_line(tmp_path: Path, scalar: str,
                                                                           needle: str) -> None:
    message = _refusal(tmp_path, f"spec:\n  strategy:\n    maxTrials: {scalar}\n")
    assert message.startswith("spec.strategy.maxTrials: ") and needle in message and "(line 3)" in message


def test_every_refused_scalar_is_reported_at_once(tmp_path: Path) -> None:
    (doc,) = _read(tmp_path, "a: yes\nb: [010, ok, .nan]\nc: {d: on}\n")
    assert [e.path for e in doc.errors] == ["a", "b[0]", "b[2]", "c.d"]
    assert [e.value for e in doc.errors] == ["yes", "010", ".nan", "on"]


# ---- mappings ------------------------------------------------------------------------------------

def test_a_duplicate_key_names_the_key_and_both_lines(tmp_path: Path) -> None:
    message = _refusal(tmp_path, "spec:\n  apply:\n    mode: Auto\n    verifySeconds: 60\n    mode: Recommend\n")
    assert message == ("spec.apply.mode: duplicate key: first at line 3, again at line 5 (kubectl refuses the file; "
                       "other YAML readers silently keep one)")


def test_duplicate_keys_in_flow_style_and_at_the_top(tmp_path: Path) -> None:
    assert "first at line 1, again at line 1" in _refusal(tmp_path, "a: {b: 1, b: 2}\n")
    assert _refusal(tmp_path, "kind: BatchTuning\nkind: Pod\n").startswith("kind: duplicate key")


@pytest.mark.parametrize("key", ["1", "true", "on", "~", "[a]", "{a: 1}", "!!int 3"])
def test_keys_must_be_strings(tmp_path: Path, key: str) -> None:
    assert "key" in _refusal(tmp_path, f"? {key}\n: x\n") or "string" in _refusal(tmp_path, f"? {key}\n: x\n")


def test_quoted_keys_that_look_like_other_types_are_strings(tmp_path: Path) -> None:
    (doc,) = _read(tmp_path, "'1': a\n\"on\": b\n")
    assert doc.value == {"1": "a", "on": "b"}


def test_anchors_and_merges_for_reuse_still_work(tmp_path: Path) -> None:
    (doc,) = _read(tmp_path, "base: &b {x: 1, z: 2}\nc:\n  <<: *b\n  z: 3\nd: *b\ne:\n  <<: [{p: 1}, {p: 2, r: 3}]\n")
    assert not doc.errors
    assert doc.value == {"base": {"x": 1, "z": 2}, "c": {"x": 1, "z": 3}, "d": {"x": 1, "z": 2}, "e": {"p": 1, "r": 3}}


def test_a_key_set_before_a_merge_that_also_sets_it_is_refused(tmp_path: Path) -> None:
    message = _refusal(tmp_path, "s:\n  maxTrials: 4\n  <<: {maxTrials: 40}\n")
    assert message.startswith("s.maxTrials: set at line 2 and again by the merge (<<) at line 3")


def test_a_merge_of_something_else_than_a_mapping_is_refused(tmp_path: Path) -> None:
    assert "a merge (<<) takes a mapping" in _refusal(tmp_path, "a:\n  <<: 3\n")


# ---- documents -----------------------------------------------------------------------------------

def test_empty_documents_are_skipped_and_indexes_count_the_others(tmp_path: Path) -> None:
    docs = _read(tmp_path, "---\n---\na: 1\n---\n# only a comment\n---\nb: 2\n...\n")
    assert [(d.index, d.line, d.value) for d in docs] == [(1, 3, {"a": 1}), (2, 7, {"b": 2})]


def test_a_document_that_cannot_be_read_does_not_hide_the_others(tmp_path: Path) -> None:
    docs = _read(tmp_path, "a: 1\n---\nb: yes\n---\nc: 3\n")
    assert [d.value for d in docs] == [{"a": 1}, None, {"c": 3}]
    assert [e.path for e in docs[1].errors] == ["b"]


def test_iter_documents_raises_naming_the_document(tmp_path: Path) -> None:
    path = tmp_path / "x.yaml"
    path.write_text("a: 1\n---\nb: yes\n")
    with pytest.raises(InvalidBatchTuning) as caught:
        list(iter_documents(path))
    assert caught.value.source == f"{path} (document 2)"


def test_load_file_still_reads_a_multi_document_file(tmp_path: Path) -> None:
    path = tmp_path / "two.yaml"
    path.write_text(MINIMAL + "---\n" + MINIMAL.replace("name: llama-8b\nspec", "name: second\nspec"))
    assert [bt.metadata.name for bt in load_file(path)] == ["llama-8b", "second"]


# ---- files that try to exhaust memory, time or the stack -------------------------------------------

def _billion_laughs(levels: int = 9) -> str:
    text = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
    previous = "a"
    for name in "bcdefghijklmnop"[:levels - 1]:
        text += f"{name}: &{name} [" + ", ".join([f"*{previous}"] * 9) + "]\n"
        previous = name
    return text


def _nested_block(depth: int) -> str:
    return "a:\n" + "".join("  " * i + "- \n" for i in range(1, depth + 1))


def _alias_chain(n: int) -> str:
    # Each anchor nests the previous one a level deeper: shallow as text, deep through aliases.
    text = "a0: &a0 [x]\n"
    for i in range(1, n):
        text += f"a{i}: &a{i} [*a{i - 1}]\n"
    return text


HOSTILE: dict[str, tuple[Any, str]] = {
    "billion-laughs": (_billion_laughs(), f"aliases expand to more than {MAX_ALIAS_NODES} extra nodes"),
    "alias-loop": ("a: &a [1, *a]\n", "an alias refers to a node that contains it"),
    "deep-flow-10000": ("[" * 10000 + "]" * 10000 + "\n", "nest"),
    "deep-block": (_nested_block(MAX_DEPTH + 50), f"nested deeper than {MAX_DEPTH} levels"),
    "deep-through-aliases": (_alias_chain(MAX_DEPTH + 20), f"nested deeper than {MAX_DEPTH} levels (through aliases)"),
    "huge-file": ("# " + "x" * MAX_FILE_BYTES + "\n", f"larger than {MAX_FILE_BYTES // 1024} KiB"),
    "huge-line": ("a: " + "x" * (MAX_FILE_BYTES + 1), f"larger than {MAX_FILE_BYTES // 1024} KiB"),
    "not-utf-8": (b"apiVersion: batchtune.io/v1alpha1\nkind: \xff\xfeBatchTuning\n", "not UTF-8 text: byte 0xff on line 2"),
    "latin-1": ("metadata: {name: caf\u00e9}\n".encode("latin-1"), "not UTF-8 text: byte 0xe9 on line 1"),
    "raw-escape": (b"metadata: {name: \x1b]0;pwned\x07}\n", "the character U+001B is not allowed in YAML"),
    "nul-byte": (b"a: b\x00c\n", "the character U+0000 is not allowed in YAML"),
    "broken-yaml": ("spec: [unclosed\n", "not valid YAML: did not find expected ',' or ']'"),
    "tab-indent": ("spec:\n\ttargetRef: {}\n", "not valid YAML"),
    "duplicate-anchor": ("a: &x 1\nb: &x 2\n", "not valid YAML"),
    "undefined-alias": ("a: *nowhere\n", "not valid YAML"),
    "other-kind": ("apiVersion: v1\nkind: Pod\nmetadata: {name: x}\n", 'kind: must be BatchTuning (got "Pod")'),
    "a-list": ("- apiVersion: batchtune.io/v1alpha1\n", "a BatchTuning must be a mapping"),
    "a-scalar": ("just words\n", "a BatchTuning must be a mapping"),
    "misindented-apply": (MINIMAL + "  apply:\n      mode: Recommend\n    verifySeconds: 60\n", "not valid YAML"),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_files_get_one_line_naming_the_file_never_a_traceback(name: str, tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    content, needle = HOSTILE[name]
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    start = time.monotonic()
    assert main(["validate", "-f", str(path)]) == 1
    elapsed = time.monotonic() - start
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err and captured.err == ""
    lines = captured.out.splitlines()
    assert len(lines) == (2 if name == "other-kind" else 1), captured.out  # other-kind: apiVersion and kind
    assert all(line.startswith(f"{path}: ") for line in lines) and needle in lines[-1], lines
    assert "\x1b" not in captured.out and all(len(line) < 400 for line in lines)
    assert elapsed < 10, f"{name} took {elapsed:.1f}s"  # each takes well under a second; a busy machine is slower


def test_a_hostile_file_in_a_fresh_interpreter_exits_1_quickly_without_a_traceback(tmp_path: Path) -> None:
    # Memory and stack are the process's own here: a bomb expanded, or recursion past the limit, would show.
    path = tmp_path / "bomb.yaml"
    path.write_text(_billion_laughs(12))
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "batchtune", "validate", "-f", str(path), "-f", str(deep)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr and done.stderr == ""
    assert len(done.stdout.splitlines()) == 2
    assert time.monotonic() - start < 60


def test_a_file_just_under_the_size_limit_is_read(tmp_path: Path) -> None:
    path = tmp_path / "big.yaml"
    padding = "#" + "x" * 1000 + "\n"
    path.write_text(MINIMAL + padding * ((MAX_FILE_BYTES - len(MINIMAL)) // len(padding)))
    assert path.stat().st_size <= MAX_FILE_BYTES
    assert [bt.metadata.name for bt in load_file(path)] == ["llama-8b"]


def test_a_kubectl_dump_sized_file_is_read_quickly(tmp_path: Path) -> None:
    # Many documents of a few hundred nodes each, near the size limit: well within a second or two.
    path = tmp_path / "many.yaml"
    one = MINIMAL + "---\n"
    path.write_text(one * (MAX_FILE_BYTES // len(one) - 1))
    start = time.monotonic()
    tunings = load_file(path)
    assert len(tunings) > 1000
    assert time.monotonic() - start < 30


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16"])
def test_a_byte_order_mark_is_read_as_kubectl_reads_it(tmp_path: Path, encoding: str) -> None:
    path = tmp_path / "bom.yaml"
    path.write_bytes(MINIMAL.encode(encoding))
    assert [bt.metadata.name for bt in load_file(path)] == ["llama-8b"]


def test_stdin_is_read_with_the_same_rules(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    path = tmp_path / "in.yaml"
    path.write_text(MINIMAL.replace("max: 256", "max: 0400"))
    done = subprocess.run([sys.executable, "-m", "batchtune", "validate", "-f", "-"],
                          stdin=path.open("rb"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stdout.startswith("-: spec.searchSpace.maxNumSeqs.max: is read as the octal number 256 by kubectl")


def test_loader_errors_are_field_errors_with_missing_or_the_text_as_value(tmp_path: Path) -> None:
    (doc,) = _read(tmp_path, "a: yes\nb: 1\nb: 2\n")
    assert [(e.path, e.value) for e in doc.errors] == [("a", "yes"), ("b", MISSING)]
