"""How many tokens to draft each round: the speed model of the speed schedule and its measured costs."""

from __future__ import annotations

import bisect
import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

MAX_KEPT = 64  # the most recently measured (models, batch size) kept per machine

STALE_WEIGHT = 0.1  # a width's decayed weight below which its cost is forgotten (about 22 drafted rounds at decay 0.9)
# From this many tokens a pass is compute-bound, its cost a line in its width: one line through every timed wide
# pass prices them all, so that one slow timing neither bars a width nor makes another look cheap by contrast.
# Chosen by replay on file-edit train answers (benchmarks/edit_replay.py, "learning the costs").
WIDE = 8


def stopwatch(device: torch.device, synchronize: bool = True) -> Callable[[], float]:
    """Start timing work for the speed model; the function returned gives the seconds since. On a GPU (with
    synchronize) the device's queue is drained at the start and at each reading, so that the time is the
    work's own, not its launch's; on a CPU every call is synchronous anyway."""
    wait = synchronize and device.type == "cuda"
    if wait:
        torch.cuda.synchronize(device)
    start = time.perf_counter()

    def seconds() -> float:
        if wait:
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    return seconds


def geometric_tau(a: float, n: int) -> float:
    """The tokens a round of n drafts writes when each is kept with probability a (the correction or bonus
    included): 1 + a + ... + a^n, in closed form, since the speed model weighs every N each round."""
    return n + 1.0 if a >= 1.0 else (1.0 - a ** (n + 1)) / (1.0 - a)


class SpeedModel:
    """The running speed model of one decoding call, for the "speed" schedule (docs/algorithm.md section 6).

    Tokens per second of a round of N drafts = tau(a, N) / (N d + v(N + 1)) (geometric_tau for tau), and of
    a step of the target alone (N = 0) 1 / v(1): a the per-position acceptance, d the draft
    step time, v(k) the target's forward time over k tokens per row. v is measured, since on a CPU it is far
    from flat, and per width where it is not even a line (narrow passes on a CPU: benchmarks/results/drafters-speed.md).
    All are estimated from this call's rounds, older rounds weighing less (`decay` per round), since
    acceptance drifts within a text (code, then prose). The acceptance is the maximum-likelihood estimate for
    geometric runs: kept drafts / (kept drafts + rejections), starting from `prior_drafts` pseudo-drafts at
    `prior_acceptance`.

    A pass over WIDE tokens or more is read off the least-squares line through the timed passes that wide
    (weighed by how often and how lately each was timed), once two such widths are timed: there a pass is
    compute-bound, and a width's own few timings are noisier than the line. A narrower width (or any, before
    that) is its own measured mean, or, never timed, read off the least-squares line through the timed ones
    (below the shortest timed width too: a step of the target alone is often never timed before it is
    chosen), or, with one width timed, taken as that width's time: optimistic for long rounds, so the next
    round is long, which times a second width. When the target alone is predicted fastest, a round after
    `probe_every` of them drafts anyway (the best N >= 1), so that acceptance keeps being measured and
    speculation resumes when it pays again; each probe that changes nothing doubles the wait for the next.

    `tile`: the target's pass_tile (diversed.backends.base.Model). A pass of a tile's width or more is weighed
    only over whole tiles (`draft_lengths`): one a few tokens past a multiple costs more than the multiple
    below it, a step that no line through the timed widths shows.
    """

    def __init__(self, maximum: int, decay: float = 0.9, prior_acceptance: float = 0.8, prior_drafts: float = 8.0,
                 probe_every: int = 16, tile: int = 1) -> None:
        self.maximum, self.decay, self.probe_every, self.tile = maximum, decay, probe_every, tile
        # Every pass (n + 1 tokens) narrower than a tile, then only passes of whole tiles: weighed each round.
        self._lengths = [n for n in range(1, maximum + 1) if n + 1 < tile or (n + 1) % tile == 0]
        self.kept, self.rejections = prior_acceptance * prior_drafts, (1 - prior_acceptance) * prior_drafts
        self.draft_time = self.draft_steps = 0.0
        # The draft model's catch-up: tokens it was fed at the start of a round because it had not seen them
        # (written while it did not draft), and their seconds, decayed; a choice between drafters pays for it.
        self.catch_up_tokens = self.catch_up_seconds = 0.0
        self.width: dict[int, list[float]] = {}  # k -> [decayed weight, decayed seconds] of passes over k
        # v(k) of the widths weighed, and the lines fitted, since a pass was last timed (_time clears them;
        # whoever fills `width` from elsewhere, CostMemory, does so before anything is weighed): every N is
        # weighed each round, by each drafter
        self._verify_times: dict[int, float] = {}
        self._lines: dict[bool, Callable[[int], float] | None] = {}
        self.plain_rounds = 0  # rounds without the draft model since it last drafted
        self.draft_length = 0  # the draft model's next round (best_length after each round)
        self.probe_interval = probe_every  # plain rounds before the next probe

    def observe(self, kept: list[int], drafted: list[int], draft_steps: int, draft_seconds: float | None,
                verify_tokens: int, verify_seconds: float) -> None:
        """Record one round: per-sequence kept and drafted counts, the draft forwards and their total time,
        and the target pass's length (tokens per sequence) and time."""
        g = self.decay
        self.kept = g * self.kept + sum(kept)
        self.rejections = g * self.rejections + sum(k < d for k, d in zip(kept, drafted, strict=True))
        if draft_seconds is not None:  # None: no forward of the round was a draft step alone
            self.draft_time = g * self.draft_time + draft_seconds
            self.draft_steps = g * self.draft_steps + draft_steps
        self._time(verify_tokens, verify_seconds)
        self.plain_rounds = 0

    def observe_catch_up(self, tokens: int, seconds: float) -> None:
        """Record a draft forward that fed `tokens` per row the draft model had not seen."""
        self.catch_up_tokens = self.decay * self.catch_up_tokens + tokens
        self.catch_up_seconds = self.decay * self.catch_up_seconds + seconds

    def catch_up_time(self, tokens: int) -> float:
        """Predicted seconds for the draft model to catch up on `tokens` per row: the measured time per token,
        else a draft step per token (an upper bound on a CPU, where feeding k tokens costs at most k steps)."""
        if tokens <= 2:  # the one or two tokens every round feeds anyway
            return 0.0
        if self.catch_up_tokens:
            return tokens * self.catch_up_seconds / self.catch_up_tokens
        return tokens * self.draft_time / self.draft_steps if self.draft_steps else float("inf")

    def observe_plain(self, seconds: float) -> None:
        """Record one step of the target alone (a pass over 1 token per sequence)."""
        self.observe_copied(1, seconds)

    def observe_copied(self, verify_tokens: int, seconds: float) -> None:
        """Record a target pass over drafts that cost no draft forward (or none): its time only (a copying
        drafter keeps its own acceptance)."""
        self._time(verify_tokens, seconds)
        self.plain_rounds += 1

    def _time(self, k: int, seconds: float) -> None:
        # Rounds that drafted age every width: one not timed for STALE such rounds is read off the line again,
        # and so chosen and timed again when that predicts it fast, so that a cost measured once (by an earlier
        # call, on a busy machine) cannot stay. Steps of the target alone age only their own width: widths
        # remembered from earlier calls outlast a stretch of text with nothing to copy.
        for width, stats in self.width.items():
            if k > 1 or width == 1:
                stats[0] *= self.decay
                stats[1] *= self.decay
        self.width = {w: stats for w, stats in self.width.items() if stats[0] >= STALE_WEIGHT}
        weight, total = self.width.get(k, (0.0, 0.0))
        self.width[k] = [weight + 1.0, total + seconds]
        self._verify_times.clear()
        self._lines.clear()

    @property
    def acceptance(self) -> float:
        return self.kept / (self.kept + self.rejections)

    def verify_time(self, k: int) -> float:
        """v(k): the measured mean time of passes over k tokens, else the line through the measured widths
        (kept until the next pass is timed: every N is weighed each round)."""
        if k not in self._verify_times:
            if 1 in self.width and k > 1:  # a pass over k tokens costs at most k passes over one (its fixed part
                # once): so a width timed while the machine was busy cannot keep drafting from being tried
                self._verify_times[k] = min(self._verify_time(k), k * self._verify_time(1))
            else:
                self._verify_times[k] = self._verify_time(k)
        return self._verify_times[k]

    def _verify_time(self, k: int) -> float:
        if k >= WIDE and (wide := self._line(wide=True)) is not None:
            return wide(k)
        if k in self.width:
            weight, total = self.width[k]
            return total / weight
        if len(self.width) == 1:
            weight, total = next(iter(self.width.values()))
            return total / weight
        return self._line(wide=False)(k)

    def _line(self, wide: bool) -> Callable[[int], float] | None:
        """The line through the passes of WIDE tokens or more, each weighing by its weight (None: fewer than
        two such widths timed); not wide, through every timed width's mean, each weighing one."""
        if wide not in self._lines:
            if wide:
                timed = {w: stats for w, stats in self.width.items() if w >= WIDE}
                self._lines[wide] = _fit(timed) if len(timed) >= 2 else None
            else:
                self._lines[wide] = _fit({w: [1.0, t / n] for w, (n, t) in self.width.items()})
        return self._lines[wide]

    def draft_lengths(self, longest: int | None = None) -> list[int]:
        """The draft lengths weighed, 1 to `longest` (at most `maximum`): every one whose pass (n + 1 tokens) is
        narrower than a tile, then only passes of whole tiles."""
        return self._lengths if longest is None else self._lengths[:bisect.bisect_right(self._lengths, longest)]

    def tokens_per_second(self, n: int, acceptance: float | None = None, overhead: float = 0.0) -> float:
        """Predicted tokens per second (per sequence) of a round of n drafts (at the running acceptance, or
        at `acceptance`), `overhead` seconds added (the draft model's catch-up); n = 0 is the target alone.
        Needs a timed verify pass, and for n > 0 a timed draft step (best_length asks only then)."""
        if n == 0:
            return 1.0 / self.verify_time(1)
        step = self.draft_time / self.draft_steps
        a = self.acceptance if acceptance is None else acceptance
        return geometric_tau(a, n) / (overhead + n * step + self.verify_time(n + 1))

    def model_rate(self, n: int, behind: int) -> float:
        """Predicted tokens per second of a round of n drafts by the draft model when its cache is `behind`
        tokens behind the text: the catch-up comes first."""
        return self.tokens_per_second(n, overhead=self.catch_up_time(behind))

    def best_length(self) -> int:
        """The draft length with the most predicted tokens per second (0: the target alone), but a probe
        round of drafts after `probe_every` rounds of the target alone; each probe that does not make
        drafting pay doubles the wait for the next (a probe costs the draft's catch-up on every token it
        missed, which on a CPU is most of a target step per few tokens). Until a step of the target alone is
        timed, 0 (so that one is); then, until a draft step is timed, 1."""
        if 1 not in self.width:  # time a step of the target alone once, rather than extrapolate it
            return 0
        if not self.draft_steps:  # no draft step timed yet (a new batch size, or only catch-up rounds): time one
            return 1
        drafted = max(self.draft_lengths(), key=self.tokens_per_second)
        if self.tokens_per_second(drafted) >= self.tokens_per_second(0):
            self.probe_interval = self.probe_every
            return drafted
        # A probe can only help where acceptance is what holds drafting back: not where even drafts that are
        # all kept would be slower than the target alone (a CPU whose verify pass costs a step per token).
        ceiling = max(self.tokens_per_second(n, acceptance=1.0) for n in self.draft_lengths())
        if self.plain_rounds >= self.probe_interval and ceiling > self.tokens_per_second(0):
            self.probe_interval = min(2 * self.probe_interval, 1024)
            return drafted
        return 0


def _fit(width: dict[int, list[float]]) -> Callable[[int], float]:
    """The least-squares line through the timed widths ({width: [weight, total seconds]}, each mean weighed by
    its weight), as the time of a pass over k tokens: never falling with the width."""
    points = [(w, t / n, n) for w, (n, t) in width.items()]
    weight = sum(n for _, _, n in points)
    mean_k = sum(w * n for w, _, n in points) / weight
    mean_t = sum(t * n for _, t, n in points) / weight
    slope = (sum(n * (w - mean_k) * (t - mean_t) for w, t, n in points)
             / sum(n * (w - mean_k) ** 2 for w, _, n in points))
    slope = max(slope, 0.0)
    # Below the shortest timed width the line may reach 0 (a compute-bound pass): the floor only keeps the
    # prediction positive; a width so predicted cheap gets chosen, and timed, at once.
    floor = 1e-3 * min(t for _, t, _ in points)
    return lambda k: max(mean_t + slope * (k - mean_k), floor)


Costs = tuple[dict[int, list[float]], float, float, float | None]  # widths, draft time and steps, catch-up


class CostMemory:
    """Costs measured by earlier decoding calls, per (target, draft, rows): a later call's speed model starts
    from them. Keys made of strings (a model's `cost_identity`: its file, size and threads) are also kept in
    the file at `path` (one entry per machine), read when first needed and written by save(), so that a new
    process starts from them too; others (id()s) live as long as this memory. path None: this memory only.
    Whoever makes one decides when it is saved (the command line after a run, the server when it stops)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.kept: dict[tuple, Costs] = {}
        self._read = path is None

    def speed_model(self, key: tuple, maximum: int, tile: int = 1) -> SpeedModel:
        """A speed model whose costs start from what earlier calls with the same key measured (each width
        and the draft step weighing as one observation, so this call's own soon dominate), but a step of the
        target alone, which every call times afresh: every choice is weighed against it, a remembered one that
        was slow (a machine busy then) would never be retimed, and timing it costs nothing (it is what the
        call does without drafts)."""
        if not self._read:
            self._read = True
            self.kept.update(_read_costs(self.path))
        model = SpeedModel(maximum, tile=tile)
        if key in self.kept:
            widths, draft_time, draft_steps, catch_up = self.kept[key]
            model.width = {k: [1.0, total / weight] for k, (weight, total) in widths.items() if k != 1}
            if draft_steps:  # none where only copying drafters drafted
                model.draft_time, model.draft_steps = draft_time / draft_steps, 1.0
            if catch_up is not None:
                model.catch_up_tokens, model.catch_up_seconds = 1.0, catch_up
        return model

    def keep(self, key: tuple, model: SpeedModel) -> None:
        """Keep a call's costs for the next call with the same key (save() writes them to disk)."""
        if model.width:  # copying drafters time verify widths with no draft step: those are kept too
            self.kept.pop(key, None)  # the most recent last
            catch_up = model.catch_up_seconds / model.catch_up_tokens if model.catch_up_tokens else None
            self.kept[key] = ({k: list(v) for k, v in model.width.items()}, model.draft_time, model.draft_steps,
                              catch_up)

    def save(self) -> None:
        """Write the kept costs of keys of strings (models named by a cost identity) to `path`, for later
        processes (nothing without a path)."""
        if self.path is not None and any(_lasting(k) for k in self.kept):
            _write_costs(self.path, {k: v for k, v in self.kept.items() if _lasting(k)})


def _lasting(key: tuple) -> bool:
    """Whether costs of this key outlive the process: both models named by a cost identity (strings)."""
    return isinstance(key[0], str) and isinstance(key[1], str)


def _read_costs(path: Path) -> dict[tuple, Costs]:
    """This machine's remembered costs from the cache folder; nothing if the file is missing or unreadable
    (it only ever saves a few rounds of measuring)."""
    try:
        stored = json.loads(path.read_text())[platform.node()]
        return {tuple(entry["key"]): ({int(k): [float(w), float(t)] for k, (w, t) in entry["widths"].items()},
                                      float(entry["draft_time"]), float(entry["draft_steps"]),
                                      None if entry.get("catch_up") is None else float(entry["catch_up"]))
                for entry in stored}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def _write_costs(path: Path, costs: dict[tuple, Costs]) -> None:
    """Replace this machine's entry of the costs file (written beside it, then renamed: never half written)."""
    try:
        everything = json.loads(path.read_text())
        everything = everything if isinstance(everything, dict) else {}
    except (OSError, ValueError):
        everything = {}
    everything[platform.node()] = [{"key": list(key), "widths": {str(k): v for k, v in widths.items()},
                                    "draft_time": draft_time, "draft_steps": draft_steps, "catch_up": catch_up}
                                   for key, (widths, draft_time, draft_steps, catch_up)
                                   in list(costs.items())[-MAX_KEPT:]]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(everything))
        temporary.replace(path)
    except OSError:  # a read-only cache: the costs stay in this process
        pass
