# ssl-vit: `make quickstart` (Fashion-MNIST shards, MPP-pretrain a small ViT, export, kNN eval)
# and `make test`. Both create .venv on first use.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
FMNIST  ?= /usr/share/datasets/fashion-mnist
SHARDS  ?= shards/fashion-mnist
RUN     ?= runs/quickstart

.PHONY: setup quickstart test test-fast lint fuzz bench fashion-mnist offline-kit offline-install

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[cpu,dev]'
	touch $@

setup: $(BIN)/.installed

# Debian's dataset-fashion-mnist package holds the IDX files. Where apt is not available,
# download the four *-ubyte.gz files of Fashion-MNIST yourself and run: make quickstart FMNIST=DIR
$(FMNIST)/train-images-idx3-ubyte.gz:
	@command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] || { \
	  echo "error: $(FMNIST) has no Fashion-MNIST; install Debian's dataset-fashion-mnist or set FMNIST=DIR holding the IDX .gz files" >&2; exit 1; }
	apt-get install -y -qq dataset-fashion-mnist >/dev/null || { apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist; }

fashion-mnist: $(FMNIST)/train-images-idx3-ubyte.gz

$(SHARDS)/manifest.json: | setup fashion-mnist
	$(BIN)/python data_prep/make_shards.py $(FMNIST) $(SHARDS) --workers 2
	$(BIN)/python data_prep/verify_shards.py $(SHARDS)

# A few minutes of MPP pretraining on the CPU, then the exported backbone's kNN accuracy.
# Rerunning resumes the run (and skips what is done).
quickstart: setup fashion-mnist $(SHARDS)/manifest.json
	$(BIN)/python pipelines/mpp_pretrain.py --config configs/fmnist_vit_tiny_mpp.yaml \
	    run.dir=$(RUN) data.root=$(SHARDS) train.epochs=null train.steps=120 \
	    optim.warmup_steps=20 run.checkpoint_every=40 run.log_every=10 monitor.knn_every=0
	$(BIN)/python evals/knn.py --backbone $(RUN) --data $(SHARDS) --k 20 --out $(RUN)/knn.json
	@echo "backbone: $(RUN)/export   kNN results: $(RUN)/knn.json"
	@echo "MLflow:   $(BIN)/mlflow ui --backend-store-uri sqlite:///mlflow.db  (http://127.0.0.1:5000)"

# The suite runs on parallel workers (pytest-xdist), one test module per worker at a time:
# most of its time is real launches (DeepSpeed ranks, MLflow servers) whose start-up uses one
# core. TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= auto
XDIST   := -n $(TEST_WORKERS) --maxprocesses 4 --dist loadfile --no-loadscope-reorder
test: setup
	$(BIN)/python -m pytest -q $(XDIST)

# The suite without the tests marked slow (the real launches: DeepSpeed ranks, MLflow servers).
test-fast: setup
	$(BIN)/python -m pytest -q $(XDIST) -m "not slow"

# What a GPU node without internet lacks, as wheels in .whl/: ssl-vit itself and everything
# 'ssl-vit[node]' requires (pyproject.toml) that the node does not have. PRESENT: the node's
# packages (`pip freeze` run there, or one name per line); PYTHON_TARGET: its Python version.
# FMNIST_KIT=DIR also copies Fashion-MNIST's IDX files from DIR to .fmnist/ (the study's data).
PYTHON_TARGET ?= 3.12
offline-kit: setup
	@test -n "$(PRESENT)" || { echo "make offline-kit PRESENT=FILE: the node's pip freeze"; exit 2; }
	$(BIN)/python benchmarks/offline_kit.py --present $(PRESENT) --python $(PYTHON_TARGET) \
	    $(if $(FMNIST_KIT),--fmnist $(FMNIST_KIT))

# On the node: the kit into $(VENV) (created over PY, the node's Python with torch, if there is
# none), with pip and no package index. configs/slurm/pretrain.sbatch then runs $(VENV).
KIT ?= .whl
offline-install:
	PY=$(PY) bash benchmarks/offline_install.sh $(KIT) $(VENV)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# The tar reader and the manifest parser fed damaged and random inputs
# (tests/test_parsers_fuzz.py): each must end, or raise its own one-line error. The suite runs a
# few hundred inputs of each kind; this runs FUZZ_EXAMPLES of each and prints how many ran.
FUZZ_EXAMPLES ?= 20000
fuzz: setup
	FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest -q -n 0 tests/test_parsers_fuzz.py \
	    --hypothesis-show-statistics

# Every benchmark side by side, written to BENCHMARKS.md (needs the shards of `make quickstart`).
bench: setup $(SHARDS)/manifest.json
	$(BIN)/pip install -q -e '.[bench]'
	$(BIN)/python benchmarks/run_all.py
