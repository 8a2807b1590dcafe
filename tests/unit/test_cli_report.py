"""`batchtune report`: files from the report ConfigMap the BatchTuning controls, or drawn from status while it is
missing or someone else's; report.html always rendered from status."""

from __future__ import annotations

import base64
import csv
import io
import json

import cli_fakes
import pytest

from batchtune.cli import main
from batchtune.cli import report as rp
from batchtune.client import StoredReport

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
UID = "u-1"  # cli_fakes.succeeded()'s uid


def owned(files: dict[str, bytes]) -> StoredReport:
    """The ConfigMap as the operator writes it: controlled by the BatchTuning."""
    return StoredReport(files, (("BatchTuning", UID),))


@pytest.fixture
def api():
    fake = cli_fakes.FakeApi()
    yield fake
    fake.close()


def test_stored_files_are_used_as_they_are():
    stored = {"curves.png": PNG_MAGIC + b"stored", "trials.csv": b"a\n", "trials.json": b"{}", "extra": b"x"}
    files, source = rp.report_files(cli_fakes.succeeded(), owned(stored))
    assert files == {k: stored[k] for k in rp.REPORT_FILES}
    assert source == "from ConfigMap llama-8b-report"


def test_without_a_configmap_everything_is_drawn_from_status():
    files, source = rp.report_files(cli_fakes.succeeded(), None)
    assert "drawn from the BatchTuning's status" in source
    assert files["curves.png"].startswith(PNG_MAGIC)
    rows = list(csv.DictReader(io.StringIO(files["trials.csv"].decode())))
    assert [r["maxNumSeqs"] for r in rows] == ["16", "32", "64", "128", "256", "512"]
    assert rows[3]["outputThroughput"] == "2810.2" and rows[5]["state"] == "Infeasible"
    summary = json.loads(files["trials.json"])["summary"]
    assert summary["bestTrial"] == "llama-8b-trial-3" and summary["knee"]["maxNumSeqs"] == 128


def test_a_partial_configmap_is_completed_from_status():
    files, source = rp.report_files(cli_fakes.succeeded(), owned({"trials.csv": b"stored\n"}))
    assert files["trials.csv"] == b"stored\n"
    assert files["curves.png"].startswith(PNG_MAGIC)
    assert "curves.png, trials.json drawn from status" in source


def test_report_of_a_tuning_without_trials_still_writes_files(tmp_path):
    files, _ = rp.report_files(cli_fakes.fresh(), None)
    assert files["trials.csv"].decode().startswith("name,maxNumSeqs")
    paths = rp.write_files(tmp_path / "new" / "dir", files)
    assert [p.name for p in paths] == list(rp.REPORT_FILES)


def test_report_command_writes_the_configmap_files_and_prints_the_paths(api, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "220")
    api.add_batchtuning(cli_fakes.succeeded())
    png = PNG_MAGIC + bytes(range(256))  # binary that is not UTF-8
    api.add_report("inference", "llama-8b", {"trials.csv": "name\nx\n", "trials.json": "{}"}, {"curves.png": png},
                   owner_uid=UID)
    kubeconfig = api.kubeconfig(tmp_path / "kc", namespace="inference")
    out_dir = tmp_path / "out"
    assert main(["report", "llama-8b", "--kubeconfig", str(kubeconfig), "--out", str(out_dir)]) == 0
    assert (out_dir / "curves.png").read_bytes() == png
    assert (out_dir / "trials.csv").read_text() == "name\nx\n"
    out = capsys.readouterr().out
    assert "★ best" in out and "Decision: max-num-seqs 128" in out
    assert str(out_dir / "curves.png") in out and "from ConfigMap llama-8b-report" in out


def test_a_long_output_path_is_printed_on_one_line(api, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    api.add_batchtuning(cli_fakes.succeeded())
    kubeconfig = api.kubeconfig(tmp_path / "kc", namespace="inference")
    out_dir = tmp_path / ("deep-" * 20)  # longer than the terminal is wide
    assert main(["report", "llama-8b", "--kubeconfig", str(kubeconfig), "--out", str(out_dir)]) == 0
    assert str(out_dir / "trials.csv") in capsys.readouterr().out


def test_report_default_folder_is_named_after_the_tuning(api, tmp_path, monkeypatch, capsys):
    api.add_batchtuning(cli_fakes.succeeded())
    kubeconfig = api.kubeconfig(tmp_path / "kc", namespace="inference")
    monkeypatch.chdir(tmp_path)
    assert main(["report", "llama-8b", "--kubeconfig", str(kubeconfig)]) == 0
    assert (tmp_path / "llama-8b-report" / "curves.png").read_bytes().startswith(PNG_MAGIC)


def test_report_unwritable_folder(api, tmp_path, capsys):
    api.add_batchtuning(cli_fakes.succeeded())
    blocker = tmp_path / "file"
    blocker.write_text("")
    kubeconfig = api.kubeconfig(tmp_path / "kc", namespace="inference")
    assert main(["report", "llama-8b", "--kubeconfig", str(kubeconfig), "--out", str(blocker / "sub")]) == 1
    assert "cannot write the report into" in capsys.readouterr().err


def test_report_unknown_name(api, tmp_path, capsys):
    api.add_batchtuning(cli_fakes.succeeded())
    kubeconfig = api.kubeconfig(tmp_path / "kc", namespace="inference")
    assert main(["report", "nope", "--kubeconfig", str(kubeconfig), "--out", str(tmp_path / "o")]) == 1
    assert 'BatchTuning "nope" not found' in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_html_is_written_on_request_from_the_configmap_or_drawn_from_status(api, tmp_path, capsys):
    api.add_batchtuning(cli_fakes.succeeded())
    kubeconfig = api.kubeconfig(tmp_path / "kc", namespace="inference")
    assert main(["report", "llama-8b", "--kubeconfig", str(kubeconfig), "--out", str(tmp_path / "a")]) == 0
    assert not (tmp_path / "a" / "report.html").exists()  # only with --html
    assert main(["report", "llama-8b", "--kubeconfig", str(kubeconfig), "--out", str(tmp_path / "b"), "--html"]) == 0
    page = (tmp_path / "b" / "report.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and "data:image/png;base64," in page
    assert "highest output throughput meeting p95 ITL 50 ms" in page and "llama-8b-trial-5" in page
    assert "holds no common curve load" in page  # this canned status predates common-load steps
    assert str(tmp_path / "b" / "report.html") in capsys.readouterr().out
    # report.html is never copied, even from the operator's own ConfigMap: anyone who may update ConfigMaps in
    # the namespace can edit it and keep its ownerReference.
    api.add_report("inference", "llama-8b", {"trials.csv": "n\n", "trials.json": "{}", "report.html": "<p>stored</p>"},
                   {"curves.png": PNG_MAGIC}, owner_uid=UID)
    assert main(["report", "llama-8b", "--kubeconfig", str(kubeconfig), "--out", str(tmp_path / "c"), "--html"]) == 0
    page = (tmp_path / "c" / "report.html").read_text()
    assert "<p>stored</p>" not in page and page.startswith("<!DOCTYPE html>") and "llama-8b-trial-5" in page
    assert (tmp_path / "c" / "trials.csv").read_text() == "n\n"  # the owned ConfigMap's other files are used


PLANTED = "<script>alert(1)</script>"


@pytest.mark.parametrize("owner", [
    pytest.param(None, id="no-owner"),
    pytest.param("u-other", id="another-batchtunings-uid"),
    pytest.param("not-controller", id="owner-but-not-controller"),
])
def test_a_report_configmap_this_batchtuning_does_not_control_is_not_copied(api, tmp_path, capsys, owner):
    api.add_batchtuning(cli_fakes.succeeded())
    api.add_report("inference", "llama-8b", {"trials.csv": PLANTED, "trials.json": PLANTED, "report.html": PLANTED},
                   {"curves.png": PNG_MAGIC + b"planted"}, owner_uid=owner if owner != "not-controller" else UID)
    if owner == "not-controller":
        route = api.routes["/api/v1/namespaces/inference/configmaps/llama-8b-report"][1]
        route["metadata"]["ownerReferences"][0]["controller"] = False
    kubeconfig = api.kubeconfig(tmp_path / "kc", namespace="inference")
    assert main(["report", "llama-8b", "--kubeconfig", str(kubeconfig), "--out", str(tmp_path / "o"), "--html"]) == 0
    for name in ("trials.csv", "trials.json", "report.html", "curves.png"):
        data = (tmp_path / "o" / name).read_bytes()
        assert b"planted" not in data and PLANTED.encode() not in data, name
    assert "llama-8b-trial-3" in (tmp_path / "o" / "trials.csv").read_text()
    out = " ".join(capsys.readouterr().out.split())
    assert "ConfigMap llama-8b-report was not used: this BatchTuning does not control it" in out


def test_html_drawn_from_status_uses_the_stored_curves():
    files, source = rp.report_files(cli_fakes.succeeded(), owned({"curves.png": PNG_MAGIC + b"stored"}), html=True)
    assert base64.b64encode(PNG_MAGIC + b"stored").decode() in files["report.html"].decode()
    assert "report.html" in source and "curves.png" not in source.split("drawn")[1]
