"""Reading and rewriting vLLM's command line in a Kubernetes container spec.

Forms understood (flags in `command`, `args` or both; `--flag value`, `--flag=value`, and
underscore spellings `--max_num_seqs`, which vLLM's parser accepts):
- `vllm serve <model> --flags...`
- `python -m vllm.entrypoints.openai.api_server --model <model> --flags...`
- only `args` with the vLLM image's own entrypoint (`vllm serve` or the api_server)
- a shell string, `sh -c "vllm serve ..."`: rewritten in place (only the changed words are
  spliced, so `$MODEL` and quoting elsewhere stay as they were) when the string is one simple
  command; pipes, `&&`, `;`, `$(...)`, backticks, redirects, subshells, comments or several lines
  are refused with `ArgsError`, since which command reads the flags is then a guess.
"""

from __future__ import annotations

import copy
import os
import shlex
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from batchtune.core.settings import Setting

API_SERVER_MODULES = ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.api_server")
SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "ksh"})
# vLLM flags that take no value: reading `--enforce-eager <model>` must not eat the model.
BOOLEAN_FLAGS = frozenset({
    "enable-chunked-prefill", "no-enable-chunked-prefill", "enforce-eager", "trust-remote-code",
    "enable-prefix-caching", "no-enable-prefix-caching", "disable-log-requests", "disable-log-stats",
    "enable-log-requests", "enable-auto-tool-choice", "disable-custom-all-reduce", "enable-lora",
    "disable-frontend-multiprocessing", "enable-expert-parallel", "async-scheduling",
    "no-async-scheduling", "enable-sleep-mode", "disable-fastapi-docs", "enable-prompt-tokens-details",
    "headless", "api-server-count-auto", "skip-tokenizer-init", "disable-sliding-window",
    "enable-reasoning", "enable-force-include-usage", "enable-server-load-tracking",
})
KNOWN_VLLM_FLAGS = frozenset({
    "max-num-seqs", "gpu-memory-utilization", "max-num-batched-tokens", "model", "served-model-name",
    "tensor-parallel-size", "max-model-len", "port", "dtype", "quantization", "kv-cache-dtype",
})
_UNSAFE_SHELL = {
    ";": "a command separator ';'", "&": "'&' or '&&'", "|": "a pipe or '||'", "<": "a redirect",
    ">": "a redirect", "(": "a subshell", ")": "a subshell", "`": "a backtick command substitution",
}


class ArgsError(ValueError):
    """The container's vLLM command line cannot be read or rewritten safely."""

    def __init__(self, container: str, why: str) -> None:
        super().__init__(f"container {container!r}: {why}")
        self.container = container
        self.why = why


class UnsafeShell(ArgsError):
    """vLLM runs inside a shell string that cannot be rewritten safely (pipes, &&, $(...), ...)."""


@dataclass
class _Word:
    text: str
    where: str  # "command" | "args" | "shell"
    index: int = 0  # position in command/args
    start: int = 0  # span in the shell string
    end: int = 0


@dataclass
class _Occurrence:
    name_word: int
    spelled: str  # the flag as written, e.g. "--max_num_seqs"
    value_word: int | None  # word index of the value, None when boolean or `=`-joined
    joined: bool


@dataclass
class _Parsed:
    container: str
    words: list[_Word]
    flags_start: int
    form: str
    shell_where: tuple[str, int] | None = None  # the list element holding the shell string
    script: str = ""
    model: str | None = None
    occurrences: dict[str, list[_Occurrence]] = field(default_factory=dict)
    flags: dict[str, str | None] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class VllmInvocation:
    """What a container runs, read for the baseline."""

    container: str
    form: str
    """serve | api_server | entrypoint | shell+serve | shell+api_server"""
    model: str | None
    max_num_seqs: int | None
    gpu_memory_utilization_percent: int | None
    """Rounded to whole percent; the exact text is in `flags["gpu-memory-utilization"]`."""
    max_num_batched_tokens: int | None
    flags: Mapping[str, str | None]
    """Canonical flag name (dashes, no leading --) -> last value (None for boolean flags)."""
    args: tuple[str, ...]
    """vLLM's own argv after the entry point (model and flags), as written."""

    @property
    def served_model_name(self) -> str | None:
        """The `model_name` label vLLM puts on its metrics: --served-model-name, else the model."""
        served = self.flags.get("served-model-name")
        return served.split()[0] if served else self.model

    def setting(self, default_gpu_memory_utilization_percent: int = 90, default_max_num_seqs: int | None = None) -> Setting | None:
        """The baseline as a Setting (vLLM defaults filled in where given), or None if unknown."""
        seqs = self.max_num_seqs if self.max_num_seqs is not None else default_max_num_seqs
        if seqs is None:
            return None
        gmu = self.gpu_memory_utilization_percent or default_gpu_memory_utilization_percent
        return Setting(seqs, gmu, self.max_num_batched_tokens)

    def to_status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"args": list(self.args)}
        if self.max_num_seqs is not None:
            out["maxNumSeqs"] = self.max_num_seqs
        if self.gpu_memory_utilization_percent is not None:
            out["gpuMemoryUtilizationPercent"] = self.gpu_memory_utilization_percent
        if self.max_num_batched_tokens is not None:
            out["maxNumBatchedTokens"] = self.max_num_batched_tokens
        return out


def canonical_flag(token: str) -> str:
    """`--max_num_seqs` / `--max-num-seqs=8` -> `max-num-seqs`."""
    return token.lstrip("-").partition("=")[0].replace("_", "-")


def _shell_words(script: str, container: str) -> list[_Word]:
    """Words of one simple shell command with their spans; refuses anything more."""
    words: list[_Word] = []
    i, n = 0, len(script)

    def refuse(what: str) -> ArgsError:
        return UnsafeShell(
            container,
            f"the shell command contains {what}, so the vLLM flags cannot be rewritten safely; "
            "run vLLM as a plain command (command/args lists) or as one simple shell command",
        )

    while i < n:
        c = script[i]
        if c in " \t":
            i += 1
            continue
        if c == "\\" and i + 1 < n and script[i + 1] == "\n":
            i += 2  # line continuation
            continue
        if c in "\r\n":
            raise refuse("several lines")
        if c == "#":
            raise refuse("a comment")
        start, buf = i, []
        while i < n and script[i] not in " \t\r\n":
            c = script[i]
            if c in _UNSAFE_SHELL:
                raise refuse(_UNSAFE_SHELL[c])
            if c == "'":
                j = script.find("'", i + 1)
                if j < 0:
                    raise refuse("an unterminated single quote")
                buf.append(script[i + 1 : j])
                i = j + 1
            elif c == '"':
                i += 1
                while True:
                    if i >= n:
                        raise refuse("an unterminated double quote")
                    c = script[i]
                    if c == '"':
                        i += 1
                        break
                    if c == "`" or script.startswith("$(", i):
                        raise refuse("a command substitution")
                    if c == "\\" and i + 1 < n and script[i + 1] in '"\\$`\n':
                        buf.append(script[i + 1])
                        i += 2
                        continue
                    buf.append(c)
                    i += 1
            elif c == "\\":
                if i + 1 >= n:
                    raise refuse("a trailing backslash")
                if script[i + 1] == "\n":
                    break
                buf.append(script[i + 1])
                i += 2
            elif script.startswith("$(", i):
                raise refuse("a command substitution")
            else:
                buf.append(c)
                i += 1
        words.append(_Word("".join(buf), "shell", start=start, end=i))
    return words


def _find_entry(texts: list[str]) -> tuple[int, str] | None:
    """(index where vLLM's own argv starts, form) in a word list, or None."""
    for i, text in enumerate(texts):
        if os.path.basename(text) == "vllm" and i + 1 < len(texts) and texts[i + 1] == "serve":
            return i + 2, "serve"
        if text == "-m" and i + 1 < len(texts) and texts[i + 1] in API_SERVER_MODULES:
            return i + 2, "api_server"
    return None


def _shell_script_at(texts: list[str]) -> int | None:
    """Index of the script word in `sh -c SCRIPT` (also `bash -lc`, `/bin/sh -ec`), or None."""
    if not texts or os.path.basename(texts[0]) not in SHELLS:
        return None
    for i in range(1, len(texts)):
        word = texts[i]
        if not word.startswith("-") or word.startswith("--"):
            return None
        if "c" in word[1:]:
            return i + 1 if i + 1 < len(texts) else None
    return None


def _parse(container: Mapping[str, Any]) -> _Parsed:
    name = str(container.get("name", "?"))
    command = [str(x) for x in container.get("command") or []]
    args = [str(x) for x in container.get("args") or []]
    words = [_Word(t, "command", index=i) for i, t in enumerate(command)]
    words += [_Word(t, "args", index=i) for i, t in enumerate(args)]
    texts = [w.text for w in words]

    parsed: _Parsed | None = None
    script_at = _shell_script_at(texts)
    if script_at is not None:
        holder = words[script_at]
        script_words = _shell_words(holder.text, name)
        script_texts = [w.text for w in script_words]
        entry = _find_entry(script_texts)
        if entry is None:
            raise ArgsError(name, f"the shell command {holder.text!r} does not run `vllm serve` or vLLM's api_server")
        parsed = _Parsed(name, script_words, entry[0], f"shell+{entry[1]}", (holder.where, holder.index), holder.text)
    else:
        entry = _find_entry(texts)
        if entry is not None:
            parsed = _Parsed(name, words, entry[0], entry[1])
        elif not command and args and (
            "vllm" in str(container.get("image", "")).lower()
            or any(t.startswith("--") and canonical_flag(t) in KNOWN_VLLM_FLAGS for t in args)
        ):
            parsed = _Parsed(name, words, 0, "entrypoint")  # the vLLM image's entrypoint reads args
    if parsed is None:
        raise ArgsError(
            name,
            "does not run vLLM: expected `vllm serve <model>`, `python -m vllm.entrypoints.openai.api_server`, "
            "vLLM image args, or `sh -c \"vllm serve ...\"` in command/args",
        )
    _read_flags(parsed)
    return parsed


def _read_flags(parsed: _Parsed) -> None:
    words, i = parsed.words, parsed.flags_start
    while i < len(words):
        text = words[i].text
        if text.startswith("-") and len(text) > 1 and not _is_number(text):
            canon = canonical_flag(text)
            if "=" in text:
                occ = _Occurrence(i, text.partition("=")[0], None, True)
                value: str | None = text.partition("=")[2]
                i += 1
            elif canon in BOOLEAN_FLAGS or i + 1 >= len(words) or (
                words[i + 1].text.startswith("-") and not _is_number(words[i + 1].text)
            ):
                occ, value = _Occurrence(i, text, None, False), None
                i += 1
            else:
                occ, value = _Occurrence(i, text, i + 1, False), words[i + 1].text
                i += 2
            parsed.occurrences.setdefault(canon, []).append(occ)
            parsed.flags[canon] = value
            if canon not in parsed.order:
                parsed.order.append(canon)
        else:
            if parsed.model is None and parsed.form.endswith(("serve", "entrypoint")):
                parsed.model = text  # `vllm serve <model>`: the first positional
            i += 1
    if "model" in parsed.flags and parsed.flags["model"] is not None:
        parsed.model = parsed.flags["model"]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _as_int(parsed: _Parsed, flag: str) -> int | None:
    value = parsed.flags.get(flag)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise ArgsError(parsed.container, f"--{flag} value {value!r} is not an integer") from None


def _as_percent(parsed: _Parsed) -> int | None:
    value = parsed.flags.get("gpu-memory-utilization")
    if value is None:
        return None
    try:
        fraction = float(value)
    except ValueError:
        raise ArgsError(parsed.container, f"--gpu-memory-utilization value {value!r} is not a number") from None
    if not 0 < fraction <= 1:
        raise ArgsError(parsed.container, f"--gpu-memory-utilization value {value!r} is outside (0, 1]")
    return int(fraction * 100 + 0.5)


def read_vllm_settings(container: Mapping[str, Any]) -> VllmInvocation:
    """The model, the three knobs' current values and every other flag of a vLLM container."""
    parsed = _parse(container)
    return VllmInvocation(
        container=parsed.container,
        form=parsed.form,
        model=parsed.model,
        max_num_seqs=_as_int(parsed, "max-num-seqs"),
        gpu_memory_utilization_percent=_as_percent(parsed),
        max_num_batched_tokens=_as_int(parsed, "max-num-batched-tokens"),
        flags=dict(parsed.flags),
        args=tuple(w.text for w in parsed.words[parsed.flags_start:]),
    )


def parse_flag_list(args: Sequence[str]) -> dict[str, str | None]:
    """`["--max-model-len", "4096", "--enforce-eager", "--dtype=half"]` -> canonical flag -> value."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        text = args[i]
        if not text.startswith("-") or _is_number(text):
            raise ValueError(f"extra arg {text!r} at position {i} is not a flag (expected --name [value])")
        canon = canonical_flag(text)
        if "=" in text:
            out[canon] = text.partition("=")[2]
            i += 1
        elif canon in BOOLEAN_FLAGS or i + 1 >= len(args) or (args[i + 1].startswith("-") and not _is_number(args[i + 1])):
            out[canon] = None
            i += 1
        else:
            out[canon] = args[i + 1]
            i += 2
    return out


def rewrite_vllm_args(
    container: Mapping[str, Any],
    setting: Setting | Mapping[str, str | None],
    extra_args: Sequence[str] = (),
) -> dict[str, Any]:
    """A copy of the container with the flags set; every other word stays as and where it was.

    `setting` is a Setting or canonical flag -> value (None: a boolean flag). Flags already present
    get their value replaced in place (all occurrences, keeping spelling and `=` form); missing ones
    are appended after vLLM's argv. `extra_args` (spec.searchSpace.extraArgs) are set the same way.
    """
    flags: dict[str, str | None] = dict(setting.as_flags() if isinstance(setting, Setting) else setting)
    flags.update(parse_flag_list(extra_args))
    parsed = _parse(container)
    new = copy.deepcopy(dict(container))
    texts = {i: w.text for i, w in enumerate(parsed.words)}  # word index -> new text
    appended: list[str] = []
    for flag, value in flags.items():
        occurrences = parsed.occurrences.get(flag)
        if not occurrences:
            appended += [f"--{flag}"] + ([] if value is None else [value])
            continue
        for occ in occurrences:
            if value is None:
                continue  # a boolean flag that is already there
            if occ.joined:
                texts[occ.name_word] = f"{occ.spelled}={value}"
            elif occ.value_word is not None:
                texts[occ.value_word] = value
            else:
                raise ArgsError(parsed.container, f"flag {occ.spelled} has no value to replace with {value!r}")

    if parsed.shell_where is not None:
        script = parsed.script
        for i in sorted(texts, reverse=True):  # splice from the end so earlier spans stay valid
            word = parsed.words[i]
            if texts[i] != word.text:
                script = script[: word.start] + shlex.quote(texts[i]) + script[word.end :]
        if appended:
            stripped = script.rstrip()
            script = stripped + " " + shlex.join(appended) + script[len(stripped):]
        where, index = parsed.shell_where
        new[where] = list(new[where])
        new[where][index] = script
        return new

    command = [str(x) for x in container.get("command") or []]
    args = [str(x) for x in container.get("args") or []]
    for i, word in enumerate(parsed.words):
        if texts[i] != word.text:
            (command if word.where == "command" else args)[word.index] = texts[i]
    if command:
        new["command"] = command
    if appended or args or "args" in new:
        new["args"] = args + appended  # appended after everything: vLLM's argv ends the command line
    return new


def find_vllm_container(pod_spec: Mapping[str, Any], name: str | None = None) -> dict[str, Any]:
    """The container running vLLM: the named one, else the only one whose command line is vLLM's."""
    containers = list(pod_spec.get("containers") or [])
    names = [str(c.get("name")) for c in containers]
    if name is not None:
        for c in containers:
            if c.get("name") == name:
                _parse(c)  # raises ArgsError naming why it is not vLLM
                return c
        raise ArgsError(name, f"no such container in the pod template (containers: {', '.join(names) or 'none'})")
    found, why, unsafe = [], [], []
    for c in containers:
        try:
            _parse(c)
        except UnsafeShell as exc:
            unsafe.append(exc)
            continue
        except ArgsError as exc:
            why.append(str(exc))
            continue
        found.append(c)
    if not found and len(unsafe) == 1:
        raise unsafe[0]  # it is the vLLM container; say why it cannot be tuned, not that it is missing
    if len(found) == 1:
        return found[0]
    if not found:
        raise ArgsError(
            ",".join(names) or "?",
            "no container runs vLLM; set spec.targetRef.containerName" + (f" ({'; '.join(why)})" if why else ""),
        )
    raise ArgsError(
        ",".join(str(c.get("name")) for c in found),
        "several containers run vLLM; set spec.targetRef.containerName to choose one",
    )


def vllm_port(container: Mapping[str, Any]) -> int:
    """The port vLLM serves on: `--port`, else a containerPort named http, else the first, else 8000."""
    try:
        port = read_vllm_settings(container).flags.get("port")
        if port is not None:
            return int(port)
    except (ArgsError, ValueError):
        pass
    ports = list(container.get("ports") or [])
    for p in ports:
        if p.get("name") == "http" and p.get("containerPort"):
            return int(p["containerPort"])
    if ports and ports[0].get("containerPort"):
        return int(ports[0]["containerPort"])
    return 8000
