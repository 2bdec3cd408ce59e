#!/usr/bin/env bash
# Set up .venv if needed, then run scripts/demo.py on 4 local CPU processes (Gloo) with torchrun.
# Extra arguments go to demo.py.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$SHARDKIT_ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$SHARDKIT_PYTHON" -m torch.distributed.run --standalone --nproc-per-node 4 scripts/demo.py "$@"
