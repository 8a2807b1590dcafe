"""The shape every benchmarked tuning strategy has."""

from __future__ import annotations

from typing import Protocol

from batchtune.bench.scenarios import Scenario
from batchtune.bench.types import Choice, Testbed


class TuningStrategy(Protocol):
    @property
    def name(self) -> str: ...  # read-only: the strategies are frozen dataclasses

    def tune(self, testbed: Testbed, scenario: Scenario, *, seed: int) -> Choice: ...
