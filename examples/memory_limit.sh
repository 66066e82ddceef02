#!/usr/bin/env bash
# A scene too large for one rank's memory trains when its points are spread over 4 ranks.
#
#   bash examples/memory_limit.sh [LIMIT_MIB] [POINTS]     # defaults: 1536 MiB, 12 million
#
# Every rank runs in a memory cgroup of its own (cgroup v1, as root) limited to LIMIT_MIB, as a
# GPU's memory would limit it. One training step of a U-Net on one floor of 6 furnished rooms
# (0.03 m voxels): at 1 rank the process outgrows the limit and the kernel kills it; at 4 ranks
# (--grid 4,1,1, each rank reading its share of the points: --input distributed) every rank stays
# under it and the step gives the same loss as an unlimited 1-rank run.
set -euo pipefail
limit_mib=${1:-1536}
points=${2:-12000000}
cg=/sys/fs/cgroup/memory
[ -w "$cg" ] || { echo "needs a writable cgroup v1 memory controller at $cg (run as root)" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"; rmdir "$cg"/sparsepipe-demo-* 2>/dev/null || true' EXIT

python - "$work" "$points" <<'PY'
import sys
from sparsepipe_hpc.bench.scale import write_floor
for split, seed in (("train", 0), ("val", 1)):
    write_floor(f"{sys.argv[1]}/{split}.h5", int(sys.argv[2]), seed=seed, rooms_x=3, rooms_y=2)
PY

# Each rank moves itself into its own limited cgroup, then becomes the trainer.
cat > "$work/limited.sh" <<SH
#!/usr/bin/env bash
g=$cg/sparsepipe-demo-\$\$
mkdir "\$g" && echo $((limit_mib << 20)) > "\$g/memory.limit_in_bytes"
[ -w "\$g/memory.memsw.limit_in_bytes" ] && echo $((limit_mib << 20)) > "\$g/memory.memsw.limit_in_bytes"
echo \$\$ > "\$g/cgroup.procs"
exec "\$@"
SH
chmod +x "$work/limited.sh"

export OMP_NUM_THREADS=1
root=(); [ "$(id -u)" = 0 ] && root=(--allow-run-as-root)
train=(python -m sparsepipe_hpc.train --data "$work" --batch-size 1 --steps 1 --voxel-size 0.03
       --width 8 --depth 3 --no-augment --no-progress)
for n in 1 4; do
  grid=$n,1,1
  echo "== $n rank(s), grid $grid, $limit_mib MiB per rank"
  set +e
  mpirun "${root[@]}" --oversubscribe -n "$n" "$work/limited.sh" /usr/bin/time -f "rank peak RSS %M KiB" \
    "${train[@]}" --grid "$grid" --out "$work/out$n" 2>&1 | grep -E "^done|peak RSS|Killed|error|killed|signal" | head -8
  echo "exit ${PIPESTATUS[0]}"
  set -e
done
