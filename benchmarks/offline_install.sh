#!/usr/bin/env bash
# Install an offline kit (`make offline-kit`, benchmarks/offline_kit.py) on a GPU node without
# internet: pip resolves ssl-vit[node] from the kit's wheels alone, the package index off.
#
#   bash benchmarks/offline_install.sh KIT [VENV [PIP_ARGS...]]     # VENV: .venv by default
#   make offline-install KIT=.whl                                   # the same
#
# A VENV that exists (an environment that already has torch) gets the kit. One that does not
# is created with PY (python3 by default: the node's Python with torch, torchvision, timm) and
# sees every package PY sees, through a .pth file: torch is not copied, and the kit's wheels
# come first. configs/slurm/pretrain.sbatch runs the repository's .venv/bin/python when there
# is one. EXTRAS picks ssl-vit's extras (default node: S3 shard roots and CPU FAISS).
set -euo pipefail
if [ $# -lt 1 ] || [ ! -d "$1" ]; then
    echo "usage: offline_install.sh KIT [VENV [PIP_ARGS...]]: KIT is the folder of" \
        "\`make offline-kit\` (.whl)" >&2
    exit 2
fi
kit=$1
venv=${2:-.venv}
shift $(($# < 2 ? $# : 2))
PY=${PY:-python3}
EXTRAS=${EXTRAS:-node}
if ! compgen -G "$kit/ssl_vit-*.whl" >/dev/null; then
    echo "$kit: no ssl_vit wheel in it; build the kit with \`make offline-kit\`" >&2
    exit 2
fi
if [ ! -x "$venv/bin/python" ]; then
    # No pip of its own: the one PY has serves (a venv's ensurepip would also put an older
    # setuptools ahead of the node's, one that torch's requirement may refuse).
    "$PY" -m venv --without-pip "$venv"
    # --system-site-packages would show the base interpreter's packages, not those of a PY
    # that is itself a virtual environment (or a conda one): addsitedir shows PY's own, with
    # the .pth files there.
    "$PY" -c 'import site, sys; print("\n".join(site.getsitepackages()))' |
        "$venv/bin/python" -c '
import site, sys
from pathlib import Path
lines = [f"import site; site.addsitedir({d.strip()!r})\n" for d in sys.stdin if d.strip()]
(Path(site.getsitepackages()[0]) / "_node_site.pth").write_text("".join(lines))'
    "$venv/bin/python" -m pip --version >/dev/null 2>&1 || "$venv/bin/python" -m ensurepip -q
fi
# A new kit's ssl-vit has the version of the one installed: without this pip would keep the
# old code ("Requirement already satisfied").
"$venv/bin/python" -m pip uninstall -q -y ssl-vit 2>/dev/null || true
"$venv/bin/python" -m pip install --no-index --find-links "$kit" "ssl-vit[$EXTRAS]" "$@"
# What a job imports, and from where (run outside the tree, which would shadow the installed
# ssl_vit): a missing or broken package fails here, not in the job.
python=$(cd "$venv" && pwd)/bin/python
(cd / && "$python" - "$venv") <<'EOF'
import sys

import deepspeed, mlflow, timm, torch, webdataset  # noqa: E401, F401
import ssl_vit

print(f"{sys.argv[1]}: ssl-vit in {ssl_vit.__path__[0]}; torch {torch.__version__}, timm "
      f"{timm.__version__}, deepspeed {deepspeed.__version__}, mlflow {mlflow.__version__}")
EOF
