#!/usr/bin/env bash
# One script that proves a GPU machine: ViT-B/16 MPP steps, the JPEG loader (CPU and GPU
# decoding), kNN on 100k x 768 features and a ZeRO-3 kill-and-resume, as one table, in at most
# about 8 minutes on one GPU (benchmarks/gpu_check.py says what each row measures).
#
#   bash benchmarks/gpu_check.sh                         # -> results/device/gpu_check_<gpu>.json
#   bash benchmarks/gpu_check.sh --device cpu --quick    # the same code on a CPU, tiny sizes
#
# On a GPU node without internet, copy .whl/ over first (`make offline-kit PRESENT=<the node's
# pip freeze>` writes it on a machine with internet): when PY lacks the packages, the kit goes
# into .venv as `make offline-install` puts it there, and .venv runs the check.
# PY picks the interpreter (default: .venv/bin/python if there is one, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
if [ -d .whl ] && ! $PY -c "import deepspeed, webdataset, mlflow" 2>/dev/null; then
    PY=$PY bash benchmarks/offline_install.sh .whl .venv -q
    PY=.venv/bin/python
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
name=$($PY -c "import torch; print(torch.cuda.get_device_name(0).replace(' ', '_')
      if torch.cuda.is_available() else 'cpu')")
exec timeout 900 $PY benchmarks/gpu_check.py --out "results/device/gpu_check_${name}.json" "$@"
