#!/usr/bin/env bash
# Whole-file edits at T = 0.7 on copied drafts (issues 50 and 52): calibrate on train problems, choose the points
# by benchmarks/pick_points.py's rule, then run the test problems. Resumable: run it again after a stop.
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=benchmarks/results/file-edit-t0.7
common=(--task file-edit --temperature 0.7 --batch-size 4 --drafter prediction --prediction --max-new-tokens 1024)
.venv/bin/diversed eval "${common[@]}" --split train --limit 12 --resume --out $here/calibration \
    --verifications exact,lossy:0.5,lossy:0.8,lossy:0.95,lossy:0.99,static:0.9,static:0.7,static:0.5
lossy=$(.venv/bin/python benchmarks/pick_points.py $here/calibration --family lossy --count 2)
static=$(.venv/bin/python benchmarks/pick_points.py $here/calibration --family static --near "${lossy%%,*}")
verifications="plain,exact,$lossy,$static"
echo "test verifications: $verifications"
.venv/bin/diversed eval "${common[@]}" --limit 100 --resume --out $here --verifications "$verifications"
