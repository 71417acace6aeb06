"""`diversed eval` on tiny models: resume, data parallelism, summaries recomputed from the results, plots."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import diversed.evaluation.run as run
from diversed.backends.prompt_cache import common_prefix
from diversed.evaluation.report import summarize_results
from diversed.evaluation.run import RESULTS_FILE, EvalConfig, evaluate, load_done_rows, parse_verifications
from diversed.machine import describe
from diversed.request import Verification
from diversed.tasks import get_task
from diversed.text import encode_prompt

from eval_worker import CONFIG, VERIFICATIONS
from tiny import ToyTask, share_of_draft_tokens, toy_pair

TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def pair():
    return toy_pair()


@pytest.fixture(scope="module")
def task():
    return ToyTask(share_of_draft_tokens, size=7)


@pytest.fixture(scope="module")
def complete(pair, task, tmp_path_factory):
    """One uninterrupted run, shared by the tests that compare against it."""
    out = tmp_path_factory.mktemp("complete")
    summaries = evaluate(pair, task, VERIFICATIONS, CONFIG, out, progress=False)
    return out, summaries


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / RESULTS_FILE).read_text().splitlines()]


def without_timing(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("wall_time", "tokens_per_s", "cached_tokens")}


def test_every_verification_runs_on_every_example(complete, task):
    out, summaries = complete
    results = rows(out)
    assert len(results) == 7 * len(VERIFICATIONS)
    assert [s["method"] for s in summaries] == VERIFICATIONS
    assert {(r["example"], r["verification"]) for r in results} == {(e.id, m) for e in task.examples()
                                                                   for m in VERIFICATIONS}
    assert summaries[VERIFICATIONS.index("static:0.2")]["acceptance_rate"] > summaries[1]["acceptance_rate"]


def test_verifications_share_each_examples_seed(pair, task, tmp_path, monkeypatch):
    seeds: dict[tuple, dict[str, int]] = {}
    original = run.run

    def spy(pair, request, **kwargs):
        seeds.setdefault(request.prompts, {})[request.verification.label] = request.seed
        return original(pair, request, **kwargs)

    monkeypatch.setattr(run, "run", spy)
    evaluate(pair, task, VERIFICATIONS, replace(CONFIG, limit=3), tmp_path, progress=False)
    assert len(seeds) == 3 and all(set(by_verification) == set(VERIFICATIONS) for by_verification in seeds.values())
    assert all(len(set(by_verification.values())) == 1 for by_verification in seeds.values())  # one seed an example
    assert len({seed for by_verification in seeds.values() for seed in by_verification.values()}) == 3  # each its own


def test_summary_is_recomputed_from_the_results_file(complete):
    out, summaries = complete
    again = summarize_results(rows(out), VERIFICATIONS)
    assert again == summaries == json.loads((out / "summary.json").read_text())
    exact = [r for r in rows(out) if r["verification"] == "exact"]
    assert summaries[1]["quality"] == pytest.approx(sum(r["reward"] for r in exact) / len(exact))
    assert summaries[1]["acceptance_rate"] == pytest.approx(
        sum(r["accepted"] for r in exact) / sum(r["drafted"] for r in exact))
    assert summaries[0]["speedup"] == 1.0
    csv_lines = (out / "summary.csv").read_text().splitlines()
    assert csv_lines[0].startswith("method,examples,quality") and len(csv_lines) == 1 + len(VERIFICATIONS)
    assert "| static:0.5 |" in (out / "summary.md").read_text()


def test_report_of_a_run_in_progress_compares_the_examples_every_verification_finished(complete, tmp_path):
    out, summaries = complete
    shutil.copy(out / run.CONFIG_FILE, tmp_path / run.CONFIG_FILE)
    everything = rows(out)
    last = everything[-1]["example"]
    # As a run leaves it mid-example: the last example done by some verifications only, its final row cut short.
    kept = [r for r in everything if r["example"] != last or r["verification"] == VERIFICATIONS[0]]
    (tmp_path / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in kept) + '{"example": "cut')
    partial = run.report(tmp_path, "share")
    assert [s["method"] for s in partial] == VERIFICATIONS
    assert partial == summarize_results([r for r in everything if r["example"] != last], VERIFICATIONS)
    assert "the 6 examples every verification finished" in (tmp_path / "summary.md").read_text()
    assert "decoded together" not in (tmp_path / "summary.md").read_text()
    assert (tmp_path / RESULTS_FILE).read_text().endswith('"cut')  # the run's files are left as they are
    with pytest.raises(FileNotFoundError, match="no evaluation"):
        run.report(tmp_path / "nothing", "share")


def test_report_of_some_verifications_compares_the_examples_those_finished(complete, tmp_path):
    """A verification stopped early holds the full report to its examples; leaving it out gives the others theirs."""
    out, summaries = complete
    shutil.copy(out / run.CONFIG_FILE, tmp_path / run.CONFIG_FILE)
    everything = rows(out)
    early = {r["example"] for r in everything if r["verification"] == VERIFICATIONS[-1]}
    early = sorted(early)[:2]
    kept = [r for r in everything if r["verification"] != VERIFICATIONS[-1] or r["example"] in early]
    (tmp_path / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in kept))
    assert all(s["examples"] == 2 for s in run.report(tmp_path, "share"))
    whole = (tmp_path / "summary.json").read_text()
    others = run.report(tmp_path, "share", ",".join(VERIFICATIONS[:-1]), to=tmp_path / "some")
    assert others == summaries[:-1] == json.loads((tmp_path / "some" / "summary.json").read_text())
    assert (tmp_path / "summary.json").read_text() == whole  # --to leaves the folder's own report alone
    assert (tmp_path / "some" / "quality_vs_acceptance.png").is_file()
    with pytest.raises(ValueError, match="is a file"):
        run.report(tmp_path, "share", to=tmp_path / RESULTS_FILE / "report")
    with pytest.raises(ValueError, match="no results for static:0.3"):
        run.report(tmp_path, "share", ["exact", "static:0.3"])
    with pytest.raises(ValueError, match="no results for diversed:gone"):  # a report needs no head folder
        run.report(tmp_path, "share", ["exact", "diversed:gone"])


def test_rows_and_report_name_the_machine_each_example_ran_on(complete, tmp_path):
    """A run resumed on another machine (the project's changes between sessions) says which examples ran where,
    and which had their verifications split between machines; rows from before machines were recorded say so."""
    out, _ = complete
    everything = rows(out)
    assert {r["machine"] for r in everything} == {describe()}
    assert f"Machine: {describe()}" in (out / "summary.md").read_text()
    shutil.copy(out / run.CONFIG_FILE, tmp_path / run.CONFIG_FILE)
    ids = sorted({r["example"] for r in everything})
    for r in everything:
        position = ids.index(r["example"])
        if position < 3:
            del r["machine"]
        elif position == 3 and r["verification"] == VERIFICATIONS[0]:
            r["machine"] = "elsewhere"
    (tmp_path / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in everything))
    run.report(tmp_path, "share")
    machines = (tmp_path / "summary.md").read_text().split("\n\n")[1]
    assert machines.splitlines() == ["Machines (times compare only within one):",
                                     "- not recorded (rows written before machines were recorded): 3 examples",
                                     f"- {describe()}: 3 examples",
                                     "- 1 example with verifications on different machines"]


def test_plots_are_written(complete):
    out, _ = complete
    for name in ("quality_vs_acceptance", "quality_vs_speedup", "quality_vs_time", "throughput_vs_acceptance"):
        path = out / f"{name}.png"
        assert path.stat().st_size > 5000 and path.read_bytes()[:4] == b"\x89PNG"


def test_resume_after_a_kill_gives_the_same_results(complete, pair, task, tmp_path, monkeypatch):
    out_complete, summaries = complete
    original, calls = run._run_batch, {"n": 0}

    def dies_after_ten(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 10:
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(run, "_run_batch", dies_after_ten)
    with pytest.raises(KeyboardInterrupt):
        evaluate(pair, task, VERIFICATIONS, CONFIG, tmp_path, progress=False)
    with open(tmp_path / RESULTS_FILE, "a") as f:
        f.write('{"example": "toy/5", "meth')  # a line cut off mid-write by the kill
    monkeypatch.setattr(run, "_run_batch", original)
    with pytest.raises(ValueError, match="--resume"):
        evaluate(pair, task, VERIFICATIONS, CONFIG, tmp_path, progress=False)
    resumed = evaluate(pair, task, VERIFICATIONS, CONFIG, tmp_path, resume=True, progress=False)
    assert [without_timing(r) for r in rows(tmp_path)] == [without_timing(r) for r in rows(out_complete)]
    for a, b in zip(resumed, summaries, strict=True):
        assert {k: a[k] for k in ("quality", "acceptance_rate", "tau")} == {
            k: b[k] for k in ("quality", "acceptance_rate", "tau")}


def test_a_cut_at_any_byte_of_the_last_two_rows_keeps_whole_rows_and_redoes_the_rest(complete, tmp_path):
    out, _ = complete
    data = (out / RESULTS_FILE).read_bytes()
    full = rows(out)
    ends = [i + 1 for i, byte in enumerate(data) if byte == ord("\n")]  # each row's end, newline included
    path = tmp_path / RESULTS_FILE
    for cut in range(ends[-3], len(data) + 1):
        path.write_bytes(data[:cut])
        done = load_done_rows(path, repair=True)
        whole = sum(end - 1 <= cut for end in ends)  # rows written up to their closing brace
        assert done == full[:whole], cut
        assert path.read_bytes() == data[:ends[whole - 1]], cut  # cut short dropped, newline restored
        # What a resume then appends: the rows not done, one per line.
        keys = {(r["example"], r["verification"]) for r in done}
        with open(path, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in full if (r["example"], r["verification"]) not in keys)
        assert path.read_bytes() == data, cut


@pytest.mark.parametrize("back", [1, 100], ids=["whole row without its newline", "row cut short"])
def test_resume_after_a_cut_inside_the_last_rows(complete, pair, task, tmp_path, back):
    """End to end, from a real run: the second-to-last row is cut `back` bytes before its end."""
    out_complete, _ = complete
    shutil.copytree(out_complete, tmp_path, dirs_exist_ok=True)
    data = (tmp_path / RESULTS_FILE).read_bytes()
    cut = data.rstrip(b"\n").rfind(b"\n") + 1 - back
    (tmp_path / RESULTS_FILE).write_bytes(data[:cut])
    evaluate(pair, task, VERIFICATIONS, CONFIG, tmp_path, resume=True, progress=False)
    assert [without_timing(r) for r in rows(tmp_path)] == [without_timing(r) for r in rows(out_complete)]


def test_resume_inside_a_batch_reruns_the_group_with_its_seed(pair, task, tmp_path):
    """A kill between the rows of a batch: the resumed run decodes that batch again whole, so its missing
    rows get the batch and seed an unbroken run gave them (sampled, so a changed seed would show)."""
    config = replace(CONFIG, batch_size=3, temperature=1.0)
    unbroken = tmp_path / "unbroken"
    evaluate(pair, task, VERIFICATIONS, config, unbroken, progress=False)
    full = rows(unbroken)
    first_group = [r for r in full if r["index"] < 3 and r["verification"] == VERIFICATIONS[0]]
    cut = tmp_path / "cut"
    shutil.copytree(unbroken, cut)
    (cut / RESULTS_FILE).write_text(json.dumps(first_group[0]) + "\n")  # one row of the first batch written
    evaluate(pair, task, VERIFICATIONS, config, cut, resume=True, progress=False)
    assert sorted(map(json.dumps, map(without_timing, rows(cut)))) == sorted(map(json.dumps, map(without_timing, full)))


SMALL = EvalConfig("small", temperature=0.0, draft_length=3, max_new_tokens=6, limit=1)
REFUSED = {  # what is wrong: (verifications, settings, the error's words)
    "a verification twice": ("exact,exact", {}, "twice"),
    "a head that is not there": ("diversed:{tmp}/no-head", {}, "no head checkpoint"),
    "limit 0": ("exact", {"limit": 0}, "limit must be at least 1"),
    "max_new_tokens 0": ("exact", {"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    "negative temperature": ("exact", {"temperature": -1.0}, "temperature"),
    "NaN temperature": ("exact", {"temperature": float("nan")}, "temperature"),
    "infinite temperature": ("exact", {"temperature": float("inf")}, "finite"),
    "draft length 0": ("exact", {"draft_length": 0}, "draft_length"),
    "draft confidence 1": ("exact", {"draft_confidence": 1.0}, "confidence"),
    "a split the task does not have": ("exact", {"split": "tset"}, "no examples in split 'tset'"),
    "a prediction the task cannot give": ("exact", {"prediction": True, "drafter": "auto"}, "no input text"),
    "a prediction nothing drafts from": ("exact", {"prediction": True}, "drafted from by drafter"),
}


@pytest.fixture
def small_task(tmp_path):
    """A task with a test split only (a JSON Lines file, as a user would give it)."""
    path = tmp_path / "small.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"t{3 + i} t9 t15", "reference": "3", "split": "test"}) + "\n"
                            for i in range(2)))
    return get_task(f"jsonl:{path}")


@pytest.mark.parametrize("case", REFUSED)
def test_a_refused_evaluation_writes_nothing_and_the_corrected_one_runs(case, pair, small_task, tmp_path):
    verifications, settings, message = REFUSED[case]
    out = tmp_path / "eval"
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        evaluate(pair, small_task, verifications.format(tmp=tmp_path), replace(SMALL, **settings), out, progress=False)
    assert not out.exists()
    evaluate(pair, small_task, ["exact"], SMALL, out, progress=False)
    assert [(r["example"], r["verification"]) for r in rows(out)] == [("1", "exact")]


@pytest.mark.parametrize("drafter", ["auto", "prediction"])
def test_an_evaluation_with_predictions_drafts_from_them_and_counts_their_tokens(pair, small_task, tmp_path, drafter):
    """Each example's input text as its prediction (file-edit's file): rows count the accepted and rejected
    prediction tokens; the target alone (plain) runs without one, as every prediction's baseline, whichever
    drafter the others use."""
    examples = [replace(e, metadata={"original": "t5 t6 t7 t8"}) for e in small_task.examples("test")]
    task = replace(small_task, examples=lambda split, limit=None: examples[:limit])
    config = replace(SMALL, prediction=True, drafter=drafter, max_new_tokens=8)
    evaluate(pair, task, ["plain", "exact"], config, tmp_path / "eval", progress=False)
    by_verification = {r["verification"]: r for r in rows(tmp_path / "eval") if r["example"] == "1"}
    assert "accepted_prediction_tokens" not in by_verification["plain"]
    exact = by_verification["exact"]
    assert exact["accepted_prediction_tokens"] + exact["rejected_prediction_tokens"] == 4


def test_an_out_path_at_or_under_a_file_is_refused(pair, small_task, tmp_path):
    taken = tmp_path / "taken"
    taken.write_text("mine\n")
    for out in (taken, taken / "eval"):
        with pytest.raises(ValueError, match="is a file, not a folder"):
            evaluate(pair, small_task, ["exact"], SMALL, out, progress=False)
    assert taken.read_text() == "mine\n"
    evaluate(pair, small_task, ["exact"], SMALL, tmp_path / "eval", progress=False)
    assert len(rows(tmp_path / "eval")) == 1


def test_resume_refuses_a_different_setting(complete, pair, task):
    out, _ = complete
    other = run.EvalConfig(**{**run.asdict(CONFIG), "temperature": 0.5})
    with pytest.raises(ValueError, match="temperature"):
        evaluate(pair, task, VERIFICATIONS, other, out, resume=True, progress=False)
    # A setting that the saved run does not record (written by an older version) is named too.
    cut_off = run.EvalConfig(**{**run.asdict(CONFIG), "draft_confidence": 0.4})
    saved = json.loads((out / run.CONFIG_FILE).read_text())
    (out / run.CONFIG_FILE).write_text(json.dumps({k: v for k, v in saved.items() if k != "draft_confidence"}))
    try:
        with pytest.raises(ValueError, match="draft_confidence"):
            evaluate(pair, task, VERIFICATIONS, cut_off, out, resume=True, progress=False)
    finally:
        (out / run.CONFIG_FILE).write_text(json.dumps(saved))


def test_two_ranks_under_torchrun_give_the_same_results(complete, tmp_path):
    out_complete, _ = complete
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    torchrun = Path(sys.executable).parent / "torchrun"
    subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", "29517", str(TESTS / "eval_worker.py"),
                    str(tmp_path), "--distributed"], check=True, env=env, timeout=300, capture_output=True)
    assert [without_timing(r) for r in rows(tmp_path)] == [without_timing(r) for r in rows(out_complete)]
    assert not list(tmp_path.glob("results.rank*.jsonl"))


def test_verification_lists_are_checked():
    assert parse_verifications("plain, exact,static:0.7,hf-static:0.5,hf-exact,diversed:gsm8k,diversed") == [
        "plain", "exact", "static:0.7", "hf-static:0.5", "hf-exact", "diversed:gsm8k", "diversed"]
    # one spelling per verification, so that a resumed run or a report finds rows written under another
    assert parse_verifications(["static:.70", "lossy:1e-1", "hf-static:.5", "diversed:gsm8k@+1.0",
                                "diversed:@-0.50"]) == [
        "static:0.7", "lossy:0.1", "hf-static:0.5", "diversed:gsm8k@+1", "diversed:@-0.5"]
    for bad, message in (("exact,exact", "twice"), ("diversed:gsm8k@1,diversed:gsm8k@+1.0", "twice"),
                         ("diversed:gsm9k", "no head checkpoint"),
                         ("hf-static", "hf-static:W"), ("hf-static:1.5", "0 < W"),
                         ("static", "needs weight"), ("nope", "must be one of"), ("", "no verifications")):
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            parse_verifications(bad)


def test_resuming_with_other_verifications_adds_them_and_keeps_the_rest(complete, pair, task, tmp_path):
    out_complete, _ = complete
    shutil.copytree(out_complete, tmp_path, dirs_exist_ok=True)
    summaries = evaluate(pair, task, ["plain", "static:0.9"], CONFIG, tmp_path, resume=True, progress=False)
    assert [s["method"] for s in summaries] == ["plain", "static:0.9"]
    verifications = {r["verification"] for r in rows(tmp_path)}
    assert verifications == {*VERIFICATIONS, "static:0.9"} and len(rows(tmp_path)) == 7 * (len(VERIFICATIONS) + 1)
    # The earlier rows are left byte for byte where they were: a committed file's diff is the added rows.
    before = (out_complete / RESULTS_FILE).read_bytes()
    assert (tmp_path / RESULTS_FILE).read_bytes().startswith(before)
    # The folder's report is of every verification in it, not only the resumed run's.
    assert [s["method"] for s in json.loads((tmp_path / "summary.json").read_text())] == [*VERIFICATIONS, "static:0.9"]


def test_a_verification_stopped_early_is_left_out_of_the_folders_report_not_the_others(complete, pair, task, tmp_path):
    out_complete, _ = complete
    shutil.copytree(out_complete, tmp_path, dirs_exist_ok=True)
    stopped = VERIFICATIONS[-1]
    kept = [r for r in rows(out_complete) if r["verification"] != stopped or r["index"] < 2]
    (tmp_path / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in kept))
    evaluate(pair, task, ["static:0.9"], CONFIG, tmp_path, resume=True, progress=False)
    report = json.loads((tmp_path / "summary.json").read_text())
    assert [s["method"] for s in report] == [*VERIFICATIONS[:-1], "static:0.9"]
    assert all(s["examples"] == 7 for s in report)


def test_duplicate_example_ids_are_refused(pair, tmp_path):
    class Twice(ToyTask):
        def examples(self, split="train", limit=None):
            return super().examples(split, limit) * 2

    with pytest.raises(ValueError, match="same id"):
        evaluate(pair, Twice(share_of_draft_tokens), ["plain"], CONFIG, tmp_path, progress=False)


def test_the_peer_stops_at_stop_strings_as_ours_does(pair):
    from diversed.evaluation.peer import assisted_generate
    from diversed.request import Sampling

    prompt = pair.tokenizer.encode("t3 t9 t15")
    free, _ = assisted_generate(pair, prompt, Sampling(0), draft_length=3, max_new_tokens=12)
    stop = pair.tokenizer.decode(free[2:3])
    cut, stats = assisted_generate(pair, prompt, Sampling(0), draft_length=3, max_new_tokens=12, stop=[stop])
    assert len(free) == 12 and stop in pair.tokenizer.decode(cut)
    assert cut == free[:len(cut)] and len(cut) < len(free) and stats.new_tokens == len(cut)


def test_the_peer_writes_the_targets_greedy_text_and_its_ensemble_weight_acts(pair):
    """hf-exact at T = 0 writes what the target writes alone (transformers' own greedy generate); hf-static
    with w near 0 keeps the drafts the target refuses, and its text is the draft's favoured words."""
    import torch

    from diversed.evaluation.peer import assisted_generate
    from diversed.request import Sampling

    prompt = pair.tokenizer.encode("t3 t9 t15")
    ids = torch.tensor([prompt])
    alone = pair.target.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                                       eos_token_id=pair.eos_token_ids, pad_token_id=pair.tokenizer.pad_token_id)
    exact, exact_stats = assisted_generate(pair, prompt, Sampling(0), draft_length=3, max_new_tokens=12)
    lenient, lenient_stats = assisted_generate(pair, prompt, Sampling(0), draft_length=3, max_new_tokens=12,
                                               weight=0.05)
    assert exact == alone[0, len(prompt):].tolist() and len(exact) == 12
    assert exact_stats.accepted < lenient_stats.accepted <= lenient_stats.drafted
    assert share_of_draft_tokens(pair.tokenizer.decode(lenient)) > share_of_draft_tokens(pair.tokenizer.decode(exact))


def test_paired_comparisons_with_bootstrap_intervals(complete):
    out, summaries = complete
    by_verification = {s["method"]: s for s in summaries}
    assert by_verification["plain"]["quality_vs_plain"] is None
    assert by_verification["exact"]["rejection_vs_exact"] is None
    results = rows(out)
    reward = {m: sum(r["reward"] for r in results if r["verification"] == m) / 7 for m in VERIFICATIONS}
    static = by_verification["static:0.2"]
    assert static["quality_vs_plain"] == pytest.approx(reward["static:0.2"] - reward["plain"])
    assert static["quality_vs_plain_low"] <= static["quality_vs_plain"] <= static["quality_vs_plain_high"]
    # w = 0.2 keeps far more drafts than exact: its rejection rate is a fraction of exact's.
    assert static["rejection_vs_exact_low"] <= static["rejection_vs_exact"] <= static["rejection_vs_exact_high"] < 1
    assert summarize_results(results, VERIFICATIONS) == summaries  # the fixed seed makes the intervals repeatable


def test_two_verifications_compared_directly_agree_with_the_summarys_paired_columns(complete):
    from diversed.evaluation.report import compare

    out, summaries = complete
    static = next(s for s in summaries if s["method"] == "static:0.2")
    versus_auto, versus_exact = compare(rows(out), "static:0.2", "plain"), compare(rows(out), "static:0.2", "exact")
    assert versus_auto["examples"] == versus_exact["examples"] == 7
    assert versus_auto["quality_difference"] == (static["quality_vs_plain"], static["quality_vs_plain_low"],
                                                 static["quality_vs_plain_high"])
    assert versus_exact["rejection_ratio"] == (static["rejection_vs_exact"], static["rejection_vs_exact_low"],
                                               static["rejection_vs_exact_high"])
    assert versus_auto["rejection_ratio"] is None  # auto drafts nothing
    assert versus_exact["acceptance"]["static:0.2"] == pytest.approx(static["acceptance_rate"])
    some = [r for r in rows(out) if r["verification"] != "exact" or r["index"] < 3]  # exact stopped after 3 examples
    assert compare(some, "static:0.2", "exact")["examples"] == 3
    with pytest.raises(ValueError, match="no results for: static:0.9"):
        compare(rows(out), "static:0.2", "static:0.9")
    apart = [r for r in rows(out) if (r["verification"], r["index"] < 3) in (("static:0.2", True), ("exact", False))]
    with pytest.raises(ValueError, match="no example in common"):
        compare(apart, "static:0.2", "exact")


def test_batched_evaluation_runs_every_verification_on_every_example(pair, task, tmp_path):
    config = replace(CONFIG, batch_size=3)
    summaries = evaluate(pair, task, VERIFICATIONS, config, tmp_path, progress=False)
    results = rows(tmp_path)
    assert {(r["example"], r["verification"]) for r in results} == {(e.id, m) for e in task.examples()
                                                                   for m in VERIFICATIONS}
    assert len(results) == 7 * len(VERIFICATIONS) and [s["method"] for s in summaries] == VERIFICATIONS
    # Batch throughput is not a single request's speed; the summary says which it is.
    assert "3 examples decoded together" in (tmp_path / "summary.md").read_text()


def synthetic_rows(verification: str, accepted: int, rewards: list[float]) -> list[dict]:
    """One row per reward: 10 drafts each, `accepted` of them kept."""
    return [{"example": f"e{i}", "verification": verification, "reward": r, "drafted": 10, "accepted": accepted,
             "new_tokens": 20, "target_forwards": 10, "wall_time": 1.0} for i, r in enumerate(rewards)]


def test_static_curve_is_interpolated_between_its_weights_and_never_extrapolated():
    from diversed.evaluation.report import curve_quality

    exact = synthetic_rows("exact", 8, [1, 1, 1, 0, 0])  # acceptance 0.8, quality 0.6
    lenient = synthetic_rows("static:0.5", 9, [1, 1, 0, 0, 0])  # acceptance 0.9, quality 0.4
    assert curve_quality([lenient, exact], 0.85) == pytest.approx(0.5)
    assert curve_quality([exact, lenient], 0.8) == pytest.approx(0.6)
    assert curve_quality([exact, lenient], 0.95) is None and curve_quality([exact, lenient], 0.7) is None
    assert curve_quality([exact], 0.8) is None and curve_quality([exact, lenient], None) is None


def test_a_verification_off_the_static_curve_is_compared_with_it_at_its_own_acceptance():
    verifications = ["plain", "exact", "static:0.5", "diversed:head"]
    rewards = [1, 1, 1, 0, 0, 1, 0, 1, 0, 1]
    rows = (synthetic_rows("plain", 0, rewards) + synthetic_rows("exact", 8, rewards)
            + synthetic_rows("static:0.5", 9, [0] * 10) + synthetic_rows("diversed:head", 8, rewards))
    for row in rows[:10]:
        row["drafted"] = 0
    for i, row in enumerate(rows[-10:]):  # acceptance 0.85 overall: half the examples keep 9 of 10
        row["accepted"] = 9 if i % 2 else 8
    by_verification = {s["method"]: s for s in summarize_results(rows, verifications)}
    diversed = by_verification["diversed:head"]
    # The curve at 0.85 is halfway between exact (0.6) and static:0.5 (0.0): 0.3; DIVERSED has 0.6.
    assert diversed["quality_vs_static"] == pytest.approx(0.3)
    assert diversed["quality_vs_static_low"] <= diversed["quality_vs_static"] <= diversed["quality_vs_static_high"]
    assert all(by_verification[m]["quality_vs_static"] is None for m in ("plain", "exact", "static:0.5"))
    assert summarize_results(rows, verifications) == list(by_verification.values())  # fixed seed: repeatable


def test_a_head_is_compared_with_every_familys_curve_and_every_family_is_drawn(tmp_path):
    from diversed.evaluation.report import markdown_table, plot_tradeoffs

    verifications = ["plain", "exact", "lossy:0.9", "cactus:1", "diversed:head"]
    rewards = [1, 1, 1, 0, 0, 1, 0, 1, 0, 1]
    rows = (synthetic_rows("plain", 0, rewards) + synthetic_rows("exact", 8, rewards)
            + synthetic_rows("lossy:0.9", 9, [0] * 10) + synthetic_rows("cactus:1", 9, [0] * 10)
            + synthetic_rows("diversed:head", 8, rewards))
    for row in rows[:10]:
        row["drafted"] = 0
    for i, row in enumerate(rows[-10:]):
        row["accepted"] = 9 if i % 2 else 8
    summaries = summarize_results(rows, verifications)
    head = summaries[-1]
    assert head["quality_vs_lossy"] == pytest.approx(0.3) and head["quality_vs_static"] is None  # no static ran
    assert summaries[3]["quality_vs_lossy"] is not None  # cactus, on the lenience curve's range
    # cactus:1 ran (one point, acceptance 0.9, quality 0): its curve from exact is 0.3 at the head's 0.85.
    assert head["quality_vs_cactus"] == pytest.approx(0.3) and head["quality_vs_lossy_entropy"] is None
    header = markdown_table(summaries, "pass@1").splitlines()[0]
    assert "| vs static curve (95% CI) | vs lenience curve (95% CI) | vs cactus curve (95% CI) | tau |" in header
    assert markdown_table(summaries, "pass@1").splitlines()[-1].startswith("| diversed (head) | 10 |")
    assert "+30.0" in markdown_table(summaries, "pass@1").splitlines()[-1]
    paths = plot_tradeoffs(summaries, tmp_path, "pass@1")
    assert {p.stem for p in paths} >= {"quality_vs_acceptance", "quality_vs_time"}


def test_each_head_has_a_colour_of_its_own_and_its_dial_points_are_hollow():
    from diversed.evaluation.report import _style

    heads = ["diversed:gsm8k", "diversed:runs/head-step-13"]  # the plot's heads, without their dials
    own, other, dial = (_style(m, heads) for m in ("diversed:gsm8k", "diversed:runs/head-step-13",
                                                    "diversed:gsm8k@+3"))
    assert own[0] == other[0] == dial[0] == "*"
    assert own[1] != other[1] and dial[1] == own[1]  # the dial keeps its head's colour
    assert own[2] == own[1] and dial[2] == "none"  # filled at its own setting, hollow dialled
    assert _style("exact", heads)[1] not in {own[1], other[1]}


def test_points_carry_the_intervals_of_quality_and_time_per_example():
    from diversed.evaluation.report import _error_bar

    summary = {"quality": 0.5, "quality_low": 0.4, "quality_high": 0.7, "acceptance_rate": 0.9,
               "time_per_example": 10.0, "time_per_example_low": 8.0, "time_per_example_high": 13.0}
    assert _error_bar(summary, "quality") == [[pytest.approx(10.0)], [pytest.approx(20.0)]]  # in percent
    assert _error_bar(summary, "time_per_example") == [[2.0], [3.0]]
    assert _error_bar(summary, "acceptance_rate") is None


def test_quality_intervals_are_wilsons_for_pass_fail_and_normal_otherwise():
    from diversed.evaluation.report import mean_interval

    low, high = mean_interval([1.0] * 3 + [0.0] * 5)  # 3 of 8: Wilson's score interval, 95%
    assert (low, high) == (pytest.approx(0.1368, abs=1e-4), pytest.approx(0.6943, abs=1e-4))
    assert mean_interval([0.0] * 8)[0] == 0.0 and mean_interval([1.0] * 8)[1] == 1.0
    low, high = mean_interval([0.2, 0.4, 0.6])  # mean 0.4, standard error 0.2 / sqrt(3)
    assert (low, high) == (pytest.approx(0.4 - 1.95996 * 0.11547, abs=1e-4), pytest.approx(0.4 + 0.22632, abs=1e-4))


def test_table_and_legend_names_tell_heads_with_the_same_folder_name_apart():
    from diversed.evaluation.report import _labels

    verifications = ["exact", "diversed", "diversed@+3", "diversed:gsm8k", "diversed:runs/lambda0.3/head-step-12",
                     "diversed:runs/lambda1/head-step-12", "diversed:runs/lambda1/head-step-12@+1"]
    assert _labels(verifications) == {
        "exact": "exact", "diversed": "diversed (packaged head)", "diversed@+3": "diversed (packaged head) @+3",
        "diversed:gsm8k": "diversed (gsm8k)",
        "diversed:runs/lambda0.3/head-step-12": "diversed (lambda0.3/head-step-12)",
        "diversed:runs/lambda1/head-step-12": "diversed (lambda1/head-step-12)",
        "diversed:runs/lambda1/head-step-12@+1": "diversed (lambda1/head-step-12) @+1"}  # a dial: the same head
    assert _labels(["diversed:a/head", "diversed:b/other"])["diversed:a/head"] == "diversed (head)"  # fewest parts
    assert _labels(["plain", "static:0.5"]) == {"plain": "plain", "static:0.5": "static:0.5"}


def test_quality_is_grouped_by_how_many_reference_runs_solved_each_example():
    """benchmarks/where_lost.py's grouping (a benchmark's helper, loaded from its file)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("where_lost", Path(__file__).parents[1] / "benchmarks/where_lost.py")
    where_lost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(where_lost)
    quality_by_reference_agreement = where_lost.quality_by_reference_agreement

    rows = (synthetic_rows("plain", 0, [1, 1, 1, 0, 0, 0])
            + synthetic_rows("exact", 8, [1, 1, 0, 1, 0, 0])
            + synthetic_rows("static:0.5", 9, [1, 0, 1, 0, 1, 0])
            + synthetic_rows("late", 9, [1, 1]))  # finished only e0, e1
    groups = quality_by_reference_agreement(rows, ["static:0.5"], ["plain", "exact"])
    assert [(g["solved_by"], g["examples"]) for g in groups] == [(2, 2), (1, 2), (0, 2)]
    assert [g["quality"]["static:0.5"][0] for g in groups] == [0.5, 0.5, 0.5]
    assert all(low <= mean <= high for g in groups for mean, low, high in g["quality"].values())
    # Only the examples every shown verification finished; a group may be empty.
    groups = quality_by_reference_agreement(rows, ["static:0.5", "late"], ["plain", "exact"])
    assert [g["examples"] for g in groups] == [2, 0, 0] and groups[1]["quality"]["late"] is None
    with pytest.raises(ValueError, match="no results for: lenient"):
        quality_by_reference_agreement(rows, ["lenient"], ["plain", "exact"])


def test_time_per_example_and_the_speedup_over_auto_it_gives(tmp_path):
    """What a user waits: the mean wall time per example with its interval, and auto's time over the verification's on
    the examples both ran. A verification writing three times longer answers in half the time is 6x faster in
    tokens/s but only 2x by time."""
    import csv

    from diversed.evaluation.report import markdown_table, write_summary

    auto = synthetic_rows("plain", 0, [1, 0, 1, 1])
    lenient = synthetic_rows("lossy:0.5", 9, [1, 0, 0])  # e0..e2 only: the speedup pairs them with auto's
    for i, (mine, theirs) in enumerate(zip(lenient, auto, strict=False)):
        theirs["wall_time"], mine["wall_time"], mine["new_tokens"] = 2.0 * (i + 1), float(i + 1), 60
    auto[3]["wall_time"] = 100.0  # unpaired: it moves auto's own mean, not the paired speedup
    summaries = summarize_results(auto + lenient, ["plain", "lossy:0.5"])
    by_verification = {s["method"]: s for s in summaries}
    mine = by_verification["lossy:0.5"]
    assert mine["time_per_example"] == pytest.approx(2.0) and mine["new_tokens"] == 60
    half = 1.959964 * 1.0 / 3 ** 0.5  # standard deviation 1 over 3 examples
    assert (mine["time_per_example_low"], mine["time_per_example_high"]) == (
        pytest.approx(2.0 - half, abs=1e-4), pytest.approx(2.0 + half, abs=1e-4))
    assert by_verification["plain"]["time_per_example"] == pytest.approx((2 + 4 + 6 + 100) / 4)
    # Every resample of the paired examples takes exactly half auto's time: the interval is the point.
    assert (mine["time_speedup"], mine["time_speedup_low"], mine["time_speedup_high"]) == (
        pytest.approx(2.0), pytest.approx(2.0), pytest.approx(2.0))
    assert by_verification["plain"]["time_speedup"] is None
    assert mine["speedup"] > 3 * mine["time_speedup"]  # tokens/s counts the longer answers as speed
    table = markdown_table(summaries, "accuracy")
    assert "| s/example (95% CI) | speedup by time (95% CI) |" in table.splitlines()[0]
    assert table.splitlines()[-1].endswith("| 60.0 | 2.0 (0.9-3.1) | 2.00x (2.00-2.00) |")
    write_summary(summaries, tmp_path, "accuracy")
    with open(tmp_path / "summary.csv") as f:
        written = list(csv.DictReader(f))
    assert float(written[1]["time_per_example"]) == pytest.approx(2.0)
    assert float(written[1]["time_speedup"]) == pytest.approx(2.0) and written[0]["time_speedup"] == ""


def test_the_old_name_of_plain_decoding_still_works_for_a_release(tmp_path):
    """Verification 'auto' (the target alone) is 'plain' now: the old spelling works, with a warning, from Python and
    the command line alike, and rows of earlier evaluations that say 'auto' are read as 'plain'."""
    with pytest.warns(FutureWarning, match="'auto' is now 'plain'"):
        assert Verification.parse("auto") == Verification("plain")
    with pytest.warns(FutureWarning):
        assert parse_verifications("auto,exact") == ["plain", "exact"]
    (tmp_path / "results.jsonl").write_text(json.dumps({"example": "a", "method": "auto", "reward": 1}) + "\n")
    assert [r["verification"] for r in load_done_rows(tmp_path / "results.jsonl")] == ["plain"]


def test_rows_that_name_their_verification_method_report_and_resume_as_before(complete, pair, task, tmp_path):
    """Until this release a row named its verification "method" (benchmarks/results holds many such rows): a
    folder of them reports as one written today, and a resumed run finds them done."""
    out, summaries = complete
    shutil.copy(out / run.CONFIG_FILE, tmp_path / run.CONFIG_FILE)
    old = "".join(json.dumps({("method" if k == "verification" else k): v for k, v in r.items()}) + "\n"
                  for r in rows(out))
    (tmp_path / RESULTS_FILE).write_text(old)
    assert run.report(tmp_path, "share") == summaries
    assert evaluate(pair, task, VERIFICATIONS, CONFIG, tmp_path, resume=True, progress=False) == summaries
    assert (tmp_path / RESULTS_FILE).read_text() == old  # nothing run again


def test_a_run_saved_with_the_old_name_of_draft_length_resumes(tmp_path):
    saved = {**dataclasses.asdict(SMALL), "draft_len": SMALL.draft_length}
    del saved["draft_length"]
    (tmp_path / run.CONFIG_FILE).write_text(json.dumps(saved))
    run._check_resumable(tmp_path, SMALL, resume=True)  # the same settings under today's names
    with pytest.raises(ValueError, match="draft_length"):
        run._check_resumable(tmp_path, replace(SMALL, draft_length=4), resume=True)


class FewShotTask(ToyTask):
    """The toy task's prompts behind one shared 40-token preamble, as few-shot and system prompts are."""

    def examples(self, split: str = "train", limit: int | None = None) -> list:
        preamble = " ".join(f"t{2 + i % 30}" for i in range(40))
        return [dataclasses.replace(e, prompt=f"{preamble} {e.prompt}") for e in super().examples(split, limit)]


def test_every_verification_of_every_example_starts_from_the_shared_beginning_alone(pair, tmp_path):
    """The examples' shared preamble is read once into the prompt caches: each verification of each example
    reads the rest of its prompt, never a prompt that another verification read; a resumed run alike."""
    task = FewShotTask(share_of_draft_tokens, size=4)
    chat = pair.tokenizer.chat_template is not None
    ids = [encode_prompt(pair.tokenizer, e.prompt_for(chat), chat) for e in task.examples()]
    shared = min(common_prefix(ids[0], other) for other in ids)
    assert shared >= 40  # the preamble
    evaluate(pair, task, VERIFICATIONS, CONFIG, tmp_path / "whole", progress=False)
    assert {row["cached_tokens"] for row in rows(tmp_path / "whole")} == {shared}
    evaluate(pair, FewShotTask(share_of_draft_tokens, size=2), VERIFICATIONS, CONFIG, tmp_path / "cut",
             progress=False)
    evaluate(pair, task, VERIFICATIONS, CONFIG, tmp_path / "cut", progress=False, resume=True)
    resumed, whole = rows(tmp_path / "cut"), rows(tmp_path / "whole")
    assert {row["cached_tokens"] for row in resumed} == {shared}
    key = lambda row: (row["example"], row["verification"])  # noqa: E731
    assert sorted(map(without_timing, resumed), key=key) == sorted(map(without_timing, whole), key=key)
