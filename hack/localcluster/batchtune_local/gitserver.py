"""A real Git server on loopback: Git's own smart-HTTP `git http-backend` behind a small HTTP server.

Git's CGI program does all of the protocol (upload-pack for fetches, receive-pack for pushes); this
module only speaks HTTP to it: it checks HTTP basic credentials when given some (so a client's
credentials are really exercised), passes the request to `git http-backend` as CGI, and streams its
answer back. Repositories are bare, under one root directory.

    with GitServer(tmp_path, credentials=("batchtune", "s3cret")) as server:
        server.create("org/deploy", {"apps/llm/deployment.yaml": "..."})
        url = server.url("org/deploy")            # http://127.0.0.1:PORT/org/deploy.git
        server.log("org/deploy", "batchtune/...")  # `git log` of a branch

    python -m batchtune_local.gitserver --root DIR [--user U --token T]   # by hand
"""

from __future__ import annotations

import argparse
import base64
import hmac
import os
import shutil
import subprocess
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

GIT = shutil.which("git") or "/usr/bin/git"
HTTP_BACKEND = os.environ.get("BATCHTUNE_GIT_HTTP_BACKEND", "/usr/lib/git-core/git-http-backend")


def _git(*args: str, cwd: Path | None = None, env: Mapping[str, str] | None = None) -> str:
    full = {"GIT_CONFIG_NOSYSTEM": "1", "HOME": str(cwd or "/tmp"), "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "GIT_AUTHOR_NAME": "test", "GIT_AUTHOR_EMAIL": "test@example.com",
            "GIT_COMMITTER_NAME": "test", "GIT_COMMITTER_EMAIL": "test@example.com", **(env or {})}
    return subprocess.run([GIT, *args], cwd=cwd, env=full, capture_output=True, text=True, check=True,
                          timeout=60).stdout


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  # the base class's name
        self.server.requests.append(f"{self.command} {self.path.split('?')[0]}")

    def _authorised(self) -> str | None:
        creds = self.server.credentials
        if creds is None:
            return "anonymous"
        header = self.headers.get("Authorization", "")
        if header.startswith("Basic "):
            try:
                user, _, token = base64.b64decode(header[6:]).decode().partition(":")
            except ValueError:
                return None
            if hmac.compare_digest(user, creds[0]) and hmac.compare_digest(token, creds[1]):
                return user
        return None

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _serve(self) -> None:
        body = self._body()
        user = self._authorised()
        if user is None:
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="git"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path, _, query = self.path.partition("?")
        env = {"GIT_PROJECT_ROOT": str(self.server.root), "GIT_HTTP_EXPORT_ALL": "1", "PATH_INFO": path,
               "QUERY_STRING": query, "REQUEST_METHOD": self.command, "REMOTE_USER": user,
               "REMOTE_ADDR": self.client_address[0], "CONTENT_TYPE": self.headers.get("Content-Type", ""),
               "CONTENT_LENGTH": str(len(body)), "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(self.server.root),
               "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
        for header, var in (("Content-Encoding", "HTTP_CONTENT_ENCODING"), ("Git-Protocol", "GIT_PROTOCOL")):
            if self.headers.get(header):
                env[var] = self.headers[header]
        out = subprocess.run([HTTP_BACKEND], input=body, env=env, capture_output=True, timeout=60).stdout
        head, _, payload = out.partition(b"\r\n\r\n")
        if not _:
            head, _, payload = out.partition(b"\n\n")
        status = 200
        headers: list[tuple[str, str]] = []
        for line in head.decode("latin-1").splitlines():
            name, _, value = line.partition(":")
            if name.lower() == "status":
                status = int(value.strip().split()[0])
            elif name:
                headers.append((name, value.strip()))
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = _serve
    do_POST = _serve


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, root: Path, credentials: tuple[str, str] | None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.root, self.credentials = root, credentials
        self.requests: list[str] = []


class GitServer:
    """Bare repositories under `root`, served over smart HTTP on 127.0.0.1 (a free port)."""

    def __init__(self, root: Path, credentials: tuple[str, str] | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._server = _Server(self.root, credentials)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> GitServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/"

    @property
    def requests(self) -> list[str]:
        return self._server.requests

    def url(self, repo: str) -> str:
        return f"{self.base_url}{repo}.git"

    def bare(self, repo: str) -> Path:
        return self.root / f"{repo}.git"

    def create(self, repo: str, files: Mapping[str, str], branch: str = "main") -> str:
        """A bare repository whose `branch` holds `files` in one commit; returns the commit."""
        bare = self.bare(repo)
        bare.parent.mkdir(parents=True, exist_ok=True)
        _git("init", "-q", "--bare", f"--initial-branch={branch}", str(bare))
        _git("config", "http.receivepack", "true", cwd=bare)
        return self.commit(repo, files, f"initial {repo}", branch)

    def commit(self, repo: str, files: Mapping[str, str | None], message: str, branch: str = "main") -> str:
        """A commit on `branch` writing (or, for None, deleting) `files`, as a user would push it."""
        work = self.root / ".work" / repo
        if work.exists():
            shutil.rmtree(work)
        work.parent.mkdir(parents=True, exist_ok=True)
        bare = self.bare(repo)
        heads = _git("for-each-ref", "--format=%(refname:short)", "refs/heads", cwd=bare).split()
        if branch in heads:
            _git("clone", "-q", "--branch", branch, str(bare), str(work))
        else:
            _git("init", "-q", f"--initial-branch={branch}", str(work))
        for path, text in files.items():
            target = work / path
            if text is None:
                target.unlink()
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        _git("add", "-A", cwd=work)
        _git("commit", "-q", "-m", message, cwd=work)
        _git("push", "-q", str(bare), f"HEAD:refs/heads/{branch}", cwd=work)
        sha = _git("rev-parse", "HEAD", cwd=work).strip()
        shutil.rmtree(work)
        return sha

    def merge(self, repo: str, branch: str, into: str = "main") -> str:
        """Merge `branch` into `into` (a fast-forward when possible), as a reviewer pressing merge would."""
        work = self.root / ".work" / f"{repo}-merge"
        if work.exists():
            shutil.rmtree(work)
        _git("clone", "-q", "--branch", into, str(self.bare(repo)), str(work))
        _git("fetch", "-q", "origin", f"refs/heads/{branch}:refs/remotes/origin/{branch}", cwd=work)
        _git("merge", "-q", "--no-edit", f"origin/{branch}", cwd=work)
        _git("push", "-q", "origin", f"HEAD:refs/heads/{into}", cwd=work)
        sha = _git("rev-parse", "HEAD", cwd=work).strip()
        shutil.rmtree(work)
        return sha

    def branches(self, repo: str) -> dict[str, str]:
        out = _git("for-each-ref", "--format=%(refname:short) %(objectname)", "refs/heads", cwd=self.bare(repo))
        return dict(line.split(" ", 1) for line in out.splitlines() if line)

    def show(self, repo: str, ref: str, path: str) -> str:
        return _git("show", f"{ref}:{path}", cwd=self.bare(repo))

    def message(self, repo: str, ref: str) -> str:
        return _git("log", "-1", "--format=%B", ref, cwd=self.bare(repo))

    def diff(self, repo: str, base: str, ref: str) -> str:
        return _git("diff", f"{base}...{ref}", cwd=self.bare(repo))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--user")
    parser.add_argument("--token")
    args = parser.parse_args()
    creds = (args.user, args.token) if args.user and args.token else None
    server = GitServer(args.root, creds)
    print(f"serving {args.root} at {server.base_url}", flush=True)
    server._server.serve_forever()


if __name__ == "__main__":
    main()
