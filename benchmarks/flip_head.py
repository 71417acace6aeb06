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

Whether the limit is the hidden states': the report also compares, under one plain logistic regression and
the same nested cross-validation, the hidden states with scalars any rule could read (TV, the target's
confidence, the position, the kind of token) and with both; and for each, the problems a rule keeping half
the flips by its score would leave with a harmful one.

The inputs at each flip are recomputed from the completion's tokens (one teacher-forced pass of both
models a problem) and cached in each flips folder (features.safetensors, not committed).

    .venv/bin/python benchmarks/flip_head.py --train benchmarks/results/gsm8k-t0.1/flips-train \\
        --heldout benchmarks/results/gsm8k-t0.1/flips --out benchmarks/results/gsm8k-t0.1/flip-head
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from flip_harm import TEMPERATURE, auc, read_records, report
from head_weights import KINDS, score_completions
from safetensors.torch import load_file, save_file

from diversed.head.model import EnsembleHead, HeadConfig
from diversed.head.names import ARCHITECTURES
from diversed.models.loading import load_pair
from diversed.request import Sampling
from diversed.tasks import get_task
from diversed.text import encode_prompt

FEATURES_FILE = "features.safetensors"
PENALTIES = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)  # L2 on the weights, against the mean log loss
FOLDS, STEPS, SEED = 5, 300, 0
KEEP = 0.5  # the share of flips a rule keeps in the "harm kept" comparison: about the bar's half of exact's rejections
# What a rule could read at a flip without any hidden state: how far apart the models are, how sure the target is,
# where the token is (early flips harm more), and the kind of token.
SCALARS = ("TV(q, p)", "target's p(y_t)", "log(1 + position)", "position / length", *(f"kind: {k}" for k in KINDS))


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
            scores = score_completions(pair, [prompt], [completion], [[False] * len(completion)], Sampling(TEMPERATURE))
            h_draft, h_target = scores.h_draft, scores.h_target
            at = torch.tensor([f["t"] for f in record["flips"]], dtype=torch.long)
            cached[f"{record['example']}/draft"] = h_draft[0, at].half().contiguous()
            cached[f"{record['example']}/target"] = h_target[0, at].half().contiguous()
        save_file(cached, path)
    return tuple(torch.cat([cached[f"{r['example']}/{side}"].float() for r in records])
                 for side in ("draft", "target"))


def scalar_inputs(records: list[dict]) -> torch.Tensor:
    """The SCALARS of every flip of the records [N, len(SCALARS)], in record and flip order."""
    return torch.tensor([[f["tv"], f["p_target"], np.log1p(f["t"]), f["t"] / r["tokens"],
                          *(f["kind"] == kind for kind in KINDS)] for r in records for f in r["flips"]],
                        dtype=torch.float32)


class Logistic(torch.nn.Module):
    """w = sigmoid(a . x + b) on inputs standardised by the flips it is fitted on: plain logistic regression,
    to compare sets of inputs under one model (the package's head normalises each model's hidden state)."""

    def __init__(self, features: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mean", features.mean(0))
        self.register_buffer("spread", features.std(0) + 1e-6)  # a constant column (a kind never seen) stays 0
        self.linear = torch.nn.Linear(features.shape[1], 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.linear((features - self.mean) / self.spread).squeeze(-1))


@dataclass
class Recipe:
    """A model and the inputs it reads at each flip (tensors with a row a flip): what is cross-validated.
    make builds an unfitted model from the training flips' inputs."""

    make: Callable[..., torch.nn.Module]
    inputs: tuple[torch.Tensor, ...]

    def fit(self, train: np.ndarray, harmful: np.ndarray, penalty: float) -> torch.nn.Module:
        """Logistic regression of harm on the training flips' inputs: mean log loss plus penalty times the
        squared weights (not the biases), full batch, L-BFGS from the seeded initial state."""
        inputs = [x[train] for x in self.inputs]
        torch.manual_seed(SEED)
        model = self.make(*inputs)
        weights = [p for name, p in model.named_parameters() if name.endswith("weight")]
        optimizer = torch.optim.LBFGS(model.parameters(), max_iter=STEPS, line_search_fn="strong_wolfe")
        target = torch.from_numpy(harmful[train]).float()

        def loss() -> torch.Tensor:
            optimizer.zero_grad()
            w = model(*inputs).clamp(1e-6, 1 - 1e-6)
            value = (torch.nn.functional.binary_cross_entropy(w, target)
                     + penalty * sum(p.square().sum() for p in weights))
            value.backward()
            return value

        optimizer.step(loss)
        return model

    def held_out(self, train: np.ndarray, test: np.ndarray, harmful: np.ndarray, penalty: float) -> np.ndarray:
        """Fit on the `train` flips (a mask) and return the fitted model's w on the `test` flips."""
        model = self.fit(train, harmful, penalty)
        with torch.no_grad():
            return model(*(x[test] for x in self.inputs)).numpy()


def problem_folds(problem: np.ndarray, within: np.ndarray) -> np.ndarray:
    """The fold (0 .. FOLDS - 1) of each flip `within` (a mask; -1 outside): whole problems dealt round-robin
    in a seeded random order."""
    problems = np.unique(problem[within])
    fold_of = {p: i % FOLDS for i, p in enumerate(np.random.default_rng(SEED).permutation(problems))}
    return np.array([fold_of[p] if inside else -1 for p, inside in zip(problem, within, strict=True)])


def cross_validate(recipe: Recipe, harmful: np.ndarray, problem: np.ndarray,
                   within: np.ndarray) -> dict[float, float]:
    """Mean held-out AUC of each penalty over FOLDS folds of the whole problems `within` (the same folds for
    each)."""
    fold = problem_folds(problem, within)
    return {penalty: float(np.mean([auc(recipe.held_out(within & (fold != k), fold == k, harmful, penalty),
                                        harmful[fold == k]) for k in range(FOLDS)]))
            for penalty in PENALTIES}


def nested(recipe: Recipe, harmful: np.ndarray, problem: np.ndarray,
           within: np.ndarray) -> tuple[list[float], np.ndarray]:
    """The held-out reading of the whole recipe, penalty choice included: in each outer fold the penalty is
    chosen by cross-validation on the other folds' problems alone, then the model fitted there is read on the
    fold. Unlike the best of cross_validate's scores, nothing read here helped choose. The folds' AUCs, and
    each flip's out-of-fold w (NaN outside `within`)."""
    fold = problem_folds(problem, within)
    aucs, w = [], np.full(len(problem), np.nan)
    for k in range(FOLDS):
        test, train = fold == k, within & (fold != k)
        inner = cross_validate(recipe, harmful, problem, train)
        w[test] = recipe.held_out(train, test, harmful, max(inner, key=inner.get))
        aucs.append(auc(w[test], harmful[test]))
    return aucs, w


def learning_curve(recipe: Recipe, harmful: np.ndarray, problem: np.ndarray) -> dict[int, float]:
    """The nested cross-validated AUC from the first quarter, half, three quarters and all of the train
    problems (in order), each of at least 3 problems a fold: whether more labels still raise it. Noisy: a
    fold holds a handful of harmful flips."""
    count = int(problem.max()) + 1
    return {n: float(np.mean(nested(recipe, harmful, problem, problem < n)[0]))
            for n in sorted({count * k // 4 for k in (1, 2, 3, 4)} - set(range(3 * FOLDS)))}


def harm_kept(w: np.ndarray, harmful: np.ndarray, problem: np.ndarray) -> float:
    """The share of problems left with a harmful flip among those kept when, in each fold of problems, the
    KEEP share of its flips with the lowest w are kept (the rule accepts the draft there): roughly the
    problems such a rule would turn wrong (each flip's harm was measured alone)."""
    fold = problem_folds(problem, np.ones(len(problem), dtype=bool))
    kept = np.zeros(len(w), dtype=bool)
    for k in range(FOLDS):
        inside = np.flatnonzero(fold == k)
        kept[inside[np.argsort(w[inside], kind="stable")[:round(KEEP * len(inside))]]] = True
    return float(np.mean([(kept & harmful)[problem == p].any() for p in np.unique(problem)]))


def compare_inputs(records: list[dict], h_draft, h_target, harmful: np.ndarray, problem: np.ndarray) -> str:
    """Plain logistic regression (Logistic) on three sets of inputs, read by nested cross-validation over
    whole problems: the SCALARS, the two hidden states, and both; and for each, the problems a rule that kept
    half the flips by its w would leave with a harmful flip, against keeping half at random (seeded)."""
    scalars, hidden = scalar_inputs(records), torch.cat([h_draft, h_target], dim=-1)
    everything = np.ones(len(problem), dtype=bool)
    rng = np.random.default_rng(SEED)
    random_keep = np.mean([harm_kept(rng.random(len(problem)), harmful, problem) for _ in range(200)])
    lines = ["| inputs (plain logistic regression) | nested CV AUC (folds) | problems left with a harmful flip "
             f"when {KEEP:.0%} of flips are kept by w |", "|---|---|---|",
             f"| none (half kept at random, mean of 200 draws) | 0.5 | {random_keep:.0%} |"]
    for name, inputs in (("scalars: " + ", ".join(SCALARS[:4]) + ", kind", scalars),
                         ("both last hidden states", hidden), ("both", torch.cat([scalars, hidden], dim=-1))):
        aucs, w = nested(Recipe(Logistic, (inputs,)), harmful, problem, everything)
        lines.append(f"| {name} | {np.mean(aucs):.3f} ({', '.join(f'{a:.2f}' for a in aucs)}) | "
                     f"{harm_kept(w, harmful, problem):.0%} |")
    known = harm_kept(harmful.astype(float), harmful, problem)
    lines.append(f"| (labels known: harmless flips kept first) | 1 | {known:.0%} |")
    return "\n".join(lines)


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
    harmful = np.array([f["harmful"] for r in train for f in r["flips"]], dtype=bool)
    problem = np.array([i for i, r in enumerate(train) for _ in r["flips"]])
    config = HeadConfig(pair.draft.hidden_size, pair.target.hidden_size, args.architecture,
                        initial_weight=float(harmful.mean(dtype=np.float32)), draft_model=pair.draft_name,
                        target_model=pair.target_name,
                        training={"method": "logistic regression on flip labels (benchmarks/flip_head.py)",
                                  "task": task.name, "temperature": TEMPERATURE, "problems": len(train),
                                  "flips": len(harmful), "harmful": int(harmful.sum())})
    recipe = Recipe(lambda *_: EnsembleHead(config), (h_draft, h_target))
    everything = np.ones(len(problem), dtype=bool)
    scores = cross_validate(recipe, harmful, problem, everything)
    penalty = max(scores, key=scores.get)
    nested_folds = nested(recipe, harmful, problem, everything)[0]
    curve = learning_curve(recipe, harmful, problem)
    config.training |= {"penalty": penalty, "cross_validated_auc": scores,
                        "nested_cross_validated_auc": float(np.mean(nested_folds))}
    head = recipe.fit(everything, harmful, penalty)
    head.save(args.out)
    test_draft, test_target = flip_inputs(pair, task, args.heldout, heldout)
    with torch.no_grad():
        w = iter(head(test_draft, test_target).tolist())
    for flip in (f for r in heldout for f in r["flips"]):
        flip["w"]["flip-head"] = next(w)
    text = (f"Trained on {len(train)} solved train problems ({len(harmful)} flips, {int(harmful.sum())} harmful), "
            f"{args.architecture}, L2 penalty {penalty} (cross-validated AUC by penalty: "
            + ", ".join(f"{p:g}: {s:.3f}" for p, s in scores.items()) + "). Nested cross-validation (the penalty "
            f"chosen inside each fold's training problems): AUC {np.mean(nested_folds):.3f} (folds "
            + ", ".join(f"{a:.3f}" for a in nested_folds) + "). Learning curve (nested AUC from the first n solved "
            "problems): " + ", ".join(f"{n}: {a:.3f}" for n, a in curve.items())
            + ".\n\nOther inputs, on the same train flips and folds:\n\n"
            + compare_inputs(train, h_draft, h_target, harmful, problem)
            + "\n\nHeld out (the solved test problems whose completion tokens are recorded):\n\n" + report(heldout))
    (args.out / "heldout.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
