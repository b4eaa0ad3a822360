"""Training configuration: a typed schema, YAML presets, `key=value` overrides, validation.

    cfg = load_config("configs/fmnist_vit_tiny_mpp.yaml", ["train.steps=200", "optim.lr=1e-3"])

Every preset in configs/ starts with the command that runs it. Unknown keys, wrong types and
inconsistent values are rejected with a one-line `ConfigError` that names the key, before any
training starts. The fully resolved config is written to the run directory as config.yaml.
The schema and its checks live here; filling dataclasses from YAML, ssl_vit.config_values.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_type_hints

import yaml

from ssl_vit.config_values import (
    ConfigError,
    Range,
    apply_mapping,
    check_range,
    parse_overrides,
    plain,
    yaml_problem,
)
from ssl_vit.io import atomic_write_text
from ssl_vit.recipe import MPP, TARGETS

# The objective kinds, by name only: validation must not import torch (a config error answers
# in a fraction of a second, not after the seconds torch and timm take to load). The registry
# in ssl_vit.objectives refuses to load unless its kinds are exactly these.
OBJECTIVE_KINDS = ("mpp", "supervised", "joint", "finetune", "cascade")
FINETUNE_KINDS = ("finetune", "cascade")  # objectives evals/finetune.py trains
# What run.stop_signals may name: what schedulers and launchers send to stop a job
# (ssl_vit/data/workers.py keeps loader workers deaf to all of them)
STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2")


@dataclass
class RunConfig:
    dir: str = "runs/default"  # run directory: config, checkpoints/, export/, logs; resumes itself
    seed: int = 0
    checkpoint_every: int = 500  # steps between checkpoints (one is always written at the end)
    keep_checkpoints: int = 2  # the last K complete checkpoints are kept
    # Epochs after which the backbone is also exported to RUN/export_epoch<E>/: snapshots of one
    # run for accuracy-against-pretraining-length curves.
    export_epochs: list[int] = field(default_factory=list)
    log_every: int = 20  # steps between metric lines / MLflow points
    max_nonfinite_steps: int = 5  # stop after this many non-finite losses in a row
    eval_every: int = 0  # steps between classifier evaluations; 0: at each epoch's end
    # The split on which in-training evals choose the best checkpoint (export_best/). None: the
    # held-out part of data.split ("holdout") when data.holdout_fraction > 0, else "val" when
    # the shard set has one, else nothing is chosen. Never "test": test data chooses nothing.
    eval_split: str | None = None
    report_split: str | None = "test"  # also scored at each eval, only reported
    # Signals that stop training at a step boundary on every rank, with a checkpoint there, the
    # MLflow run KILLED and exit code 124; the same command goes on from there. SLURM sends
    # SIGTERM at preemption and at the time limit, and the signal `--signal` asks for ahead of
    # it. Any of SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2; [] for none.
    stop_signals: list[str] = field(default_factory=lambda: ["SIGTERM", "SIGUSR1"])


@dataclass
class DataConfig:
    # Shard set made by data_prep/make_shards.py or indexed by data_prep/index_shards.py: a
    # folder or a URL (http(s)://, s3://, gs://, file://, or 'pipe:CMD {}' with {} for the
    # file name; ssl_vit.data.urls), a manifest file kept apart from its shards, or a brace
    # pattern naming some shards of a set (.../data-{000000..000099}.tar).
    root: str = "shards/fashion-mnist"
    split: str = "train"
    num_workers: int = 2
    augment: bool = True  # random resized crop + flip: the classification augmentation (B.1.2)
    crop_scale: tuple[float, float] = (0.08, 1.0)
    hflip: bool = True
    # Random shift of up to this many pixels per axis, zero-filled, after the crop: the "pad and
    # random crop" of small-image training (CIFAR-style); 0: none, as the paper (B.1.2).
    translate: int = 0
    # A shard missing or unreadable after its retries: stop ("error") or train on without it,
    # counted in the logs and MLflow ("skip").
    missing_shards: str = "error"
    # false: every training sample read once per epoch by exactly one loader stream (streams
    # start inside shards through the manifest's offset index); true: each stream draws shards
    # with replacement, an epoch being a sample count (elastic runs, few or unindexed remote
    # shards). ssl_vit.data.stream (the plan).
    resampled: bool = False
    # Where training JPEGs are decoded, cropped and flipped: "gpu" (the whole batch at once on
    # the training GPU; workers only read and draw the boxes), "cpu" (in the loader workers), or
    # "auto": gpu when training on CUDA from streamed shards without data.translate.
    decode: str = "auto"
    read_retries: int = 5  # tries of a failed remote read, with backoff from 1 s, doubling
    read_timeout: float = 60.0  # seconds a remote read may stall before it counts as failed
    # bytes/s below which an http(s) read fails even while bytes trickle in (ssl_vit.data.urls)
    min_read_rate: float = float(256 << 10)
    # seconds without a batch before training stops, naming what the loader was reading
    stall_timeout: float = 600.0
    # Bytes read are checked against the manifest's block checksums: "read" checks every block
    # read whole (held-out samples passed over by a seek leave theirs unchecked, and counted);
    # "all" reads those too, so every sample trained on is checked (ssl_vit.data.tar_reader).
    verify: str = "read"
    # Hashed share of `split` kept out of training to choose on (ssl_vit.data.holdout).
    # None: 0.02 when fine-tuning (the paper's held-out 2%, appendix B.1.1), else 0.
    holdout_fraction: float | None = None
    # Hashed share of the rest that training reads (1.0: all): 0.1 fine-tunes on 10% of the
    # labels, the label-scarce regime where pretraining on every image should pay.
    train_fraction: float = 1.0
    # A JSON file listing the manifest indices of `split` that training reads (sorted; none held
    # out), e.g. a class-balanced few per class; every other sample is left out. Not with
    # train_fraction < 1. None: all (ssl_vit.data.holdout).
    subset_file: str | None = None
    # Decode the split once into RAM and batch from there (ssl_vit.data.memory): true, false,
    # or auto (when its images share one size and decode to at most 2 GiB per rank).
    in_memory: Any = "auto"


@dataclass
class ModelConfig:
    arch: str = "vit_tiny_patch16_224"  # any timm ViT / hybrid / MLP-Mixer name
    img_size: int = 28
    patch_size: int | None = 4  # None keeps the architecture's own
    in_chans: int | None = None  # None: from the shard manifest (1 gray, 3 RGB)
    # passed on to timm.create_model; each key must be an argument of the arch's class
    kwargs: dict[str, Any] = field(default_factory=dict)
    init_from: str | None = None  # exported backbone / run dir to start from (fine-tuning);
    # its arch and kwargs win, position embeddings are resampled to img_size (sec. 3.2)
    drop_path_rate: float = 0.0  # stochastic depth while training (also with init_from); the
    # export does not keep it: a regulariser of this run, not a property of the weights

    def backbone_kwargs(self, in_chans: int) -> dict[str, Any]:
        """The `build_backbone` keyword arguments for a fresh (not `init_from`) backbone."""
        return {
            "img_size": self.img_size,
            "in_chans": in_chans,
            "patch_size": self.patch_size,
            **self.kwargs,
        }


@dataclass
class ObjectiveConfig:
    kind: str = "mpp"  # "mpp", "supervised", "joint" (a*MPP + b*supervised), "finetune" or
    # "cascade" (Dynamic ViT fine-tuning: ssl_vit.objectives.cascade)
    # MPP: the paper's recipe (ssl_vit.recipe) unless overridden
    corrupt_ratio: float = MPP.corrupt_ratio  # share of patches corrupted
    mask_prob: float = MPP.mask_prob  # of corrupted: [mask] embedding
    random_prob: float = MPP.random_prob  # of corrupted: another patch's embedding
    target: str = MPP.target  # one of ssl_vit.recipe.TARGETS
    bits: int = MPP.bits  # colour bits per channel of the targets
    # target=pixels only: each patch's pixels less their mean, over their std (MAE's target)
    normalize_pixels: bool = False
    label_smoothing: float = 0.0
    mpp_weight: float = 1.0
    supervised_weight: float = 1.0
    # cascade: image sizes of the coarser stages (the finest is model.img_size), and the reuses
    cascade_sizes: Any = (14, 28)
    feature_reuse: bool = True
    relation_reuse: bool = True


@dataclass
class OptimConfig:
    name: str = "adamw"  # "adamw" (pretraining, B.1) or "sgd" (fine-tuning, B.1.1)
    momentum: float = 0.9  # SGD only
    layer_decay: float | None = None  # fine-tuning: each block below the last at x this lr
    lr: float = 2e-4  # MPP: Adam, lr 2e-4 (B.1.2); supervised used 1e-3..3e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.1  # kept off biases, norms, position embeddings and special tokens
    grad_clip: float = 1.0  # global norm (B.1)
    warmup_steps: int = 10_000
    schedule: str = "cosine"  # "cosine" or "linear" decay after warmup
    min_lr_ratio: float = 0.0


@dataclass
class TrainConfig:
    global_batch: int = 4096  # images per optimizer step, whatever the number of ranks
    micro_batch: int | None = None  # cap per rank per forward (memory); None: no accumulation
    steps: int | None = None  # optimizer steps; or give epochs
    epochs: float | None = None  # in samples of the manifest's split
    # auto: bf16 on GPUs that have it (else fp16); on CPU fp32 without native bf16 (emulated bf16
    # is slower), and with AVX512-BF16/AMX the faster of fp32 and bf16 autocast, timed at start
    precision: str = "auto"
    zero_stage: int = 0  # DeepSpeed ZeRO stage 0-3
    # Merged last into DeepSpeed's JSON config, e.g. {zero_optimization: {offload_optimizer:
    # {device: cpu}}} or a lower stage3_param_persistence_threshold
    deepspeed: dict[str, Any] = field(default_factory=dict)
    # torch.compile each model block in place: true, false, or auto (long GPU runs; a CPU run
    # measures it: ssl_vit.engine.compile says when and why)
    compile: Any = False


@dataclass
class TrackingConfig:
    experiment: str = "ssl-vit"
    run_name: str | None = None
    uri: str | None = None  # None: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db
    register_as: str | None = None  # registered model name: the export becomes a new version
    parent_run_id: str | None = None  # nest this run under that one (a sweep's parent run)


@dataclass
class MonitorConfig:
    knn_every: int = 0  # steps between online kNN checks; 0 turns the monitor off
    train_split: str = "train"
    eval_split: str = "test"
    num_train: int = 5000  # labelled samples in the kNN gallery
    num_eval: int = 1000
    k: int = 20


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)

    def to_dict(self) -> dict[str, Any]:
        return plain(dataclasses.asdict(self))

    @property
    def holdout_share(self) -> float:
        """The share of data.split held out of training to choose on: data.holdout_fraction,
        by default 2% when fine-tuning (appendix B.1.1) and none otherwise."""
        f = self.data.holdout_fraction
        return (
            float(f) if f is not None else (0.02 if self.objective.kind in FINETUNE_KINDS else 0.0)
        )


def training_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """A config dict, as YAML reads it back, less the keys that change how a run executes but
    not what it trains (tracking, train.compile, data.in_memory: the same augmentation
    distribution, fed another way; run.stop_signals): what two runs must share for one's result
    to stand for the other's (a sweep's finished values, a rerun's cached results). A key the
    config has gained since `cfg` was written counts at its default, the value every run before
    it trained with."""
    out = yaml.safe_load(yaml.safe_dump(cfg))
    for section, defaults in Config().to_dict().items():
        if isinstance(out.get(section), dict):
            out[section] = {**defaults, **out[section]}
    out.pop("tracking", None)
    out.get("train", {}).pop("compile", None)
    out.get("data", {}).pop("in_memory", None)
    out.get("run", {}).pop("stop_signals", None)
    return out


def load_config(path: str | os.PathLike | None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML preset at `path`, then `overrides`; validated."""
    cfg = Config()
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"{p}: config file not found; see configs/ for presets")
        try:
            body = yaml.safe_load(p.read_text(encoding="utf-8")) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML ({yaml_problem(e)}); fix the file") from None
        if not isinstance(body, dict):
            raise ConfigError(f"{p}: expected a mapping of sections at the top level")
        apply_mapping(cfg, body)
    apply_mapping(cfg, parse_overrides(overrides or []))
    validate(cfg)
    return cfg


# Keys whose value is one of a few names (checked before anything that depends on them)
CHOICES: dict[str, tuple[Any, ...]] = {
    "objective.kind": OBJECTIVE_KINDS,
    "objective.target": TARGETS,
    "optim.name": ("adamw", "sgd"),
    "optim.schedule": ("cosine", "linear"),
    "train.precision": ("auto", "bf16", "fp16", "fp32"),
    "train.compile": (True, False, "auto"),
    "train.zero_stage": (0, 1, 2, 3),  # DeepSpeed's ZeRO stages
    "data.in_memory": (True, False, "auto"),
    "data.missing_shards": ("error", "skip"),
    "data.decode": ("auto", "cpu", "gpu"),
    "data.verify": ("read", "all"),
}


# The values every numeric key may take (the other keys are names, checked by CHOICES, or
# checked by their own code below). Written ">= a", "> a" or as an interval, "[0, 1)"; after a
# ";", what the error adds. A tuple or list key's range holds for each element. NaN and the
# infinities are refused everywhere. A numeric field added to the schema needs its row here
# (tests/test_bad_inputs.py fails until it has one); cross-key checks are in `validate`.
RANGES: dict[str, str] = {
    # torch.manual_seed takes 64 bits, and the trainer seeds each step with seed * 1_000_003 + ..
    "run.seed": "[0, 4294967295]",
    "run.checkpoint_every": ">= 1",  # step % checkpoint_every: 0 would divide by zero
    "run.keep_checkpoints": ">= 1",  # 0 would delete the checkpoint just written
    "run.export_epochs": ">= 1",  # an export at the end of epoch E; there is no end of epoch 0
    "run.log_every": ">= 1",  # step % log_every
    "run.max_nonfinite_steps": ">= 1",  # 0 would stop at the first step, finite or not
    "run.eval_every": ">= 0; 0 evaluates at each epoch's end",
    "data.num_workers": ">= 0; 0 reads in the training process",
    "data.crop_scale": "(0, 1]; shares of the image's area, e.g. [0.08, 1.0]",
    "data.translate": ">= 0",  # pixels; below model.img_size, checked in `validate`
    "data.read_retries": ">= 1",  # tries, the first included
    "data.read_timeout": "> 0",  # seconds
    "data.min_read_rate": "> 0",  # bytes/s
    "data.stall_timeout": "> 0",  # seconds
    "data.holdout_fraction": "[0, 0.5); e.g. 0.02",  # chosen on, never trained on
    "data.train_fraction": "(0, 1]; e.g. 0.1",
    "model.img_size": ">= 1",
    "model.patch_size": ">= 1",
    "model.in_chans": ">= 1",
    "model.drop_path_rate": "[0, 1)",  # a block's drop probability: 1 would drop every block
    "objective.corrupt_ratio": "(0, 1]",  # 0 would leave MPP nothing to predict
    "objective.mask_prob": "[0, 1]",  # with random_prob: shares of the corrupted patches
    "objective.random_prob": "[0, 1]",
    "objective.bits": "[1, 8]",  # of an 8-bit channel: 2^bits levels (ssl_vit.objectives.mpp)
    "objective.label_smoothing": "[0, 1)",  # 1 would spread every target evenly: no label left
    "objective.mpp_weight": ">= 0",  # joint: both 0 is refused in `validate`
    "objective.supervised_weight": ">= 0",
    "optim.momentum": "[0, 1)",  # SGD's; 1 never forgets a gradient
    "optim.layer_decay": "(0, 1]; e.g. 0.75",  # a block's lr is lr x layer_decay^depth-below
    "optim.lr": "> 0; e.g. 2e-4",
    "optim.betas": "[0, 1); e.g. [0.9, 0.999]",  # AdamW's moment decays
    "optim.eps": "> 0; e.g. 1e-8",  # AdamW's denominator guard
    "optim.weight_decay": ">= 0",
    "optim.grad_clip": ">= 0; 0 does not clip",  # DeepSpeed's gradient_clipping: 0 is off
    "optim.warmup_steps": ">= 0",
    "optim.min_lr_ratio": "[0, 1]",  # the end of the decay as a share of optim.lr
    "train.global_batch": ">= 1",
    "train.micro_batch": ">= 1",  # null: the whole per-rank batch in one forward
    "train.steps": ">= 1",
    "train.epochs": "> 0",
    "monitor.knn_every": ">= 0; 0 turns the monitor off",
    "monitor.num_train": ">= 1",
    "monitor.num_eval": ">= 1",
    "monitor.k": ">= 1",  # at most monitor.num_train, checked in `validate`
}


# Constructor arguments of the backbone that model.kwargs must not carry: the run sets them from
# its own keys (a model.kwargs value would win over those silently), or they have no place in a
# backbone built for training. The other keys are checked against the constructor of the arch's
# class once timm is loaded (engine.preflight.check_backbone).
KWARGS_SET_ELSEWHERE: dict[str, str] = {
    "img_size": "set model.img_size instead",
    "patch_size": "set model.patch_size instead",
    "in_chans": "set model.in_chans instead (or leave it to the shard manifest)",
    "drop_path_rate": "set model.drop_path_rate instead",
    "num_classes": "the backbone is built without a classifier (the objective adds its head); "
    "drop it",
    "pretrained": "weights come from model.init_from (an export); drop it",
    "device": "the training engine places the model; drop it",
    "dtype": "train.precision sets it; drop it",
}


def _hint(key: str) -> Any:
    """The type hint of `section.name` (a KeyError for a key the schema lacks: a stale row)."""
    section, name = key.split(".")
    return get_type_hints(get_type_hints(Config)[section])[name]


_RANGES = {key: (Range.parse(spec), _hint(key)) for key, spec in RANGES.items()}


def validate(cfg: Config, world_size: int | None = None) -> None:
    """Checks that need no data; `engine.preflight.check_data` does the rest with the shards."""
    for key, choices in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        # `in` alone would take 1 for True and 0.0 for False; the type must match too
        if not any(value == c and type(value) is type(c) for c in choices):
            names = [str(c).lower() if isinstance(c, bool) else str(c) for c in choices]
            raise ConfigError(f"{key}={value!r}: choose {', '.join(names[:-1])} or {names[-1]}")
    for key, (allowed, hint) in _RANGES.items():
        section, name = key.split(".")
        check_range(key, getattr(getattr(cfg, section), name), hint, allowed)
    m, o, t, d = cfg.model, cfg.objective, cfg.train, cfg.data
    if d.crop_scale[0] > d.crop_scale[1]:
        raise ConfigError(
            f"data.crop_scale={list(d.crop_scale)}: give [smallest, largest] share of the area, "
            "e.g. [0.08, 1.0]"
        )
    if d.subset_file is not None and d.train_fraction < 1:
        raise ConfigError(
            f"data.subset_file={d.subset_file!r} and data.train_fraction={d.train_fraction} both "
            "choose the samples trained on; give one"
        )
    if d.subset_file is not None and d.missing_shards == "skip":
        raise ConfigError(
            f"data.subset_file={d.subset_file!r} lists manifest indices, which a skipped shard "
            "would shift onto other samples; set data.missing_shards=error"
        )
    if o.kind == "cascade":
        _check_cascade_sizes(o.cascade_sizes, m.img_size)
    _check_stop_signals(cfg.run.stop_signals)
    if o.mask_prob + o.random_prob > 1:
        raise ConfigError(
            f"objective.mask_prob={o.mask_prob} + objective.random_prob={o.random_prob} exceeds "
            "1: they are shares of the corrupted patches (the rest are kept); lower one"
        )
    if o.normalize_pixels and o.target != "pixels":
        raise ConfigError(
            f"objective.normalize_pixels=true normalises pixel targets, but objective.target="
            f"{o.target!r}; set objective.target=pixels or drop it"
        )
    if o.kind == "joint" and o.mpp_weight == 0 and o.supervised_weight == 0:
        raise ConfigError(
            "objective.mpp_weight and objective.supervised_weight are both 0: the joint loss "
            "would train nothing; give one a positive weight"
        )
    for key, instead in KWARGS_SET_ELSEWHERE.items():
        if key in m.kwargs:
            raise ConfigError(f"model.kwargs.{key}: {instead}")
    if m.patch_size is not None and not m.init_from and m.img_size % m.patch_size:
        raise ConfigError(
            f"model.img_size={m.img_size} is not divisible by model.patch_size={m.patch_size}"
        )
    if (t.steps is None) == (t.epochs is None):
        raise ConfigError("give exactly one of train.steps and train.epochs")
    if t.compile is True and t.zero_stage == 3:
        raise ConfigError(
            "train.compile=true does not run under ZeRO-3 here (its parameter hooks run inside "
            "each block); set train.compile=auto or false"
        )
    if d.translate >= m.img_size:
        raise ConfigError(f"data.translate={d.translate}: a shift in pixels in [0, model.img_size)")
    if cfg.monitor.k > cfg.monitor.num_train:
        raise ConfigError(
            f"monitor.k={cfg.monitor.k} exceeds monitor.num_train={cfg.monitor.num_train}, the "
            "gallery it searches; lower monitor.k or raise monitor.num_train"
        )
    if cfg.run.eval_split is not None and cfg.run.eval_split in ("test", cfg.run.report_split):
        raise ConfigError(
            f"run.eval_split={cfg.run.eval_split!r} would choose the best checkpoint on test data; "
            "leave it unset (held-out part of the training split) or name a val split"
        )
    if world_size is not None:
        local_batch(cfg, world_size)


def _check_stop_signals(names: Any) -> None:
    ok = isinstance(names, (list, tuple)) and all(n in STOP_SIGNALS for n in names)
    if not ok or len(set(names)) != len(names):
        raise ConfigError(
            f"run.stop_signals={names!r}: give distinct names among {', '.join(STOP_SIGNALS)}, "
            "e.g. [SIGTERM, SIGUSR1], or [] for none"
        )


def _check_cascade_sizes(sizes: Any, img_size: int) -> None:
    ok = isinstance(sizes, (list, tuple)) and len(sizes) >= 1
    ok = ok and all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in sizes)
    if not ok or list(sizes) != sorted(set(sizes)) or sizes[-1] >= img_size:
        raise ConfigError(
            f"objective.cascade_sizes={sizes!r}: give increasing image sizes of the coarser "
            f"stages, each below model.img_size={img_size}, e.g. [14, 28]"
        )


def local_batch(cfg: Config, world_size: int) -> tuple[int, int, int]:
    """(per-rank batch, micro batch, gradient-accumulation steps) for this world size.

    `train.micro_batch` is a cap (what fits in one device's memory): the micro batch is the
    largest divisor of the per-rank batch that does not exceed it, so one preset serves 1 GPU
    (accumulating) and 32 (not needing to)."""
    t = cfg.train
    if t.global_batch % world_size:
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not divisible by the {world_size} ranks; "
            "change the batch or the number of processes"
        )
    per_rank = t.global_batch // world_size
    cap = min(t.micro_batch or per_rank, per_rank)
    micro = next(m for m in range(cap, 0, -1) if per_rank % m == 0)
    return per_rank, micro, per_rank // micro


def save_config(cfg: Config, path: str | os.PathLike, header: str = "") -> None:
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    atomic_write_text(path, (header + "\n" if header else "") + text)
