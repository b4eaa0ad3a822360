#!/usr/bin/env bash
# The study's GPU track on one GPU, in one call: shards, then from scratch beside MPP +
# fine-tuning (steps.gpu_track), then the pipeline against the plain loop if time is left.
#
#   OUT=/tmp/device BUDGET=540 STUDY_GIT_COMMIT=$(git rev-parse HEAD) \
#       bash studies/mpp_fashion_mnist/gpu_track.sh
#   (copy .whl, .fmnist and runs/study/mpp_hybrid_gpu/export and .../export_epoch20 over first:
#   a few tens of MiB)
#
# Where nothing can be installed (a GPU node with torch and timm but no internet), the other
# dependencies travel beside the tree: .whl/*.whl (webdataset, mlflow-skinny and their needs for
# the node's Python), .whl/deepspeed-site.tgz (the pure-Python deepspeed package) and the
# Fashion-MNIST IDX files in .fmnist/, all written by `make offline-kit PRESENT=<the node's pip
# freeze>` (benchmarks/offline_kit.py; about 50 MiB). Elsewhere `pip install -e .` and FMNIST=DIR do.
# BUDGET: seconds after which unfinished steps are stopped (they resume from their checkpoints
# on a later call).
# What comes back under $OUT: the study's results of the track, logs and metric lines, and the
# MPP run's exports (the frozen evaluations of the study read them on any machine).
set -u
OUT=${OUT:-/tmp/gpu_track}
BUDGET=${BUDGET:-540}
FMNIST=${FMNIST:-.fmnist}
WHEELS=${WHEELS:-.whl}
PY=${PY:-python3}
LOGS=runs/study/device
T0=$(date +%s)
mkdir -p "$OUT" "$LOGS"
elapsed() { echo $(($(date +%s) - T0)); }

if [ -d "$WHEELS" ]; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        "$WHEELS"/*.whl && tar -xzf "$WHEELS"/deepspeed-site.tgz -C /tmp/site || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L
$PY -c "import torch, deepspeed, webdataset, mlflow, timm; print('torch', torch.__version__,
'deepspeed', deepspeed.__version__, 'timm', timm.__version__, 'mlflow', mlflow.__version__,
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" || exit 1
[ -f shards/fashion-mnist/manifest.json ] ||
    $PY data_prep/make_shards.py "$FMNIST" shards/fashion-mnist --workers 12 >"$LOGS/shards.log" 2>&1 ||
    { tail -5 "$LOGS/shards.log"; exit 1; }
echo "shards ready at $(elapsed) s"

# Two chains side by side: a small model leaves a GPU mostly idle between kernel launches.
# Steps with a committed result are skipped, the rest run in the plan's order (the 20 + 30
# split first); a fine-tune whose pretraining's export is not here (carried: above) pretrains
# it again first (4 minutes).
setsid $PY studies/mpp_fashion_mnist/study.py run --only mpp_hybrid_gpu ft_mpp_hybrid_gpu_{e20_s0,s0,s1,s2} \
    >"$LOGS/chain_mpp.log" 2>&1 &
A=$!
setsid $PY studies/mpp_fashion_mnist/study.py run --only scratch_hybrid_gpu_s{0,1,2} >"$LOGS/chain_scratch.log" 2>&1 &
B=$!
nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv -l 10 >"$LOGS/gpu_util.csv" 2>&1 &
PROFILED=
while kill -0 $A 2>/dev/null || kill -0 $B 2>/dev/null; do
    # Where a training step's host time goes: 15 s of the from-scratch run, idle time included
    # (a wait on the GPU shows as such), if py-spy travelled with the wheels.
    if [ -z "$PROFILED" ] && [ "$(elapsed)" -ge 120 ] && [ -x /tmp/site/bin/py-spy ]; then
        P=$(pgrep -f "supervised_pretrain.py.*scratch_hybrid_gpu" | head -1)
        [ -n "$P" ] && PROFILED=1 && /tmp/site/bin/py-spy record --pid "$P" --duration 15 \
            --rate 250 --idle --format raw -o "$OUT/pyspy_scratch.txt" >"$LOGS/pyspy.log" 2>&1 &
    fi
    if [ "$(elapsed)" -ge "$BUDGET" ]; then
        echo "budget reached at $(elapsed) s: stopping the chains"
        kill -TERM -- -$A -$B 2>/dev/null  # each chain is its own process group: its training goes too
        sleep 5
        break
    fi
    sleep 5
done
echo "chains ended at $(elapsed) s"
for f in runs/study/*_gpu*/metrics.jsonl; do
    [ -f "$f" ] && echo "$f: $(tail -1 "$f" | head -c 400)"
done

# The pipeline against the plain loop on this GPU, in fp32 and then in bf16 (what
# `train.precision=auto` takes on this GPU), each if two minutes are left.
for prec in fp32 bf16; do
    [ $((BUDGET - $(elapsed))) -ge 120 ] || break
    timeout $((BUDGET - $(elapsed))) $PY benchmarks/train_throughput.py --steps 200 --rounds 1 \
        --config configs/fmnist_hybrid_mpp.yaml --out "$OUT/train_throughput_$prec.json" \
        "train.precision=$prec" >"$LOGS/throughput_$prec.log" 2>&1
    tail -4 "$LOGS/throughput_$prec.log"
done

tar -czf "$OUT/results.tgz" studies/mpp_fashion_mnist/results/*_gpu* 2>/dev/null
tar -czf "$OUT/logs.tgz" runs/study/logs "$LOGS" runs/study/*_gpu*/metrics.jsonl \
    runs/study/*_gpu*/config.yaml 2>/dev/null
for e in export_epoch10 export_epoch20 export_epoch40; do  # export/ is export_epoch40
    d=runs/study/mpp_hybrid_gpu/$e
    [ -f "$d/objective.json" ] && tar -czf "$OUT/mpp_hybrid_gpu.$e.tgz" "$d"
done
ls -la "$OUT"
echo "done at $(elapsed) s"
