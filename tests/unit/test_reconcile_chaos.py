"""Chaos without a cluster: the operator killed at 20 seeded random moments over a full Auto tuning.

A kill lands between two writes of a tick (after any create, delete or production patch, or before
the status write), so what the tick did to the world stays and what it meant to write to status is
lost; in-memory state (the Prometheus back-off) is lost too. Every run must end with the decision an
undisturbed run takes, create no object twice, leave no owned object behind, and never leave
production applied but unverified.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from datetime import timedelta

import pytest
from fake_world import FakeCluster, World, production_target, reset_backoff, spec

from batchtune.controller.reconcile import reconcile
from batchtune.core.production import AppliedMark, MarkState

TERMINAL = {"Succeeded", "Failed", "RolledBack", "Recommended"}
SEEDS = range(20)


class Killed(Exception):
    """The operator process died here."""


class KillableCluster(FakeCluster):
    """Dies right after its `budget`-th write."""

    def __init__(self, world: World, budget: list[int], where: list[str]) -> None:
        super().__init__(world)
        self.budget = budget
        self.where = where

    def _write(self, what: str) -> None:
        self.budget[0] -= 1
        if self.budget[0] == 0:
            self.where.append(f"{self.w.phase}:{what}")
            raise Killed()

    def create(self, obj):  # type: ignore[no-untyped-def]  # same signature as FakeCluster's
        created = super().create(obj)
        self._write(f"create {obj['kind']}")
        return created

    def delete(self, kind, namespace, name):  # type: ignore[no-untyped-def]
        super().delete(kind, namespace, name)
        self._write(f"delete {kind}")

    def patch_deployment(self, namespace, name, patch, resource_version):  # type: ignore[no-untyped-def]
        result = super().patch_deployment(namespace, name, patch, resource_version)
        self._write("patch production")
        return result


def tuning_world() -> World:
    w = World(bt_spec=spec(searchSpace={"maxNumSeqs": {"values": [8, 16, 32, 64]}},
                           strategy={"type": "Adaptive", "maxTrials": 4, "maxParallelTrials": 2}))
    w.deployments["llm"] = production_target()
    return w


def run(w: World, kills: int, rng: random.Random | None, where: list[str] | None = None) -> int:
    """Tick to a terminal phase, killing the operator up to `kills` times at random; returns the kills done."""
    done = 0

    def next_budget() -> int:
        return rng.randint(1, 12) if rng is not None and done < kills else -1

    budget = [next_budget()]
    for _ in range(600):
        if w.phase in TERMINAL:
            for _ in range(3):
                w.tick()  # the garbage pass still runs in a terminal phase
            return done
        ports = w.ports()
        ports.cluster = KillableCluster(w, budget, where if where is not None else [])
        try:
            patch = reconcile(w.tuning(), ports, w.now, logging.getLogger("chaos"))
        except Killed:
            done += 1
            reset_backoff()  # a new operator process remembers nothing but status
            budget[0] = next_budget()
        else:
            if rng is not None and done < kills and rng.random() < 0.05:
                done += 1  # killed after the tick's writes, before its status write reached the API server
                reset_backoff()
                if where is not None:
                    where.append(f"{w.phase}:status write")
            else:
                w.apply(patch)
        w.now += timedelta(seconds=5)
        w.settle()
    raise AssertionError(f"no terminal phase: {w.phase}")


def outcome(w: World) -> tuple:
    args = w.deployments["llm"]["spec"]["template"]["spec"]["containers"][0]["args"]
    return w.phase, w.status.get("bestSetting"), tuple(args)


@pytest.fixture(autouse=True)
def _fresh_backoff():
    reset_backoff()
    yield
    reset_backoff()


def test_undisturbed_run_succeeds():
    w = tuning_world()
    run(w, 0, None)
    assert w.phase == "Succeeded"


@pytest.mark.parametrize("seed", [pytest.param(s, id=f"seed-{s}") for s in SEEDS])
def test_killed_at_random_moments_it_ends_the_same_way(seed: int):
    undisturbed = tuning_world()
    run(undisturbed, 0, None)
    w = tuning_world()
    kills = run(w, 8, random.Random(seed))
    assert kills >= 1
    assert outcome(w) == outcome(undisturbed)
    counts = Counter(w.created)
    assert [name for name, n in counts.items() if n > 1] == [], "an object was created twice"
    assert w.deployments.keys() == {"llm"} and w.jobs == {}, "an owned object was left behind"
    mark = AppliedMark.read(w.deployments["llm"])
    assert mark is not None and mark.state is MarkState.VERIFIED, "production was left applied but unverified"
    names = [t["name"] for t in w.status["trials"]]
    assert len(names) == len(set(names))


def test_the_kills_land_in_every_kind_of_moment():
    where: list[str] = []
    for seed in SEEDS:
        run(tuning_world(), 8, random.Random(seed), where)
    kinds = {w.split(":", 1)[1] for w in where}
    phases = {w.split(":", 1)[0] for w in where}
    assert {"create Deployment", "create Job", "delete Job", "patch production", "status write"} <= kinds, kinds
    assert {"Trialing", "Applying", "Verifying"} <= phases, phases


# ---- a kill after the production patch, then a spec edit, a delete or a new round before the next tick ---------


class DiesAfterProductionPatch(FakeCluster):
    """The operator dies right after patching production's args: the patch stands, the tick's status write is lost."""

    def patch_deployment(self, namespace, name, patch, resource_version):  # type: ignore[no-untyped-def]
        result = super().patch_deployment(namespace, name, patch, resource_version)
        if (patch.get("spec") or {}).get("template"):
            raise Killed()
        return result


def kill_after_production_patch(w: World) -> None:
    """Tick until the operator patches production and dies before writing status; status stays as it was."""
    for _ in range(400):
        ports = w.ports()
        ports.cluster = DiesAfterProductionPatch(w)
        try:
            w.apply(reconcile(w.tuning(), ports, w.now, logging.getLogger("chaos")))
        except Killed:
            reset_backoff()
            w.now += timedelta(seconds=5)
            return
        w.now += timedelta(seconds=5)
        w.settle()
    raise AssertionError(f"production was never patched: {w.phase}")


def args_of(w: World) -> list[str]:
    return list(w.deployments["llm"]["spec"]["template"]["spec"]["containers"][0]["args"])


def unverified_change_left(w: World) -> AppliedMark:
    mark = AppliedMark.read(w.deployments["llm"])
    assert mark is not None and mark.state is MarkState.APPLIED and w.status.get("applied", {}).get("appliedAt") is None
    return mark


def test_killed_after_the_patch_then_a_spec_edit_restores_the_original_args_first_and_rolls_back_to_them():
    w = tuning_world()
    original = args_of(w)
    kill_after_production_patch(w)
    assert args_of(w) != original and unverified_change_left(w).generation == 1
    w.generation = 2  # edited before the operator ran again
    w.bt_spec["slo"]["headroomPercent"] = 5
    w.tick()
    assert args_of(w) == original, "the next generation planned over the old generation's unverified change"
    assert AppliedMark.read(w.deployments["llm"]).state is MarkState.ROLLED_BACK
    assert any(reason == "RolledBack" for _, reason, _ in w.events)
    # Generation 2's own change regresses: its rollback restores the original args, not generation 1's change.
    def figures(dep, start, end):  # type: ignore[no-untyped-def]
        changed = dep["spec"]["template"]["spec"]["containers"][0]["args"] != original
        return {"itlMs": 500.0 if changed else 15.0, "ttftMs": 100.0, "e2eMs": 1000.0, "errorRatePercent": 0.0,
                "servedSharePercent": 100.0, "requests": 500.0}
    w.production_figures = figures
    assert w.run_until(TERMINAL) == "RolledBack"
    assert w.status["applied"]["generation"] == 2 and w.status["applied"]["previous"]["args"] == original
    assert args_of(w) == original


def test_killed_after_the_patch_then_deleted_restores_production_from_its_mark():
    w = tuning_world()
    original = args_of(w)
    kill_after_production_patch(w)
    unverified_change_left(w)
    w.delete()
    assert args_of(w) == original
    assert AppliedMark.read(w.deployments["llm"]).state is MarkState.ROLLED_BACK
    assert w.deployments.keys() == {"llm"}


def test_killed_after_the_patch_then_deleted_with_status_naming_no_target_still_restores():
    w = tuning_world()
    original = args_of(w)
    kill_after_production_patch(w)
    w.status.pop("applied", None)  # status never got as far as the checkpoint's write (or lost it)
    w.delete()
    assert args_of(w) == original
