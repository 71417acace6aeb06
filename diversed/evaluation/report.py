"""From per-example results to the summary table (Markdown, CSV, JSON) and the trade-off pictures."""

from __future__ import annotations

import csv
import json
import random
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from scipy.stats import binomtest, norm, sem

# A summary's first column, the verification, keeps its name "method": the tables and summary files of the
# evaluations committed under benchmarks/results (and benchmarks/pick_points.py, which reads them) stay as they were.
COLUMNS = ("method", "examples", "quality", "quality_low", "quality_high", "quality_vs_plain", "quality_vs_plain_low",
           "quality_vs_plain_high", "acceptance_rate", "rejection_vs_exact", "rejection_vs_exact_low",
           "rejection_vs_exact_high", "quality_vs_static", "quality_vs_static_low", "quality_vs_static_high",
           "quality_vs_lossy", "quality_vs_lossy_low", "quality_vs_lossy_high", "quality_vs_cactus",
           "quality_vs_cactus_low", "quality_vs_cactus_high", "quality_vs_lossy_entropy",
           "quality_vs_lossy_entropy_low", "quality_vs_lossy_entropy_high", "tau",
           "tokens_per_s", "speedup", "new_tokens", "time_per_example", "time_per_example_low",
           "time_per_example_high", "time_speedup", "time_speedup_low", "time_speedup_high")
BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED = 2000, 0
# Training-free families: curves through their points, each from exact (its strictest end: w = 1, L = 0, a
# budget of 0) by its parameter (the letter the pictures annotate points with); a verification off a family is
# compared with its curve at its own acceptance (summary key quality_vs_<family>, "-" as "_").
FAMILIES = {"static": ("w", "tab:blue"), "lossy": ("L", "tab:orange"), "cactus": ("d", "tab:brown"),
            "lossy-entropy": ("L", "tab:olive")}
HEAD_COLORS = ("tab:red", "tab:purple", "tab:pink", "tab:cyan", "darkred")  # none a family's


def summarize_results(rows: Sequence[dict], verifications: Sequence[str]) -> list[dict]:
    """One summary per verification, in the given order, recomputed from the result rows.

    quality: mean reward with a 95% interval (Wilson's for 0/1 rewards, normal otherwise);
    acceptance_rate: accepted / drafted over all examples; tau: new tokens / target forwards;
    tokens_per_s: new tokens / wall time over all examples; speedup: tokens/s over plain's; new_tokens: mean
    new tokens per example; time_per_example: mean wall time per example, in seconds, with a 95% normal
    interval (what a user waits for an answer: unlike tokens/s, it counts a verification that writes longer
    answers as slower).
    Paired comparisons on the examples both verifications ran, with 95% percentile-bootstrap intervals
    (resampling examples, fixed seed): quality_vs_plain, the difference in mean reward from plain's;
    rejection_vs_exact, the verification's rejection rate (1 - acceptance) over exact's (0.5 = half as many
    drafts rejected); quality_vs_static, for a verification off the static curve (DIVERSED, lossy, ...), its
    quality minus the static ensemble's at the same acceptance (curve_quality), and quality_vs_lossy,
    quality_vs_cactus, quality_vs_lossy_entropy the same against each other family's curve (exact and the
    family's points that ran); time_speedup, plain's total wall time over the verification's on the same
    examples (speedup from time per example).
    """
    summaries = []
    for verification in verifications:
        mine = [r for r in rows if r["verification"] == verification]
        if not mine:
            continue
        rewards, times = [r["reward"] for r in mine], [r["wall_time"] for r in mine]
        low, high = mean_interval(rewards)
        new_tokens = sum(r["new_tokens"] for r in mine)
        forwards = sum(r["target_forwards"] for r in mine)
        summaries.append({
            "method": verification, "examples": len(mine), "quality": sum(rewards) / len(rewards),
            "quality_low": low, "quality_high": high,
            "acceptance_rate": _acceptance(mine),
            "tau": new_tokens / forwards if forwards else None,
            "tokens_per_s": new_tokens / sum(times),
            "new_tokens": new_tokens / len(mine), "time_per_example": sum(times) / len(times),
            **dict(zip(("time_per_example_low", "time_per_example_high"), _normal_interval(times), strict=True))})
    plain = next((s for s in summaries if s["method"] == "plain"), None)
    by_verification = {m: {r["example"]: r for r in rows if r["verification"] == m} for m in verifications}
    curves = [(curve_key(family), [m for m in verifications if m == "exact" or m.partition(":")[0] == family])
              for family in FAMILIES]
    for s in summaries:
        s["speedup"] = s["tokens_per_s"] / plain["tokens_per_s"] if plain else None
        verification = s["method"]
        for key, others, statistic in (("quality_vs_plain", ["plain"], _quality_difference),
                                       ("rejection_vs_exact", ["exact"], _rejection_ratio),
                                       *((key, curve, _quality_above_curve) for key, curve in curves),
                                       ("time_speedup", ["plain"], _time_speedup)):
            compared = (_paired_bootstrap({m: by_verification[m] for m in [verification, *others]},
                                          partial(statistic, verification, others))
                        if others and verification not in others and set(others) <= by_verification.keys() else None)
            s[key], s[key + "_low"], s[key + "_high"] = compared or (None, None, None)
    return summaries


def compare(rows: Sequence[dict], verification: str, other: str) -> dict:
    """Two verifications of an evaluation on the examples both finished, paired as summarize_results pairs
    each verification with plain and exact: `quality_difference` (verification's mean reward minus other's) and
    `rejection_ratio` (verification's rejection rate over other's), each (estimate, low, high) with its 95%
    percentile-bootstrap interval over examples (None where undefined), and each one's acceptance rate on those
    examples."""
    by_verification = {m: {r["example"]: r for r in rows if r["verification"] == m} for m in (verification, other)}
    if missing := [m for m, mine in by_verification.items() if not mine]:
        raise ValueError(f"no results for: {', '.join(missing)}")
    shared = set(by_verification[verification]) & set(by_verification[other])
    if not shared:
        raise ValueError(f"{verification} and {other} have no example in common")
    return {"examples": len(shared),
            "quality_difference": _paired_bootstrap(by_verification,
                                                    partial(_quality_difference, verification, [other])),
            "rejection_ratio": _paired_bootstrap(by_verification, partial(_rejection_ratio, verification, [other])),
            "acceptance": {m: _acceptance([mine[e] for e in shared]) for m, mine in by_verification.items()}}


def _quality_difference(verification: str, others: list[str], rows: dict[str, list[dict]]) -> float:
    return _mean_reward(rows[verification]) - _mean_reward(rows[others[0]])


def _rejection_ratio(verification: str, others: list[str], rows: dict[str, list[dict]]) -> float | None:
    mine, theirs = _rejection(rows[verification]), _rejection(rows[others[0]])
    return mine / theirs if mine is not None and theirs else None


def _time_speedup(verification: str, others: list[str], rows: dict[str, list[dict]]) -> float | None:
    mine = sum(r["wall_time"] for r in rows[verification])
    return sum(r["wall_time"] for r in rows[others[0]]) / mine if mine else None


def curve_key(family: str) -> str:
    """The summary key of the comparison with a family's curve: quality_vs_static, ..., quality_vs_lossy_entropy."""
    return "quality_vs_" + family.replace("-", "_")


def _quality_above_curve(verification: str, curve: list[str], rows: dict[str, list[dict]]) -> float | None:
    """The verification's quality minus the curve's (a family's, through exact) at its acceptance."""
    quality = curve_quality([rows[m] for m in curve], _acceptance(rows[verification]))
    return None if quality is None else _mean_reward(rows[verification]) - quality


def curve_quality(curve: Sequence[list[dict]], acceptance: float | None) -> float | None:
    """A family's quality at this acceptance rate: linear between the two measured points whose acceptance
    rates enclose it (each verification's rows give one point: acceptance over all its drafts, mean reward);
    None outside the measured range, which is never extrapolated. Exact is every curve's strict end."""
    points = sorted((a, _mean_reward(rows)) for rows in curve if (a := _acceptance(rows)) is not None)
    if acceptance is None or len(points) < 2 or not points[0][0] <= acceptance <= points[-1][0]:
        return None
    for (a0, q0), (a1, q1) in zip(points, points[1:], strict=False):
        if a0 <= acceptance <= a1:
            return q0 if a1 == a0 else q0 + (q1 - q0) * (acceptance - a0) / (a1 - a0)
    return None


def _mean_reward(rows: list[dict]) -> float:
    return sum(r["reward"] for r in rows) / len(rows)


def _acceptance(rows: list[dict]) -> float | None:
    drafted = sum(r["drafted"] for r in rows)
    return sum(r["accepted"] for r in rows) / drafted if drafted else None


def _rejection(rows: list[dict]) -> float | None:
    acceptance = _acceptance(rows)
    return None if acceptance is None else 1 - acceptance


def _paired_bootstrap(by_verification: dict[str, dict], statistic) -> tuple[float, float, float] | None:
    """statistic({verification: its rows}) over the examples every verification ran, and its 95%
    percentile-bootstrap interval, resampling those examples with a fixed seed (None if the statistic is
    undefined on them)."""
    shared = sorted(set.intersection(*(set(rows) for rows in by_verification.values())))

    def on(sample: list[str]):
        return statistic({m: [rows[e] for e in sample] for m, rows in by_verification.items()})

    estimate = on(shared) if shared else None
    if estimate is None:
        return None
    rng = random.Random(BOOTSTRAP_SEED)
    values = [v for _ in range(BOOTSTRAP_RESAMPLES)
              if (v := on([shared[rng.randrange(len(shared))] for _ in shared])) is not None]
    if not values:
        return None
    values.sort()
    return estimate, values[int(0.025 * (len(values) - 1))], values[int(0.975 * (len(values) - 1))]


def mean_interval(values: list[float]) -> tuple[float, float]:
    """95% interval of a mean: Wilson's score interval for 0/1 values (sensible at 0% and 100%, unlike the
    normal one), else the normal approximation."""
    if set(values) <= {0.0, 1.0}:
        ci = binomtest(round(sum(values)), len(values)).proportion_ci(0.95, method="wilson")
        return float(ci.low), float(ci.high)
    return _normal_interval(values)


def _normal_interval(values: list[float]) -> tuple[float, float]:
    """95% interval of a mean by the normal approximation (a point for a single value)."""
    mean = sum(values) / len(values)
    half = float(norm.ppf(0.975) * sem(values)) if len(values) > 1 else 0.0
    return mean - half, mean + half


def markdown_table(summaries: Sequence[dict], metric: str) -> str:
    """The summary as a Markdown table; quality is the task's metric (e.g. pass@1) in percent. The static and
    lenience curves always have a column, cactus and lossy-entropy where any of their points ran."""
    ran = {s["method"].partition(":")[0] for s in summaries}
    families = ["static", "lossy", *(f for f in ("cactus", "lossy-entropy") if f in ran)]
    curves = [f"vs {'lenience' if f == 'lossy' else f} curve (95% CI)" for f in families]
    lines = [f"| method | n | {metric} (95% CI) | vs plain (95% CI) | acceptance | rejection vs exact (95% CI) | "
             + " | ".join(curves) + " | tau | tokens/s | speedup | mean tokens | s/example (95% CI) "
             "| speedup by time (95% CI) |",
             "|---" * (12 + len(families)) + "|"]
    labels = _labels([s["method"] for s in summaries])
    for s in summaries:
        vs_curves = " | ".join(format_difference(_paired(s, curve_key(f))) for f in families)
        lines.append(
            f"| {labels[s['method']]} | {s['examples']} | {100 * s['quality']:.1f} "
            f"({100 * s['quality_low']:.1f}-{100 * s['quality_high']:.1f}) | "
            f"{format_difference(_paired(s, 'quality_vs_plain'))} | {_percent(s['acceptance_rate'])} | "
            f"{format_ratio(_paired(s, 'rejection_vs_exact'))} | {vs_curves} | {_number(s['tau'])} | "
            f"{s['tokens_per_s']:.2f} | {_number(s['speedup'], 'x')} | {s['new_tokens']:.1f} | "
            f"{s['time_per_example']:.1f} ({s['time_per_example_low']:.1f}-{s['time_per_example_high']:.1f}) | "
            f"{format_ratio(_paired(s, 'time_speedup'), 'x')} |")
    return "\n".join(lines)


def format_difference(value: tuple[float, float, float] | None) -> str:
    """A paired difference in quality, (estimate, low, high) as fractions, in points: '+2.4 (-2.2 to +7.1)'."""
    return "-" if value is None else "{:+.1f} ({:+.1f} to {:+.1f})".format(*(100 * v for v in value))


def _paired(summary: dict, key: str) -> tuple[float, float, float] | None:
    """A summary's paired comparison `key` as (estimate, low, high), or None where it has none."""
    return None if summary[key] is None else (summary[key], summary[key + "_low"], summary[key + "_high"])


def format_ratio(value: tuple[float, float, float] | None, unit: str = "") -> str:
    """A paired ratio, (estimate, low, high): '0.64 (0.58-0.70)', or with a unit '1.21x (1.10-1.33)'."""
    return "-" if value is None else "{:.2f}{} ({:.2f}-{:.2f})".format(value[0], unit, *value[1:])


def write_summary(summaries: Sequence[dict], out_dir: Path, metric: str, header: str = "") -> None:
    """summary.md, summary.csv and summary.json in out_dir."""
    (out_dir / "summary.json").write_text(json.dumps(summaries, indent=1) + "\n")
    with open(out_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: s[k] for k in COLUMNS} for s in summaries)
    (out_dir / "summary.md").write_text((header + "\n\n" if header else "") + markdown_table(summaries, metric) + "\n")


def plot_tradeoffs(summaries: Sequence[dict], out_dir: Path, metric: str) -> list[Path]:
    """quality_vs_acceptance.png, quality_vs_speedup.png, quality_vs_time.png (time per example) and
    throughput_vs_acceptance.png.

    Each training-free family that ran (static, lossy, cactus, lossy-entropy) is drawn as a curve through its
    points and exact, in order of acceptance; plain is a point, DIVERSED heads are stars (a colour a head, its
    dial points hollow) and transformers' assisted generation crosses (its defaults a plus); quality and time
    per example have their 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no screen
    import matplotlib.pyplot as plt

    paths = []
    for x_key, y_key, name in (("acceptance_rate", "quality", "quality_vs_acceptance"),
                               ("speedup", "quality", "quality_vs_speedup"),
                               ("time_per_example", "quality", "quality_vs_time"),
                               ("acceptance_rate", "tokens_per_s", "throughput_vs_acceptance")):
        points = [s for s in summaries if s.get(x_key) is not None]
        if not points:
            continue
        fig, ax = plt.subplots(figsize=(6, 4.5))
        exact = [s for s in points if s["method"] == "exact"]
        for family, (letter, color) in FAMILIES.items():
            members = [s for s in points if s["method"].partition(":")[0] == family]
            curve = sorted(exact + members, key=lambda s: s["acceptance_rate"] or 0.0)
            if members and len(curve) > 1:
                ax.plot([s[x_key] for s in curve], [_scale(s[y_key], y_key) for s in curve], "-", color=color,
                        label=f"{family} ({letter} sweep, from exact)")
            for s in members:
                value = s["method"].partition(":")[2].split(",")[0]
                ax.annotate(f"{letter}={value}", (s[x_key], _scale(s[y_key], y_key)), fontsize=8,
                            textcoords="offset points", xytext=(4, 4))
        labels = _labels([s["method"] for s in points])
        heads = sorted({s["method"].partition("@")[0] for s in points if s["method"].startswith("diversed")})
        for s in points:
            marker, color, face, size = _style(s["method"], heads)
            ax.errorbar(s[x_key], _scale(s[y_key], y_key), xerr=_error_bar(s, x_key), yerr=_error_bar(s, y_key),
                        fmt=marker, color=color, markerfacecolor=face, markersize=size, capsize=3,
                        label=labels[s["method"]])
        ax.set_xlabel({"acceptance_rate": "acceptance rate", "speedup": "speedup over the target alone (tokens/s)",
                       "time_per_example": "seconds per example"}[x_key])
        ax.set_ylabel(f"{metric} (%)" if y_key == "quality" else "tokens/s")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1))  # beside the axes: never over a point
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(fig)
        paths.append(path)
    return paths


def plot_training(log: Path, out: Path) -> Path:
    """The curves of a head's training run (its log.jsonl): reward, measured acceptance rate and the
    acceptance proxy A, and mean w (with its spread over tokens where logged), against the step, in one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = _training_steps(log)
    x = [s["step"] for s in steps]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    axes[0].plot(x, [s["reward"] for s in steps], "o-", color="tab:green")
    axes[0].set_title("mean reward of the step's samples")
    axes[1].plot(x, [s["acceptance_rate"] for s in steps], "o-", label="measured acceptance rate")
    axes[1].plot(x, [s["acceptance"] for s in steps], "s--", label="acceptance proxy A")
    axes[1].legend(fontsize=8)
    axes[1].set_title("acceptance")
    mean_w = [s["mean_w"] for s in steps]
    axes[2].plot(x, mean_w, "o-", color="tab:red", label="mean w")
    if all("w_std" in s for s in steps):  # logs written before w_std was recorded have the mean only
        w_std = [s["w_std"] for s in steps]
        axes[2].fill_between(x, [m - d for m, d in zip(mean_w, w_std, strict=True)],
                             [m + d for m, d in zip(mean_w, w_std, strict=True)], color="tab:red", alpha=0.2,
                             label="± std over tokens")
    first = [(s["step"], s["first_w"]) for s in steps if "first_w" in s]  # logged since the first GSM8K run
    if first:
        axes[2].plot(*zip(*first, strict=True), "^:", color="tab:purple", label="mean w at the first token")
    disagreement = [(s["step"], s["disagreement_w"]) for s in steps if "disagreement_w" in s]
    if disagreement:
        axes[2].plot(*zip(*disagreement, strict=True), "v:", color="tab:brown", label="w weighted by TV(q, p)")
    axes[2].legend(fontsize=8)
    axes[2].set_ylim(0, 1)
    axes[2].set_title("mean w (weight on the target)")
    for ax in axes:
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def training_table(log: Path) -> str:
    """The steps of a head's training run (its log.jsonl) as a Markdown table: the samples' mean reward and
    acceptance rate, the sampling head's mean w, its spread over tokens, its mean at the first token and its
    TV-weighted mean (where logged), the completions the update used (where logged; fewer than sampled with
    informative_only), the gradient norms of the two loss terms at the sampling head, the approximate KL after
    the update, and the seconds (of which rescoring)."""
    lines = ["| step | reward | acceptance rate | mean w | w spread | w at token 1 | w by TV | updated on "
             "| reward-term grad norm | acceptance-term grad norm | KL after update | seconds (rescoring) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in _training_steps(log):
        scoring = f" ({s['scoring_seconds']:.0f})" if "scoring_seconds" in s else ""
        first, by_tv = (f"{s[key]:.3f}" if key in s else "-" for key in ("first_w", "disagreement_w"))
        lines.append(f"| {s['step']} | {s['reward']:.3f} | {s['acceptance_rate']:.3f} | {s['mean_w']:.3f} | "
                     f"{s.get('w_std', float('nan')):.3f} | {first} | {by_tv} | {s.get('trained_on', '-')} | "
                     f"{s.get('pg_grad_norm', float('nan')):.2f} | "
                     f"{s.get('acceptance_grad_norm', float('nan')):.3f} | {s.get('approx_kl', float('nan')):.1e} | "
                     f"{s['seconds']:.0f}{scoring} |")
    return "\n".join(lines)


def _training_steps(log: Path) -> list[dict]:
    steps = [json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()]
    if not steps:
        raise ValueError(f"{log} has no training steps")
    return steps


def _style(verification: str, heads: Sequence[str]) -> tuple[str, str, str, int]:
    """A point's marker, colour, face colour and size; `heads` are the plot's heads without their dials, each
    given a colour of its own (several heads in one red would be told apart by the legend's order alone)."""
    if verification.startswith("diversed"):
        head, at, _ = verification.partition("@")
        color = HEAD_COLORS[heads.index(head) % len(HEAD_COLORS)]
        return "*", color, "none" if at else color, 14
    if verification.startswith("hf-"):
        marker, color, size = ("P" if verification == "hf-default" else "x"), "tab:gray", 9
    elif verification.partition(":")[0] in FAMILIES:
        marker, color, size = "o", FAMILIES[verification.partition(":")[0]][1], 7
    else:
        marker, color, size = {"plain": ("s", "black", 8), "exact": ("D", "tab:green", 8)}.get(
            verification, ("^", "tab:gray", 8))
    return marker, color, color, size


def _labels(verifications: list[str]) -> dict[str, str]:
    """Table and legend names: diversed:PATH/TO/HEAD@+1 -> diversed (TO/HEAD) @+1, with the fewest trailing parts
    of the path that tell the heads apart (whole paths make poor names; heads are often all "head-step-N")."""
    heads = {m: Path(m.partition(":")[2].partition("@")[0]).parts for m in verifications if m.startswith("diversed:")}
    paths = set(heads.values())
    depth = 1
    while len({parts[-depth:] for parts in paths}) < len(paths) and depth < max(map(len, paths)):
        depth += 1

    def label(m: str) -> str:
        base, at, dial = m.partition("@")
        name = ("/".join(heads[m][-depth:]) if m in heads else "packaged head" if base == "diversed" else None)
        return m if name is None else f"diversed ({name})" + (f" @{dial}" if at else "")
    return {m: label(m) for m in verifications}


def _error_bar(summary: dict, key: str) -> list[list[float]] | None:
    """The 95% interval of a summary's quality or time per example as errorbar's [[below], [above]]."""
    if f"{key}_low" not in summary:
        return None
    return [[_scale(summary[key] - summary[f"{key}_low"], key)], [_scale(summary[f"{key}_high"] - summary[key], key)]]


def _scale(value: float, key: str) -> float:
    return 100 * value if key == "quality" else value


def _percent(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _number(x: float | None, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.2f}{suffix}"
