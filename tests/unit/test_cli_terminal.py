"""No terminal escape sequence and no rich markup from a file or a cluster object reaches the terminal.

A BatchTuning's name, condition messages, trial reasons and recommendation text come from whoever may
write the object (and from engine logs the operator quotes): `\\x1b]0;pwned\\x07` retitles the window,
`\\x1b[2J` clears the screen, `\\r` overwrites a line, `[bold red]x[/]` is rich markup. The CLI prints
them as visible escapes and literal text.
"""

from __future__ import annotations

import copy
import io
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import cli_fakes
import pytest
from rich.console import Console

from batchtune.api import FieldError, InvalidBatchTuning
from batchtune.cli import main
from batchtune.cli import status as st
from batchtune.cli.recommend import recommendation_text
from batchtune.terminal import clean, markup, printable, safe, text

NOW = datetime(2025, 1, 1, 11, 0, tzinfo=UTC)
TITLE = "\x1b]0;pwned\x07"
CLEAR = "\x1b[2J"
MARKUP = "[bold red]x[/]"
HOSTILE = f"a{TITLE}b{CLEAR}c\rd{MARKUP}e:thumbs_up:\x9b31m\u202egnp.exe\x7f"
SHOWN = "a\\x1b]0;pwned\\x07b\\x1b[2Jc\\rd[bold red]x[/]e:thumbs_up:\\x9b31m\\u202egnp.exe\\x7f"
FORBIDDEN = ("\x1b]", "\x1b[2J", "\x07", "\r", "\x9b", "\u202e", "\x7f", "👍")


@pytest.mark.parametrize("raw, shown", [
    pytest.param(HOSTILE, SHOWN, id="everything"),
    pytest.param("line\nbreak\ttab", "line\\nbreak\\ttab", id="newline-and-tab-on-one-line"),
    pytest.param("\x00\x1f\x80\x9f", "\\x00\\x1f\\x80\\x9f", id="c0-and-c1"),
    pytest.param("\ud800", "\\ud800", id="lone-surrogate-cannot-be-printed"),
    pytest.param("\u2028\u2066\u200f", "\\u2028\\u2066\\u200f", id="separators-and-bidi"),
    pytest.param("llama-8b ★ ◆ café 日本 👍", "llama-8b ★ ◆ café 日本 👍", id="printable-text-unchanged"),
    pytest.param(42, "42", id="not-a-string"),
])
def test_printable(raw: Any, shown: str) -> None:
    assert printable(raw) == shown
    assert printable(printable(raw)) == printable(raw)  # idempotent


def test_multiline_keeps_newline_and_tab_but_not_carriage_return() -> None:
    assert printable("a\nb\tc\rd\x1b[2J", multiline=True) == "a\nb\tc\\rd\\x1b[2J"


def test_markup_and_text_keep_markup_literal() -> None:
    console = Console(file=io.StringIO(), color_system=None, highlight=False, width=200)
    console.print(f"[bold]{markup(MARKUP)}[/]")
    console.print(text(MARKUP + " :thumbs_up:"))
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert out.count("[bold red]x[/]") == 2 and ":thumbs_up:" in out and "👍" not in out


def test_clean_escapes_keys_and_values_deeply_and_keeps_other_types() -> None:
    assert clean({"k\x1b": ["v\r", 1, None, {"x": True}]}) == {"k\\x1b": ["v\\r", 1, None, {"x": True}]}
    assert safe(None) == ""


def test_field_errors_escape_their_path_message_and_value() -> None:
    error = FieldError(f"spec.{CLEAR}", f"v{TITLE}", f"bad {TITLE}")
    shown = str(error)
    assert not any(f in shown for f in FORBIDDEN)
    assert shown.startswith("spec.\\x1b[2J: bad \\x1b]0;pwned\\x07 (got ")
    assert not any(f in str(InvalidBatchTuning([error], source=f"f{CLEAR}.yaml")) for f in FORBIDDEN)


def hostile() -> dict[str, Any]:
    """A finished tuning whose every printed string carries escapes and markup (every field the typed status model
    holds as text; `forged()` puts them in the typed fields too)."""
    bt = cli_fakes.succeeded()
    bt["metadata"]["name"] = "llama" + HOSTILE
    bt["metadata"]["namespace"] = "ns" + CLEAR
    bt["spec"]["targetRef"]["name"] = "t" + HOSTILE
    bt["spec"]["slo"]["percentile"] = "P95" + MARKUP
    status = bt["status"]
    status["bestSetting"] = "best" + HOSTILE
    status["bestTrial"] = "llama-8b-trial-3" + TITLE
    for cond in status["conditions"]:
        cond["message"] = "multi\nline " + HOSTILE
        cond["reason"] = "Verified" + MARKUP
        cond["type"] = cond["type"] + "\r"
    for trial in status["trials"]:
        trial["message"] = "engine log: \x1b[31mERROR\x1b[0m " + HOSTILE
        trial["verdictReason"] = "p95 " + HOSTILE
        trial["metrics"] = {"outputThroughput": "fast" + TITLE, "itlMs": 3.0}  # not a number: not shown
    status["pruned"][0]["message"] = "pruned " + HOSTILE
    status["knee"]["reason"] = "knee " + HOSTILE
    rec = status["recommendation"]
    rec["reason"] = "because\n" + HOSTILE
    rec["args"] = ["serve", "--model=" + HOSTILE, "--x\n--evil"]
    rec["kustomizePatch"] = "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: " + HOSTILE + "\n"
    rec["jsonPatch"] = json.dumps([{"op": "replace", "path": "/x", "value": HOSTILE}])
    return bt


# Status fields the model types as something other than text, each given a hostile string (a forged status).
FORGED = {
    "status.phase": ("Succeeded" + CLEAR, "Succeeded\\u001b[2J"),
    "status.conditions[0].lastTransitionTime": ("when" + TITLE, "when\\u001b]0;pwned\\u0007"),
    "status.trials[0].index": ("0" + TITLE, "0\\u001b]0;pwned\\u0007"),
    "status.trials[0].state": ("Done" + MARKUP, "Done[bold red]x[/]"),
    "status.trials[0].reason": ("OOMKilled" + TITLE, "OOMKilled\\u001b]0;pwned\\u0007"),
    "status.trials[0].setting.maxNumSeqs": ("16" + CLEAR, "16\\u001b[2J"),
    "status.applied.appliedAt": ("then" + CLEAR, "then\\u001b[2J"),
}


def forged() -> dict[str, Any]:
    """`hostile()` with a hostile string in every typed field of FORGED too."""
    bt = hostile()
    status = bt["status"]
    status["phase"] = FORGED["status.phase"][0]
    status["conditions"][0]["lastTransitionTime"] = FORGED["status.conditions[0].lastTransitionTime"][0]
    trial = status["trials"][0]
    trial["index"] = FORGED["status.trials[0].index"][0]
    trial["state"] = FORGED["status.trials[0].state"][0]
    trial["reason"] = FORGED["status.trials[0].reason"][0]
    trial["setting"]["maxNumSeqs"] = FORGED["status.trials[0].setting.maxNumSeqs"][0]
    status["applied"]["appliedAt"] = FORGED["status.applied.appliedAt"][0]
    return bt


def _terminal(renderable: Any) -> str:
    console = Console(file=io.StringIO(), force_terminal=True, color_system="truecolor", width=400)
    console.print(renderable)
    return console.file.getvalue()  # type: ignore[attr-defined]


def _assert_safe(out: str) -> None:
    bad = [f for f in FORBIDDEN if f in out]
    assert not bad, (bad, out)


def test_status_renders_every_hostile_string_as_visible_escapes_and_literal_markup() -> None:
    bt = hostile()
    original = copy.deepcopy(bt)
    out = _terminal(st.render_status(bt, NOW))
    _assert_safe(out)
    assert bt == original  # rendering does not change the object
    plain = Console(file=io.StringIO(), width=400, color_system=None)
    plain.print(st.render_status(bt, NOW))
    shown = plain.file.getvalue()  # type: ignore[attr-defined]
    assert "\x1b" not in shown
    # Succeeded\x1b[2J, OOMKilled\x1b]... and then\x1b[2J are in typed fields now: refused, named and shown
    # escaped by test_a_hostile_string_in_a_typed_field_is_refused_naming_the_field_safely.
    for needle in ("llama" + SHOWN, "t" + SHOWN, "ns\\x1b[2J", "Verified[bold red]x[/]", "\\r ",
                   "engine log: \\x1b[31mERROR\\x1b[0m", "because\n" + SHOWN, "--x\\n--evil", "knee " + SHOWN,
                   "pruned " + SHOWN, "best" + SHOWN, "llama-8b-trial-3\\x1b]0;pwned\\x07", "p95 " + SHOWN):
        assert needle in shown, needle
    table = Console(file=io.StringIO(), width=400, color_system=None)
    table.print(st.trials_table(bt))
    assert "ITL p95[bold red]x[/] ms" in table.file.getvalue()  # type: ignore[attr-defined]


@pytest.mark.parametrize("part", ["header", "trials_table", "trial_notes", "conditions_table", "decision"])
def test_every_render_function_is_safe_on_its_own(part: str) -> None:
    render = getattr(st, part)
    args = (hostile(), NOW) if part in ("header", "conditions_table") else (hostile(),)
    _assert_safe(_terminal(render(*args)))


def test_failed_tuning_message_is_safe() -> None:
    bt = cli_fakes.failed()
    bt["status"]["phase"] = "Failed"
    bt["status"]["conditions"][1]["message"] = HOSTILE
    out = _terminal(st.decision(bt))
    _assert_safe(out)
    assert SHOWN in out


@pytest.mark.parametrize("output", ["patch", "kustomize", "args"])
def test_recommendation_text_and_note_are_safe(output: str) -> None:
    patch, note = recommendation_text(hostile(), output)
    _assert_safe(patch + note)
    assert "\n" not in note
    if output == "args":
        assert patch.splitlines() == ["serve", "--model=" + SHOWN, "--x\\n--evil"]
    if output == "kustomize":
        assert patch.splitlines()[3] == "  name: " + SHOWN
    if output == "patch":
        assert json.loads(patch)[0]["value"] == HOSTILE  # JSON's own escapes are kept: the patch still applies


def test_a_patch_with_raw_control_characters_is_printed_escaped() -> None:
    bt = hostile()
    bt["status"]["recommendation"]["jsonPatch"] = '[{"value": "' + HOSTILE + '"}]\n'
    patch, _ = recommendation_text(bt, "patch")
    _assert_safe(patch)
    assert patch == '[{"value": "' + SHOWN + '"}]\n'


@pytest.fixture
def api():
    fake = cli_fakes.FakeApi()
    yield fake
    fake.close()


def _serve(api: cli_fakes.FakeApi, bt: dict[str, Any]) -> None:
    path = cli_fakes.BT_PATH.format(ns="inference")
    api.routes[path + "/llama-8b"] = (200, bt)
    api.routes[path] = (200, {"kind": "BatchTuningList", "items": [{"metadata": {"name": "llama-8b"}}]})


@pytest.mark.parametrize("argv", [
    pytest.param(["status", "llama-8b"], id="status"),
    pytest.param(["report", "llama-8b", "--out", "{tmp}/out"], id="report"),
    pytest.param(["recommend", "llama-8b", "-o", "kustomize"], id="recommend-kustomize"),
    pytest.param(["recommend", "llama-8b", "-o", "args"], id="recommend-args"),
    pytest.param(["recommend", "llama-8b", "-o", "patch"], id="recommend-patch"),
])
def test_commands_print_a_hostile_object_safely(api, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    monkeypatch.setenv("COLUMNS", "400")
    _serve(api, hostile())
    kubeconfig = api.kubeconfig(tmp_path / "kc", namespace="inference")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv + ["--kubeconfig", str(kubeconfig)]) == 0
    captured = capsys.readouterr()
    _assert_safe(captured.out + captured.err)
    assert "\x1b" not in captured.out + captured.err  # not a terminal: rich adds no styles either
    assert "[bold red]x[/]" in captured.out + captured.err


@pytest.mark.parametrize("argv", [
    pytest.param(["status", "llama-8b"], id="status"),
    pytest.param(["status", "llama-8b", "--watch", "--interval", "0"], id="status-watch"),
    pytest.param(["report", "llama-8b", "--out", "{tmp}/out", "--html"], id="report"),
    pytest.param(["recommend", "llama-8b", "-o", "patch"], id="recommend-patch"),
    pytest.param(["recommend", "llama-8b", "-o", "hpa"], id="recommend-hpa"),
])
def test_a_hostile_string_in_a_typed_field_is_refused_naming_the_field_safely(
        api, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    _serve(api, forged())
    kubeconfig = api.kubeconfig(tmp_path / "kc", namespace="inference")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(argv + ["--kubeconfig", str(kubeconfig)]) == 1
    captured = capsys.readouterr()
    _assert_safe(captured.out + captured.err)
    assert "Traceback" not in captured.err and not captured.out
    lines = captured.err.splitlines()
    for field, (_, shown) in FORGED.items():
        line = next((x for x in lines if f": {field}: " in x), None)
        assert line is not None, (field, lines)
        assert line.startswith("error: BatchTuning ns\\x1b[2J/llama" + SHOWN + ": ") and shown in line, line
    assert not (tmp_path / "out").exists()  # nothing written from a status that does not parse


def test_a_hostile_api_error_message_is_safe(api, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    api.routes[cli_fakes.BT_PATH.format(ns="inference") + "/llama-8b"] = cli_fakes.forbidden("no " + HOSTILE)
    kubeconfig = api.kubeconfig(tmp_path / "kc", namespace="inference")
    for command in ("status", "report", "recommend"):
        assert main([command, "llama-8b", "--kubeconfig", str(kubeconfig)]) == 1
        captured = capsys.readouterr()
        _assert_safe(captured.out + captured.err)


def test_a_watch_shows_a_hostile_outage_message_safely(monkeypatch: pytest.MonkeyPatch) -> None:
    from batchtune.client import ApiUnreachable

    sink = io.StringIO()
    monkeypatch.setattr(st, "console", lambda: Console(file=sink, width=300, force_terminal=True))
    final = hostile()
    final["status"]["phase"] = "Succeeded"
    sequence: list[Any] = [ApiUnreachable("down " + HOSTILE), final]

    def fetch() -> Any:
        item = sequence.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    running = hostile()
    running["status"]["phase"] = "Trialing"
    st.watch(fetch, running, interval=0)
    out = sink.getvalue()  # rich's live display moves the cursor itself (\r, \x1b[2K): only ours must not
    assert not [f for f in FORBIDDEN if f != "\r" and f in out]


def test_validate_prints_hostile_names_keys_and_file_names_safely(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "x\x1b[2J[bold red]y.yaml"
    path.write_text('apiVersion: batchtune.io/v1alpha1\nkind: BatchTuning\nmetadata: {name: "llama\\e]0;pwned\\a"}\n'
                    'spec:\n  "\\e[2J\\r": 1\n  targetRef: {name: "\\u202ex"}\n')
    assert main(["validate", "-f", str(path)]) == 1
    out = capsys.readouterr().out
    _assert_safe(out)
    assert "metadata.name: must be a DNS subdomain name" in out and '"llama\\u001b]0;pwned\\u0007"' in out
    assert "spec.\\x1b[2J\\r: unknown field" in out
    assert "x\\x1b[2J[bold red]y.yaml: " in out


def test_plan_prints_hostile_file_names_and_extra_args_safely(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "300")
    sample = (Path(__file__).resolve().parents[2] / "manifests" / "samples" / "batchtuning-minimal.yaml").read_text()
    good = tmp_path / "[bold red]x.yaml"
    good.write_text(sample)
    bad = tmp_path / "bad.yaml"
    bad.write_text(sample.replace("max: 256", 'max: 256\n    extraArgs: ["--dtype=auto\\e[2J"]'))
    assert main(["plan", "-f", str(good), "-f", str(bad)]) == 1
    captured = capsys.readouterr()
    _assert_safe(captured.out + captured.err)
    assert "[boldred]x.yaml:llama-8b" in "".join(captured.out.split())  # the table title wraps the long path
    assert "--dtype=auto\\u001b[2J" in captured.out  # the refusal quotes the value with the ESC made visible
