#!/usr/bin/env bash
# The CPU dry run of proof of value III (bench/proof_v3_protocol.md): every command of the
# harness on the tiny untrained model at the micro shape, one calibration seed and 3 seeds of
# each task. It checks the machinery, not the result (the tiny model scores 0 everywhere).
#   bash bench/proof_v3_dry_run.sh [work folder]      # about 40 minutes on 2 CPU cores
set -euo pipefail
work=${1:-runs/proof_v3_dry}
run() { python bench/proof_v3.py "$@" --shape micro --device cpu --work-dir "$work" --out "$work/out"; }
run stage0 --seed 100 --part 0/2
run stage0 --seed 100 --part 1/2
python bench/proof_v3.py stage0-report --out "$work/out"
for task in S F control; do
  for seed in 0 1 2; do
    run seed --task "$task" --seed "$seed" --grid "$work/out/stage0.json"
  done
  python bench/proof_v3.py analyse --task "$task" --out "$work/out"
done
