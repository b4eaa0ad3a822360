"""Bad inputs on every command line: the documented exit code, never a traceback, and a last
stderr line that names the file, option or config key and says what to do.

Each row is (id, argv, exit code, text the last stderr line must hold). Placeholders in argv:
{S} a real shard set, {IDX} the IDX folder it was made from, {B} a folder of broken inputs
(the `bad` fixture), {O} a fresh folder for this row only. Rows fail before any real work;
the few whose command must import timm first are marked slow. Pipeline rows add --check, so
a bad input that were wrongly accepted would not start a training run. More make_shards rows
(missing source, --resize without --size, --job-index, --shard-bytes, a different shard set
in OUT) live in test_data_prep_jobs.py.
"""

from __future__ import annotations

import json
import math
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, get_type_hints

import pytest
from conftest import run_cli

from ssl_vit.config import (
    CHOICES,
    RANGES,
    Config,
    ConfigError,
    load_config,
    training_settings,
    validate,
)
from ssl_vit.config_values import Range

MAKE = "data_prep/make_shards.py"
VERIFY = "data_prep/verify_shards.py"
MPP = "pipelines/mpp_pretrain.py"
SUP = "pipelines/supervised_pretrain.py"
FINETUNE = "evals/finetune.py"
# What every pipeline row needs to be valid apart from its one bad value.
RUN = ["data.root={S}", "run.dir={O}/run", "tracking.uri=sqlite:///{O}/mlflow.db"]
PRE = [*RUN, "model.img_size=16", "train.global_batch=32", "train.steps=2", "--check"]
# Evals: a small random baseline, no MLflow run, no feature cache outside the test.
RANDOM = ["--random-init", "vit_tiny_patch16_224", "--patch-size", "4", "--data", "{S}"]
EVAL = ["--no-mlflow", "--cache-dir", "{O}/cache"]
NO_RUN = "0123456789abcdef0123456789abcdef"  # a run id no store holds

ROWS = [
    # data_prep/make_shards.py: argparse errors exit 2, errors in the inputs exit 1
    ("source-wrong-file-type", [MAKE, "{B}/notes.md", "{O}"], 1,
     "notes.md: a file source must be a list file (.txt, .csv, .jsonl)"),
    ("source-without-images", [MAKE, "{B}/empty", "{O}"], 1,
     "empty: no images found"),
    ("shard-size-zero", [MAKE, "{IDX}", "{O}", "--shard-size", "0"], 2,
     "argument --shard-size: '0' is not a positive integer"),
    ("shard-size-fraction", [MAKE, "{IDX}", "{O}", "--shard-size", "1.5"], 2,
     "argument --shard-size: '1.5' is not a positive integer"),
    ("unknown-format", [MAKE, "{IDX}", "{O}", "--format", "gif"], 2,
     "argument --format: invalid choice: 'gif' (choose from"),
    ("quality-out-of-range", [MAKE, "{IDX}", "{O}", "--quality", "0"], 2,
     "argument --quality: '0' is not a quality from 1 to 100"),
    ("val-fraction-above-one", [MAKE, "{IDX}", "{O}", "--val-fraction", "1.5"], 2,
     "argument --val-fraction: '1.5' is not a fraction in [0, 1)"),
    ("fractions-sum-to-one", [MAKE, "{IDX}", "{O}", "--val-fraction", "0.6",
                              "--test-fraction", "0.5"], 2,
     "--val-fraction + --test-fraction must be below 1"),
    ("out-is-a-file", [MAKE, "{IDX}", "{B}/afile"], 1,
     "afile: exists and is not a folder; choose a folder for the shards"),
    ("out-under-a-file", [MAKE, "{IDX}", "{B}/afile/shards"], 1,
     "afile is a file; choose another folder"),
    ("jsonl-line-without-path", [MAKE, "{B}/nopath.jsonl", "{O}"], 1,
     'nopath.jsonl:2: expected a JSON object with "path"'),
    ("jsonl-line-bad-json", [MAKE, "{B}/badjson.jsonl", "{O}"], 1,
     'badjson.jsonl:2: expected a JSON object with "path"'),
    ("csv-header-without-path", [MAKE, "{B}/nopath.csv", "{O}"], 1,
     "nopath.csv: the header names columns file, label but none is 'path'"),
    ("class-names-file-missing", [MAKE, "{IDX}", "{O}", "--class-names", "@{B}/names.txt"], 1,
     "--class-names @{B}/names.txt: cannot read"),
    ("class-names-too-few", [MAKE, "{IDX}", "{O}", "--class-names", "a,b"], 1,
     "label 3 is out of range for 2 class names"),
    ("merge-before-jobs", [MAKE, "{IDX}", "{O}", "--merge"], 1,
     "is not written yet; run or rerun the job that owns it"),
    # data_prep/verify_shards.py: every problem exits 1
    ("verify-manifest-missing", [VERIFY, "{B}/empty"], 1,
     "empty/manifest.json: not found; point at a shard set made by data_prep/make_shards.py"),
    ("verify-manifest-corrupt", [VERIFY, "{B}/corrupt"], 1,
     "corrupt/manifest.json: not valid JSON"),
    ("verify-manifest-version", [VERIFY, "{B}/v99"], 1,
     "v99/manifest.json: format_version 99 is not supported (this ssl-vit reads 1)"),
    # pipelines/*.py and evals/finetune.py: ConfigError / ManifestError exit 2
    ("unknown-config-key", [MPP, *PRE, "train.stepz=3"], 2,
     "unknown config key 'train.stepz'; known keys here: train.global_batch"),
    ("config-value-wrong-type", [MPP, *PRE, "optim.lr=abc"], 2,
     "config key 'optim.lr': 'abc' is not a valid float"),
    ("config-list-given-a-number", [MPP, *PRE, "run.export_epochs=3"], 2,
     "config key 'run.export_epochs': 3 is not a valid list of int (e.g. [1, 2, 4])"),
    ("section-given-a-value", [MPP, *PRE, "run=3"], 2,
     "config key 'run' is a section; give a mapping"),
    ("override-not-key-value", [MPP, *PRE, "train.steps"], 2,
     "override 'train.steps' is not key=value"),
    ("config-file-missing", [MPP, "--config", "{B}/nope.yaml", *PRE], 2,
     "nope.yaml: config file not found; see configs/ for presets"),
    ("config-yaml-syntax", [MPP, "--config", "{B}/bad.yaml", *PRE], 2,
     "bad.yaml: not valid YAML (line 3, column 1:"),
    ("config-not-a-mapping", [MPP, "--config", "{B}/list.yaml", *PRE], 2,
     "list.yaml: expected a mapping of sections at the top level"),
    ("negative-steps", [MPP, *PRE, "train.steps=-5"], 2,
     "train.steps=-5: must be an integer >= 1"),
    ("corrupt-ratio-above-one", [MPP, *PRE, "objective.corrupt_ratio=1.5"], 2,
     "objective.corrupt_ratio=1.5: must be a number in (0, 1]"),
    # every numeric key has a range (config.RANGES); these once passed --check and then failed
    # in training with a ZeroDivisionError or a traceback from the loader or the optimizer
    ("checkpoint-every-zero", [MPP, *PRE, "run.checkpoint_every=0"], 2,
     "run.checkpoint_every=0: must be an integer >= 1"),
    ("num-workers-negative", [MPP, *PRE, "data.num_workers=-1"], 2,
     "data.num_workers=-1: must be an integer >= 0 (0 reads in the training process)"),
    ("lr-negative", [MPP, *PRE, "optim.lr=-1"], 2,
     "optim.lr=-1.0: must be a number > 0 (e.g. 2e-4)"),
    ("lr-nan", [MPP, *PRE, "optim.lr=.nan"], 2,
     "optim.lr=nan: must be a number > 0 (e.g. 2e-4)"),
    ("betas-at-one", [MPP, *PRE, "optim.betas=[0.9,1]"], 2,
     "optim.betas=[0.9, 1.0]: each must be a number in [0, 1) (e.g. [0.9, 0.999])"),
    ("crop-scale-reversed", [MPP, *PRE, "data.crop_scale=[1.0,0.5]"], 2,
     "data.crop_scale=[1.0, 0.5]: give [smallest, largest] share of the area"),
    ("translate-beyond-the-image", [MPP, *PRE, "data.translate=40"], 2,
     "data.translate=40: a shift in pixels in [0, model.img_size)"),
    ("img-size-not-divisible", [MPP, *PRE, "model.img_size=18"], 2,
     "model.img_size=18 is not divisible by model.patch_size=4"),
    ("batch-larger-than-data", [MPP, *PRE, "train.global_batch=4096"], 2,
     "train.global_batch=4096 exceeds the 512 training samples of split 'train'"),
    ("train-fraction-zero", [SUP, *PRE, "data.train_fraction=0"], 2,
     "data.train_fraction=0.0: must be a number in (0, 1] (e.g. 0.1)"),
    ("train-fraction-below-a-batch", [SUP, *PRE, "data.train_fraction=0.02"], 2,
     "training samples of split 'train'; lower the batch or raise data.train_fraction=0.02"),
    ("data-without-manifest", [MPP, *PRE, "data.root={B}/empty"], 2,
     "empty/manifest.json: not found"),
    ("data-split-not-in-manifest", [MPP, *PRE, "data.split=valid"], 2,
     "no split 'valid'; it has ['test', 'train']"),
    ("unknown-model-name", [MPP, *PRE, "model.arch=vit_no_such_model"], 2,
     "model.arch='vit_no_such_model' is not a timm model"),
    ("model-kwargs-not-taken", [MPP, *PRE, "model.kwargs={{no_such_option: 1}}"], 2,
     "model.kwargs.no_such_option: vit_tiny_patch16_224 (timm VisionTransformer) takes no "
     "'no_such_option'; it takes act_layer, attn_drop_rate,"),
    # model.kwargs is checked key by key against the arch's class: timm drops a null-valued key
    # and trained a full-size default model; a misspelt one ended in a TypeError traceback
    ("model-kwargs-no-space-after-colon", [MPP, *PRE, "model.kwargs={{embed_dim:64,depth:2}}"],
     2, "config key 'model.kwargs': 'embed_dim:64' reads as a key with no value; put a space "
     "after the colon: {{embed_dim: 64}}"),
    ("config-file-no-space-after-colon", [MPP, "--config", "{B}/nospace.yaml", *PRE], 2,
     "config key 'train.deepspeed.zero_optimization': 'stage:2' reads as a key with no value"),
    ("model-kwargs-misspelt", [MPP, *PRE, "model.kwargs={{dpeth: 2}}"], 2,
     "model.kwargs.dpeth: vit_tiny_patch16_224 (timm VisionTransformer) takes no 'dpeth'; "
     "did you mean 'depth'?"),
    ("model-kwargs-misspelt-no-data", [MPP, *PRE, "--no-data", "model.kwargs={{dpeth: 2}}"], 2,
     "model.kwargs.dpeth: vit_tiny_patch16_224 (timm VisionTransformer) takes no 'dpeth'; "
     "did you mean 'depth'?"),
    ("mixer-given-a-vit-kwarg", [MPP, *PRE, "model.arch=mixer_s16_224",
                                 "model.kwargs={{embed_dim: 32, depth: 2}}"], 2,
     "model.kwargs.depth: mixer_s16_224 (timm MlpMixer) takes no 'depth'; did you mean "
     "'num_blocks'?"),
    ("model-kwargs-sets-a-model-key", [MPP, *PRE, "model.kwargs={{img_size: 32}}"], 2,
     "model.kwargs.img_size: set model.img_size instead"),
    ("supervised-with-mpp-kind", [SUP, *PRE, "objective.kind=mpp"], 2,
     "supervised_pretrain.py: objective.kind must be supervised or joint"),
    ("unknown-precision", [SUP, *PRE, "train.precision=fp8"], 2,
     "train.precision='fp8': choose auto, bf16, fp16 or fp32"),
    ("finetune-backbone-missing", [FINETUNE, "--config", "configs/fmnist_finetune.yaml",
                                   "--backbone", "{B}/nope", *RUN, "--check"], 2,
     "model.init_from: {B}/nope: no backbone.json here"),
    ("finetune-chooses-on-test", [FINETUNE, "--config", "configs/fmnist_finetune.yaml", *RUN,
                                  "model.init_from=null", "run.eval_split=test", "--check"], 2,
     "run.eval_split='test' would choose the best checkpoint on test data"),
    ("finetune-sweep-one-value", [FINETUNE, "--config", "configs/fmnist_finetune.yaml", *RUN,
                                  "model.init_from=null", "--sweep", "optim.lr=0.01", "--check"],
     2, "--sweep 'optim.lr=0.01': expected section.key=v1,v2[,...] with two or more values"),
    ("finetune-sweep-without-holdout", [FINETUNE, "--config", "configs/fmnist_finetune.yaml",
                                        *RUN, "model.init_from=null", "data.holdout_fraction=0",
                                        "--sweep", "optim.lr=0.01,0.03", "--check"], 2,
     "--sweep chooses on held-out data: set data.holdout_fraction"),
    # evals/*.py: bad input exits 2
    ("knn-k-zero", ["evals/knn.py", *RANDOM, *EVAL, "--k", "0"], 2,
     "--k values must be >= 1"),
    ("fewshot-shots-not-integers", ["evals/fewshot.py", *RANDOM, *EVAL, "--shots", "1", "five"],
     2, "argument --shots: invalid int value: 'five'"),
    ("probe-backbone-missing", ["evals/linear_probe.py", "--backbone", "{B}/nope",
                                "--data", "{S}", *EVAL], 2,
     "nope: no such backbone folder; pass an export folder or run dir"),
    ("probe-backbone-without-export", ["evals/linear_probe.py", "--backbone", "{B}/noexport",
                                       "--data", "{S}", *EVAL], 2,
     "noexport: no backbone.safetensors here or under export/"),
    ("knn-split-not-in-manifest", ["evals/knn.py", *RANDOM, *EVAL, "--test-split", "val"], 2,
     "no split 'val'; it has ['test', 'train']"),
    ("inspect-backbone-without-export", ["evals/inspect_vit.py", "--backbone", "{B}/noexport",
                                         "--data", "{S}", "--out", "{O}", "--no-mlflow"], 2,
     "noexport: no backbone.json here or in"),
    # --backbone / model.init_from by MLflow URI ({M}: a real SQLite store, see `store`)
    ("knn-uri-unknown-run", ["evals/knn.py", "--backbone", f"runs:/{NO_RUN}/export",
                             "--data", "{S}", *EVAL, "--tracking-uri", "{M}"], 2,
     f"runs:/{NO_RUN}/export: no run {NO_RUN} in MLflow store"),
    ("probe-uri-missing-artifact", ["evals/linear_probe.py", "--backbone", "runs:/{R0}/export",
                                    "--data", "{S}", *EVAL, "--tracking-uri", "{M}"], 2,
     "runs:/{R0}/export: run {R0} has no artifact 'export'"),
    ("fewshot-uri-model-without-versions", ["evals/fewshot.py", "--backbone", "models:/empty/1",
                                            "--data", "{S}", *EVAL, "--tracking-uri", "{M}"], 2,
     "models:/empty/1: registered model 'empty' has no versions"),
    ("knn-uri-pickled-weights", ["evals/knn.py", "--backbone", "runs:/{RP}/export",
                                 "--data", "{S}", *EVAL, "--tracking-uri", "{M}"], 2,
     "runs:/{RP}/export: holds backbone.pt (pickled weights) and no backbone.safetensors"),
    ("finetune-uri-unknown-model", [FINETUNE, "--config", "configs/fmnist_finetune.yaml", *RUN,
                                    "model.init_from=models:/nosuch@best", "tracking.uri={M}",
                                    "--check"], 2,
     "model.init_from: models:/nosuch@best: no registered model 'nosuch'"),
    ("inspect-manifest-version", ["evals/inspect_vit.py", "--random-init", "vit_tiny_patch16_224",
                                  "--data", "{B}/v99", "--out", "{O}", "--no-mlflow"], 2,
     "v99/manifest.json: format_version 99 is not supported"),
]  # fmt: skip


@pytest.fixture(scope="module")
def bad(tmp_path_factory) -> Path:
    """One folder of broken inputs, shared by the rows."""
    b = tmp_path_factory.mktemp("bad")
    (b / "notes.md").write_text("not a list of images\n")
    (b / "empty").mkdir()
    (b / "afile").write_text("a file where a folder should be\n")
    (b / "nopath.jsonl").write_text('{"path": "a.png"}\n{"label": 1}\n')
    (b / "badjson.jsonl").write_text('{"path": "a.png"}\n{"path": "b.png", \n')
    (b / "nopath.csv").write_text("file,label\na.png,1\n")
    (b / "bad.yaml").write_text("run:\n  dir: [unclosed\n")
    (b / "list.yaml").write_text("- train\n- model\n")
    (b / "nospace.yaml").write_text("train:\n  deepspeed: {zero_optimization: {stage:2}}\n")
    (b / "corrupt").mkdir()
    (b / "corrupt" / "manifest.json").write_text('{"format": "ssl-vit-shards", "splits": {')
    (b / "v99").mkdir()
    manifest = {"format": "ssl-vit-shards", "format_version": 99, "splits": {}}
    (b / "v99" / "manifest.json").write_text(json.dumps(manifest))
    (b / "noexport").mkdir()
    (b / "noexport" / "README.txt").write_text("a run directory that never exported\n")
    return b


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict[str, str]:
    """A real MLflow SQLite store: a run without an export ({R0}), a run whose export holds
    pickled weights instead of safetensors ({RP}), a registered model without versions."""
    import torch
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("bad", artifact_location=str(root / "artifacts"))
    pickled = root / "export"
    pickled.mkdir()
    torch.save({"w": torch.zeros(2)}, pickled / "backbone.pt")
    (pickled / "backbone.json").write_text('{"format_version": 1, "arch": "x", "kwargs": {}}')
    r0, rp = (client.create_run(exp).info.run_id for _ in range(2))
    client.log_artifacts(rp, str(pickled), "export")
    client.create_registered_model("empty")
    return {"M": uri, "R0": r0, "RP": rp}


# Rows whose command must import timm before it can tell (about 10 s each on a busy machine).
SLOW = {
    "finetune-uri-unknown-model",
    "unknown-model-name",
    "model-kwargs-not-taken",
    "model-kwargs-misspelt",
    "model-kwargs-misspelt-no-data",
    "mixer-given-a-vit-kwarg",
    "finetune-backbone-missing",
    "inspect-backbone-without-export",
    "inspect-manifest-version",
}
PARAMS = [
    pytest.param(*r[1:], id=r[0], marks=[pytest.mark.slow] if r[0] in SLOW else []) for r in ROWS
]


TEST = "test_bad_input_is_one_line_error"


@pytest.fixture(scope="module")
def outcomes(request, bad, store, tiny_shards, tmp_path_factory) -> dict[str, tuple]:
    """(process, placeholders) of every row selected in this session, keyed by row id. A row's
    time is almost all its command's start-up (imports, one core), so the commands run a few at
    a time, once, when the first row asks, rather than one after another; each row still has
    its own process, its own {O} and MLflow cache folders, and its own test and verdict."""
    ids = [i.callspec.id for i in request.session.items
           if i.module is request.module and i.originalname == TEST]  # fmt: skip
    rows = {r[0]: r[1] for r in ROWS if r[0] in ids}
    base = tmp_path_factory.mktemp("rows")

    def run_row(row: str) -> tuple:
        (base / row).mkdir()  # as tmp_path was: {O} itself is left for the command to make
        where = {"S": tiny_shards, "IDX": tiny_shards.parent / "idx", "B": bad,
                 "O": base / row / "out", **store}  # fmt: skip
        env = {"SSL_VIT_MLFLOW_CACHE": str(base / row / "mlflow-cache")}  # never the user's
        return run_cli([a.format(**where) for a in rows[row]], timeout=300, env=env), where

    with ThreadPoolExecutor(max_workers=(os.cpu_count() or 1) + 1) as pool:
        return dict(zip(rows, pool.map(run_row, rows), strict=True))


@pytest.mark.parametrize("argv,code,message", PARAMS)
def test_bad_input_is_one_line_error(argv, code, message, outcomes, request):
    proc, where = outcomes[request.node.callspec.id]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines, f"no message on stderr; stdout: {proc.stdout[-1000:]}"
    assert proc.returncode == code, (proc.returncode, lines[-1])
    assert message.format(**where) in lines[-1], lines[-1]


def test_table_is_wide():
    """At least 24 rows, every row's id unique, every command line covered."""
    assert len(ROWS) >= 24 and len({r[0] for r in ROWS}) == len(ROWS)
    assert SLOW <= {r[0] for r in ROWS}
    scripts = {r[1][0] for r in ROWS}
    assert {MAKE, VERIFY, MPP, SUP, FINETUNE} <= scripts
    evals = {"linear_probe", "knn", "fewshot", "inspect_vit"}
    assert {f"evals/{e}.py" for e in evals} <= scripts


@pytest.mark.slow
def test_broken_latest_pointer_is_one_line_error(tiny_shards, tmp_path):
    """A `latest` that names a checkpoint which is not there (copied run, hand edits), and no
    other checkpoint to fall back to (with one, the run resumes from it: see
    test_checkpoint_failover.py)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step00000007\n")
    argv = [MPP, f"data.root={tiny_shards}", f"run.dir={run}", "model.img_size=16",
            f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "train.global_batch=32",
            "train.steps=2"]  # fmt: skip
    proc = run_cli(argv, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "no intact checkpoint to resume" in last, last
    assert "latest names 'step00000007', which does not exist" in last, last


def _schema() -> dict[str, Any]:
    """Every `section.name` of the config schema and its type hint."""
    return {f"{section}.{name}": hint
            for section, cls in get_type_hints(Config).items()
            for name, hint in get_type_hints(cls).items()}  # fmt: skip


def test_every_numeric_key_has_a_range():
    """A numeric field added to the schema without a row in config.RANGES (or CHOICES) fails
    here, before a bad value of it can reach training; and no row names a key that is gone."""
    numeric = {k for k, hint in _schema().items() if re.search(r"\b(int|float)\b", str(hint))}
    assert {"run.checkpoint_every", "optim.betas", "run.export_epochs"} <= numeric  # the probe
    assert numeric - set(RANGES) - set(CHOICES) == set()
    assert set(RANGES) <= numeric


def _outside(allowed: Range) -> list[float]:
    """Values just outside the range, on each side that has a bound."""
    out = [allowed.lo - 1 if allowed.lo_closed else allowed.lo]
    if math.isfinite(allowed.hi):
        out.append(allowed.hi + 1 if allowed.hi_closed else allowed.hi)
    return out


def _refused(key: str, override: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(None, ["train.steps=10", override])
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{key}="), message
    return message


@pytest.mark.parametrize("key", sorted(RANGES))
def test_a_value_outside_the_range_is_refused_naming_the_key(key):
    allowed, hint = Range.parse(RANGES[key]), _schema()[key]
    section, name = key.split(".")
    default = getattr(getattr(Config(), section), name)
    is_int = re.search(r"\bint\b", str(hint)) is not None
    bad = [int(v) for v in _outside(allowed)] if is_int else [*_outside(allowed), ".nan", ".inf"]
    for value in bad:
        many = isinstance(default, (list, tuple))
        text = f"[{', '.join([str(value)] * max(1, len(default)))}]" if many else str(value)
        message = _refused(key, f"{key}={text}")
        assert allowed.text in message, message
    # bool is an int to Python; set past the YAML reader (which refuses it already)
    cfg = load_config(None, ["train.steps=10"])
    setattr(getattr(cfg, section), name, [True] * max(1, len(default)) if many else True)
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=.*True"):
        validate(cfg)


def test_ranges_read_as_written():
    half = Range.parse("[0, 0.5); e.g. 0.02")
    assert (0 in half, 0.49 in half, 0.5 in half, -1e-9 in half) == (True, True, False, False)
    assert half.text == "in [0, 0.5)" and half.hint == "e.g. 0.02"
    positive = Range.parse("> 0")
    assert (1e-30 in positive, 0 in positive, math.inf in positive) == (True, False, False)
    assert math.nan not in Range.parse(">= 0") and 10**400 in Range.parse(">= 1")
    with pytest.raises(ValueError, match="write '>= a'"):
        Range.parse("0..1")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["objective.kind=joint", "objective.mpp_weight=0", "objective.supervised_weight=0"],
         "objective.mpp_weight and objective.supervised_weight are both 0"),
        (["objective.mask_prob=0.8", "objective.random_prob=0.3"],
         "objective.mask_prob=0.8 + objective.random_prob=0.3 exceeds 1"),
        (["monitor.num_train=10", "monitor.k=20"],
         "monitor.k=20 exceeds monitor.num_train=10"),
        (["data.crop_scale=[0.9,0.5]"], "data.crop_scale=[0.9, 0.5]: give [smallest, largest]"),
    ],
)  # fmt: skip
def test_keys_in_range_but_inconsistent_together_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, ["train.steps=10", *overrides])


def test_values_at_the_edges_of_their_ranges_pass():
    load_config(None, ["train.steps=1", "run.checkpoint_every=1", "data.num_workers=0",
                       "data.crop_scale=[1,1]", "optim.grad_clip=0", "optim.min_lr_ratio=1",
                       "optim.layer_decay=1", "objective.bits=8", "run.seed=4294967295",
                       "objective.kind=joint", "objective.mpp_weight=0", "monitor.k=5000",
                       "optim.warmup_steps=0", "run.eval_every=0"])  # fmt: skip


@pytest.mark.parametrize(
    ("value", "message"),
    [
        # SIGKILL cannot be handled; the others would fail only after the set-up
        ("[SIGKILL]", "give distinct names among SIGTERM, SIGINT, SIGHUP, SIGUSR1, SIGUSR2"),
        ("[sigterm]", "give distinct names among"),
        ("[SIGTERM, SIGTERM]", "give distinct names among"),
        ("[15]", "is not a valid list of str"),
        ("SIGTERM", "is not a valid list of str"),
    ],
)
def test_stop_signals_must_be_distinct_names_a_scheduler_sends(value, message):
    with pytest.raises(ConfigError, match=r"run\.stop_signals") as e:
        load_config(None, ["train.steps=10", f"run.stop_signals={value}"])
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_stop_signals_take_any_of_the_names_or_none():
    default = load_config(None, ["train.steps=10"])
    assert default.run.stop_signals == ["SIGTERM", "SIGUSR1"]
    load_config(None, ["train.steps=10", "run.stop_signals=[SIGUSR2, SIGHUP, SIGINT]"])
    none = load_config(None, ["train.steps=10", "run.stop_signals=[]"])
    assert none.run.stop_signals == []
    # how a run may be stopped is not what it trains: a sweep keeps a value trained either way
    assert training_settings(none.to_dict()) == training_settings(default.to_dict())
