"""The Git port's failure, apart from the client that raises it (`controller.gitremote`, which loads dulwich):
the reconcile loop catches it on every PullRequest tick, and an operator that never opens a pull request
never loads dulwich (~3 MB of RSS)."""

from __future__ import annotations


class GitError(Exception):
    """The repository could not be read or written (the message carries no credentials)."""
