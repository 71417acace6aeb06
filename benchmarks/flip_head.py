"""A head trained on flip labels, not on the sequence reward: can hidden states rank harmful flips better than
the RL heads do? (Not the paper's method: an experiment on where the RL heads fall short.)

flip_harm.py labels every flip of the target's right greedy completions as harmful or harmless. Here those
labels on train-split problems train a head of the package's own form (EnsembleHead: w from both models'
last hidden states) by logistic regression: w is fitted to P(harmful | hidden states) at the flipped
position, with an L2 penalty chosen by cross-validation that holds out whole problems (their flips are not
independent; the report also gives the nested cross-validated AUC, penalty choice included, and its
learning curve). The fitted head is then read on the held-out test-split flips, in the same table as the RL
heads (flip_harm.report): AUC of w for harm with intervals over problems. Only the ranking matters; where
the head is strict or lenient overall is the dial's job (`@+k`), set later on an evaluation.

The inputs at each flip are recomputed from the completion's tokens (one teacher-forced pass of both
models a problem) and cached in each flips folder (features.safetensors, not committed).

    .venv/bin/python benchmarks/flip_head.py --train benchmarks/results/gsm8k-t0.1/flips-train \\
        --heldout benchmarks/results/gsm8k-t0.1/flips --out benchmarks/results/gsm8k-t0.1/flip-head
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from flip_harm import TEMPERATURE, auc, read_records, report
from safetensors.torch import load_file, save_file

from diversed.decoding.sampling import Sampling
from diversed.evaluation.head_weights import score_completions
from diversed.head.model import ARCHITECTURES, EnsembleHead, HeadConfig
from diversed.models.loading import load_pair
from diversed.tasks import get_task
from diversed.text import encode_prompt

FEATURES_FILE = "features.safetensors"
PENALTIES = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)  # L2 on the head's weights, against the mean log loss
FOLDS, STEPS, SEED = 5, 300, 0


@torch.no_grad()
def flip_inputs(pair, task, folder: Path, records: list[dict]) -> tuple[torch.Tensor, torch.Tensor]:
    """Both models' last hidden states at every flip of the records ([N, d_draft], [N, d_target], in record
    and flip order), read from the folder's cache or computed for the problems it lacks and then cached."""
    path = folder / FEATURES_FILE
    cached = load_file(path) if path.exists() else {}
    missing = [r for r in records if f"{r['example']}/draft" not in cached]
    if missing:
        examples = {e.id: e for e in task.examples(missing[0]["example"].split("/")[0])}
        for record in missing:
            completion = record["completion"]
            prompt = encode_prompt(pair.tokenizer, examples[record["example"]].prompt)
            h_draft, h_target, *_ = score_completions(pair, [prompt], [completion], [[False] * len(completion)],
                                                      Sampling(TEMPERATURE))
            at = torch.tensor([f["t"] for f in record["flips"]], dtype=torch.long)
            cached[f"{record['example']}/draft"] = h_draft[0, at].half().contiguous()
            cached[f"{record['example']}/target"] = h_target[0, at].half().contiguous()
        save_file(cached, path)
    return tuple(torch.cat([cached[f"{r['example']}/{side}"].float() for r in records])
                 for side in ("draft", "target"))


def fit(config: HeadConfig, h_draft: torch.Tensor, h_target: torch.Tensor, harmful: torch.Tensor,
        penalty: float) -> EnsembleHead:
    """Logistic regression of harm on the head's inputs: mean log loss plus penalty times the squared
    weights (not the bias), full batch, L-BFGS from the head's initial state (w = the harm rate)."""
    torch.manual_seed(SEED)
    head = EnsembleHead(config)
    weights = [p for name, p in head.named_parameters() if name.endswith("weight")]
    optimizer = torch.optim.LBFGS(head.parameters(), max_iter=STEPS, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        optimizer.zero_grad()
        w = head(h_draft, h_target).clamp(1e-6, 1 - 1e-6)
        value = torch.nn.functional.binary_cross_entropy(w, harmful) + penalty * sum(p.square().sum() for p in weights)
        value.backward()
        return value

    optimizer.step(loss)
    return head


def problem_folds(problem: np.ndarray) -> np.ndarray:
    """The fold (0 .. FOLDS - 1) of each flip: whole problems dealt round-robin in a seeded random order."""
    problems = np.unique(problem)
    fold_of = {p: i % FOLDS for i, p in enumerate(np.random.default_rng(SEED).permutation(problems))}
    return np.array([fold_of[p] for p in problem])


def held_out_auc(config: HeadConfig, h_draft, h_target, harmful, test: torch.Tensor, penalty: float) -> float:
    """Fit on the flips outside `test` (a mask), and the AUC of that head's w for harm on the flips inside."""
    head = fit(config, h_draft[~test], h_target[~test], harmful[~test], penalty)
    with torch.no_grad():
        w = head(h_draft[test], h_target[test]).numpy()
    return auc(w, harmful[test].numpy().astype(bool))


def cross_validate(config: HeadConfig, h_draft, h_target, harmful, problem: np.ndarray) -> dict[float, float]:
    """Mean held-out AUC of each penalty over FOLDS folds of whole problems (the same folds for each)."""
    fold = problem_folds(problem)
    return {penalty: float(np.mean([held_out_auc(config, h_draft, h_target, harmful, torch.from_numpy(fold == k),
                                                 penalty) for k in range(FOLDS)]))
            for penalty in PENALTIES}


def nested_auc(config: HeadConfig, h_draft, h_target, harmful, problem: np.ndarray) -> tuple[float, list[float]]:
    """The held-out AUC of the whole recipe, penalty choice included: in each outer fold the penalty is
    chosen by cross-validation on the other folds' problems alone, then the head fitted there is read on
    the fold. Unlike the best of cross_validate's scores, nothing read here helped choose. Mean and folds."""
    fold = problem_folds(problem)
    aucs = []
    for k in range(FOLDS):
        test = torch.from_numpy(fold == k)
        inner = cross_validate(config, h_draft[~test], h_target[~test], harmful[~test], problem[fold != k])
        aucs.append(held_out_auc(config, h_draft, h_target, harmful, test, max(inner, key=inner.get)))
    return float(np.mean(aucs)), aucs


def learning_curve(config: HeadConfig, h_draft, h_target, harmful, problem: np.ndarray) -> dict[int, float]:
    """The nested cross-validated AUC from the first quarter, half, three quarters and all of the train
    problems (in order), each of at least 3 problems a fold: whether more labels still raise it. Noisy: a
    fold holds a handful of harmful flips."""
    count = int(problem.max()) + 1
    curve = {}
    for n in sorted({count * k // 4 for k in (1, 2, 3, 4)} - set(range(3 * FOLDS))):
        first = torch.from_numpy(problem < n)
        curve[n] = nested_auc(config, h_draft[first], h_target[first], harmful[first], problem[problem < n])[0]
    return curve


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="gsm8k")
    parser.add_argument("--train", type=Path, required=True, help="flips folder of train-split problems")
    parser.add_argument("--heldout", type=Path, required=True, help="flips folder of test-split problems")
    parser.add_argument("--architecture", default="linear", choices=ARCHITECTURES)
    parser.add_argument("--out", type=Path, required=True, help="where the head, its config and report go")
    args = parser.parse_args()
    train = [r for r in read_records(args.train) if r["right"]]
    # Only records that keep their completion's tokens can be read: a greedy completion regenerated on
    # another machine (another llama.cpp build) can take another path, so it is never guessed.
    heldout = [r for r in read_records(args.heldout) if r["right"] and "completion" in r]
    task, pair = get_task(args.task), load_pair()
    h_draft, h_target = flip_inputs(pair, task, args.train, train)
    harmful = torch.tensor([f["harmful"] for r in train for f in r["flips"]], dtype=torch.float32)
    problem = np.array([i for i, r in enumerate(train) for _ in r["flips"]])
    config = HeadConfig(pair.draft.hidden_size, pair.target.hidden_size, args.architecture,
                        initial_weight=float(harmful.mean()), draft_model=pair.draft_name,
                        target_model=pair.target_name,
                        training={"method": "logistic regression on flip labels (benchmarks/flip_head.py)",
                                  "task": task.name, "temperature": TEMPERATURE, "problems": len(train),
                                  "flips": len(harmful), "harmful": int(harmful.sum())})
    scores = cross_validate(config, h_draft, h_target, harmful, problem)
    penalty = max(scores, key=scores.get)
    nested, nested_folds = nested_auc(config, h_draft, h_target, harmful, problem)
    curve = learning_curve(config, h_draft, h_target, harmful, problem)
    config.training |= {"penalty": penalty, "cross_validated_auc": scores, "nested_cross_validated_auc": nested}
    head = fit(config, h_draft, h_target, harmful, penalty)
    head.save(args.out)
    test_draft, test_target = flip_inputs(pair, task, args.heldout, heldout)
    with torch.no_grad():
        w = iter(head(test_draft, test_target).tolist())
    for flip in (f for r in heldout for f in r["flips"]):
        flip["w"]["flip-head"] = next(w)
    text = (f"Trained on {len(train)} solved train problems ({len(harmful)} flips, {int(harmful.sum())} harmful), "
            f"{args.architecture}, L2 penalty {penalty} (cross-validated AUC by penalty: "
            + ", ".join(f"{p:g}: {s:.3f}" for p, s in scores.items()) + "). Nested cross-validation (the penalty "
            f"chosen inside each fold's training problems): AUC {nested:.3f} (folds "
            + ", ".join(f"{a:.3f}" for a in nested_folds) + "). Learning curve (nested AUC from the first n solved "
            "problems): " + ", ".join(f"{n}: {a:.3f}" for n, a in curve.items())
            + ".\n\nHeld out (the solved test problems whose completion tokens are recorded):\n\n" + report(heldout))
    (args.out / "heldout.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
