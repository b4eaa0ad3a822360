#!/usr/bin/env bash
# One node's part of configs/slurm/pretrain.sbatch: srun runs this once on every node of the
# job, and it starts torchrun there with one training process per GPU:
#
#   srun --ntasks-per-node=1 bash configs/slurm/node.sh pipelines/mpp_pretrain.py --config C ...
#
# Everything it needs comes from SLURM's variables, so every node computes the same rendezvous
# without talking to the others:
#   SLURM_JOB_NODELIST  the first host of the job is the master (hosts torchrun's store, rank 0)
#   SLURM_NNODES        --nnodes
#   SLURM_NODEID        --node-rank (0 on the first host of the node list)
#   SLURM_JOB_ID        the port: 20000 + job id mod 10000 (two jobs sharing a node differ)
#   SLURM_GPUS_ON_NODE  --nproc-per-node (else nvidia-smi's GPU count, else 1)
#   SLURM_CPUS_ON_NODE  CPU threads per process: this node's CPUs / processes
# Set MASTER_ADDR, MASTER_PORT, NPROC_PER_NODE or OMP_NUM_THREADS to choose them yourself,
# PYTHON for the interpreter (default: python3, that of the environment sbatch inherited), and
# STOP_TIMEOUT for the seconds a stop signal leaves the ranks to checkpoint (default 120).
set -euo pipefail

if [[ $# -lt 1 ]]; then
    echo "usage: node.sh ENTRY_SCRIPT [ARGS...]   (run by srun, one task per node)" >&2
    exit 2
fi
: "${SLURM_JOB_NODELIST:?not inside a SLURM job (run through configs/slurm/pretrain.sbatch)}"
: "${SLURM_NNODES:?}" "${SLURM_NODEID:?}" "${SLURM_JOB_ID:?}"

# (pipefail off in there: head leaving after one line may end a long host list with SIGPIPE)
first_host() { set +o pipefail; scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1; }
master_addr=${MASTER_ADDR:-$(first_host)}
if [[ -z $master_addr ]]; then
    echo "node.sh: no host from scontrol show hostnames '$SLURM_JOB_NODELIST'" >&2
    exit 1
fi
master_port=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 10000))}

if [[ -n ${NPROC_PER_NODE:-} ]]; then
    procs=$NPROC_PER_NODE
elif [[ -n ${SLURM_GPUS_ON_NODE:-} ]]; then
    procs=$SLURM_GPUS_ON_NODE
elif command -v nvidia-smi >/dev/null && gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU'); then
    procs=$gpus
else
    procs=1
fi

# torchrun alone would give each process 1 thread when it starts several; the processes share
# the node's CPUs instead (loader workers set their own).
cpus=${SLURM_CPUS_ON_NODE:-$(nproc)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((cpus / procs > 0 ? cpus / procs : 1))}

echo "node $SLURM_NODEID/$SLURM_NNODES ($(hostname)): $procs process(es)," \
    "master $master_addr:$master_port, OMP_NUM_THREADS=$OMP_NUM_THREADS" >&2

# Stopping (StopSignals in ssl_vit/engine/distributed.py). SLURM's SIGTERM, and the SIGUSR1
# pretrain.sbatch forwards, reach torchrun; with this list it passes both on to its training
# processes, and it gives them STOP_TIMEOUT s to checkpoint before it kills them (its default,
# 30 s, is short for a large model on shared storage; the other ranks get as long after one
# crashed). torchrun reads the list since torch 2.9 and the timeout since a later release. An
# older one would die of SIGUSR1: it ignores it (trap below; so do its processes until the
# trainer takes it), and the ranks get it from SLURM alone, which signals every process of the
# step.
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${STOP_TIMEOUT:-120}
trap '' USR1

# Static rendezvous: ranks follow the node rank (rank 0 on the master), and node 0's torchrun
# hosts the store the others join. NCCL_*, AWS_* and the like reach the processes through the
# environment srun passed on.
exec "${PYTHON:-python3}" -m torch.distributed.run \
    --nnodes "$SLURM_NNODES" --nproc-per-node "$procs" --node-rank "$SLURM_NODEID" \
    --rdzv-backend static --master-addr "$master_addr" --master-port "$master_port" \
    "$@"
