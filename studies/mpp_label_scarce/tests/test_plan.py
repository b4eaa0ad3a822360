"""The label-scarce study's plan, checked before any of its runs: the subsets are class-balanced,
disjoint from the held-out images, fixed by their seeds, and the pilot is never scored; every
arm gets the same downstream recipe; no step lets the test split choose anything."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ssl_vit.data.holdout import held_out_indices
from studies.mpp_label_scarce import steps as S
from studies.mpp_label_scarce.subsets import class_balanced_subset

PLAN_MD = Path(__file__).resolve().parents[1] / "PLAN.md"
LABELS = np.random.default_rng(7).integers(0, 10, size=60_000)  # a split's labels, 10 classes
HELD = held_out_indices(len(LABELS), S.HOLDOUT)


@pytest.mark.parametrize("per_class", S.PER_CLASS)
def test_subsets_are_class_balanced_disjoint_from_held_out_and_fixed_by_seed(per_class):
    a = class_balanced_subset(LABELS, per_class, seed=1, exclude=HELD)
    assert np.array_equal(np.bincount(LABELS[a], minlength=10), np.full(10, per_class))
    assert not np.intersect1d(a, HELD).size
    assert np.array_equal(a, class_balanced_subset(LABELS, per_class, seed=1, exclude=HELD))
    assert not np.array_equal(a, class_balanced_subset(LABELS, per_class, seed=2, exclude=HELD))


def test_the_pilot_is_never_among_the_evaluated_subsets():
    pilot = class_balanced_subset(LABELS, S.PILOT[0], S.PILOT[1], exclude=HELD)
    pool_out = np.union1d(HELD, pilot)
    for n, seed in S.evaluated_subsets():
        assert (n, seed) != S.PILOT
        assert not np.intersect1d(class_balanced_subset(LABELS, n, seed, pool_out), pilot).size
    pilot_file = str(S.subset_file(*S.PILOT))
    scored = [s for s in S.plan("0.03", "0") if not s.name.startswith("pilot/")]
    assert not any(pilot_file in a for s in scored for a in s.args())
    assert len({s for s in S.SUBSET_SEEDS}) == 5 and S.PILOT[1] not in S.SUBSET_SEEDS


def test_a_class_too_small_is_refused():
    with pytest.raises(ValueError, match="eligible"):
        class_balanced_subset(np.array([0, 0, 1]), 2, seed=0)


def _recipe(args: list[str]) -> list[str]:
    """A fine-tune's command less what may differ between arms: run dir, start, data, seed."""
    varying = ("run.dir=", "model.init_from=", "data.subset_file=", "run.seed=", "model.")
    return [a for a in args if not a.startswith(varying)]


def test_every_arm_gets_the_one_downstream_recipe():
    fts = [s for s in S.plan("0.03", "1e-4") if s.name.startswith("ft/")]
    assert {tuple(_recipe(s.args())) for s in fts} == {tuple(_recipe(fts[0].args()))}
    assert {s.name.split("/")[1] for s in fts} == set(S.arms())
    args = fts[0].args()
    assert "optim.lr=0.03" in args and "optim.weight_decay=1e-4" in args
    assert f"train.steps={S.FT_STEPS}" in args and not any("--sweep" in a for a in args)
    # every arm at the same input: 28 px, 7x7 patches (random init's given, the others' exported)
    assert all("model.img_size=28" in s.args() for s in fts)


def test_the_pilot_chooses_on_held_out_by_the_stated_rule():
    grid = {(s, lr, wd): 0.5 for s in ("random", "mpp") for lr in S.FT_LRS for wd in S.FT_WDS}
    grid[("random", "0.01", "1e-4")], grid[("mpp", "0.01", "1e-4")] = 0.70, 0.80  # mean 0.75
    grid[("random", "0.06", "0")], grid[("mpp", "0.06", "0")] = 0.90, 0.60  # mean 0.75: a tie
    assert S.chosen_recipe(grid) == ("0.01", "1e-4")  # the tie goes to the smaller lr
    pilots = S.pilot_steps()
    assert len(pilots) == 2 * len(S.FT_LRS) * len(S.FT_WDS)
    assert all(f"data.holdout_fraction={S.HOLDOUT}" in s.args() for s in pilots)


def test_no_step_names_the_test_split():
    for step in S.plan("0.03", "0"):
        assert not any("test" in a for a in step.args()), step.name


def test_the_dose_response_runs_each_length_as_its_own_schedule():
    runs = {s.name: s for s in S.plan() if s.name.startswith("mpp_e")}
    for e in S.MPP_EPOCHS:
        args = runs[f"mpp_e{e}_seed0"].args()
        assert f"train.epochs={e}" in args and not any("export_epochs" in a for a in args)
    assert all(runs[f"mpp_e{e}_seed0"].gpu for e in S.GPU_MPP_EPOCHS)
    assert not any(runs[f"mpp_e{e}_seed0"].gpu for e in S.MPP_EPOCHS)


def test_the_positive_control_is_pixel_masked_modelling_through_the_same_pipeline():
    control = next(s for s in S.plan() if s.name.startswith("pixels_e"))
    mpp = next(s for s in S.plan() if s.name == f"mpp_e{S.CONTROL_EPOCHS}_seed0")
    assert control.args()[:3] == mpp.args()[:3]  # the same script and preset
    assert set(S.CONTROL) <= set(control.args())


def test_every_flag_still_to_build_is_named_in_the_plan():
    text = PLAN_MD.read_text()
    used = {a.split("=")[0] for s in S.plan("0.03", "0") for a in s.args()}
    for flag in S.TO_BUILD:
        assert flag in text, flag
    assert {"data.subset_file", "--train-indices", "--cv-folds"} <= used


def test_chains_run_every_step_once_and_never_share_an_export():
    plan = S.plan("0.03", "0")
    done = {"subsets", "mpp_e40_seed0"}  # a pretraining with a result whose export may be gone
    todo = [s for s in plan if s.name not in done]
    chains = S.chains(todo, parts=3)
    names = [n for chain in chains for n in chain]
    assert sorted(names) == sorted(s.name for s in todo)  # each step once
    by_name = {s.name: s for s in plan}
    order = {s.name: i for i, s in enumerate(plan)}
    for chain in chains:
        reads = {need for n in chain for need in by_name[n].needs}
        trains = {n for n in chain if n in S.pretrained_names()}
        assert len(reads | trains) <= 1, chain  # at most one export per chain
        assert [order[n] for n in chain] == sorted(order[n] for n in chain)  # the plan's order
    # the steps of a pretraining that already has a result form its chain (it rebuilds there)
    assert any(all(by_name[n].needs == ("mpp_e40_seed0",) for n in c) for c in chains)
    free = [c for c in chains if not any(by_name[n].needs or n in S.pretrained_names() for n in c)]
    assert len(free) == 3 and "baseline_scratch_all_labels" in {n for c in free for n in c}
