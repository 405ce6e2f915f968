#!/bin/sh
# A GPU node's health check for elastrun (docs/reliability.md, *Health checks*):
#
#   elastrun --health-check "sh examples/gpu_health_check.sh" --health-check-timeout 120 ...
#
# Exit 0 and "healthy" when every check passes; else exit 1 with one line saying
# which failed. Checks:
#   * the driver answers and lists at least ELASTRUN_EXPECTED_GPUS GPUs (default 1);
#   * no GPU reports uncorrected (volatile) ECC errors;
#   * DCGM's quick diagnostic passes (dcgmi diag -r 1), when dcgmi is installed;
#   * each folder of ELASTRUN_HEALTH_DIRS (space-separated: checkpoints, data)
#     takes a file.
set -u
fail() {
    echo "unhealthy: $*"
    exit 1
}
command -v nvidia-smi >/dev/null 2>&1 || fail "nvidia-smi not found"
want=${ELASTRUN_EXPECTED_GPUS:-1}
listed=$(nvidia-smi -L 2>/dev/null) || fail "nvidia-smi -L failed"
n=$(printf '%s\n' "$listed" | grep -c '^GPU ')
[ "$n" -ge "$want" ] || fail "nvidia-smi lists $n GPUs, $want expected"
ecc=$(nvidia-smi --query-gpu=ecc.errors.uncorrected.volatile.total --format=csv,noheader,nounits 2>/dev/null) ||
    fail "nvidia-smi cannot read the ECC counters"
for count in $ecc; do
    case "$count" in
    0 | "[N/A]" | N/A) ;;
    *) fail "a GPU reports $count uncorrected ECC errors" ;;
    esac
done
if command -v dcgmi >/dev/null 2>&1; then
    dcgmi diag -r 1 >/dev/null 2>&1 || fail "dcgmi diag -r 1 failed"
fi
for dir in ${ELASTRUN_HEALTH_DIRS:-}; do
    probe="$dir/.elastrun-health-$$"
    { echo probe >"$probe" && rm -f "$probe"; } 2>/dev/null || fail "cannot write to $dir"
done
echo healthy
