"""PullRequest mode: the decision goes to Git, production's change comes from Git, verify runs as in Auto.

Proposing: production's "before" window is checkpointed (as Auto does before its patch), then the
change is written in the user's layout (`core.gitwrite`) as one commit on the decision's own branch
(`controller.gitremote`), and a pull request is opened where a forge is configured
(`controller.forge`). A previous decision's branch that was never merged is superseded: its pull
request is closed with a comment naming the new one, and the branch deleted. Pushing and opening are
idempotent, so a crash between them and the status write only repeats them.

AwaitingMerge: the operator never writes to the Deployment. When production's engine container runs
exactly the proposed command line and has rolled out, that is the merged change arriving (by Argo CD,
Flux or whatever deploys the branch); `applied.appliedAt` records when it was seen and Verifying
judges it as in Auto. A regression cannot be rolled back by batchtune here (Git owns the Deployment):
the tuning fails with `Regression` and says which commit to revert.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from batchtune.api import PullRequestRecord
from batchtune.controller.forge import ForgeError, api_url
from batchtune.controller.giterrors import GitError
from batchtune.controller.ports import NotAllowed
from batchtune.controller.tick import Target, Tick
from batchtune.core import gitwrite
from batchtune.core.policy import git_url_problem
from batchtune.core.production import rollout_complete
from batchtune.core.recommend import ContainerArgs, kustomize_patch
from batchtune.core.settings import Setting
from batchtune.core.vocabulary import M, Phase, Reason, TrialState

FORGE_POLL_SECONDS = 30
"""How often an open pull request's state is asked of the forge while waiting."""


def connect(tick: Tick) -> tuple[Any, Any | None]:
    """The repository and the forge (None without spec.apply.git.forge); `NotAllowed` when the install refuses."""
    git = tick.spec.apply.git
    assert git is not None
    install = tick.ports.install
    problem = git_url_problem(git.url, install.git_urls)
    api = None
    if problem is None and git.forge is not None:
        api = git.forge.api_url or api_url(git.forge.type, git.url)
        problem = git_url_problem(api, install.git_urls, "spec.apply.git.forge.apiUrl")
    if problem:
        raise NotAllowed(problem)
    token = None
    if git.credentials_secret_ref is not None:
        ref = git.credentials_secret_ref
        token = tick.ports.cluster.secret_value(tick.tuning.namespace, ref.name, ref.key, label=install.git_secret_label,
                                                field="spec.apply.git.credentialsSecretRef")
    remote = tick.ports.git.remote(git.url, git.username, token)
    forge = None
    if git.forge is not None:
        if token is None:
            raise NotAllowed("spec.apply.git.forge needs spec.apply.git.credentialsSecretRef (the forge's API token)")
        assert api is not None
        forge = tick.ports.git.forge(git.forge.type.value, api, git.url, token)
    return remote, forge


def _margins(tick: Tick, metrics: dict[str, float | None]) -> list[str]:
    slo = tick.view.slo
    out = []
    for what, key, limit in (("TTFT", M.TTFT_MS, slo.ttft_ms), ("inter-token latency", M.ITL_MS, slo.itl_ms),
                             ("end-to-end latency", M.E2E_MS, slo.e2e_ms)):
        value = metrics.get(key)
        if limit and value is not None:
            out.append(f"{what} p{slo.percentile} {value:.0f} ms of {limit} ms ({100 * (limit - value) / limit:.0f}% "
                       "to spare)")
    errors = metrics.get(M.ERROR_RATE_PERCENT)
    if errors is not None:
        out.append(f"errors {errors:.2f}% of {slo.max_error_rate_percent}% allowed")
    capacity = metrics.get(M.SLO_CAPACITY)
    if capacity is not None:
        out.append(f"SLO capacity {capacity:.3g} requests/s per replica (with {slo.headroom_percent}% headroom under "
                   "the targets)")
    return out


def message(tick: Tick, target: Target) -> tuple[str, str]:
    """(pull request title, commit message): the decision and its evidence."""
    rec = tick.status.recommendation
    assert rec is not None
    label = tick.status.best_setting or rec.setting.summary()
    title = f"{target.name}: {label} (batchtune {tick.tuning.name})"
    rows: list[tuple[str, ...]] = [("trial", "setting", "state", "verdict", "SLO capacity req/s", "reason")]
    best: dict[str, float | None] = {}
    for t in tick.status.trials:
        capacity = (t.metrics or {}).get(M.SLO_CAPACITY)
        rows.append((t.name + (" (chosen)" if t.name == tick.status.best_trial else ""), t.setting.summary(),
                     t.state.value, t.verdict.value if t.verdict else "-",
                     f"{capacity:.3g}" if capacity is not None else "-", t.reason or ""))
        if t.name == tick.status.best_trial and t.state is TrialState.DONE:
            best = dict(t.metrics or {})
    notes = [f"BatchTuning: {tick.tuning.namespace}/{tick.tuning.name} (generation {tick.tuning.generation}, "
             f"round {tick.status.round or 1})",
             f"Deployment: {tick.tuning.namespace}/{target.name}, container {target.container.get('name')}",
             f"Command line: {' '.join(rec.args)}"]
    if rec.workload:
        notes.append(f"Workload: {rec.workload}")
    if rec.replicas_hint:
        notes.append(f"Replicas for the observed peak: {rec.replicas_hint} ({rec.replicas_basis})")
    notes.append(f"Report: ConfigMap {tick.tuning.namespace}/{tick.tuning.name}-report "
                 f"(`batchtune report {tick.tuning.name} -n {tick.tuning.namespace} --html`)")
    body = gitwrite.commit_message(title, f"Decision: {rec.reason}", rows, _margins(tick, best), notes)
    return title, body


def _target_for_git(tick: Tick, target: Target) -> gitwrite.Target:
    git = tick.spec.apply.git
    assert git is not None
    return gitwrite.Target(git.layout, git.path, target.name, str(target.container["name"]), git.values_key)


def propose(tick: Tick) -> None:
    assert tick.status.recommendation is not None
    target = tick.target()
    if target is None:
        return
    setting = tick.status.recommendation.setting.core()
    change = tick.args_change(target)
    if change is None:
        return
    current, desired = change
    if not tick.checkpointed(target, current, desired):
        return  # production's window and exact args before the change (what verify compares against) first
    remote, forge = connect(tick)
    title, body = message(tick, target)
    pushed = push(tick, target, remote, setting, desired, body)
    if pushed is None:
        return
    record, commit = pushed
    if forge is not None and not open_request(tick, forge, record, title, body):
        return
    previous = tick.status.pull_request
    if previous is not None and previous.branch != record.branch:
        supersede(tick, remote, forge, previous, record)
    tick.status.pull_request = record
    git = tick.spec.apply.git
    assert git is not None
    where_text = f"pull request #{record.number} ({record.url})" if record.number else f"branch {record.branch}"
    text = (f"Proposed {tick.status.best_setting} in {git.url}: {where_text}, commit {commit[:12]} on "
            f"{git.branch}; waiting for production to run it")
    tick.event(False, Reason.PULL_REQUEST_OPENED if record.number else Reason.BRANCH_PUSHED, text)
    tick.log.info("%s", text)
    tick.set_phase(Phase.AWAITING_MERGE, Reason.WAITING_FOR_MERGE, text)


def push(tick: Tick, target: Target, remote: Any, setting: Setting, desired: ContainerArgs,
         body: str) -> tuple[PullRequestRecord, str] | None:
    """The decision's commit on its own branch: (its record, the commit); None when this tick's step ends here (an
    edit that cannot be made, Git unreachable, or the base branch already holding the change)."""
    git = tick.spec.apply.git
    assert git is not None
    where = _target_for_git(tick, target)
    branch = gitwrite.branch_name(git.branch_prefix, tick.tuning.namespace, tick.tuning.name, tick.status.round or 1,
                                  tick.tuning.generation)

    def rewrite(container: Any) -> Any:
        return target.engine.rewrite(container, setting, tick.view.spec.extra_args)

    def edit(files: Any) -> dict[str, str]:
        patch = kustomize_patch(target.deployment, str(target.container["name"]), desired.to_wire())
        return gitwrite.change(where, files, rewrite, patch)

    try:
        pushed = remote.propose(git.branch, branch, gitwrite.files_to_read(where), edit, body,
                                now=tick.now.timestamp())
    except gitwrite.EditError as exc:
        tick.fail(Reason.GIT_EDIT_FAILED, f"spec.apply.git: {exc}")
        return None
    except GitError as exc:
        tick.waiting(Reason.GIT_UNAVAILABLE, f"Git: {exc}; retrying", warn=True)
        return None
    record = PullRequestRecord(branch=branch, repository=git.url, base=pushed.base, commit=pushed.commit,
                               generation=tick.tuning.generation, round=tick.status.round or 1,
                               files=sorted(edit_paths(where, target.name)))
    if not pushed.changed:
        record.commit = None
        tick.status.pull_request = record
        tick.set_phase(Phase.AWAITING_MERGE, Reason.WAITING_FOR_MERGE,
                       f"{git.url} {git.branch} already holds {tick.status.best_setting}; waiting for production to run it")
        return None
    return record, str(pushed.commit)


def open_request(tick: Tick, forge: Any, record: PullRequestRecord, title: str, body: str) -> bool:
    """Open the pull request for the pushed branch (idempotent at the forge); False: the next tick tries again."""
    git = tick.spec.apply.git
    assert git is not None
    try:
        pr = forge.open(record.branch, git.branch, title, body)
    except ForgeError as exc:
        tick.status.pull_request = record  # pushed: the next tick opens the request
        tick.waiting(Reason.GIT_UNAVAILABLE, f"Pushed {record.branch}; the forge did not open the pull request: {exc}",
                     warn=True)
        return False
    record.number, record.url, record.state, record.checked_at = pr.number, pr.url, "Open", tick.now
    return True


def edit_paths(where: gitwrite.Target, deployment: str) -> list[str]:
    if where.layout is gitwrite.Layout.KUSTOMIZE:
        kfile = gitwrite.files_to_read(where)[0]
        directory = kfile.rpartition("/")[0]
        name = gitwrite.patch_file_name(deployment)
        return [kfile, f"{directory}/{name}" if directory else name]
    return [where.path]


def supersede(tick: Tick, remote: Any, forge: Any | None, old: PullRequestRecord, new: PullRequestRecord) -> None:
    """Close the previous decision's pull request (naming the new one) and delete its branch, unless it merged."""
    by = f"#{new.number}" if new.number else f"branch {new.branch}"
    try:
        if forge is not None and old.number:
            state = forge.get(old.number).state
            if state == "merged":
                return
            forge.close(old.number, f"Superseded by {by}: a later batchtune decision for "
                                    f"{tick.tuning.namespace}/{tick.tuning.name}.")
        remote.delete(old.branch)
    except (ForgeError, GitError) as exc:
        tick.event(True, Reason.GIT_UNAVAILABLE, f"Could not supersede {old.branch}: {exc}")
        return
    tick.event(False, Reason.SUPERSEDED, f"{old.branch}" + (f" (#{old.number})" if old.number else "")
               + f" superseded by {by}")


def await_merge(tick: Tick) -> None:
    applied, record = tick.status.applied, tick.status.pull_request
    target = tick.target(applied.target if applied and applied.target else None)
    if target is None or applied is None or record is None:
        return
    current = ContainerArgs.of(target.container)
    desired = applied.new.core() if applied.new else None
    if current == desired:
        if not rollout_complete(target.deployment):
            tick.waiting(Reason.WAITING_FOR_ROLLOUT, f"Production runs the merged change; waiting for {target.name} "
                                                     "to roll out")
            return
        applied.applied_at = tick.now
        applied.rollout_completed_at = tick.now
        text = (f"Production runs {tick.status.best_setting} from Git ({record.branch}"
                + (f", #{record.number}" if record.number else "") + f"); verifying it for at least "
                f"{tick.spec.apply.verify_seconds}s")
        tick.event(False, Reason.MERGED_CHANGE_RUNNING, text)
        tick.set_phase(Phase.VERIFYING, Reason.MERGED_CHANGE_RUNNING, text)
        return
    if applied.previous is None or current != applied.previous.core():
        tick.target_changed(target)  # production moved to something else: the trials no longer hold
        return
    if record.number and (record.checked_at is None
                          or tick.now >= record.checked_at + timedelta(seconds=FORGE_POLL_SECONDS)):
        try:
            _, forge = connect(tick)
            state = forge.get(record.number).state if forge is not None else None
        except ForgeError as exc:
            tick.waiting(Reason.GIT_UNAVAILABLE, f"The forge did not say how #{record.number} stands: {exc}")
            return
        record.checked_at = tick.now
        if state is not None:
            record.state = state.capitalize()
        if state == "closed":
            text = (f"Pull request #{record.number} ({record.url}) was closed without merging; production keeps its "
                    "setting. The recommendation stays in status; change the spec to propose again")
            tick.set_phase(Phase.RECOMMENDED, Reason.PULL_REQUEST_CLOSED, text)
            tick.event(False, Reason.PULL_REQUEST_CLOSED, text)
            return
    state = f" (pull request #{record.number}: {record.state})" if record.number else ""
    tick.waiting(Reason.WAITING_FOR_MERGE, f"Waiting for production to run {tick.status.best_setting} from "
                                           f"{record.branch}{state}")
