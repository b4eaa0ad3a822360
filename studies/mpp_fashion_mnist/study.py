"""The paper's MPP study on Fashion-MNIST (sec. 4.6), as a resumable plan of real commands.

    python evals/study.py run      # every step without a result yet, in order (hours on 2 cores)
    python evals/study.py run --only mpp_e6/knn   # just these steps
    python evals/study.py status   # done, stale (its recipe changed since) or todo
    python evals/study.py report   # RESULTS.md from results/study/ (the committed results)

Run it in the background (`nohup python evals/study.py run > runs/study/study.log 2>&1 &`).
Each finished step leaves its result in results/study/<step>.json (the command, wall time,
machine, MLflow run and the JSON the step wrote; a training step's metric lines beside it):
those files are committed, so a new machine regenerates RESULTS.md and reruns only the steps
without a result. A step's checkpoints and exports stay in runs/study/ (never committed); a step
that needs another's export (a fine-tune needs its pretraining) reruns that one first when the
export is gone. A result whose recipe changed (the command, a config file's contents, or the
result of a step it reads) is stale: the step reruns, its old run directory moved aside. A
stopped pretraining or fine-tuning resumes from its own checkpoints.

The budget, the same for every method (equal total compute; every step here costs about the
same per image, 28 px, 16 tokens): pretraining PRETRAIN_EPOCHS epochs at batch 256, then
FINETUNE_EPOCHS epochs of fine-tuning at batch 128; from scratch gets the sum, trained with the
supervised preset's recipe (the stronger from-scratch baseline). A hashed 2% of the training
split is held out from every training run and makes every choice (lr, best evaluation).
"""

from __future__ import annotations

import argparse
import sys

from study_steps import (  # noqa: F401  (Step, STUDY, ...: what tests and tools read here)
    AUGMENTATIONS,
    BUDGET,
    EAGER,
    FEW_LABELS,
    FINETUNE_EPOCHS,
    FINETUNE_RECIPES,
    FT_LONG_EPOCHS,
    GPU_FINETUNE_EPOCHS,
    GPU_PRETRAIN_EPOCHS,
    GPU_RUN,
    GPU_SCRATCH_EPOCHS,
    GPU_SNAPSHOTS,
    GPU_SPLIT,
    HYBRID,
    LONG_FINETUNE_EPOCHS,
    LONG_PRETRAIN_EPOCHS,
    LONG_SCRATCH_EPOCHS,
    LONG_SNAPSHOTS,
    MIXER,
    MPP,
    P4,
    P4_FINETUNE_EPOCHS,
    P4_PRETRAIN_EPOCHS,
    P4_SCRATCH_EPOCHS,
    P4_SNAPSHOTS,
    PRETRAIN_EPOCHS,
    RANDOM,
    RANDOM_HYBRID,
    RANDOM_P4,
    READOUT,
    RECIPES,
    RESULTS,
    ROOT,
    SCRATCH_EPOCHS,
    SEEDS,
    SHIFT,
    SNAPSHOTS,
    STUDY,
    SUP,
    Step,
    cascade,
    evals,
    few_label_arms,
    few_label_budget,
    finetune,
    finetune_hires,
    finetune_recipe,
    ft_long_arms,
    inspection,
    pretrain,
    recipe,
    scratch,
    snapshot_evals,
)


def plan() -> list[Step]:
    """In order of what matters most, so a partial study still answers the main questions."""
    py, sup_py = "pipelines/mpp_pretrain.py", "pipelines/supervised_pretrain.py"
    main_comparison = [
        step
        for seed in SEEDS
        for step in (finetune("mpp", seed), finetune("supervised", seed), scratch(seed))
    ]
    return [
        # The crop augmentation every training step uses, chosen on held-out (issue 13 item 3).
        *(recipe(n) for n in AUGMENTATIONS),
        pretrain("mpp", MPP, py),
        *snapshot_evals("mpp", (PRETRAIN_EPOCHS,)),
        *evals("random", RANDOM),
        *evals("pixels", ["--raw-pixels"]),
        main_comparison[0],  # MPP's fine-tuning lr sweep
        *(finetune_recipe(name) for name in FINETUNE_RECIPES),
        pretrain("supervised", SUP, sup_py),
        *main_comparison[1:3],  # seed 0 of supervised and from scratch
        *snapshot_evals("mpp", SNAPSHOTS[:-1]),  # the curve against pretraining length
        recipe("recipe_p4"),  # 7x7 tokens: the finer grid item 3 asks for first
        *snapshot_evals("supervised", (PRETRAIN_EPOCHS,)),
        # Pipeline vs a plain timm loop, images/s side by side (item 4); run between steps, so
        # nothing of the study runs beside it.
        Step(
            "speed",
            [
                "benchmarks/train_throughput.py",
                "--steps",
                "100",
                "--rounds",
                "3",
                "--out",
                str(STUDY / "speed" / "train_throughput.json"),
            ],
            STUDY / "speed" / "train_throughput.json",
        ),  # fmt: skip
        *main_comparison[3:],  # seeds 1 and 2: the error bars
        *(recipe(n) for n in RECIPES if n not in (*AUGMENTATIONS, "recipe_p4")),  # lr, width
        # Dynamic ViT (issue 15): the cascade, then each reuse switched off alone.
        *cascade("cascade"),
        *cascade("cascade_no_feature_reuse", "objective.feature_reuse=false"),
        *cascade("cascade_no_relation_reuse", "objective.relation_reuse=false"),
        # An MLP-Mixer beside the ViT under the same recipe (issue 15, single seed).
        pretrain("mixer", MIXER, py),
        *snapshot_evals("mixer", (PRETRAIN_EPOCHS,)),
        finetune("mixer", SEEDS[0]),
        inspection("mpp"),
        inspection("mixer"),
        # The longer schedule (single seed): does pretraining longer keep paying, and does a
        # longer fine-tune close the gap to from scratch at equal compute?
        pretrain("mpp_long", MPP, py, epochs=LONG_PRETRAIN_EPOCHS, snapshots=LONG_SNAPSHOTS),
        finetune("mpp_long", SEEDS[0], LONG_FINETUNE_EPOCHS),
        *snapshot_evals("mpp_long", LONG_SNAPSHOTS),
        scratch(SEEDS[0], LONG_SCRATCH_EPOCHS, "scratch_long"),
        finetune_hires("mpp_long", LONG_FINETUNE_EPOCHS),  # the paper's higher resolution
        # The finer grid, 49 tokens (single seed): MPP pretraining and its fine-tune against
        # from scratch for the sum, then the frozen features along the pretraining.
        scratch(SEEDS[0], P4_SCRATCH_EPOCHS, "scratch_p4", *P4),
        pretrain("mpp_p4", MPP, py, *P4, epochs=P4_PRETRAIN_EPOCHS, snapshots=P4_SNAPSHOTS),
        finetune("mpp_p4", SEEDS[0], P4_FINETUNE_EPOCHS, lr_from=f"ft_mpp_s{SEEDS[0]}"),
        *snapshot_evals("mpp_p4", P4_SNAPSHOTS),
        *evals("random_p4", RANDOM_P4),
        # Ablations (single seed): the corruption rate and the target (sec. 4.6, B.1.2), and
        # the [class] token read-out.
        pretrain("mpp15", MPP, py, "objective.corrupt_ratio=0.15"),
        *snapshot_evals("mpp15", (PRETRAIN_EPOCHS,)),
        pretrain("mpp_downsized", MPP, py, "objective.target=downsized_color"),
        *snapshot_evals("mpp_downsized", (PRETRAIN_EPOCHS,)),
        pretrain("mpp_pixels", MPP, py, "objective.target=pixels"),
        *snapshot_evals("mpp_pixels", (PRETRAIN_EPOCHS,)),
        *evals("mpp_cls", ["--backbone", str(STUDY / "mpp"), "--pool", "cls"], ("mpp",)),
        # Translation at the longer schedule (single seed): from scratch first (does the shift
        # raise what the architecture reaches?), then MPP and its fine-tune with the lr the
        # flips-only long sweep chose on held-out, then the frozen features.
        scratch(SEEDS[0], LONG_SCRATCH_EPOCHS, "scratch_long_shift", *SHIFT),
        pretrain(
            "mpp_long_shift", MPP, py, *SHIFT, epochs=LONG_PRETRAIN_EPOCHS, snapshots=LONG_SNAPSHOTS
        ),  # fmt: skip
        finetune("mpp_long_shift", SEEDS[0], LONG_FINETUNE_EPOCHS, "ft_mpp_long_s0", *SHIFT),
        *snapshot_evals("mpp_long_shift", LONG_SNAPSHOTS[-1:]),
        # Error bars for the longer schedule: seeds 1 and 2 of its fine-tune (the lr seed 0's
        # sweep chose) and of from scratch, a pair at a time.
        *(
            step
            for seed in SEEDS[1:]
            for step in (
                finetune("mpp_long", seed, LONG_FINETUNE_EPOCHS),
                scratch(seed, LONG_SCRATCH_EPOCHS, "scratch_long"),
            )
        ),  # fmt: skip
        # The paper's hybrid at the main budget (6 + 2 against 8 from scratch), seed 0 first:
        # it led the 16-token ViT by 4 points held-out at 2 epochs (recipe_hybrid32). Fine-tuned
        # with the lr the 16-token sweep chose (a sweep is 4 fine-tunes).
        scratch(SEEDS[0], SCRATCH_EPOCHS, "scratch_hybrid", *HYBRID),
        pretrain("mpp_hybrid", MPP, py, *HYBRID, snapshots=(2, 4, 6)),
        finetune("mpp_hybrid", SEEDS[0], FINETUNE_EPOCHS, f"ft_mpp_s{SEEDS[0]}", HYBRID[1]),
        *snapshot_evals("mpp_hybrid", (PRETRAIN_EPOCHS,)),
        *evals("random_hybrid", RANDOM_HYBRID),
        # Frozen features with the read-out chosen on held-out, beside the last block's: the
        # hybrid's first (its export is fresh), then the ViT's (6-epoch MPP) and random inits.
        *evals(
            "mpp_hybrid_e6_readout",
            ["--backbone", str(STUDY / "mpp_hybrid" / "export_epoch6"), *READOUT],
            ("mpp_hybrid",),
        ),  # fmt: skip
        *evals("random_hybrid_readout", [*RANDOM_HYBRID, *READOUT]),
        *evals(
            "mpp_e6_readout",
            ["--backbone", str(STUDY / "mpp" / "export_epoch6"), *READOUT],
            ("mpp",),
        ),  # fmt: skip
        *evals("random_readout", [*RANDOM, *READOUT]),
        *longer_finetunes(),
        *label_scarce(),
        *gpu_track(py),
    ]


def longer_finetunes() -> list[Step]:
    """The main pretraining fine-tuned longer, each length against from scratch for the sum."""
    steps = []
    for epochs in FT_LONG_EPOCHS:
        ft, base = ft_long_arms(epochs)
        steps.append(finetune("mpp", SEEDS[0], epochs, f"ft_mpp_s{SEEDS[0]}", name=ft))
        steps.append(scratch(SEEDS[0], PRETRAIN_EPOCHS + epochs, base.removesuffix("_s0")))
    return steps


def label_scarce() -> list[Step]:
    """The main pretraining fine-tuned on a share of the labels against from scratch on them
    for the same compute, seed by seed; seed 0 sweeps the paper's lr grid on held-out."""
    steps = []
    for fraction in FEW_LABELS:
        ft_epochs, scratch_epochs, ft_args, scratch_args = few_label_budget(fraction)
        for seed in SEEDS:
            ft, base = few_label_arms(fraction, seed)
            lr_from = None if seed == SEEDS[0] else few_label_arms(fraction, SEEDS[0])[0]
            steps.append(finetune("mpp", seed, ft_epochs, lr_from, *ft_args, name=ft))
            steps.append(scratch(seed, scratch_epochs, base.rsplit("_s", 1)[0], *scratch_args))
    return steps


def gpu_track(py: str) -> list[Step]:
    """The hybrid at the GPU budget: from scratch and MPP + fine-tune run side by side on one
    GPU (benchmarks/device_study.sh), the exported features evaluated anywhere."""
    mpp = "mpp_hybrid_gpu"
    steps = [
        scratch(SEEDS[0], GPU_SCRATCH_EPOCHS, "scratch_hybrid_gpu", *HYBRID, *GPU_RUN),
        pretrain(
            mpp, MPP, py, *HYBRID, *GPU_RUN, epochs=GPU_PRETRAIN_EPOCHS, snapshots=GPU_SNAPSHOTS
        ),  # fmt: skip
        # the same 50 epochs split 20 + 30 (study_steps.GPU_SPLIT): first, goal 2's best bet
        finetune(mpp, SEEDS[0], GPU_SPLIT[1], f"ft_mpp_s{SEEDS[0]}", HYBRID[1], *GPU_RUN,
                 name=f"ft_{mpp}_e{GPU_SPLIT[0]}_s{SEEDS[0]}", snapshot=GPU_SPLIT[0]),
        # every seed fine-tunes the one pretraining, with the 16-token sweep's lr, as the main
        # comparison's seeds do: seeds 1-2 give the GPU budget its error bars (issue 13 item 5)
        *(finetune(mpp, seed, GPU_FINETUNE_EPOCHS, f"ft_mpp_s{SEEDS[0]}", HYBRID[1], *GPU_RUN)
          for seed in SEEDS),
        *(scratch(seed, GPU_SCRATCH_EPOCHS, "scratch_hybrid_gpu", *HYBRID, *GPU_RUN)
          for seed in SEEDS[1:]),
    ]  # fmt: skip
    for step in steps:
        step.gpu = True
    return [
        *steps,
        *(  # the last first: the others draw the curve against pretraining length
            step
            for e in sorted(GPU_SNAPSHOTS, reverse=True)
            for step in evals(
                f"{mpp}_readout_e{e}",  # named like snapshot_evals' steps: the report reads both
                ["--backbone", str(STUDY / mpp / f"export_epoch{e}"), *READOUT],
                (mpp,),
            )
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("run", "status", "report"))
    p.add_argument("--only", nargs="+", metavar="STEP", help="run: just these steps (by name)")
    args = p.parse_args(argv)
    steps = plan()
    if args.action == "report":
        from study_report import write_report

        write_report(steps, RESULTS, ROOT / "RESULTS.md", BUDGET, STUDY, SNAPSHOTS, SEEDS)
        print("wrote RESULTS.md")
        return 0
    from study_run import run, state

    if args.action == "status":
        for step in steps:
            print(f"{state(step, ROOT):6}{step.name}")
        return 0

    return run(steps, ROOT, STUDY, args.only)


if __name__ == "__main__":
    from ssl_vit import startup

    startup.begin(pause_gc=False)  # MLflow telemetry off by default (ssl_vit/startup.py)
    sys.exit(main())
