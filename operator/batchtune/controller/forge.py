"""Pull/merge requests through a forge's REST API: GitHub, Gitea (and Forgejo, which keeps Gitea's API), GitLab.

Each call is idempotent where the loop needs it to be: `open` first looks for an open request from
the same head branch and returns it. The token goes in a request header only; errors carry the
status and the forge's message with the token taken out.

Endpoints (from each forge's REST reference):

| | open | find by head | read | close | comment |
|---|---|---|---|---|---|
| GitHub | POST /repos/{o}/{r}/pulls | GET .../pulls?state=open&head={o}:{branch} | GET .../pulls/{n} (merged) | PATCH .../pulls/{n} state=closed | POST .../issues/{n}/comments |
| Gitea | POST /repos/{o}/{r}/pulls | GET .../pulls?state=open (head.ref) | GET .../pulls/{n} (merged) | PATCH .../pulls/{n} state=closed | POST .../issues/{n}/comments |
| GitLab | POST /projects/{id}/merge_requests | GET ...?state=opened&source_branch= | GET .../merge_requests/{iid} (state merged) | PUT ... state_event=close | POST .../notes |
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit

from batchtune.core.gitwrite import ForgeType

TIMEOUT_SECONDS = 20.0


class ForgeError(Exception):
    """The forge refused or did not answer (the message carries no token)."""


@dataclass(frozen=True)
class PullRequest:
    number: int
    url: str
    state: str
    """open, closed or merged."""


def api_url(kind: ForgeType, repo_url: str) -> str:
    """The forge's API base for a repository URL (github.com -> api.github.com; others: /api/v1, /api/v4)."""
    parts = urlsplit(repo_url)
    root = f"{parts.scheme}://{parts.netloc}"
    if kind is ForgeType.GITHUB:
        return "https://api.github.com" if parts.hostname == "github.com" else root + "/api/v3"
    return root + ("/api/v4" if kind is ForgeType.GITLAB else "/api/v1")


def repo_path(repo_url: str) -> tuple[str, str]:
    """(owner or group path, repository name) from https://host/owner/name(.git)."""
    path = urlsplit(repo_url).path.strip("/").removesuffix(".git")
    owner, _, name = path.rpartition("/")
    if not owner or not name:
        raise ForgeError(f"{repo_url!r} does not name an owner and a repository")
    return owner, name


class Forge:
    def __init__(self, kind: ForgeType, api: str, repo_url: str, token: str, timeout: float = TIMEOUT_SECONDS) -> None:
        self.kind, self.api, self._token, self.timeout = kind, api.rstrip("/"), token, timeout
        self.owner, self.name = repo_path(repo_url)

    # ---- HTTP --------------------------------------------------------------------------------

    def _headers(self) -> dict[str, str]:
        if self.kind is ForgeType.GITLAB:
            return {"PRIVATE-TOKEN": self._token}
        if self.kind is ForgeType.GITHUB:
            return {"Authorization": f"Bearer {self._token}", "Accept": "application/vnd.github+json",
                    "X-GitHub-Api-Version": "2022-11-28"}
        return {"Authorization": f"token {self._token}"}

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.api + path, data=data, method=method,
                                     headers={"Content-Type": "application/json", "User-Agent": "batchtune",
                                              **self._headers()})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:  # noqa: S310  # URL checked by the install's policy
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode("utf-8", "replace")
            raise ForgeError(self._scrub(f"{self.kind.value} {method} {path}: HTTP {exc.code}: {detail}")) from None
        except (urllib.error.URLError, OSError) as exc:
            raise ForgeError(self._scrub(f"{self.kind.value} {method} {path}: {exc}")) from None
        return json.loads(raw) if raw else None

    def _scrub(self, text: str) -> str:
        return text.replace(self._token, "***") if self._token else text

    def _repo(self) -> str:
        if self.kind is ForgeType.GITLAB:
            return f"/projects/{quote(self.owner + '/' + self.name, safe='')}"
        return f"/repos/{quote(self.owner, safe='')}/{quote(self.name, safe='')}"

    # ---- requests ----------------------------------------------------------------------------

    def _pr(self, raw: dict[str, Any]) -> PullRequest:
        if self.kind is ForgeType.GITLAB:
            state = {"opened": "open", "merged": "merged"}.get(str(raw.get("state")), "closed")
            return PullRequest(int(raw["iid"]), str(raw.get("web_url", "")), state)
        state = "merged" if raw.get("merged") or raw.get("merged_at") else ("open" if raw.get("state") == "open" else "closed")
        return PullRequest(int(raw["number"]), str(raw.get("html_url", "")), state)

    def find_open(self, head: str) -> PullRequest | None:
        if self.kind is ForgeType.GITLAB:
            found = self._call("GET", f"{self._repo()}/merge_requests?state=opened&source_branch={quote(head, safe='')}")
        elif self.kind is ForgeType.GITHUB:
            found = self._call("GET", f"{self._repo()}/pulls?state=open&head={quote(self.owner + ':' + head, safe='')}")
        else:
            found = [p for p in self._call("GET", f"{self._repo()}/pulls?state=open&limit=50") or []
                     if (p.get("head") or {}).get("ref") == head]
        return self._pr(found[0]) if found else None

    def open(self, head: str, base: str, title: str, body: str) -> PullRequest:
        """The open request from `head` into `base`, created if there is none."""
        existing = self.find_open(head)
        if existing is not None:
            return existing
        if self.kind is ForgeType.GITLAB:
            raw = self._call("POST", f"{self._repo()}/merge_requests",
                             {"source_branch": head, "target_branch": base, "title": title, "description": body,
                              "remove_source_branch": True})
        else:
            raw = self._call("POST", f"{self._repo()}/pulls", {"head": head, "base": base, "title": title, "body": body})
        return self._pr(raw)

    def get(self, number: int) -> PullRequest:
        kind = "merge_requests" if self.kind is ForgeType.GITLAB else "pulls"
        return self._pr(self._call("GET", f"{self._repo()}/{kind}/{number}"))

    def comment(self, number: int, text: str) -> None:
        if self.kind is ForgeType.GITLAB:
            self._call("POST", f"{self._repo()}/merge_requests/{number}/notes", {"body": text})
        else:
            self._call("POST", f"{self._repo()}/issues/{number}/comments", {"body": text})

    def close(self, number: int, text: str) -> None:
        """Comment why, then close (a merged request is left alone)."""
        if self.get(number).state != "open":
            return
        self.comment(number, text)
        if self.kind is ForgeType.GITLAB:
            self._call("PUT", f"{self._repo()}/merge_requests/{number}", {"state_event": "close"})
        else:
            self._call("PATCH", f"{self._repo()}/pulls/{number}", {"state": "closed"})
