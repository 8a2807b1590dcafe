"""What the CLI prints from files and cluster objects, made safe for a terminal and for rich.

A BatchTuning's name, its condition messages, trial reasons (engine log excerpts) and recommendation
text come from the cluster, where anyone who may write the object (or the engine whose log was
quoted) chose them. Printed raw, `\\x1b]0;...\\x07` retitles the terminal, `\\x1b[2J` clears it, `\\r`
overwrites a line, and `[red]` or `:smile:` is rich markup. Everything printed from such a value goes
through `printable` (batchtune.api.errors: control characters as visible escapes) and reaches rich as
a `Text` (never parsed for markup or emoji) or through `rich.markup.escape`.
"""

from __future__ import annotations

from typing import Any

from batchtune.api.errors import printable

__all__ = ["clean", "markup", "printable", "safe", "text"]


def safe(value: Any, multiline: bool = False) -> str:
    """`value` as a string with control characters escaped; newline and tab kept only when `multiline`."""
    return printable("" if value is None else value, multiline)


def markup(value: Any, multiline: bool = False) -> str:
    """`safe(value)` escaped for rich markup, for a value placed inside a markup string."""
    from rich.markup import escape

    return escape(safe(value, multiline))


def text(value: Any, style: str = "", multiline: bool = False) -> Any:
    """`safe(value)` as a rich Text: rendered as is, never as markup or emoji codes."""
    from rich.text import Text

    return Text(safe(value, multiline), style=style)


def clean(obj: Any, multiline: bool = True) -> Any:
    """A copy of a JSON-like object with every string (keys too) passed through `safe`."""
    if isinstance(obj, str):
        return safe(obj, multiline)
    if isinstance(obj, dict):
        return {clean(k, multiline) if isinstance(k, str) else k: clean(v, multiline) for k, v in obj.items()}
    if isinstance(obj, list):
        return [clean(v, multiline) for v in obj]
    return obj
