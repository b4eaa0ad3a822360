"""What a GPU run gets without a GPU to run it on: ZeRO's communication settings in the DeepSpeed
config, and the published peak that model FLOP utilisation divides by. Pure functions, fast."""

from __future__ import annotations

import pytest
import torch
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

from ssl_vit import perf
from ssl_vit.config import load_config
from ssl_vit.engine.optim import comm_settings, deepspeed_config, model_size
from ssl_vit.engine.trainer import MetricWindow
from ssl_vit.perf import matmul_dtype, mfu_denominator, published_peak

VIT_B = {"params": 86_567_656, "width": 768}  # vit_base_patch16_224
COMM_KEYS = {"overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size"}


def cfg_with(*overrides: str):
    return load_config(None, ["train.steps=10", "train.global_batch=64", *overrides])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cpu_config_is_what_it_was(stage, precision):
    """On the CPU accelerator the config gains nothing: DeepSpeed's CPU streams are no-ops, so
    there is nothing for overlap_comm to overlap (gloo reduces in the calling thread)."""
    cfg = cfg_with(f"train.zero_stage={stage}")
    plain = deepspeed_config(cfg, 2, 8, 4, precision)
    assert deepspeed_config(cfg, 2, 8, 4, precision, on_gpu=False, **VIT_B) == plain
    assert not COMM_KEYS & set(plain["zero_optimization"])


def test_gpu_zero0_fp32_has_no_zero_optimizer_to_configure():
    ds = deepspeed_config(cfg_with("train.zero_stage=0"), 8, 8, 1, "fp32", on_gpu=True, **VIT_B)
    assert ds["zero_optimization"] == {"stage": 0}


@pytest.mark.parametrize(("stage", "precision"), [(0, "bf16"), (1, "bf16"), (2, "fp32")])
def test_gpu_zero1_and_2_overlap_in_buckets_of_an_eighth_of_the_model(stage, precision):
    """bf16 at stage 0 runs DeepSpeed's stage-1 path, so it is configured as stage 1."""
    cfg = cfg_with(f"train.zero_stage={stage}")
    zero = deepspeed_config(cfg, 8, 8, 1, precision, on_gpu=True, **VIT_B)["zero_optimization"]
    bucket = 11 * 2**20  # 86.6M / 8 = 10.8M, up to whole 2**20 elements
    assert zero == {
        "stage": max(stage, 1),
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
    }
    parsed = DeepSpeedZeroConfig(**zero)  # DeepSpeed's own validation of the section
    assert parsed.overlap_comm and parsed.reduce_bucket_size == bucket


@pytest.mark.parametrize(
    ("params", "bucket"),
    [
        (5_700_000, 25 * 2**20 // 4),  # a tiny ViT: one bucket, of 25 MiB of fp32 gradients
        (304_000_000, 37 * 2**20),  # ViT-L
        (1_843_000_000, 220 * 2**20),  # ViT-G
        (10_000_000_000, 500_000_000),  # past DeepSpeed's default: its default
    ],
)
def test_bucket_scales_with_the_model_within_bounds(params, bucket):
    got = comm_settings(2, params, 1024)
    assert got["reduce_bucket_size"] == got["allgather_bucket_size"] == bucket
    assert bucket % 2 == 0  # DeepSpeed asserts an even all-gather bucket


def test_gpu_zero3_takes_width_squared_sizes():
    zero = deepspeed_config(cfg_with("train.zero_stage=3"), 8, 8, 1, "bf16", on_gpu=True, **VIT_B)
    zero = zero["zero_optimization"]
    assert zero == {
        "stage": 3,
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_bucket_size": 768 * 768,
        "stage3_prefetch_bucket_size": int(0.9 * 768 * 768),
        "stage3_param_persistence_threshold": 7680,  # biases and norms stay whole
    }
    parsed = DeepSpeedZeroConfig(**zero)
    assert parsed.prefetch_bucket_size == 530_841 and parsed.param_persistence_threshold == 7680
    no_width = comm_settings(3, VIT_B["params"], 0)
    assert no_width["reduce_bucket_size"] == 11 * 2**20
    assert not any(k.startswith("stage3_") for k in no_width)  # DeepSpeed's defaults


def test_train_deepspeed_overrides_merge_on_top_of_the_gpu_defaults():
    """fp32 communication stays the default; bf16 communication, or no overlap, is one
    override away, and the other defaults stay."""
    cfg = cfg_with(
        "train.zero_stage=2",
        "train.deepspeed={communication_data_type: bf16, zero_optimization: {overlap_comm: false}}",
    )
    default = deepspeed_config(
        cfg_with("train.zero_stage=2"), 8, 8, 1, "bf16", on_gpu=True, **VIT_B
    )
    assert default["communication_data_type"] == "fp32"
    ds = deepspeed_config(cfg, 8, 8, 1, "bf16", on_gpu=True, **VIT_B)
    assert ds["communication_data_type"] == "bf16"
    assert ds["zero_optimization"]["overlap_comm"] is False
    assert ds["zero_optimization"]["reduce_bucket_size"] == 11 * 2**20
    assert ds["data_types"] == {"grad_accum_dtype": "fp32"}


def test_model_size_reads_the_objective_and_its_backbone_width():
    from ssl_vit.models import build_backbone
    from ssl_vit.objectives import build_objective

    backbone = build_backbone("vit_tiny_patch16_224", img_size=16, in_chans=1, patch_size=4,
                              depth=2, embed_dim=32, num_heads=2)  # fmt: skip
    objective = build_objective("mpp", backbone, mean=[0.5], std=[0.25])
    size = model_size(objective)
    assert size == {"params": sum(p.numel() for p in objective.parameters()), "width": 32}
    assert size["params"] > sum(p.numel() for p in backbone.parameters())  # the head counts
    assert model_size(torch.nn.Linear(3, 4)) == {"params": 16, "width": 0}


# Names as torch.cuda.get_device_name() gives them -> (the table's name, dense bf16 TFLOP/s).
@pytest.mark.parametrize(
    ("device", "expect"),
    [
        ("NVIDIA A100-SXM4-80GB", ("A100", 312)),
        ("NVIDIA A100-SXM4-40GB", ("A100", 312)),
        ("NVIDIA A100 80GB PCIe", ("A100", 312)),
        ("NVIDIA A100-PCIE-40GB", ("A100", 312)),
        ("NVIDIA H100 80GB HBM3", ("H100 SXM", 989.5)),
        ("NVIDIA H100 PCIe", ("H100 PCIe", 756.5)),
        ("NVIDIA H100 NVL", ("H100 NVL", 835.5)),
        ("NVIDIA H200", ("H200 SXM", 989.5)),
        ("NVIDIA H200 NVL", ("H200 NVL", 835.5)),
        ("NVIDIA L40S", ("L40S", 362.05)),
        ("NVIDIA L4", ("L4", 121)),
        ("NVIDIA A10", ("A10", 125)),
        ("AMD Instinct MI300X", ("MI300X", 1307.4)),
        # not in the table, or not the whole GPU: no published figure
        ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", None),
        ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", None),
        ("NVIDIA H100", None),  # SXM or PCIe: the name does not say
        ("NVIDIA GH200 480GB", None),
        ("NVIDIA L40", None),
        ("NVIDIA A10G", None),
        ("NVIDIA RTX A1000", None),
        ("NVIDIA A100X", None),
        ("NVIDIA GeForce RTX 4090", None),
        ("Tesla V100-SXM2-16GB", None),  # Volta has no bf16 tensor cores
    ],
)
def test_published_bf16_peak_by_device_name(device, expect):
    found = published_peak(device, "bf16")
    if expect is None:
        assert found is None
    else:
        name, flops, source = found
        assert (name, flops) == (expect[0], expect[1] * 1e12)
        assert "datasheet" in source or "data sheet" in source


@pytest.mark.parametrize(
    ("device", "dtype", "tflops"),
    [
        ("NVIDIA H100 80GB HBM3", "fp16", 989.5),
        ("NVIDIA H100 80GB HBM3", "tf32", 494.5),  # 989 with sparsity, halved
        ("NVIDIA H100 80GB HBM3", "fp32", 67),
        ("NVIDIA A100-SXM4-80GB", "tf32", 156),
        ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
        ("NVIDIA L4", "tf32", 60),
        ("Tesla V100-SXM2-32GB", "fp16", 125),
        ("Tesla V100-PCIE-16GB", "fp16", 112),
        ("Tesla V100S-PCIE-32GB", "fp16", 130),
        ("Tesla V100-SXM2-16GB", "tf32", 15.7),  # no TF32 units: fp32 stays fp32
        ("AMD Instinct MI300X", "fp32", 163.4),
        ("AMD Instinct MI300X", "tf32", None),
    ],
)
def test_published_peak_by_dtype(device, dtype, tflops):
    found = published_peak(device, dtype)
    assert (found and found[1]) == (tflops and tflops * 1e12)


def test_mfu_denominator_falls_back_to_the_measured_peak_and_says_which():
    peak, why = mfu_denominator("NVIDIA H100 80GB HBM3", "bf16", 7.0e14)
    assert peak == 989.5e12
    assert why.startswith("the published dense bf16 peak of the H100 SXM: 989.5 TFLOP/s")
    peak, why = mfu_denominator(None, "fp32", 1.5e11)
    assert peak == 1.5e11
    assert why == "the fp32 matmul peak measured at start: 0.15 TFLOP/s (a CPU)"
    peak, why = mfu_denominator("NVIDIA GeForce RTX 4090", "bf16", 1.6e14)
    assert peak == 1.6e14 and "NVIDIA GeForce RTX 4090 has no published peak" in why


def test_matmul_dtype_follows_precision_and_torch_tf32_flag():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)  # a device object needs no GPU
    assert matmul_dtype("bf16", cpu) == "bf16" and matmul_dtype("fp16", cuda) == "fp16"
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert matmul_dtype("fp32", cuda) == "fp32"
        torch.set_float32_matmul_precision("high")  # cuBLAS may use TF32 for fp32 matmuls
        assert matmul_dtype("fp32", cuda) == "tf32"
        assert matmul_dtype("fp32", cpu) == "fp32"
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_measured_peak_is_the_best_timing_so_busy_moments_do_not_lower_it(monkeypatch):
    """Two of three timings land on a busy device (one matmul per 0.25 s on the clock), the
    third on a quiet one (four): the peak is the quiet rate; a median would be the busy one."""
    clock = {"now": 0.0, "calls": 0}

    def perf_counter() -> float:
        now = clock["now"]
        clock["calls"] += 1  # calls 1-4: the two busy timings (start, one matmul each)
        clock["now"] += 0.25 if clock["calls"] <= 4 else 0.0625
        return now

    monkeypatch.setattr(perf.time, "perf_counter", perf_counter)
    n = 8
    got = perf.measure_matmul_peak(n=n, repeats=3, min_time=0.25)
    assert got == pytest.approx(2 * n**3 * 4 / 0.25)  # not 2 * n**3 * 1 / 0.25


def test_metric_window_logs_mfu_against_both_peaks():
    window = MetricWindow(torch.device("cpu"), global_batch=8)
    window.add(torch.tensor(1.0), {})
    window.end_step(0.0)
    row = window.flush({}, flops_per_step=1e12, peak=4e12, world=2, measured_peak=1e12)
    fps = row["train/model_flops_per_s"]
    assert row["train/mfu"] == pytest.approx(fps / 8e12)
    assert row["train/mfu_measured"] == pytest.approx(fps / 2e12)
