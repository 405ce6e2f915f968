#!/usr/bin/env bash
# One elastrun agent on this node of a SLURM job: what `srun` in train.sbatch runs on every node
# of the allocation (docs/slurm.md). Arguments: more elastrun flags, then the training script and
# its arguments. This adds the rendezvous flags every node must agree on, from SLURM's variables:
#   with 3 nodes or more, the allocation's first three nodes are the store's candidate hosts
#   (the job outlives the loss of any one of them, docs/failover.md); with fewer, the first
#   node hosts the store (is_host=1 there, 0 elsewhere),
#   the run id is the job id (a requeued job keeps it, and resumes its checkpoints),
#   as many nodes as the allocation has (ELASTRUN_NNODES=MIN:MAX to change it),
#   world sizes in multiples of ELASTRUN_NODE_UNIT nodes (default 1): with
#   ELASTRUN_NNODES=4:5 ELASTRUN_NODE_UNIT=4 on 5 nodes, 4 train and 1 waits as a hot spare.
# The node list comes from `scontrol show hostnames`, or from ELASTRUN_NODES (the host names,
# space-separated) where scontrol is not at hand (a container without the SLURM client).
set -euo pipefail

if [[ -n ${ELASTRUN_NODES:-} ]]; then
    read -ra nodes <<<"$ELASTRUN_NODES"
else
    mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
fi
port=${ELASTRUN_PORT:-29400}
if ((${#nodes[@]} >= 3)); then
    rdzv=(--rdzv-endpoint="${nodes[0]}:$port,${nodes[1]}:$port,${nodes[2]}:$port"
        --local-addr="$SLURMD_NODENAME")
else
    rdzv=(--rdzv-endpoint="${nodes[0]}:$port" --rdzv-conf="is_host=$((SLURM_NODEID == 0))")
fi

exec elastrun \
    --nnodes="${ELASTRUN_NNODES:-$SLURM_NNODES}" \
    --node-unit="${ELASTRUN_NODE_UNIT:-1}" \
    --rdzv-backend=c10d \
    "${rdzv[@]}" \
    --rdzv-id="$SLURM_JOB_ID" \
    "$@"
