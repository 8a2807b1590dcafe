"""Verify: is production, after the change, at least as good as before it? Pure, on windowed figures.

Both windows come from the engine's own metrics on production's pods (histograms, counters). A
latency counts as a regression when it breaks its SLO target *and* got worse than before by more than
`max_regression_percent`: the coarse histogram buckets can place an unchanged p95 above a tight target,
and the change is to blame only for what changed. Failed requests count from every source the engine
has (error and abort finish reasons, HTTP error statuses), and the served share of the offered load
(finished over arrived) must not fall: a throughput drop is judged against the traffic production was
offered, not only while requests queue. Too few requests is no evidence: verify waits for them up to
a deadline, then follows the stated policy (keep or roll back). Unknown stays unknown.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from batchtune.core.slo import SloTargets
from batchtune.core.vocabulary import M, Reason, Verdict

SERVED_SHARE = "servedSharePercent"
"""Requests finished over requests arrived in the window, in percent (production windows only)."""
ARRIVAL_RATE = "arrivalRate"


class InconclusivePolicy(StrEnum):
    """What verify does when production gave too few requests by the deadline."""

    KEEP = "Keep"
    """The setting was measured to meet the SLO in trials; with no traffic to contradict it, it stays."""
    ROLL_BACK = "RollBack"
    """Nothing unverified stays: the previous args come back."""


@dataclass(frozen=True)
class VerifyPolicy:
    verify_seconds: int
    """The least time production is watched after the rollout completed."""
    timeout_seconds: int
    """Until when (from the rollout) verify waits for `min_requests`; then `on_inconclusive` decides."""
    min_requests: int
    max_regression_percent: int
    on_inconclusive: InconclusivePolicy = InconclusivePolicy.KEEP

    def __post_init__(self) -> None:
        if self.verify_seconds < 1:
            raise ValueError(f"verify window {self.verify_seconds!r} s must be >= 1")
        if self.timeout_seconds < self.verify_seconds:
            raise ValueError(f"verify timeout {self.timeout_seconds} s is shorter than the window {self.verify_seconds} s")


class Next(StrEnum):
    WAIT = "Wait"
    JUDGE = "Judge"
    INCONCLUSIVE = "Inconclusive"


@dataclass(frozen=True)
class VerifyResult:
    verdict: Verdict
    reason: str


def window_state(policy: VerifyPolicy, rollout_done: datetime, now: datetime, requests: float | None) -> Next:
    """Whether verify judges now, waits for the window or for traffic, or has run out of time."""
    if now < rollout_done + timedelta(seconds=policy.verify_seconds):
        return Next.WAIT
    enough = requests is not None and requests >= policy.min_requests
    if enough:
        return Next.JUDGE
    if now >= rollout_done + timedelta(seconds=policy.timeout_seconds):
        return Next.INCONCLUSIVE
    return Next.WAIT


def inconclusive(policy: VerifyPolicy, requests: float | None, why: str = "") -> tuple[Reason, str]:
    """The condition reason and message for a verify that ran out of time (keep or roll back)."""
    seen = "no" if requests is None else f"{int(requests)}"
    text = (f"production served {seen} requests in {policy.timeout_seconds}s after the rollout "
            f"(spec.apply.verifyMinRequests is {policy.min_requests})" + (f"; {why}" if why else ""))
    if policy.on_inconclusive is InconclusivePolicy.KEEP:
        return Reason.KEPT_UNVERIFIED, (f"{text}: kept, as spec.apply.onInconclusiveVerify is Keep "
                                        "(the setting met the SLO in its trials)")
    return Reason.VERIFY_INCONCLUSIVE, f"{text}: rolled back, as spec.apply.onInconclusiveVerify is RollBack"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if not math.isnan(value) else None


def judge(slo: SloTargets, max_regression_percent: int, before: Mapping[str, Any],
          after: Mapping[str, Any]) -> VerifyResult:
    """Production after the change against production before it."""
    tolerance = 1 + max_regression_percent / 100
    problems: list[str] = []
    unknown: list[str] = []
    fine: list[str] = []
    for metric, target in slo.latency_targets().items():
        a, b = _number(after.get(metric)), _number(before.get(metric))
        if a is None:
            unknown.append(f"{metric} after the change is not measured")
            continue
        worse = b is not None and a > b * tolerance  # a before of 0 ms excuses nothing
        if a > target and (worse or b is None or math.isinf(a)):
            was = f", was {b:.4g} ms" if b is not None else ""
            shown = "above the highest histogram bucket" if math.isinf(a) else f"{a:.4g} ms"
            problems.append(f"p{slo.percentile} {metric} {shown} > {target} ms target{was}")
        else:
            fine.append(f"p{slo.percentile} {metric} {a:.4g} ms")
    errors, errors_before = _number(after.get(M.ERROR_RATE_PERCENT)), _number(before.get(M.ERROR_RATE_PERCENT))
    if errors is None:
        unknown.append("error rate after the change is not measured")
    elif errors > slo.max_error_rate_percent and (errors_before is None or errors > errors_before * tolerance):
        was = f", was {errors_before:.3g}%" if errors_before is not None else ""
        problems.append(f"error rate {errors:.3g}% > {slo.max_error_rate_percent:g}%{was}")
    else:
        fine.append(f"error rate {errors:.3g}%")
    served, served_before = _number(after.get(SERVED_SHARE)), _number(before.get(SERVED_SHARE))
    if served is None:
        unknown.append("the share of offered requests production served after the change is not measured")
    else:
        floor = 100.0 - max_regression_percent
        if served_before is not None:
            floor = min(floor, served_before - max_regression_percent)
        if served < floor:
            was = f" (was {served_before:.3g}%)" if served_before is not None else ""
            problems.append(f"production served {served:.3g}% of the requests it was offered{was}, below "
                            f"{floor:.3g}% (spec.apply.maxRegressionPercent {max_regression_percent}%)")
        else:
            fine.append(f"served {served:.3g}% of offered requests")
    if problems:
        return VerifyResult(Verdict.VIOLATED, "; ".join(problems))
    if unknown:
        return VerifyResult(Verdict.UNKNOWN, "; ".join(unknown))
    return VerifyResult(Verdict.MET, "; ".join(fine))  # never empty: the error rate was judged
