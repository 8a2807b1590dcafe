"""A container's command line as words: read flags, rewrite values in place, engine-neutral.

Forms understood (flags in `command`, `args` or both; `--flag value`, `--flag=value`):
- an engine's own entry point in the words (the engine says where its argv starts);
- only `args`, read by the image's entrypoint (the engine says whether the image is its own);
- a shell string, `sh -c "... --flags"`: rewritten in place (only the changed words are spliced, so
  `$MODEL` and quoting elsewhere stay as they were) when the string is one simple command; pipes,
  `&&`, `;`, `$(...)`, backticks, redirects, subshells, comments or several lines are refused with
  `UnsafeShell`, since which command reads the flags is then a guess.
"""

from __future__ import annotations

import copy
import os
import shlex
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Arity = Literal[0, 1, "?", "+"]

SHELLS = frozenset({"sh", "bash", "dash", "ash", "zsh", "ksh"})
_UNSAFE_SHELL = {
    ";": "a command separator ';'", "&": "'&' or '&&'", "|": "a pipe or '||'", "<": "a redirect",
    ">": "a redirect", "(": "a subshell", ")": "a subshell", "`": "a backtick command substitution",
}


class ArgsError(ValueError):
    """The container's command line cannot be read or rewritten safely."""

    def __init__(self, container: str, why: str) -> None:
        super().__init__(f"container {container!r}: {why}")
        self.container = container
        self.why = why


class UnsafeShell(ArgsError):
    """The engine runs inside a shell string that cannot be rewritten safely (pipes, &&, $(...), ...)."""


@dataclass
class Word:
    text: str
    where: str
    """"command" | "args" | "shell"."""
    index: int = 0
    """Position in command/args."""
    start: int = 0
    """Span in the shell string."""
    end: int = 0


@dataclass
class Occurrence:
    name_word: int
    spelled: str
    """The flag as written, e.g. "--max_num_seqs"."""
    value_word: int | None
    """Word index of the value; None when boolean or `=`-joined."""
    joined: bool


@dataclass(frozen=True)
class Grammar:
    """What an engine tells the parser: where its argv starts and how its flags read."""

    entry: Callable[[list[str]], tuple[int, str] | None]
    """(index where the engine's argv starts, form) in a word list, or None."""
    canonical: Callable[[str], str]
    """`--max_num_seqs=8` -> `max-num-seqs` (including abbreviations the engine's parser accepts)."""
    arity: Callable[[str], Arity]
    """How many words a canonical flag reads: 0 (a switch), 1, "?" (one if the next is no flag) or "+"."""
    positional_model: bool = True
    """Whether the first positional of the argv is the model (`vllm serve <model>`)."""


@dataclass
class CommandLine:
    container: str
    words: list[Word]
    flags_start: int
    form: str
    shell_where: tuple[str, int] | None = None
    """The list element holding the shell string."""
    script: str = ""
    positionals: list[str] = field(default_factory=list)
    occurrences: dict[str, list[Occurrence]] = field(default_factory=dict)
    flags: dict[str, str | None] = field(default_factory=dict)

    @property
    def argv(self) -> tuple[str, ...]:
        """The engine's own argv after its entry point, as written."""
        return tuple(w.text for w in self.words[self.flags_start:])


def shell_words(script: str, container: str) -> list[Word]:
    """Words of one simple shell command with their spans; refuses anything more."""
    words: list[Word] = []
    i, n = 0, len(script)

    def refuse(what: str) -> ArgsError:
        return UnsafeShell(
            container,
            f"the shell command contains {what}, so the engine's flags cannot be rewritten safely; "
            "run the engine as a plain command (command/args lists) or as one simple shell command",
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
        start, buf = i, list[str]()
        i = _shell_word(script, i, buf, refuse)
        words.append(Word("".join(buf), "shell", start=start, end=i))
    return words


def _shell_word(script: str, i: int, buf: list[str], refuse: Callable[[str], ArgsError]) -> int:
    """Reads the word at `i` into `buf`, unquoted; the index just past it."""
    n = len(script)
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
            i = _double_quoted(script, i + 1, buf, refuse)
        elif c == "\\":
            if i + 1 >= n:
                raise refuse("a trailing backslash")
            if script[i + 1] == "\n":
                break  # a line continuation ends the word
            buf.append(script[i + 1])
            i += 2
        elif script.startswith("$(", i):
            raise refuse("a command substitution")
        else:
            buf.append(c)
            i += 1
    return i


def _double_quoted(script: str, i: int, buf: list[str], refuse: Callable[[str], ArgsError]) -> int:
    """Reads a double-quoted string from just after its opening quote into `buf`; the index past its closing one."""
    n = len(script)
    while True:
        if i >= n:
            raise refuse("an unterminated double quote")
        c = script[i]
        if c == '"':
            return i + 1
        if c == "`" or script.startswith("$(", i):
            raise refuse("a command substitution")
        if c == "\\" and i + 1 < n and script[i + 1] in '"\\$`\n':
            buf.append(script[i + 1])
            i += 2
            continue
        buf.append(c)
        i += 1


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


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def is_flag(text: str) -> bool:
    return text.startswith("-") and len(text) > 1 and not is_number(text)


def parse(
    container: Mapping[str, Any],
    grammar: Grammar,
    entrypoint_image: Callable[[Mapping[str, Any], list[str]], bool],
    what: str,
) -> CommandLine:
    """The container's command line read with an engine's grammar; `ArgsError` when it is not the engine's.

    `entrypoint_image(container, args)`: with no command, whether the image's own entrypoint is the
    engine (then args are its argv). `what` names the engine in errors ("run vLLM: ...").
    """
    name = str(container.get("name", "?"))
    command = [str(x) for x in container.get("command") or []]
    args = [str(x) for x in container.get("args") or []]
    words = [Word(t, "command", index=i) for i, t in enumerate(command)]
    words += [Word(t, "args", index=i) for i, t in enumerate(args)]
    texts = [w.text for w in words]

    parsed: CommandLine | None = None
    script_at = _shell_script_at(texts)
    if script_at is not None:
        holder = words[script_at]
        script_words = shell_words(holder.text, name)
        entry = grammar.entry([w.text for w in script_words])
        if entry is None:
            raise ArgsError(name, f"the shell command {holder.text!r} does not {what}")
        parsed = CommandLine(name, script_words, entry[0], f"shell+{entry[1]}", (holder.where, holder.index),
                             holder.text)
    else:
        entry = grammar.entry(texts)
        if entry is not None:
            parsed = CommandLine(name, words, entry[0], entry[1])
        elif not command and args and entrypoint_image(container, args):
            parsed = CommandLine(name, words, 0, "entrypoint")
    if parsed is None:
        raise ArgsError(name, f"does not {what}")
    _read_flags(parsed, grammar)
    return parsed


def _read_flags(parsed: CommandLine, grammar: Grammar) -> None:
    words, i = parsed.words, parsed.flags_start
    while i < len(words):
        text = words[i].text
        if is_flag(text):
            canon = grammar.canonical(text)
            value: str | None
            if "=" in text:
                occ = Occurrence(i, text.partition("=")[0], None, True)
                value = text.partition("=")[2]
                i += 1
            else:
                taken = _values(grammar.arity(canon), [w.text for w in words[i + 1:]])
                occ = Occurrence(i, text, i + 1 if len(taken) == 1 else None, False)
                value = " ".join(taken) if taken else None
                i += 1 + len(taken)
            parsed.occurrences.setdefault(canon, []).append(occ)
            parsed.flags[canon] = value
        else:
            parsed.positionals.append(text)
            i += 1


def parse_flag_list(args: Sequence[str], grammar: Grammar, what: str = "extra arg") -> list[tuple[str, str, str | None]]:
    """`["--max-model-len", "4096", "--enforce-eager"]` -> [(canonical, as written, value), ...].

    A positional token is an error: in a flag list it would be read as the model or silently dropped.
    """
    out: list[tuple[str, str, str | None]] = []
    i = 0
    while i < len(args):
        text = args[i]
        if not is_flag(text):
            raise ValueError(f"{what} {text!r} at position {i} is not a flag (expected --name [value])")
        canon = grammar.canonical(text)
        if "=" in text:
            out.append((canon, text.partition("=")[0], text.partition("=")[2]))
            i += 1
        else:
            taken = _values(grammar.arity(canon), list(args[i + 1:]))
            out.append((canon, text, " ".join(taken) if taken else None))
            i += 1 + len(taken)
    return out


def _values(arity: Arity, rest: list[str]) -> list[str]:
    """The words after a flag that are its value(s)."""
    if arity == 0:
        return []
    if arity == "+":
        taken = []
        for word in rest:
            if is_flag(word):
                break
            taken.append(word)
        return taken
    # 1 or "?": one word unless the next is a flag (argparse reads `--flag --other` the same way)
    return rest[:1] if rest and not is_flag(rest[0]) else []


def rewrite(parsed: CommandLine, container: Mapping[str, Any], flags: Mapping[str, str | None]) -> dict[str, Any]:
    """A copy of the container with `flags` (canonical -> value; None: a boolean switch) set.

    Flags already present get their value replaced in place (all occurrences, keeping spelling and
    `=` form); missing ones are appended after the engine's argv. Every other word stays as it was.
    """
    texts, appended = _rewritten_words(parsed, flags)
    if parsed.shell_where is not None:
        return _rewrite_script(parsed, container, texts, appended, parsed.shell_where)
    new = copy.deepcopy(dict(container))
    command = [str(x) for x in container.get("command") or []]
    args = [str(x) for x in container.get("args") or []]
    for i, word in enumerate(parsed.words):
        if texts[i] != word.text:
            (command if word.where == "command" else args)[word.index] = texts[i]
    if command:
        new["command"] = command
    if appended or args or "args" in new:
        new["args"] = args + appended  # appended after everything: the engine's argv ends the command line
    return new


def _rewritten_words(parsed: CommandLine, flags: Mapping[str, str | None]) -> tuple[dict[int, str], list[str]]:
    """(each word's new text by its position, the words to append for flags not on the command line)."""
    texts = {i: w.text for i, w in enumerate(parsed.words)}
    appended: list[str] = []
    for flag, value in flags.items():
        occurrences = parsed.occurrences.get(flag)
        if not occurrences:
            appended += [f"--{flag}"] + ([] if value is None else [value])
            continue
        if value is None:
            continue  # a boolean switch that is already there
        for occ in occurrences:
            if occ.joined:
                texts[occ.name_word] = f"{occ.spelled}={value}"
            elif occ.value_word is not None:
                texts[occ.value_word] = value
            else:
                raise ArgsError(parsed.container, f"flag {occ.spelled} has no value to replace with {value!r}")
    return texts, appended


def _rewrite_script(parsed: CommandLine, container: Mapping[str, Any], texts: dict[int, str], appended: list[str],
                    shell_where: tuple[str, int]) -> dict[str, Any]:
    """The container with its shell script's words replaced in their spans and the new flags appended."""
    new = copy.deepcopy(dict(container))
    script = parsed.script
    for i in sorted(texts, reverse=True):  # splice from the end so earlier spans stay valid
        word = parsed.words[i]
        if texts[i] != word.text:
            script = script[: word.start] + shlex.quote(texts[i]) + script[word.end :]
    if appended:
        stripped = script.rstrip()
        script = stripped + " " + shlex.join(appended) + script[len(stripped):]
    where, index = shell_where
    new[where] = list(new[where])
    new[where][index] = script
    return new
