"""One trial's run loop, the same for the operator and the bench: the next load run, what a run's reading does to
its step, and when the trial concludes.

`core.protocol` makes the search's decisions (the next load, closing a step, the conclusion); this module is the
loop around them, one load run at a time. A step opens at the protocol's next load with its window (a bracketing
step's short one, grown where an earlier step of its kind had to be lengthened); it takes `repeats` runs (the curve
step one); a run with too few requests to judge is run again for longer instead of counting; once the search is
done, the curve step; then the conclusion. The state is the trial's steps (`Step`), as status holds them, and
nothing here does I/O or reads a clock.

The operator drives it one run per few reconcile ticks (`controller/trials.py`: each run a load Job, read from
Prometheus); the bench drives it in one go with a simulated world behind `World` (`run_trial`). So what the bench
measures is what the operator would, decision for decision (tests/unit/test_trial_equivalence.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Protocol

from batchtune.core import protocol
from batchtune.core.protocol import Conclusion, CurveLoad, Neighbour, ProtocolConfig, RunResult, StepResult
from batchtune.core.settings import Setting
from batchtune.core.vocabulary import M, StepPurpose, Verdict


@dataclass(frozen=True)
class Windows:
    """How long a trial's load runs measure."""

    measure_seconds: int
    """A full step's window (`spec.trial.measureSeconds`)."""
    bracket_seconds: int | None = None
    """A bracketing step's window; None: every step runs the full one."""
    counted: bool = False
    """Runs are counted, not timed (`spec.load.numPrompts`): none is lengthened."""


@dataclass(frozen=True)
class TrialPlan:
    """What one trial measures and how: everything the loop decides on besides the steps themselves."""

    setting: Setting
    config: ProtocolConfig
    windows: Windows
    neighbours: tuple[Neighbour, ...] = ()
    """Finished trials' capacities, where the search starts without a prediction."""
    curve: CurveLoad | None = None
    """The report's common load, measured once the search is done (None: no curve step)."""
    predicted: int | None = None
    """A twin's predicted capacity load for this setting, where the search starts."""


@dataclass(frozen=True)
class Step:
    """A load step of a trial: open (its runs so far) or closed (its result)."""

    load: int
    purpose: StepPurpose | None = None
    """None: a full-window step of the search."""
    seconds: int | None = None
    """Its window when it is not the full one: a bracketing step's, or one grown for too few requests."""
    lengthened: int = 0
    """Runs that finished too few requests and were run again for longer."""
    runs: tuple[RunResult, ...] = ()
    """The runs counted so far (an open step's; a closed step keeps only its result)."""
    result: StepResult | None = None
    """The closed step: the worst case over its runs, judged (a curve step given up: Unknown, no metrics)."""

    @property
    def closed(self) -> bool:
        return self.result is not None

    @property
    def curve(self) -> bool:
        return self.purpose is StepPurpose.CURVE

    @property
    def short(self) -> bool:
        return self.purpose is StepPurpose.BRACKET

    def window(self, windows: Windows) -> int | None:
        """Seconds its next run measures; None when runs are counted."""
        return None if windows.counted else (self.seconds or windows.measure_seconds)


@dataclass(frozen=True)
class Run:
    """The load run to start next."""

    step: int
    """Index of its step in the trial's steps."""
    load: int
    """Concurrent requests, requests per minute, or percent of a trace's speed (`ProtocolConfig.unit`)."""
    purpose: StepPurpose | None
    seconds: int | None
    """The window it measures; None: counted (spec.load.numPrompts)."""
    repeat: int
    """Which of its step's runs, from 0."""
    runs_before: int
    """Load runs already ended on the trial's server: the first one's warm-up also fills caches and compiles."""


class Recorded(StrEnum):
    """What a run's reading did to its step."""

    LENGTHENED = "Lengthened"
    """Too few requests to judge: the step runs again, longer."""
    REPEAT = "Repeat"
    """Counted; the step needs another run (spec.trial.repeats)."""
    CLOSED = "Closed"


@dataclass(frozen=True)
class Concluded:
    """The trial's conclusion, and which of its steps is its point on the report's curves."""

    conclusion: Conclusion
    curve_step: int | None


# ---- the loop's decisions ----------------------------------------------------------------------


def search_results(steps: Sequence[Step]) -> list[StepResult]:
    """The closed steps of the trial's own search, in order: all the protocol decides on (never the curve step)."""
    return [s.result for s in steps if s.result is not None and not s.curve]


def open_step(steps: Sequence[Step]) -> int | None:
    """Index of the step in progress, or None when every step is closed."""
    return next((i for i, s in enumerate(steps) if not s.closed), None)


def curve_done(steps: Sequence[Step]) -> bool:
    return any(s.curve and s.closed for s in steps)


def next_step(plan: TrialPlan, steps: Sequence[Step]) -> Step | None:
    """The step to open once every step is closed (the search's, then the curve step); None: conclude.

    A window that had to grow for an earlier search step of the same kind (short or full) is where the next one
    starts: lower loads finish fewer requests. The curve step starts at the full window (lengthened, as any run,
    if too few finish)."""
    upcoming = protocol.next_step(search_results(steps), plan.setting, plan.neighbours, plan.config, plan.curve,
                                  curve_done(steps), plan.predicted)
    if upcoming is None:
        return None
    if upcoming.curve:
        return Step(upcoming.load, StepPurpose.CURVE)
    grown = max((s.seconds for s in steps if s.lengthened and s.seconds and not s.curve and s.short == upcoming.short),
                default=None)
    short = plan.windows.bracket_seconds if upcoming.short else None
    if short is None:
        return Step(upcoming.load, seconds=grown)
    return Step(upcoming.load, StepPurpose.BRACKET, max(short, grown or 0))


def search_done(plan: TrialPlan, steps: Sequence[Step]) -> bool:
    """The search has measured all it needs; what is left, if anything, is the curve step."""
    if any(s.curve for s in steps):
        return True
    if not steps or open_step(steps) is not None:
        return False
    upcoming = next_step(plan, steps)
    return upcoming is not None and upcoming.curve


def run_of(plan: TrialPlan, steps: Sequence[Step], index: int) -> Run:
    """The next run of the open step `index`."""
    step = steps[index]
    before = sum(1 for i, s in enumerate(steps) if i != index and s.closed) + len(step.runs) + step.lengthened
    return Run(index, step.load, step.purpose, step.window(plan.windows), len(step.runs), before)


def record(plan: TrialPlan, steps: Sequence[Step], index: int, result: RunResult) -> tuple[tuple[Step, ...], Recorded]:
    """The trial's steps after a run of step `index` read `result`.

    A run with too few requests to judge (`protocol.longer_run`) does not count: its step runs again for longer.
    A step closes once it has its runs (`protocol.runs_needed`), the worst case over them judged."""
    step = steps[index]
    if not plan.windows.counted:
        seconds = step.seconds or plan.windows.measure_seconds
        longer = protocol.longer_run(result.metrics, seconds, plan.windows.measure_seconds, plan.config.slo)
        if longer is not None:
            return _put(steps, index, replace(step, seconds=longer, lengthened=step.lengthened + 1)), Recorded.LENGTHENED
    runs = (*step.runs, result)
    if len(runs) < protocol.runs_needed(step.curve, plan.config):
        return _put(steps, index, replace(step, runs=runs)), Recorded.REPEAT
    closed = protocol.close_step(step.load, runs, plan.config, not step.short)
    return _put(steps, index, replace(step, runs=(), result=closed)), Recorded.CLOSED


NOT_MEASURED_AT_THE_CURVE = "not measured at the common load"


def give_up_curve(steps: Sequence[Step], index: int, why: str) -> tuple[Step, ...]:
    """The curve step closed unmeasured: the trial concludes from its search alone."""
    step = steps[index]
    reason = f"{NOT_MEASURED_AT_THE_CURVE}: {why}"[:500]
    return _put(steps, index, replace(step, runs=(), result=StepResult(step.load, {}, Verdict.UNKNOWN, reason,
                                                                      -math.inf)))


def conclude(plan: TrialPlan, steps: Sequence[Step]) -> Concluded:
    """The trial's conclusion from its search, and its curve point: the curve step when it was measured, else a
    search step that ran at the curve load (no extra run was needed). What it tells the search (its observations)
    is the steps a finished trial keeps (`kept`): the bench learns from what the operator's status holds."""
    search = search_results(steps)
    conclusion = protocol.conclude(search, plan.config)
    measured = next((i for i, s in enumerate(steps) if s.curve and s.result is not None and s.result.metrics), None)
    curve_step = measured
    if measured is None and plan.curve is not None:
        at = protocol.search_step_at(search, plan.curve, plan.config)
        if at is not None:
            curve_step = [i for i, s in enumerate(steps) if s.result is not None and not s.curve][at]
    keep = kept(steps, curve_step, conclusion.metrics.get(M.SLO_CAPACITY_LOAD), plan.predicted)
    searched = [i for i, s in enumerate(steps) if s.result is not None and not s.curve]
    observed = tuple(o for i, o in zip(searched, conclusion.observations, strict=True) if i in keep)
    return Concluded(replace(conclusion, observations=observed), curve_step)


KEPT_STEPS = 4
"""Load steps a finished trial keeps (status holds every step only while its trial runs: the loop needs them then)."""


def kept(steps: Sequence[Step], curve_step: int | None, capacity_load: float | None,
         predicted: int | None) -> tuple[int, ...]:
    """Indexes, in order, of the closed steps a finished trial keeps, at most `KEPT_STEPS`: its point at the common
    curve load (the report's curves; or its curve step given up, saying why), the step its SLO capacity was measured
    at (its figures), the step at the twin's predicted capacity (how the prediction compared) or else its first, the
    lowest load above its capacity that failed (where the SLO broke), the short step the capacity's full window
    confirmed; then the latest other steps of its search, while room is left."""
    closed = [i for i, s in enumerate(steps) if s.result is not None]
    search = [i for i in closed if not steps[i].curve]
    failed = {i for i in search if not (result := steps[i].result) or not result.passed}
    wanted: list[int] = []

    def want(index: int | None) -> None:
        if index is not None and index in closed and index not in wanted and len(wanted) < KEPT_STEPS:
            wanted.append(index)

    want(curve_step)
    want(next((i for i in closed if steps[i].curve), None))  # given up unmeasured: why the curve has no point
    want(next((i for i in reversed(search) if not steps[i].short and steps[i].load == capacity_load), None))
    at_predicted = [i for i in search if steps[i].load == predicted]
    want(next((i for i in at_predicted if not steps[i].short), at_predicted[0] if at_predicted else None))
    want(search[0] if search else None)
    above = [i for i in failed if capacity_load is not None and steps[i].load > capacity_load]
    want(min(above, key=lambda i: steps[i].load) if above else None)
    want(next((i for i in search if steps[i].short and steps[i].load == capacity_load), None))
    for index in reversed(search):
        want(index)
    return tuple(sorted(wanted))


def _put(steps: Sequence[Step], index: int, step: Step) -> tuple[Step, ...]:
    return (*steps[:index], step, *steps[index + 1:])


# ---- the loop, in one go -----------------------------------------------------------------------


@dataclass(frozen=True)
class RunFailure:
    """A run that gave no reading because the server failed under it (the trial fails, its curve step only
    goes unmeasured)."""

    message: str


class World(Protocol):
    """Where a trial's runs run when they are run synchronously (the bench's simulated GPU, a test's model)."""

    def run(self, run: Run) -> RunResult | RunFailure:
        """Run this load run on the trial's server: its figures (status metric keys), or why there are none."""
        ...


@dataclass(frozen=True)
class Finished:
    """A trial run to its end: its steps, and its conclusion (None when a run failed the trial)."""

    steps: tuple[Step, ...]
    concluded: Concluded | None
    failure: RunFailure | None = None


def run_trial(plan: TrialPlan, world: World) -> Finished:
    """The loop the operator runs across ticks, in one go: open a step, run it until it closes, conclude."""
    steps: tuple[Step, ...] = ()
    while True:
        index = open_step(steps)
        if index is None:
            step = next_step(plan, steps)
            if step is None:
                return Finished(steps, conclude(plan, steps))
            steps, index = (*steps, step), len(steps)
        result = world.run(run_of(plan, steps, index))
        if isinstance(result, RunFailure):
            if not steps[index].curve:
                return Finished(steps, None, result)
            steps = give_up_curve(steps, index, f"the trial pod failed at the common load: {result.message}")
            continue
        steps, _ = record(plan, steps, index, result)
