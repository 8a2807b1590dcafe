"""Every reason batchtune writes has an entry in docs/troubleshooting.md, and the page names no other."""

from __future__ import annotations

import re
from pathlib import Path

from batchtune.core.vocabulary import Reason

PAGE = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"


def test_every_reason_is_documented():
    text = PAGE.read_text()
    missing = [r.value for r in Reason if f"`{r.value}`" not in text]
    assert missing == [], f"add these reasons to docs/troubleshooting.md: {missing}"


def test_the_page_documents_no_reason_that_does_not_exist():
    text = PAGE.read_text()
    rows = re.findall(r"^\| `([A-Z][A-Za-z]+)`(?:, `([A-Z][A-Za-z]+)`)? \|", text, flags=re.M)
    named = {name for row in rows for name in row if name}
    assert named - {r.value for r in Reason} == set()
