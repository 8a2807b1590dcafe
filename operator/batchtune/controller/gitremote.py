"""A Git repository over smart HTTP (dulwich, pure Python: the image has no git binary).

One operation per decision: fetch the base branch's tip (depth 1, into memory), read the files the
layout needs, write the edited ones as a commit on top of it, and push that commit to the decision's
branch. Pushing is idempotent: a branch that already holds a commit with the same tree on the same
base is left as it is; otherwise the branch (batchtune's own, under its prefix) is force-updated.

Credentials are HTTP basic (a username and a token), passed to the client, never put into a URL, a log
line or an exception message (`scrub` takes the token out of any text that leaves this module).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import urllib3
from dulwich.client import HttpGitClient, HTTPProxyUnauthorized, HTTPUnauthorized
from dulwich.config import ConfigDict
from dulwich.errors import GitProtocolError, HangupException, NotGitRepository
from dulwich.object_store import commit_tree_changes
from dulwich.objects import Blob, Commit
from dulwich.repo import MemoryRepo

from batchtune.controller.giterrors import GitError

AUTHOR = b"batchtune <batchtune@users.noreply.batchtune.io>"
FILE_MODE = 0o100644
TIMEOUT_SECONDS = 30.0
_ERRORS = (GitProtocolError, HangupException, NotGitRepository, HTTPUnauthorized, HTTPProxyUnauthorized, OSError,
           urllib3.exceptions.HTTPError)


@dataclass(frozen=True)
class Credentials:
    username: str
    token: str = field(repr=False)


@dataclass(frozen=True)
class Pushed:
    branch: str
    commit: str
    base: str
    """The base branch's commit the change was made on."""
    changed: bool
    """False: the repository's base branch already holds the setting (nothing was pushed)."""
    updated: bool = True
    """False: the branch already held this very change (nothing was pushed again)."""


def scrub(text: str, credentials: Credentials | None) -> str:
    if credentials and credentials.token:
        text = text.replace(credentials.token, "***")
    return text


class GitRemote:
    """One repository URL with its credentials."""

    def __init__(self, url: str, credentials: Credentials | None = None, timeout: float = TIMEOUT_SECONDS) -> None:
        parts = urlsplit(url)
        self.url, self.credentials = url, credentials
        self._path = parts.path or "/"
        self._client: Any = HttpGitClient(f"{parts.scheme}://{parts.netloc}/", config=ConfigDict(), timeout=timeout, quiet=True,
                                     username=credentials.username if credentials else None,
                                     password=credentials.token if credentials else None)

    def _fail(self, what: str, exc: BaseException) -> GitError:
        return GitError(scrub(f"{what} {self.url}: {type(exc).__name__}: {exc}", self.credentials))

    def refs(self) -> dict[str, str]:
        """Branch name -> commit, for every branch."""
        try:
            result = self._client.get_refs(self._path.encode())
        except _ERRORS as exc:
            raise self._fail("listing the branches of", exc) from None
        refs = getattr(result, "refs", result)
        return {k.decode()[len("refs/heads/"):]: v.decode() for k, v in refs.items()
                if k.startswith(b"refs/heads/") and v}

    def _fetch(self, branch: str) -> tuple[Any, bytes]:
        repo: Any = MemoryRepo()
        ref = f"refs/heads/{branch}".encode()

        def wants(refs: Mapping[bytes, bytes], depth: int | None = None) -> list[bytes]:
            if ref not in refs:
                raise GitError(f"{self.url} has no branch {branch!r} (spec.apply.git.branch)")
            return [refs[ref]]

        try:
            result = self._client.fetch(self._path.encode(), repo, determine_wants=wants, depth=1)
        except GitError:
            raise
        except _ERRORS as exc:
            raise self._fail("fetching", exc) from None
        return repo, result.refs[ref]

    def read(self, branch: str, paths: Sequence[str]) -> tuple[str, dict[str, str | None]]:
        """The branch's tip and the text of each path there (None: no such file)."""
        repo, tip = self._fetch(branch)
        return tip.decode(), self._files(repo, repo[tip].tree, paths)

    @staticmethod
    def _files(repo: Any, tree_id: bytes, paths: Sequence[str]) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for path in paths:
            try:
                _, sha = repo[tree_id].lookup_path(repo.object_store.__getitem__, path.encode())
                blob = repo[sha]
                out[path] = blob.data.decode("utf-8") if isinstance(blob, Blob) else None
            except KeyError:
                out[path] = None
        return out

    def propose(self, base_branch: str, branch: str, paths: Sequence[str],
                edit: Callable[[Mapping[str, str | None]], Mapping[str, str]], message: str,
                now: float | None = None) -> Pushed:
        """Commit `edit(files)` on the tip of `base_branch` and push it to `branch`."""
        repo, tip = self._fetch(base_branch)
        base_tree = repo[tip].tree
        files = self._files(repo, base_tree, paths)
        changes = edit(files)
        if not changes:
            return Pushed(branch, tip.decode(), tip.decode(), changed=False, updated=False)
        blobs = []
        for path, text in sorted(changes.items()):
            blob = Blob.from_string(text.encode("utf-8"))
            repo.object_store.add_object(blob)
            blobs.append((path.encode(), FILE_MODE, blob.id))
        tree: Any = commit_tree_changes(repo.object_store, repo[base_tree], blobs)
        existing = self.refs().get(branch)
        if existing:
            same = self._same_change(branch, existing, tip, tree)
            if same:
                return Pushed(branch, existing, tip.decode(), changed=True, updated=False)
        commit: Any = Commit()
        commit.tree, commit.parents = tree, [tip]
        commit.author = commit.committer = AUTHOR
        stamp = int(time.time() if now is None else now)
        commit.author_time = commit.commit_time = stamp
        commit.author_timezone = commit.commit_timezone = 0
        commit.encoding = b"UTF-8"
        commit.message = message.encode("utf-8")
        repo.object_store.add_object(commit)
        ref = f"refs/heads/{branch}".encode()
        try:
            result = self._client.send_pack(self._path.encode(), lambda refs: {**refs, ref: commit.id},
                                            generate_pack_data=repo.generate_pack_data)
        except _ERRORS as exc:
            raise self._fail("pushing to", exc) from None
        errors = {k.decode(): v for k, v in (getattr(result, "ref_status", None) or {}).items() if v}
        if errors:
            raise GitError(scrub(f"{self.url} refused the push of {branch}: {errors}", self.credentials))
        return Pushed(branch, commit.id.decode(), tip.decode(), changed=True)

    def _same_change(self, branch: str, head: str, base: bytes, tree: bytes) -> bool:
        """Whether `branch` already holds one commit with `tree` on top of `base`."""
        repo: Any = MemoryRepo()
        try:
            self._client.fetch(self._path.encode(), repo,
                               determine_wants=lambda refs, depth=None: [refs[f"refs/heads/{branch}".encode()]],
                               depth=1)
        except (*_ERRORS, KeyError):
            return False
        commit = repo[head.encode()]
        return isinstance(commit, Commit) and commit.tree == tree and list(commit.parents) == [base]

    def delete(self, branch: str) -> None:
        """Delete `branch` (no error when it is gone already)."""
        ref = f"refs/heads/{branch}".encode()
        if branch not in self.refs():
            return
        zero = b"0" * 40
        try:
            self._client.send_pack(self._path.encode(), lambda refs: {**refs, ref: zero},
                                   generate_pack_data=lambda *a, **k: (0, iter([])))
        except _ERRORS as exc:
            raise self._fail("deleting a branch of", exc) from None

    def contains(self, branch: str, paths: Sequence[str], want: Mapping[str, str]) -> bool:
        """Whether `branch`'s tip holds each of `want` (path -> text)."""
        _, files = self.read(branch, paths)
        return all(files.get(p) == text for p, text in want.items())

