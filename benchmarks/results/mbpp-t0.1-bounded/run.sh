#!/usr/bin/env bash
# MBPP at T = 0.1, issue 52's last run: calibrate lenience on train problems, choose the points by
# benchmarks/pick_points.py's rule, continue the GSM8K T = 0.1 bounded head on MBPP's training split, then run
# the test problems. Resumable: run it again after a stop (each stage skips what it has finished).
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=benchmarks/results/mbpp-t0.1-bounded
train=benchmarks/results/train-mbpp-t0.1-lenience
common=(--task mbpp --temperature 0.1 --batch-size 4 --draft-length 3)

.venv/bin/diversed eval "${common[@]}" --split train --limit 12 --resume --out $here/calibration \
    --verifications exact,lossy:0.5,lossy:0.8,lossy:0.95,lossy:0.99
.venv/bin/diversed report $here/calibration
lossy=$(.venv/bin/python benchmarks/pick_points.py $here/calibration --family lossy --count 2)

if [ ! -d $train/head-step-24 ]; then
    resume=(); if [ -d $train/checkpoint ] || [ -d $train/checkpoint.old ]; then resume=(--resume); fi
    .venv/bin/diversed train --task mbpp --kind lenience --max-lenience 0.99 --lambda 0.03 --temperature 0.1 \
        --prompts-per-step 2 --samples-per-prompt 8 --max-new-tokens 384 --draft-length 3 --checkpoint-every 1 \
        --informative-only --seed 0 --until-step 24 \
        --init-head benchmarks/results/train-gsm8k-t0.1-lenience/head-step-13 --out $train "${resume[@]}"
    cp -r $train/checkpoint $train/head-step-24
fi
head=$train/head-step-24

verifications="plain,exact,$lossy,diversed:$head,diversed:$head@+1"
echo "test verifications: $verifications"
.venv/bin/diversed eval "${common[@]}" --limit 150 --resume --out $here --verifications "$verifications"
