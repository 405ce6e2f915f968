#!/usr/bin/env bash
# One elastrun agent on this node of a SLURM job: what `srun` in train.sbatch runs on every node
# of the allocation (docs/slurm.md). Arguments: more elastrun flags, then the training script and
# its arguments. This adds the rendezvous flags every node must agree on, from SLURM's variables:
#   the first node of the allocation hosts the store (is_host=1 there, 0 elsewhere),
#   the run id is the job id (a requeued job keeps it, and resumes its checkpoints),
#   as many nodes as the allocation has (ELASTRUN_NNODES=MIN:MAX to change it),
#   world sizes in multiples of ELASTRUN_NODE_UNIT nodes (default 1): with
#   ELASTRUN_NNODES=4:5 ELASTRUN_NODE_UNIT=4 on 5 nodes, 4 train and 1 waits as a hot spare.
set -euo pipefail

head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
is_host=$((SLURM_NODEID == 0))

exec elastrun \
    --nnodes="${ELASTRUN_NNODES:-$SLURM_NNODES}" \
    --node-unit="${ELASTRUN_NODE_UNIT:-1}" \
    --rdzv-backend=c10d \
    --rdzv-endpoint="$head_node:${ELASTRUN_PORT:-29400}" \
    --rdzv-id="$SLURM_JOB_ID" \
    --rdzv-conf="is_host=$is_host" \
    "$@"
