#!/usr/bin/env bash
# GSM8K at T = 0.7 (issue 52): calibrate on train problems, choose the points by benchmarks/pick_points.py's
# rule, then run every training-free method on the test problems. Resumable: run it again after a stop.
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=benchmarks/results/gsm8k-t0.7
common=(--task gsm8k --temperature 0.7 --batch-size 4 --draft-length 3)
.venv/bin/diversed eval "${common[@]}" --split train --limit 12 --resume --out $here/calibration \
    --verifications exact,lossy:0.5,lossy:0.8,lossy:0.95,lossy:0.99,cactus:0.1,cactus:0.3,cactus:1,lossy-entropy:0.99
lossy=$(.venv/bin/python benchmarks/pick_points.py $here/calibration --family lossy --count 3)
top=${lossy%%,*}
cactus=$(.venv/bin/python benchmarks/pick_points.py $here/calibration --family cactus --near "$top")
verifications="plain,exact,$lossy,$cactus,lossy-entropy:${top#lossy:}"
echo "test verifications: $verifications"
.venv/bin/diversed eval "${common[@]}" --limit 150 --resume --out $here --verifications "$verifications"
