"""The recommendation as a change to a Git repository, in the user's layout: pure text edits.

Three layouts (spec.apply.git.layout):

- **Kustomize**: `<path>/batchtune-<deployment>.yaml` holds a strategic-merge patch of the engine
  container's command/args (batchtune owns that file and writes it whole); `<path>/kustomization.yaml`
  gets one `patches: - path: ...` entry if it does not list the file yet.
- **HelmValues**: the list at `valuesKey` (dotted, e.g. `vllm.args`) in the values file has its
  knob flags rewritten by the engine, as a trial's command line is; every other word stays.
- **Manifest**: the Deployment's engine container in a (multi-document) manifest file has its
  command/args rewritten in place, the same way.

Edits are made on the text, never by dumping a parsed document again: comments, key order, quoting
and indentation of everything else stay byte for byte, so the pull request's diff is the knob change.
Every edit is checked by parsing the result: the changed list must hold exactly the new words and
the rest of the file must load to the same data; otherwise `EditError` names the file and the key.
"""

from __future__ import annotations

import copy
import difflib
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode


class Layout(StrEnum):
    """How the repository holds the engine container's command line (spec.apply.git.layout)."""

    KUSTOMIZE = "Kustomize"
    """path is a kustomization's directory: batchtune writes batchtune-<deployment>.yaml there (a strategic-merge
    patch of the container's command/args) and lists it under patches."""
    HELM_VALUES = "HelmValues"
    """path is a values file: the list at valuesKey holds the engine's flags and gets its batching flags rewritten."""
    MANIFEST = "Manifest"
    """path is the manifest holding the Deployment: the engine container's command/args are rewritten in place."""


class ForgeType(StrEnum):
    """The forge whose API opens pull (merge) requests (spec.apply.git.forge.type)."""

    GITHUB = "GitHub"
    GITEA = "Gitea"
    """Gitea or Forgejo (the same API)."""
    GITLAB = "GitLab"


class EditError(Exception):
    """The file cannot be edited as the layout says (names the file, the key and why)."""


Rewrite = Callable[[Mapping[str, Any]], Mapping[str, Any]]
"""A container (name, command, args) -> the same container with the chosen setting applied (Engine.rewrite)."""


# ---- locating nodes ---------------------------------------------------------------------------

def _get(node: Node | None, key: str) -> Node | None:
    if not isinstance(node, MappingNode):
        return None
    for k, v in node.value:
        if isinstance(k, ScalarNode) and k.value == key:
            return v if isinstance(v, Node) else None
    return None


def _key_node(node: MappingNode, key: str) -> ScalarNode | None:
    for k, _ in node.value:
        if isinstance(k, ScalarNode) and k.value == key:
            return k
    return None


def _scalars(node: SequenceNode, where: str) -> list[str]:
    if not all(isinstance(item, ScalarNode) for item in node.value):
        raise EditError(f"{where} must be a list of strings")
    return [str(item.value) for item in node.value]


def _compose_all(text: str, file: str) -> list[Node]:
    try:
        return [n for n in yaml.compose_all(text, Loader=yaml.SafeLoader) if n is not None]
    except yaml.YAMLError as exc:
        raise EditError(f"{file} is not YAML: {exc}") from None


def _load_all(text: str) -> list[Any]:
    return [d for d in yaml.safe_load_all(text) if d is not None]


# ---- rendering scalars in the style they had -------------------------------------------------

def _render(value: str, style: str | None) -> str:
    """One string as a YAML scalar, in the old item's quoting where that still reads back the same."""
    plain = yaml.safe_dump(value, width=10_000).removesuffix("\n...\n").rstrip("\n")
    if style == '"' and plain.startswith("'"):
        out = yaml.safe_dump(value, default_style='"', width=10_000)
    elif style in ('"', "'") and not plain.startswith(("'", '"')):
        out = yaml.safe_dump(value, default_style=style, width=10_000)
    else:
        out = yaml.safe_dump(value, width=10_000)
    out = out.removesuffix("\n...\n").rstrip("\n")
    if "\n" in out:
        out = yaml.safe_dump(value, default_style='"', width=10_000).rstrip("\n")
    return out


def _line_start(text: str, index: int) -> int:
    return text.rfind("\n", 0, index) + 1


def _line_end(text: str, index: int) -> int:
    end = text.find("\n", index)
    return len(text) if end < 0 else end + 1


def _replace_sequence(text: str, node: SequenceNode, new: Sequence[str]) -> str:
    """`text` with the list at `node` holding `new`, touching only the lines of items that changed."""
    old_items: list[ScalarNode] = list(node.value)
    old = [str(i.value) for i in old_items]
    if old == list(new):
        return text
    quoted = '"' if any(i.style == '"' for i in old_items) else None
    if len(old) == len(new) and old_items:
        for item, value in sorted(zip(old_items, new, strict=True), key=lambda p: -p[0].start_mark.index):
            if str(item.value) != value:
                text = text[:item.start_mark.index] + _render(value, item.style) + text[item.end_mark.index:]
        return text
    if node.flow_style or not old_items:
        if not old_items and not node.flow_style:
            raise EditError("the list is empty in block style")
        styles = dict(zip(old, (i.style for i in old_items), strict=True))
        body = "[" + ", ".join(_render(v, styles.get(v, quoted)) for v in new) + "]"
        return text[:node.start_mark.index] + body + text[node.end_mark.index:]
    return _resize_block_list(text, old_items, new, quoted)


def _resize_block_list(text: str, old_items: Sequence[ScalarNode], new: Sequence[str], quoted: str | None) -> str:
    """A block list whose length changes: one item per line; the lines of unchanged items reused as they were."""
    old = [str(i.value) for i in old_items]
    starts = [_line_start(text, i.start_mark.index) for i in old_items]
    ends = [_line_end(text, i.end_mark.index) for i in old_items]
    for a, b in zip(ends, starts[1:], strict=False):
        if a > b:
            raise EditError("the list has two items on one line")
    prefix = text[starts[0]:old_items[0].start_mark.index]
    if not prefix.rstrip().endswith("-"):
        raise EditError("the list's items are not one per line")
    lines: list[str] = []
    matcher = difflib.SequenceMatcher(a=old, b=list(new), autojunk=False)
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op == "equal":
            lines += [text[starts[i]:ends[i]] for i in range(i1, i2)]
        else:
            lines += [prefix + _render(new[j], quoted) + "\n" for j in range(j1, j2)]
    tail = text[ends[-1]:]
    joined = "".join(lines)
    if not tail and not text.endswith("\n"):
        joined = joined.rstrip("\n")
    return text[:starts[0]] + joined + tail


def _check(before: str, after: str, file: str, where: str, expect: Callable[[list[Any]], list[Any]]) -> None:
    """The edit changed exactly what it meant to: `expect(old documents)` equals the new documents."""
    try:
        new_docs = _load_all(after)
    except yaml.YAMLError as exc:
        raise EditError(f"{file}: editing {where} would break the YAML ({exc})") from None
    if new_docs != expect(copy.deepcopy(_load_all(before))):
        raise EditError(f"{file}: editing {where} in place would change more than the list; edit it by hand")


# ---- Manifest ---------------------------------------------------------------------------------

def _containers(doc: Node) -> SequenceNode | None:
    node = _get(_get(_get(_get(doc, "spec"), "template"), "spec"), "containers")
    return node if isinstance(node, SequenceNode) else None


def _find_deployment(docs: Sequence[Node], name: str) -> int | None:
    for i, doc in enumerate(docs):
        kind, named = _get(doc, "kind"), _get(_get(doc, "metadata"), "name")
        if isinstance(kind, ScalarNode) and kind.value == "Deployment" and isinstance(named, ScalarNode) and \
                named.value == name:
            return i
    return None


def _rewritten(rewrite: Rewrite, container: Mapping[str, Any], where: str) -> Mapping[str, Any]:
    try:
        return rewrite(container)
    except ValueError as exc:
        raise EditError(f"{where}: {exc}") from None


def _container_entry(doc: Node, file: str, deployment: str, container: str) -> MappingNode:
    containers = _containers(doc)
    entry = None
    for c in containers.value if containers else []:
        name = _get(c, "name")
        if isinstance(name, ScalarNode) and name.value == container:
            entry = c
    if not isinstance(entry, MappingNode):
        raise EditError(f"{file}: Deployment {deployment} has no container named {container!r}")
    return entry


def _command_lists(entry: MappingNode, where: str) -> dict[str, SequenceNode]:
    """The container's command and args lists, those it has."""
    nodes: dict[str, SequenceNode] = {}
    for field in ("command", "args"):
        node = _get(entry, field)
        if node is None:
            continue
        if not isinstance(node, SequenceNode):
            raise EditError(f"{where}: {field} must be a list")
        nodes[field] = node
    return nodes


def edit_manifest(text: str, file: str, deployment: str, container: str, rewrite: Rewrite) -> str:
    """The manifest file with the named Deployment's container rewritten (its command and args lists)."""
    docs = _compose_all(text, file)
    index = _find_deployment(docs, deployment)
    if index is None:
        raise EditError(f"{file} (spec.apply.git.path) holds no Deployment named {deployment!r}")
    entry = _container_entry(docs[index], file, deployment, container)
    where = f"Deployment {deployment}, container {container}"
    nodes = _command_lists(entry, f"{file}: {where}")
    current: dict[str, Any] = {"name": container}
    for field, node in nodes.items():
        current[field] = _scalars(node, f"{file}: {where}: {field}")
    new = _rewritten(rewrite, current, f"{file}: {where}")
    for field in ("command", "args"):
        if new.get(field) != current.get(field) and field not in nodes:
            raise EditError(f"{file}: {where} has no {field} list to edit; add one, or use layout Kustomize")
    out = text
    for field, node in sorted(nodes.items(), key=lambda kv: -kv[1].start_mark.index):
        out = _replace_sequence(out, node, [str(a) for a in new.get(field) or []])

    def expected(old: list[Any]) -> list[Any]:
        for c in old[index]["spec"]["template"]["spec"]["containers"]:
            if c.get("name") == container:
                for f in nodes:
                    c[f] = list(new.get(f) or [])
        return old

    _check(text, out, file, where, expected)
    return out


# ---- HelmValues -------------------------------------------------------------------------------

_KEY = re.compile(r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$")


def edit_values(text: str, file: str, key: str, container: str, rewrite: Rewrite) -> str:
    """The values file with the args list at dotted `key` rewritten as a container's args would be."""
    if not _KEY.match(key):
        raise EditError(f"spec.apply.git.valuesKey {key!r} must be dotted keys (e.g. vllm.args)")
    docs = _compose_all(text, file)
    if len(docs) != 1:
        raise EditError(f"{file} must hold one YAML document")
    node: Node | None = docs[0]
    for part in key.split("."):
        node = _get(node, part)
    if not isinstance(node, SequenceNode):
        raise EditError(f"{file} has no list at {key} (spec.apply.git.valuesKey)")
    current = _scalars(node, f"{file}: {key}")
    try:
        new = [str(a) for a in rewrite({"name": container, "args": current}).get("args") or []]
    except ValueError:
        # A chart's list of flags only (the model comes from another value): read it after a stand-in command.
        stand_in = ["vllm", "serve", "batchtune-stand-in-model"]
        out_container = _rewritten(rewrite, {"name": container, "command": stand_in, "args": current}, f"{file}: {key}")
        if list(out_container.get("command") or []) != stand_in:
            raise EditError(f"{file}: {key}: the engine cannot set its flags within this list") from None
        new = [str(a) for a in out_container.get("args") or []]
    out = _replace_sequence(text, node, new)

    def expected(old: list[Any]) -> list[Any]:
        parent = old[0]
        parts = key.split(".")
        for part in parts[:-1]:
            parent = parent[part]
        parent[parts[-1]] = new
        return old

    _check(text, out, file, key, expected)
    return out


# ---- Kustomize --------------------------------------------------------------------------------

def patch_file_name(deployment: str) -> str:
    return f"batchtune-{deployment}.yaml"


PATCH_HEADER = ("# Written by batchtune (spec.apply.mode PullRequest): the engine container's command line with\n"
                "# the tuned batching flags. batchtune replaces this file on a later decision.\n")


def _lists_patch(root: MappingNode, patch: str) -> bool:
    """Whether the kustomization already lists `patch` (under patches, by path or by name, or
    patchesStrategicMerge)."""
    for key in ("patches", "patchesStrategicMerge"):
        listed = _get(root, key)
        if not isinstance(listed, SequenceNode):
            continue
        for item in listed.value:
            path = item if isinstance(item, ScalarNode) else _get(item, "path")
            if isinstance(path, ScalarNode) and path.value == patch:
                return True
    return False


def _after_patches(text: str, root: MappingNode) -> int:
    """Where a new item of the block list `patches` goes: after its last item, before the blank and comment lines
    that lead into the next key."""
    keys = [k for k, _ in root.value]
    after = next(i for i, k in enumerate(keys) if isinstance(k, ScalarNode) and k.value == "patches") + 1
    at = _line_start(text, keys[after].start_mark.index) if after < len(keys) else len(text)
    while at > 0:
        prev = _line_start(text, at - 1)
        line = text[prev:at].strip()
        if line and not line.startswith("#"):
            break
        at = prev
    return at


def edit_kustomization(text: str | None, file: str, patch: str) -> str:
    """kustomization.yaml listing `patch` under `patches` (unchanged when it already lists it)."""
    if text is None:
        raise EditError(f"{file} does not exist (spec.apply.git.path must be the kustomization's directory)")
    docs = _compose_all(text, file)
    if len(docs) != 1 or not isinstance(docs[0], MappingNode):
        raise EditError(f"{file} must hold one YAML mapping")
    root = docs[0]
    if _lists_patch(root, patch):
        return text
    patches = _get(root, "patches")
    if patches is None:
        out = text if text.endswith("\n") or not text else text + "\n"
        out += f"patches:\n- path: {patch}\n"
    elif isinstance(patches, SequenceNode) and not patches.flow_style and patches.value:
        indent = " " * _column_of_dash(text, patches.value[0].start_mark.index)
        at = _after_patches(text, root)
        head = text[:at] if text[:at].endswith("\n") else text[:at] + "\n"
        out = head + f"{indent}- path: {patch}\n" + text[at:]
    else:
        raise EditError(f"{file}: patches is not a block list; add `- path: {patch}` to it by hand")

    def expected(old: list[Any]) -> list[Any]:
        old[0].setdefault("patches", [])
        old[0]["patches"] = list(old[0]["patches"] or []) + [{"path": patch}]
        return old

    _check(text, out, file, "patches", expected)
    return out


def _column_of_dash(text: str, index: int) -> int:
    start = _line_start(text, index)
    line = text[start:index]
    pos = line.rfind("-")
    if pos < 0:
        raise EditError("a list item without its dash on the same line")
    return pos


# ---- one change ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Target:
    layout: Layout
    path: str
    """A file (Manifest, HelmValues) or the kustomization's directory (Kustomize), relative to the repository."""
    deployment: str
    container: str
    values_key: str | None = None


def files_to_read(target: Target) -> list[str]:
    if target.layout is Layout.KUSTOMIZE:
        base = target.path.rstrip("/")
        return [f"{base}/kustomization.yaml" if base else "kustomization.yaml"]
    return [target.path]


def change(target: Target, files: Mapping[str, str | None], rewrite: Rewrite,
           kustomize_patch: str | None = None) -> dict[str, str]:
    """The files to write (path -> new text), given the current text of `files_to_read(target)`.

    An empty mapping: the repository already holds the setting.
    """
    out: dict[str, str] = {}
    if target.layout is Layout.KUSTOMIZE:
        assert kustomize_patch is not None
        kfile = files_to_read(target)[0]
        directory = kfile.rpartition("/")[0]
        name = patch_file_name(target.deployment)
        patch_path = f"{directory}/{name}" if directory else name
        new_k = edit_kustomization(files.get(kfile), kfile, name)
        if new_k != files.get(kfile):
            out[kfile] = new_k
        content = PATCH_HEADER + kustomize_patch
        if files.get(patch_path) != content:
            out[patch_path] = content
        return out
    text = files.get(target.path)
    if text is None:
        raise EditError(f"{target.path} (spec.apply.git.path) does not exist on the base branch")
    if target.layout is Layout.MANIFEST:
        new = edit_manifest(text, target.path, target.deployment, target.container, rewrite)
    else:
        if not target.values_key:
            raise EditError("spec.apply.git.valuesKey is required with layout HelmValues")
        new = edit_values(text, target.path, target.values_key, target.container, rewrite)
    return {target.path: new} if new != text else {}


# ---- branch and message ----------------------------------------------------------------------

_UNSAFE_REF = re.compile(r"[^A-Za-z0-9._/-]+")


def branch_name(prefix: str, namespace: str, tuning: str, round_: int, generation: int) -> str:
    """One branch per decision: the tuning, its generation and round."""
    name = f"{prefix.rstrip('/')}/{namespace}/{tuning}/g{generation}-r{round_}"
    name = _UNSAFE_REF.sub("-", name).replace("..", "-")
    return name.strip("/.")


def commit_message(title: str, decision: str, table: Sequence[Sequence[str]], margins: Sequence[str],
                   notes: Sequence[str]) -> str:
    """Title line, then the decision, the trial table, the chosen setting's margins and notes."""
    lines = [title[:72], "", decision, ""]
    if table:
        widths = [max(len(str(row[i])) for row in table) for i in range(len(table[0]))]
        for n, row in enumerate(table):
            lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
            if n == 0:
                lines.append("  ".join("-" * w for w in widths))
        lines.append("")
    if margins:
        lines.append("Margins of the chosen setting under the SLO:")
        lines += [f"- {m}" for m in margins]
        lines.append("")
    lines += list(notes)
    return "\n".join(lines).rstrip() + "\n"
