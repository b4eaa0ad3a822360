#!/usr/bin/env bash
# The study's GPU track on one GPU: its training steps as parallel chains, in a copy of the tree,
# for at most BUDGET seconds a call; what has finished comes back under $OUT.
#
#   OUT=/tmp/device BUDGET=520 STUDY_GIT_COMMIT=$(git rev-parse HEAD) \
#       bash studies/mpp_fashion_mnist/gpu_track.sh            # start the chains, watch, collect
#   OUT=/tmp/device BUDGET=120 bash studies/mpp_fashion_mnist/gpu_track.sh collect
#                                                              # later: wait for them, collect
#
# Where nothing can be installed (a GPU node with torch and timm but no internet), the other
# dependencies travel beside the tree: .whl/ (ssl-vit[node] and what it needs beyond the node's
# packages, for its Python) and the Fashion-MNIST IDX files in .fmnist/, both written by
# `make offline-kit PRESENT=<the node's pip freeze> FMNIST_KIT=<IDX folder>`
# (benchmarks/offline_kit.py); the kit goes into a virtual environment over PY as
# benchmarks/offline_install.sh puts it there. Elsewhere `pip install -e .` and FMNIST=DIR do.
#
# CHAINS: the steps, chains separated by ';', each chain's steps run one after the other by
# `$STUDY run --only` (a step with a committed result is skipped). STUDY: the study's runner
# (this study's by default; `studies/mpp_label_scarce/study.py chains` prints that study's
# chains); RESULTS: what comes back, paths or globs under the tree. The default is issue 38's
# rules on the GPU track: MPP pretraining seeds 0-2 and their fine-tunes, from scratch's lr grid
# and from scratch seeds 1-2 at the preset's lr. A small model leaves a GPU mostly idle between
# kernel launches, so the chains share it. Each chain logs to its own MLflow store (one SQLite
# file per writer).
#
# The chains run in a copy of the tree (WORK) as their own sessions: a first call that reaches
# BUDGET leaves them running (KEEP=1, the default) and returns what has finished; `collect` waits
# for them on the same machine up to its BUDGET, then stops what is left. Unfinished steps resume
# from their checkpoints on a later run in the same WORK.
set -u
MODE=${1:-start}
OUT=${OUT:-/tmp/gpu_track}
BUDGET=${BUDGET:-520}
KEEP=${KEEP:-1}
WORK=${WORK:-/tmp/gpu_track_tree}
FMNIST=${FMNIST:-.fmnist}
WHEELS=${WHEELS:-.whl}
PY=${PY:-python3}
STUDY=${STUDY:-studies/mpp_fashion_mnist/study.py}
RESULTS=${RESULTS:-"studies/mpp_fashion_mnist/results/*_gpu* studies/mpp_fashion_mnist/results/scratch_sweep/hybrid_gpu"}
CHAINS=${CHAINS:-"mpp_hybrid_gpu_seed0 ft_mpp_hybrid_gpu_seed0_s0;
mpp_hybrid_gpu_seed1 ft_mpp_hybrid_gpu_seed1_s1;
mpp_hybrid_gpu_seed2 ft_mpp_hybrid_gpu_seed2_s2;
scratch_sweep/hybrid_gpu/lr=5e-4; scratch_sweep/hybrid_gpu/lr=1e-3;
scratch_sweep/hybrid_gpu/lr=2e-3; scratch_sweep/hybrid_gpu/lr=4e-3;
scratch_hybrid_gpu_s1; scratch_hybrid_gpu_s2"}
T0=$(date +%s)
elapsed() { echo $(($(date +%s) - T0)); }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1

if [ "$MODE" = start ]; then
    rm -rf "$WORK" && mkdir -p "$WORK" && cp -a . "$WORK"/ && cd "$WORK" || exit 1
    if [ -d "$WHEELS" ]; then
        PY=$PY bash benchmarks/offline_install.sh "$WHEELS" /tmp/gpu_track_venv -q --no-compile \
            --no-cache-dir || exit 1
        PY=/tmp/gpu_track_venv/bin/python
    fi
    echo "export PY=$PY PYTHONPATH=$WORK STUDY_GIT_COMMIT=${STUDY_GIT_COMMIT:-}" >env.sh
    . ./env.sh
    nvidia-smi -L
    $PY -c "import torch, deepspeed, webdataset, mlflow, timm; print('torch', torch.__version__,
'deepspeed', deepspeed.__version__, 'timm', timm.__version__, 'mlflow', mlflow.__version__,
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU')" || exit 1
    mkdir -p runs/study/device
    [ -f shards/fashion-mnist/manifest.json ] ||
        $PY data_prep/make_shards.py "$FMNIST" shards/fashion-mnist --workers 12 \
            >runs/study/device/shards.log 2>&1 || { tail -5 runs/study/device/shards.log; exit 1; }
    echo "shards ready at $(elapsed) s"
    i=0
    IFS=';' read -ra chain_list <<<"$(echo "$CHAINS" | tr '\n' ' ')"  # one line: read stops at a newline
    for chain in "${chain_list[@]}"; do
        # shellcheck disable=SC2086  # a chain is a list of step names
        MLFLOW_TRACKING_URI="sqlite:///runs/study/device/mlflow_$i.db" setsid \
            $PY "$STUDY" run --only $chain \
            >"runs/study/device/chain_$i.log" 2>&1 </dev/null &
        echo "$!" >>runs/study/device/chains.pid
        echo "chain $i: $(echo $chain)"
        i=$((i + 1))
    done
    setsid nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv -l 10 \
        >runs/study/device/gpu_util.csv 2>&1 </dev/null &
else
    cd "$WORK" && . ./env.sh || exit 1
fi

running() { for p in $(cat runs/study/device/chains.pid); do kill -0 "$p" 2>/dev/null && return 0; done; return 1; }
while running && [ "$(elapsed)" -lt "$BUDGET" ]; do sleep 5; done
if running && { [ "$MODE" = collect ] || [ "$KEEP" = 0 ]; }; then
    echo "budget reached at $(elapsed) s: stopping the chains"
    for p in $(cat runs/study/device/chains.pid); do kill -TERM -- "-$p" 2>/dev/null; done
    sleep 5
fi
echo "$(running && echo 'chains still running' || echo 'chains ended') at $(elapsed) s"
for f in runs/study/device/chain_*.log; do echo "== $f"; grep -E "^\[study\]|Error|error:" "$f" | tail -4; done
for f in runs/study/*/metrics.jsonl runs/study/scratch_sweep/hybrid_gpu/*/metrics.jsonl; do
    [ -f "$f" ] && echo "$f: $(tail -1 "$f" | head -c 300)"
done

# What has finished: the results (JSON and metric lines) of the GPU steps; logs apart.
# shellcheck disable=SC2086  # RESULTS is a list of globs
tar -czf "$OUT/results.tgz" $RESULTS 2>/dev/null
tar -czf "$OUT/logs.tgz" runs/study/logs runs/label_scarce/logs runs/study/device 2>/dev/null
ls -la "$OUT"
echo "done at $(elapsed) s"
