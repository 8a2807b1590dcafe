"""Which hidden realities (`bench.reality`) a result is reported on, and which the rules were developed on.

The strategies' rules were tuned on every scenario's reality at truth seed 0, and Adaptive's `batch_never_filled`
and `too_few_requests` rules and the offered-rate capacity were written after reading seeds 1-5's cases, so that
set is evidence for nothing: a result is reported on other, held-out realities (seeds 6-10 by default) and says
which it used. This module is
apart from `reality.py` on purpose: the oracle cache's key hashes that file's source.
"""

from __future__ import annotations

DEVELOPMENT_TRUTH_SEEDS: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
"""The realities the strategies' rules were developed on or read for (`--truth-seeds 0-5`): not evidence for them."""
REPORTING_TRUTH_SEEDS: tuple[int, ...] = (6, 7, 8, 9, 10)
"""The held-out realities a result is reported on (`--truth-seeds`' default)."""


def parse_truth_seeds(text: str) -> tuple[int, ...]:
    """`1-5`, `0`, `1,3,7-9` as a sorted tuple of distinct non-negative seeds; ValueError when malformed."""
    seeds: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = (int(lo), int(hi)) if sep else (int(part), int(part))
        except ValueError:
            raise ValueError(f"{part!r} is not a seed or a range of seeds (e.g. 1-5)") from None
        if first < 0 or last < first:
            raise ValueError(f"{part!r}: seeds are >= 0 and a range runs low-high")
        seeds.update(range(first, last + 1))
    if not seeds:
        raise ValueError("no truth seed given")
    return tuple(sorted(seeds))


def held_out(seeds: tuple[int, ...]) -> bool:
    """True when none of the seeds is a development seed."""
    return not set(seeds) & set(DEVELOPMENT_TRUTH_SEEDS)


def format_seeds(seeds: tuple[int, ...]) -> str:
    """(1, 2, 3, 5) as `1-3,5`."""
    runs: list[list[int]] = []
    for seed in sorted(seeds):
        if runs and seed == runs[-1][-1] + 1:
            runs[-1].append(seed)
        else:
            runs.append([seed])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
