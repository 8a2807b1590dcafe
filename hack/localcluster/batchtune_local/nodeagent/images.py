"""Image mapping: which local command stands in for a container image.

A mapping file (YAML) lists entries tried in order before the built-in ones::

    images:
      - match: "batchtune.test/*"     # fnmatch pattern on the full image reference
        run: []                       # argv prefix; [] runs the container command as is
        entrypoint: []                # the image's ENTRYPOINT, used when the container has no command
        dropPrefixes: []              # leading command words the prefix already stands for

A leading `python` or `python3` in the final argv is the agent's own interpreter, so the
project's virtual environment is what runs.
"""

from __future__ import annotations

import fnmatch
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

BUILTIN_SOURCE = "<built-in defaults>"


@dataclass(frozen=True)
class ImageRule:
    match: str
    """fnmatch pattern on the image reference, e.g. `*vllm*`."""
    run: tuple[str, ...]
    """argv prefix of the local command; empty runs the container's command itself."""
    entrypoint: tuple[str, ...] = ()
    """The image's ENTRYPOINT: used when the container sets no `command`."""
    drop_prefixes: tuple[tuple[str, ...], ...] = ()
    """Leading command words dropped because `run` already stands for them."""
    source: str = BUILTIN_SOURCE
    """The mapping file (or the built-ins) the rule came from, for error messages."""


BUILTIN_RULES: tuple[ImageRule, ...] = (
    ImageRule("*vllm*", ("python", "-m", "batchtune", "twin", "vllm"), entrypoint=("vllm", "serve")),
    ImageRule(
        "*batchtune*",
        ("python", "-m", "batchtune"),
        drop_prefixes=(("python", "-m", "batchtune"), ("python3", "-m", "batchtune"), ("batchtune",)),
    ),
)


class ImageNotMapped(Exception):
    """No rule matches the image: the pod waits with reason ErrImagePull."""

    def __init__(self, image: str, sources: tuple[str, ...]) -> None:
        self.image = image
        self.sources = sources
        super().__init__(
            f"Image {image!r} has no local mapping in {', '.join(sources)}; "
            "add an entry under 'images:' in the node agent's --image-map file"
        )


@dataclass(frozen=True)
class ImageMap:
    rules: tuple[ImageRule, ...] = BUILTIN_RULES
    sources: tuple[str, ...] = field(default=(BUILTIN_SOURCE,))

    def rule_for(self, image: str) -> ImageRule:
        for rule in self.rules:
            if fnmatch.fnmatchcase(image, rule.match):
                return rule
        raise ImageNotMapped(image, self.sources)

    def argv_for(self, container: dict[str, Any], python: str = sys.executable) -> list[str]:
        """The local argv for a container spec (dict with `image`, optional `command`, `args`)."""
        image = str(container.get("image") or "")
        rule = self.rule_for(image)
        command = [str(c) for c in container.get("command") or []]
        args = [str(a) for a in container.get("args") or []]
        # Kubernetes semantics: `command` replaces ENTRYPOINT (and drops CMD), `args` replaces CMD.
        words = (command if command else list(rule.entrypoint)) + args
        for prefix in rule.drop_prefixes:
            if tuple(words[: len(prefix)]) == prefix:
                words = words[len(prefix):]
                break
        argv = list(rule.run) + words
        if not argv:
            raise ValueError(f"container {container.get('name')!r}: image {image!r} maps to an empty command")
        if argv[0] in ("python", "python3"):
            argv[0] = python
        return argv


def load_image_map(path: str | Path | None) -> ImageMap:
    """The mapping from a YAML file (its rules first, then the built-ins), or the built-ins alone."""
    if path is None:
        return ImageMap()
    text = Path(path).read_text(encoding="utf-8")
    doc = yaml.safe_load(text) or {}
    if not isinstance(doc, dict) or not isinstance(doc.get("images", []), list):
        raise ValueError(f"image map {path}: expected a mapping with a list 'images', got {type(doc).__name__}")
    source = str(path)
    rules = [_rule_from(entry, source, i) for i, entry in enumerate(doc.get("images") or [])]
    builtins = () if doc.get("replaceDefaults") else BUILTIN_RULES
    sources = (source,) if doc.get("replaceDefaults") else (source, BUILTIN_SOURCE)
    return ImageMap(tuple(rules) + builtins, sources)


def _rule_from(entry: Any, source: str, index: int) -> ImageRule:
    where = f"image map {source}: images[{index}]"
    if not isinstance(entry, dict) or not isinstance(entry.get("match"), str):
        raise ValueError(f"{where}: needs a string 'match', got {entry!r}")
    unknown = set(entry) - {"match", "run", "entrypoint", "dropPrefixes"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")

    def words(key: str) -> tuple[str, ...]:
        value = entry.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, (str, int, float)) for v in value):
            raise ValueError(f"{where}.{key}: expected a list of strings, got {value!r}")
        return tuple(str(v) for v in value)

    drops = entry.get("dropPrefixes") or []
    if not isinstance(drops, list) or not all(isinstance(d, list) for d in drops):
        raise ValueError(f"{where}.dropPrefixes: expected a list of lists, got {drops!r}")
    return ImageRule(
        match=entry["match"],
        run=words("run"),
        entrypoint=words("entrypoint"),
        drop_prefixes=tuple(tuple(str(w) for w in d) for d in drops),
        source=source,
    )
