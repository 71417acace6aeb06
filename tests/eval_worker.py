"""Run a toy evaluation; under torchrun, one rank of it. Used by test_evaluation.py:
    torchrun --nproc-per-node 2 tests/eval_worker.py OUT_DIR"""

import sys

import torch.distributed as dist

from diversed.evaluation.run import EvalConfig, evaluate

from tiny import ToyTask, share_of_draft_tokens, toy_pair

VERIFICATIONS = ["plain", "exact", "static:0.5", "static:0.2"]
CONFIG = EvalConfig("toy", temperature=1.0, draft_length=3, max_new_tokens=10, seed=3)


def main(out_dir: str) -> None:
    if not dist.is_initialized() and len(sys.argv) > 2 and sys.argv[2] == "--distributed":
        dist.init_process_group("gloo")
    evaluate(toy_pair(), ToyTask(share_of_draft_tokens, size=7), VERIFICATIONS, CONFIG, out_dir, progress=False)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
