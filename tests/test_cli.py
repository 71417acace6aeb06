"""The command line on tiny models saved to folders (loading by path, JSON output, errors, train, eval)."""

import io
import json
import re
import sys

import pytest

from diversed.cli import main

from tiny import save_tiny_pair, tiny_model, word_tokenizer


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A target, a close draft and a draft with another tokenizer, saved as Hugging Face folders."""
    root = tmp_path_factory.mktemp("models")
    paths = save_tiny_pair(tiny_model(0, vocab=40, hidden=32, arch="olmo2"), root)
    other = word_tokenizer()
    other.add_tokens(["extra"])
    tiny_model(2, vocab=41, hidden=32, arch="olmo2").save_pretrained(root / "other")
    other.save_pretrained(root / "other")
    paths["other"] = str(root / "other")
    return paths


def run(args, capsys, stdin: str | None = None):
    if stdin is not None:
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin.encode()))
    try:
        code = main(args)
    finally:
        sys.stdin = sys.__stdin__
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json_has_text_and_metrics(models, capsys):
    code, out, _ = run(["generate", "--draft", models["draft"], "--target", models["target"], "--json",
                        "--verification", "exact", "--temperature", "0", "--max-new-tokens", "6", "--no-chat",
                        "t3 t4 t5", "t9"], capsys)
    assert code == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert [line["prompt"] for line in lines] == ["t3 t4 t5", "t9"]
    for line in lines:
        assert isinstance(line["text"], str) and 0 <= line["acceptance_rate"] <= 1
        assert line["metrics"]["new_tokens"] == line["new_tokens"] <= 6 and line["wall_time"] > 0


def test_generate_json_with_provenance_has_a_record_per_token(models, capsys):
    code, out, _ = run(["generate", "--draft", models["draft"], "--target", models["target"], "--json",
                        "--provenance", "--verification", "lossy:0.5", "--max-new-tokens", "8", "--no-chat", "t3 t4"],
                       capsys)
    line = json.loads(out)
    assert code == 0 and len(line["provenance"]) == line["new_tokens"]
    assert "".join(r["token"] for r in line["provenance"]) == line["text"]


def test_the_old_spelling_of_draft_length_works_with_a_warning(models, capsys):
    code, out, err = run(["generate", "--draft", models["draft"], "--target", models["target"], "--json",
                          "--draft-len", "2", "--max-new-tokens", "4", "--no-chat", "t3"], capsys)
    assert code == 0 and json.loads(out)["new_tokens"] == 4
    assert "--draft-len is now --draft-length" in err


def test_the_old_spelling_of_verification_works_with_a_warning(models, capsys):
    code, out, err = run(["generate", "--draft", models["draft"], "--target", models["target"], "--json",
                          "--method", "static:0.5", "--max-new-tokens", "4", "--no-chat", "t3"], capsys)
    assert code == 0 and json.loads(out)["metrics"]["verification"] == "static:0.5"
    assert "--method is now --verification" in err


@pytest.mark.parametrize(("args", "old", "new", "message"), [
    (["generate", "--method", "banana", "t3"], "--method", "--verification", "--verification must be one of"),
    (["serve", "--method", "banana"], "--method", "--verification", "--verification must be one of"),
    (["eval", "--task", "humaneval", "--out", "{tmp}/eval", "--methods", "plain,banana"], "--methods",
     "--verifications", "--verification must be one of"),
    (["report", "{tmp}", "--methods", "exact"], "--methods", "--verifications",
     "--verifications and --to are for evaluations"),
])
def test_the_old_verification_flags_set_the_new_ones(capsys, tmp_path, args, old, new, message):
    """Each old flag's value goes where the new flag's would: here to a refusal before any model loads."""
    (tmp_path / "log.jsonl").write_text("")  # a head's training run, which report refuses --verifications for
    code, _, err = run([a.format(tmp=tmp_path) for a in args], capsys)
    assert code == 2 and f"{old} is now {new}" in err and message in err, err


def test_generate_stream_prints_the_same_text_as_it_comes(models, capsys):
    common = ["generate", "--draft", models["draft"], "--target", models["target"], "--no-chat", "--temperature",
              "0", "--max-new-tokens", "12", "--stop", "t7", "t3 t4", "t5 t6"]
    code, whole, _ = run(common, capsys)
    assert code == 0
    code, streamed, _ = run([*common, "--stream"], capsys)
    timing = re.compile(r"in [0-9.]+ s \([0-9.]+ tok/s\)")
    assert code == 0 and timing.sub("", streamed) == timing.sub("", whole)


def test_generate_drafts_from_a_prediction_and_counts_its_tokens(models, capsys, tmp_path):
    common = ["generate", "--draft", models["draft"], "--target", models["target"], "--no-chat", "--json",
              "--temperature", "0", "--max-new-tokens", "16", "t3 t4"]
    code, out, _ = run(common, capsys)
    answer = json.loads(out)["text"]
    (tmp_path / "prediction.txt").write_text(answer)
    code, out, _ = run([*common, "--prediction", str(tmp_path / "prediction.txt")], capsys)
    metrics = json.loads(out)["metrics"]
    assert code == 0 and json.loads(out)["text"] == answer
    assert metrics["drafters"]["prediction"]["accepted"] > 0 and metrics["accepted_prediction_tokens"] > 0
    code, out, _ = run([*common, "--prediction", "-"], capsys, stdin=answer)
    assert code == 0 and json.loads(out)["metrics"]["accepted_prediction_tokens"] == \
        metrics["accepted_prediction_tokens"]


def test_generate_reads_stdin_and_files(models, capsys, tmp_path):
    common = ["generate", "--draft", models["draft"], "--target", models["target"], "--no-chat",
              "--max-new-tokens", "3", "--verification", "static:0.5"]
    code, out, _ = run(common + ["-"], capsys, stdin="t3 t4\nt5\n")
    assert code == 0 and out.count("[static:0.5]") == 2
    (tmp_path / "p.jsonl").write_text('{"prompt": "t3"}\n{"prompt": "t7 t8"}\n')
    code, out, _ = run(common + ["--json", "--file", str(tmp_path / "p.jsonl")], capsys)
    assert [json.loads(x)["prompt"] for x in out.splitlines()] == ["t3", "t7 t8"]


@pytest.mark.parametrize("args, message", [
    (["--verification", "static"], "needs weight"),
    (["--verification", "static:1.5"], "weight must be in"),
    (["--temperature", "-1"], "temperature"),
    (["--draft-length", "0"], "--draft-length"),
    (["--verification", "diversed", "--head", "/nonexistent"], "no head checkpoint"),
    (["--prediction", "/nonexistent"], "--prediction '/nonexistent': no such file"),
    (["--prediction", __file__, "--drafter", "lookup"], "a --prediction is drafted from by drafter 'auto'"),
    (["--drafter", "prediction"], "--drafter 'prediction' drafts from a prediction"),
    (["--provenance"], "use it with --json"),
])
def test_generate_refuses_bad_options(models, capsys, args, message):
    code, _, err = run(["generate", "--draft", models["draft"], "--target", models["target"], "--no-chat",
                        *args, "t3"], capsys)
    assert code == 2 and message in err


def test_mismatched_tokenizers_are_refused_naming_both(models, capsys):
    code, _, err = run(["generate", "--draft", models["other"], "--target", models["target"], "t3"], capsys)
    assert code == 2 and "tokenizers differ" in err and "41 tokens" in err and "40" in err


def test_train_then_generate_and_eval_with_the_head(models, capsys, tmp_path):
    data = tmp_path / "task.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"t{i} t{i + 1}", "reference": f"t{i + 2} t{i + 3}"}) + "\n"
                            for i in range(2, 8)))
    pair_args = ["--draft", models["draft"], "--target", models["target"]]
    head = tmp_path / "head"
    code, _, _ = run(["train", "--task", f"jsonl:{data}", "--out", str(head), "--epochs", "1", "--max-new-tokens",
                      "6", "--prompts-per-step", "3", "--samples-per-prompt", "2", *pair_args], capsys)
    assert code == 0 and (head / "head.safetensors").is_file() and (head / "head.json").is_file()
    assert len((head / "log.jsonl").read_text().splitlines()) == 2
    assert (head / "training.png").read_bytes()[:4] == b"\x89PNG"
    (head / "training.png").unlink()
    code, out, _ = run(["report", str(head)], capsys)  # a training run's table so far, and its curves
    assert code == 0 and out.splitlines()[0].startswith("| step | reward |") and len(out.splitlines()) == 4
    assert "| 2 | " in out and "| w by TV |" in out and (head / "training.png").is_file()
    code, out, _ = run(["generate", "--json", "--verification", "diversed", "--head", str(head), "--no-chat",
                        "--max-new-tokens", "4", *pair_args, "t3"], capsys)
    assert code == 0 and json.loads(out)["metrics"]["verification"] == f"diversed:{head}"
    code, out, _ = run(["eval", "--task", f"jsonl:{data}", "--split", "all", "--verifications",
                        f"plain,exact,diversed:{head}", "--out", str(tmp_path / "eval"), "--max-new-tokens", "4",
                        *pair_args], capsys)
    assert code == 0 and "| diversed (head) |" in out and (tmp_path / "eval" / "summary.md").is_file()


def test_a_bad_prompt_file_line_is_named(models, capsys, tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "t3"}\n\n{"text": "t4"}\n')
    code, _, err = run(["generate", "--draft", models["draft"], "--target", models["target"], "--file",
                        str(tmp_path / "p.jsonl")], capsys)
    assert code == 2 and "p.jsonl:3" in err and '"prompt"' in err


def test_generate_with_a_restricted_draft_vocabulary_and_a_profile(models, capsys):
    common = ["generate", "--draft", models["draft"], "--target", models["target"], "--no-chat", "--temperature",
              "0", "--max-new-tokens", "8", "t3 t4 t5"]
    _, full, _ = run(common + ["--json", "--verification", "plain"], capsys)
    code, out, _ = run(common + ["--json", "--draft-vocab", "10", "--profile"], capsys)
    line = json.loads(out)
    assert code == 0 and line["text"] == json.loads(full)["text"]
    assert set(line["metrics"]["profile"]) >= {"draft", "target forward", "other", "total", "rounds"}
    code, out, _ = run(common + ["--profile"], capsys)
    assert code == 0 and "target forward" in out and "rounds)" in out


def test_the_packaged_head_is_refused_for_other_models(models, capsys):
    code, _, err = run(["generate", "--draft", models["draft"], "--target", models["target"], "--no-chat",
                        "--verification", "diversed", "t3"], capsys)
    assert code == 2 and "was trained for target hidden size 1536" in err
