"""`diversed eval`: several verifications on the same examples, same seeds, one run; resumable and
data-parallel.

Every (example, verification) result is one JSON line, appended and flushed as soon as it exists, so a killed
run loses at most the generation in flight and `resume=True` picks up where it stopped. Under torchrun,
rank r takes examples r, r + K, r + 2K, ... and writes its own part file; rank 0 merges them.
Verifications run in turn on each example, so every verification sees the machine in the same state.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

from diversed.admission import load_head
from diversed.backends.prompt_cache import common_prefix
from diversed.decoding.schedule import CostMemory
from diversed.evaluation.peer import assisted_generate
from diversed.evaluation.report import plot_tradeoffs, summarize_results, write_summary
from diversed.folders import changed_settings, check_writable, saved_settings
from diversed.generation import run
from diversed.head.names import head_folder
from diversed.machine import describe
from diversed.models.loading import Pair
from diversed.request import RENAMED_SCHEDULES, RENAMED_VERIFICATIONS, Drafting, Request, Sampling, Verification
from diversed.tasks.task import predicted_outputs
from diversed.text import cut_at_stop, encode_prompt

PEERS = ("hf-exact", "hf-static", "hf-default")
CONFIG_FILE, RESULTS_FILE = "eval_config.json", "results.jsonl"


@dataclass(frozen=True)
class EvalConfig:
    """What must stay the same for results to be comparable (and for a run to be resumed). A setting that no
    run could use is refused here, so that neither the CLI nor evaluate() writes anything for it."""

    task: str
    temperature: float = 1.0
    draft_length: int = 5
    draft_confidence: float = 0.0  # a sequence stops drafting once a draft's probability is below this
    draft_schedule: str = "constant"  # or "heuristic", "speed" (diversed.request.Drafting)
    drafter: str = "model"  # diversed.decoding.drafters.DRAFTERS
    max_new_tokens: int = 128
    split: str = "test"
    limit: int | None = None
    seed: int = 0
    draft_model: str = ""
    target_model: str = ""
    dtype: str = ""
    draft_int8: bool = False  # asked for; it applies to float32 and float16 CPU drafts
    backend: str = ""
    batch_size: int = 1  # examples decoded together per verification (peers always run one at a time)
    prediction: bool = False  # each example's input text (metadata["original"]) as its predicted output

    def __post_init__(self) -> None:
        if self.draft_schedule in RENAMED_SCHEDULES:  # a run saved under the old name resumes under the new one
            object.__setattr__(self, "draft_schedule", RENAMED_SCHEDULES[self.draft_schedule])
        self.request(("a prompt",), "plain" if not self.prediction else "exact",
                     "a prediction" if self.prediction else None, self.seed)  # the request's own checks
        if self.limit is not None and self.limit < 1:
            raise ValueError(f"limit must be at least 1 (or None for the whole split), got {self.limit}")

    def request(self, prompts: Sequence[str | list[dict]], verification: str, predictions, seed: int,
                stop: Sequence[str] = ()) -> Request:
        """These settings as a Request for some examples' prompts (predictions: one per prompt, or None) with
        the task's stop strings."""
        return Request(tuple(prompts), verification, Sampling(self.temperature), self.drafter, self.drafting,
                       max_new_tokens=self.max_new_tokens, stop=tuple(stop), seed=seed, predictions=predictions,
                       batch_size=self.batch_size)

    @property
    def drafting(self) -> Drafting:
        longest = self.draft_length if self.draft_schedule == "speed" else Drafting.maximum  # speed: up to it
        return Drafting(self.draft_length, self.draft_schedule, longest, self.draft_confidence)


def parse_verifications(text: str | Sequence[str], *, heads: bool = True) -> list[str]:
    """'plain,exact,static:0.7,diversed:DIR,hf-exact,hf-static:0.7' -> validated labels, in order, each in its
    canonical spelling ('static:.70' -> 'static:0.7', 'diversed:x@+1.0' -> 'diversed:x@+1'), so that a resumed
    run or a report finds the rows whatever the spelling. heads: check that each diversed verification's head
    is there (to run it; a report of its results needs none)."""
    labels = [m.strip() for m in (text.split(",") if isinstance(text, str) else text) if m.strip()]
    if not labels:
        raise ValueError("no verifications given")
    canonical = [_canonical(label, heads) for label in labels]
    if len(set(canonical)) != len(canonical):
        raise ValueError(f"a verification is listed twice in {labels}")
    return canonical


def _canonical(label: str, heads: bool) -> str:
    """One verification label checked and spelled canonically (see parse_verifications)."""
    name, _, value = label.partition(":")
    if name in PEERS:
        try:
            weight = float(value) if value else None
        except ValueError:
            weight = -1.0
        if (name == "hf-static") != (weight is not None) or (weight is not None and not 0 < weight < 1):
            raise ValueError(f"peer {label!r}: use hf-exact, hf-default or hf-static:W with 0 < W < 1")
        return name if weight is None else f"{name}:{weight}"
    verification = Verification.parse(label)
    if verification.name == "diversed" and heads:
        head_folder(verification.head)  # a missing head is found before the models load
    return verification.label


def evaluate(pair: Pair, task, verifications: Sequence[str], config: EvalConfig, out_dir: str | Path, *,
             resume: bool = False, progress: bool = True, costs: CostMemory | None = None) -> list[dict]:
    """Run every verification on the task's examples and write results.jsonl, then the folder's report
    (report(): summary.{md,csv,json} and the plots) into out_dir, of every verification in it that has finished
    these examples, earlier runs' too. Returns this run's summaries (one per verification); under torchrun, only
    rank 0 returns them. costs: the speed schedule's measured costs to start from and add to (None: this run's
    own)."""
    out_dir = Path(out_dir)
    # Everything is checked before anything is written: a refused call must leave out_dir as it was, or a
    # corrected rerun would find an evaluation it has to --resume, with the refused settings.
    verifications = parse_verifications(verifications)
    check_out_dir(out_dir)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    examples = task.examples(config.split, limit=config.limit)  # the task refuses a split it does not have
    if not examples:
        raise ValueError(f"task {config.task!r} has no examples in split {config.split!r}")
    if len({e.id for e in examples}) != len(examples):
        raise ValueError(f"task {config.task!r} has examples with the same id: results would overwrite each other")
    if config.prediction:
        predicted_outputs(config.task, examples)  # a task without input texts is refused before anything runs
    if config.prediction and any(m.partition(":")[0] in PEERS for m in verifications):
        raise ValueError("transformers' assisted generation takes no prediction: leave out its verifications")
    heads = {m: {Verification.parse(m).head: load_head(pair, Verification.parse(m).head)} for m in verifications
             if m.partition(":")[0] == "diversed"}
    _check_resumable(out_dir, config, resume)  # on every rank, so that all of them stop together
    _barrier()
    if rank == 0 and not (out_dir / CONFIG_FILE).exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / CONFIG_FILE).write_text(json.dumps(asdict(config), indent=1) + "\n")
    _barrier()
    part = out_dir / (f"results.rank{rank}.jsonl" if world > 1 else RESULTS_FILE)
    # Each rank repairs only the file it appends to; a torn tail of another rank's file is read as absent.
    done = {(r["example"], r["verification"]) for path in _result_files(out_dir)
            for r in load_done_rows(path, repair=path == part)}
    costs = CostMemory() if costs is None else costs
    machine = describe()  # every row names it: a run resumed on another machine times its rows there
    mine = list(range(rank, len(examples), world))
    todo = [(i, m) for i in mine for m in verifications if (examples[i].id, m) not in done]
    bar = tqdm(total=len(todo), desc=f"eval {config.task}" + (f" [rank {rank}]" if world > 1 else ""),
               disable=not progress, dynamic_ncols=True)
    running: dict[str, list[dict]] = {m: [] for m in verifications}
    if todo:
        _pin_shared_prefix(pair, [examples[i] for i in mine], config.batch_size)
    with open(part, "a") as f:
        # Verifications take turns on each group of batch_size examples, so that each sees the machine alike.
        for start in range(0, len(mine), config.batch_size):
            group = mine[start:start + config.batch_size]
            for label in verifications:
                if all((examples[i].id, label) in done for i in group):
                    continue
                # And each finds the prompt caches alike: holding the examples' shared beginning alone.
                _forget_unpinned(pair)
                # A group cut short by a kill runs again whole: the same batch and seed as an unbroken run
                # (and as the other verifications), with only its missing rows written.
                for row in _run_batch(pair, task, examples, group, label, config, heads.get(label), costs):
                    if (row["example"], label) in done:
                        continue
                    row["machine"] = machine
                    f.write(json.dumps(row) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                    running[label].append(row)
                    bar.update()
                bar.set_postfix_str(_running_line(running))
    bar.close()
    _barrier()
    if rank != 0:
        return []
    everything, ids = _merge(out_dir, examples, verifications), {e.id for e in examples}
    # The folder's report: every verification in it that has finished these examples, earlier runs' too, so
    # that a resume with other verifications drops none of them (and one stopped early does not cut the others
    # short).
    done: dict[str, set[str]] = {}
    for r in everything:
        done.setdefault(r["verification"], set()).add(r["example"])
    report(out_dir, task.metric, [m for m, finished in done.items() if ids <= finished])
    return summarize_results([r for r in everything if r["verification"] in verifications and r["example"] in ids],
                             verifications)


def report(out_dir: str | Path, metric: str, verifications: Sequence[str] | None = None,
           to: str | Path | None = None) -> list[dict]:
    """Summaries and plots of an evaluation so far (while it runs, or after it was stopped): only the examples
    that every verification has finished, so that all of them are compared on the same examples. Reads the
    result files and writes summary.{md,csv,json} and the plots; the run itself is left as it is.

    verifications: report these only (say, to leave out one that was stopped early and would hold the others
    to its examples); by default every verification with results.
    to: write the summary and plots into this folder instead of out_dir, so that a report of some
    verifications leaves the evaluation's own report as it is."""
    out_dir = Path(out_dir)
    to = out_dir if to is None else Path(to)
    if not (out_dir / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"no evaluation in {out_dir}: {CONFIG_FILE} is missing")
    check_writable(to, "the report")
    config = EvalConfig(**saved_settings(json.loads((out_dir / CONFIG_FILE).read_text())))
    rows = _unique([r for path in _result_files(out_dir) for r in load_done_rows(path)])
    present = list(dict.fromkeys(r["verification"] for r in rows))
    if verifications is not None:
        verifications = parse_verifications(verifications, heads=False)
        if missing := [m for m in verifications if m not in present]:
            raise ValueError(f"no results for {', '.join(missing)} in {out_dir}; it has {', '.join(present)}")
        rows = [r for r in rows if r["verification"] in verifications]
    verifications = verifications or present
    finished = {m: {r["example"] for r in rows if r["verification"] == m} for m in verifications}
    complete = set.intersection(*finished.values()) if finished else set()
    if not complete:
        raise ValueError(f"no example in {out_dir} has been run with every verification yet")
    rows = [r for r in rows if r["example"] in complete]
    summaries = summarize_results(rows, verifications)
    done = f"the {len(complete)} examples every verification finished, of {config.limit or 'all'}"
    to.mkdir(parents=True, exist_ok=True)
    write_summary(summaries, to, metric, _header(config, done) + "\n\n" + _machines(rows))
    plot_tradeoffs(summaries, to, metric)
    return summaries


def _header(config: EvalConfig, examples: str) -> str:
    # dtype and the int8 draft are transformers' settings: a llama.cpp run's weights are its GGUF files'.
    weights = "" if config.backend == "llama.cpp" else (
        f", {config.dtype}{', int8 draft' if config.draft_int8 else ''}")
    return (f"{config.task} ({config.split}, {examples}), {config.draft_model} -> "
            f"{config.target_model}, {config.backend or 'transformers'}{weights}, "
            f"T = {config.temperature}, drafts {config.drafting}, "
            f"{config.max_new_tokens} new tokens, seed {config.seed}{_batching(config.batch_size)}")


def _machines(rows: list[dict]) -> str:
    """The machine the rows ran on or, for a run resumed on others, each machine with its examples' count, and
    any example whose verifications ran on different machines (its times do not compare)."""
    by_example: dict[str, set[str]] = {}
    for r in rows:
        by_example.setdefault(r["example"], set()).add(r.get("machine", "not recorded (rows written before "
                                                                         "machines were recorded)"))
    counts = Counter(m for machines in by_example.values() if len(machines) == 1 for m in machines)
    split = sum(len(machines) > 1 for machines in by_example.values())
    if len(counts) == 1 and not split:
        return f"Machine: {next(iter(counts))}"
    lines = [f"- {m}: {_examples(n)}" for m, n in counts.items()]
    lines += [f"- {_examples(split)} with verifications on different machines"] if split else []
    return "Machines (times compare only within one):\n" + "\n".join(lines)


def _examples(count: int) -> str:
    return f"{count} example{'s' * (count != 1)}"


def _batching(batch_size: int) -> str:
    # Rows decoded together share the target's passes, which helps plain decoding more than speculative
    # rounds: tokens/s here is not the speed a single request sees (benchmarks/llama_speed.py measures that).
    return "" if batch_size == 1 else (f"; {batch_size} examples decoded together, so tokens/s (tokens over the "
                                       "rows' own times) and speedup are rates of a row sharing the batch, not "
                                       "single-request speed")


def _pin_shared_prefix(pair: Pair, examples: list, capacity: int) -> None:
    """Read the examples' shared beginning (a few-shot or system prompt) into the pair's prompt caches once, and
    pin it there alone: every verification of every example starts from it, in a resumed run as in an
    unbroken one (what another verification read of a prompt is dropped before each: _forget_unpinned)."""
    chat = pair.tokenizer.chat_template is not None
    ids = [encode_prompt(pair.tokenizer, e.prompt_for(chat), chat) for e in examples]
    shared = ids[0][:min(common_prefix(ids[0], other) for other in ids)]
    for model in (pair.target, pair.draft):
        if model is None:
            continue
        rows = model.rows(1, capacity)  # first: llama.cpp makes its context, and its cache, for the batches
        if model.cache is None:
            continue
        model.cache.forget(list(model.cache.entries))
        if len(shared) > 1:
            rows.feed([shared], 1)
            rows.select([])  # the row leaves: its tokens go to the cache
            model.cache.pinned = {key for key, tokens in model.cache.entries.items() if tokens == shared}


def _forget_unpinned(pair: Pair) -> None:
    for model in (pair.target, pair.draft):
        if model is not None and model.cache is not None:
            model.cache.forget([key for key in model.cache.entries if key not in model.cache.pinned])


def _run_batch(pair: Pair, task, examples: list, indices: list[int], label: str, config: EvalConfig,
               heads: dict | None, costs: CostMemory) -> list[dict]:
    """One verification on some examples, decoded together (one at a time for the peers); the seed depends on
    the first example only, so verifications share it."""
    seed = (config.seed * 1_000_003 + indices[0]) % 2**63
    name, _, value = label.partition(":")
    if name in PEERS:
        results = []
        for offset, index in enumerate(indices):
            prompt = encode_prompt(pair.tokenizer, examples[index].prompt_for(pair.tokenizer.chat_template is not None))
            tokens, stats = assisted_generate(pair, prompt, Sampling(config.temperature),
                                              draft_length=None if name == "hf-default" else config.draft_length,
                                              weight=float(value) if value else None,
                                              max_new_tokens=config.max_new_tokens, stop=task.stop, seed=seed + offset)
            text = cut_at_stop(pair.tokenizer.decode(tokens, skip_special_tokens=True), task.stop)
            results.append((text, stats.to_dict()))
    else:
        prompts = [examples[i].prompt_for(pair.tokenizer.chat_template is not None) for i in indices]
        # The target alone (plain) drafts nothing: it is every prediction's baseline.
        predictions = predicted_outputs(task.name, [examples[i] for i in indices]) \
            if config.prediction and label != "plain" else None
        completions = run(pair, config.request(prompts, label, predictions, seed, task.stop), heads=heads, costs=costs)
        results = [(c.text, c.metrics) for c in completions]
    rows = []
    for index, (text, metrics) in zip(indices, results, strict=True):
        metrics.pop("verification", None)
        rows.append({"example": examples[index].id, "index": index, "verification": label,
                     "reward": task.reward(examples[index], text), "text": text, **metrics})
    return rows


def _check_resumable(out_dir: Path, config: EvalConfig, resume: bool) -> None:
    """Refuse to mix results of another config into an existing run, or to continue one without resume."""
    path = out_dir / CONFIG_FILE
    if not path.exists():
        return
    if not resume:
        raise ValueError(f"{out_dir} already holds an evaluation: pass --resume to continue it")
    saved = asdict(EvalConfig(**saved_settings(json.loads(path.read_text()))))  # added since: defaults
    if changed := changed_settings(saved, asdict(config)):
        raise ValueError(f"cannot resume {out_dir} with a different setting: {', '.join(changed)}")


def check_out_dir(out_dir: Path, resume: bool | None = None) -> None:
    """Refuse an out_dir that is, or lies under, an existing file (mkdir would fail only after the checks);
    with resume given, also one that holds an evaluation when resume is False."""
    if resume is False and (Path(out_dir) / CONFIG_FILE).exists():
        raise ValueError(f"{out_dir} already holds an evaluation: pass --resume to continue it")
    check_writable(Path(out_dir), "the evaluation")


def _result_files(out_dir: Path) -> list[Path]:
    """results.jsonl and the ranks' part files."""
    return sorted(out_dir.glob("results*.jsonl"))


def load_done_rows(path: Path, *, repair: bool = False) -> list[dict]:
    """The finished rows of a results file, in file order. A kill can stop a write at any byte: a line that
    holds a whole row counts, with or without its newline; a line cut short is dropped, to be redone.
    repair=True makes the file safe to append to: it cuts a last line cut short, or ends a whole last row
    with its newline, so that the next row starts on a line of its own."""
    if not path.exists():
        return []
    data = path.read_bytes()
    rows = [row for line in data.split(b"\n") if (row := _parse_row(line)) is not None]
    if repair and data and not data.endswith(b"\n"):
        tail = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:  # synced with the first row appended next
            if _parse_row(data[tail:]) is None:
                f.truncate(tail)
            else:
                f.seek(len(data))
                f.write(b"\n")
    return rows


def _parse_row(line: bytes) -> dict | None:
    """The result row a line holds, or None for a line cut short (or blank)."""
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if isinstance(row, dict) and "method" in row:  # an older run's row: the verification was its "method"
        row["verification"] = row.pop("method")
    if not (isinstance(row, dict) and "example" in row and "verification" in row):
        return None
    verification = row["verification"]
    return {**row, "verification": RENAMED_VERIFICATIONS.get(verification, verification)}  # older runs' spellings


def _merge(out_dir: Path, examples: list, verifications: list[str]) -> list[dict]:
    """Every row of the folder, once each. A single process has appended its rows to results.jsonl as it went,
    and the file stays as it is (rows in the order they ran; a resumed run adds at the end), so that a
    committed evaluation's diff shows only the rows a run added. A distributed run's rank files are appended
    to it here, in example then verification order, and removed."""
    main = out_dir / RESULTS_FILE
    rows = load_done_rows(main, repair=True)
    if parts := sorted(out_dir.glob("results.rank*.jsonl")):
        order = {e.id: i for i, e in enumerate(examples)}
        position = {m: i for i, m in enumerate(verifications)}
        done = {(r["example"], r["verification"]) for r in rows}
        new = {(r["example"], r["verification"]): r for path in parts for r in load_done_rows(path)}
        new = sorted((r for key, r in new.items() if key not in done),
                     key=lambda r: (order.get(r["example"], len(order)), r["example"],
                                    position.get(r["verification"], len(position)), r["verification"]))
        with open(main, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in new)
            f.flush()
            os.fsync(f.fileno())
        for path in parts:
            path.unlink()
        rows += new
    return _unique(rows)


def _unique(rows: list[dict]) -> list[dict]:
    """The first row of each (example, verification): a run killed between appending a rank's rows and
    removing its file leaves them twice."""
    first: dict[tuple, dict] = {}
    for r in rows:
        first.setdefault((r["example"], r["verification"]), r)
    return list(first.values())


def _running_line(running: dict[str, list[dict]]) -> str:
    parts = []
    for label, rows in running.items():
        if rows:
            drafted = sum(r["drafted"] for r in rows)
            rate = f"{sum(r['accepted'] for r in rows) / drafted:.0%}" if drafted else "-"
            parts.append(f"{label}: q={sum(r['reward'] for r in rows) / len(rows):.2f} acc={rate}")
    return " | ".join(parts)


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
