#!/usr/bin/env bash
# GSM8K at T = 0.1, issue 52's additions: calibrate cactus on train problems, choose the points by
# benchmarks/pick_points.py's rule, continue the lenience head at T = 0.1 for 13 steps, then run the test
# problems. Resumable: run it again after a stop (each stage skips what it has finished).
set -euo pipefail
cd "$(dirname "$0")/../../.."
here=benchmarks/results/gsm8k-t0.1-bounded
calibration=benchmarks/results/gsm8k-t0.1/lossy-calibration
train=benchmarks/results/train-gsm8k-t0.1-lenience
common=(--task gsm8k --temperature 0.1 --batch-size 4 --draft-length 3)

.venv/bin/diversed eval "${common[@]}" --split train --limit 12 --resume --out $calibration \
    --verifications exact,cactus:0.1,cactus:0.3,cactus:1
.venv/bin/diversed report $calibration
lossy=$(.venv/bin/python benchmarks/pick_points.py $calibration --family lossy --count 2)
cactus=$(.venv/bin/python benchmarks/pick_points.py $calibration --family cactus --near lossy:0.99)

if [ ! -d $train/head-step-13 ]; then
    resume=(); if [ -d $train/checkpoint ] || [ -d $train/checkpoint.old ]; then resume=(--resume); fi
    .venv/bin/diversed train --task gsm8k --kind lenience --max-lenience 0.99 --lambda 0.03 --temperature 0.1 \
        --prompts-per-step 2 --samples-per-prompt 8 --max-new-tokens 320 --draft-length 3 --checkpoint-every 1 \
        --limit 400 --seed 1 --until-step 13 --init-head benchmarks/results/train-gsm8k-t0.7-lenience/head-step-80 \
        --out $train "${resume[@]}"
    cp -r $train/checkpoint $train/head-step-13
fi
head=$train/head-step-13

verifications="plain,exact,$lossy,$cactus,diversed:gsm8k,diversed:gsm8k@+3,diversed:$head,diversed:$head@+1"
echo "test verifications: $verifications"
.venv/bin/diversed eval "${common[@]}" --limit 150 --resume --out $here --verifications "$verifications"
