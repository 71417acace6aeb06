"""Bad input, table-driven, through the command line and the Python API: every case ends in a clear error
that names the problem (or, where the input is in fact fine, in the right result), never in a traceback
from inside the library or a silently different result. Command-line cases that can be refused before any
model loads must be: loading is made to fail loudly for them."""

from __future__ import annotations

import io
import math
import socket
import sys

import pytest
import torch

from diversed.cli import main
from diversed.evaluation.run import EvalConfig, parse_verifications
from diversed.head.config import TrainConfig
from diversed.head.model import EnsembleHead, HeadConfig
from diversed.models.options import check_load_options
from diversed.request import Drafting, Request, Sampling, Verification
from diversed.tasks import get_task

from tiny import save_tiny_pair, tiny_gguf, tiny_model, word_tokenizer


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Model folders and files, good and bad, and the other inputs the cases point at."""
    root = tmp_path_factory.mktemp("inputs")
    target = tiny_model(0, vocab=40, hidden=32, arch="olmo2")
    paths = save_tiny_pair(target, root)
    (root / "empty").mkdir()
    truncated = root / "truncated"
    target.save_pretrained(truncated)
    word_tokenizer().save_pretrained(truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    paths |= {"empty": str(root / "empty"), "truncated": str(truncated)}
    paths["gguf"] = tiny_gguf(tiny_model(0), root / "model.gguf")
    (root / "short.gguf").write_bytes(open(paths["gguf"], "rb").read()[:4000])
    (root / "text.gguf").write_text("not a model")
    (root / "folder.gguf").mkdir()
    for name in ("short.gguf", "text.gguf", "folder.gguf"):
        paths[name] = str(root / name)
    texts = {"file.txt": b"t3 t4\n", "blank.txt": b"\n  \n\t\n", "latin1.txt": "caf\xe9 t3\n".encode("latin-1"),
             "binary.txt": bytes(range(256)), "empty.txt": b"", "bad.jsonl": b'{"prompt": "t3"}\nnot json\n',
             "number.jsonl": b'{"prompt": 5}\n', "noprompt.jsonl": b'{"text": "t3"}\n'}
    for name, data in texts.items():
        (root / name).write_bytes(data)
        paths[name] = str(root / name)
    (root / "head").mkdir()
    (root / "head" / "head.json").write_text("{not json")
    (root / "head" / "head.safetensors").write_bytes(b"")
    paths["head"] = str(root / "head")
    paths["missing"] = str(root / "missing")
    paths["missing.gguf"] = str(root / "missing.gguf")
    paths["root"] = str(root)
    return paths


@pytest.fixture
def no_loading(monkeypatch):
    """Make any model load fail loudly: early refusals must not get that far."""
    import diversed.backends.llama_cpp as llama_backend
    import diversed.models.loading as loading

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was refused")

    monkeypatch.setattr(loading, "load_model", refuse)
    monkeypatch.setattr(llama_backend, "LlamaCppModel", refuse)


def run(args: list[str], capsys, stdin: bytes | None = None) -> tuple[int, str]:
    """Exit code and standard error of the command; argparse's own refusals exit 2 too."""
    if stdin is not None:
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin))
    try:
        code = main(args)
    except SystemExit as exit_:
        code = exit_.code
    finally:
        sys.stdin = sys.__stdin__
    return code, capsys.readouterr().err


# Each case: (arguments after "generate" with the tiny pair, what the error must say). {name} is a path of
# the `files` fixture. All are refused before any model loads.
GENERATE = [
    *[(["--temperature", v], m) for v, m in (("-1", "temperature"), ("nan", "temperature"), ("inf", "temperature"),
                                             ("abc", "invalid float"), ("1e999", "temperature"))],
    *[(["--top-k", v], m) for v, m in (("-1", "--top-k"), ("abc", "invalid int"), ("1.5", "invalid int"))],
    *[(["--top-p", v], "--top-p") for v in ("0", "-0.5", "1.5", "nan", "inf")],
    *[(["--draft-length", v], m) for v, m in (("0", "--draft-length"), ("-3", "--draft-length"), ("x", "invalid int"))],
    *[(["--draft-confidence", v], "confidence") for v in ("1", "1.5", "-0.1", "nan", "inf")],
    *[(["--max-new-tokens", v], m) for v, m in (("0", "--max-new-tokens"), ("-5", "--max-new-tokens"),
                                                ("2.5", "invalid int"))],
    *[(["--batch-size", v], "--batch-size") for v in ("0", "-1")],
    *[(["--seed", v], m) for v, m in (("-1", "seed"), (str(2**70), "seed"), ("x", "invalid int"))],
    *[(["--verification", "typical", "--delta", v], "delta") for v in ("0", "-1", "nan", "inf")],
    *[(["--verification", m], e) for m, e in (
        ("banana", "--verification must be one of"), ("", "--verification must be one of"), ("static", "needs weight"),
        ("static:abc", "cannot read --verification"), ("static:nan", "weight must be in"),
        ("static:inf", "weight must be in"),
        ("static:-0.1", "weight must be in"), ("static:1.5", "weight must be in"), ("lossy:1", "lenience"),
        ("lossy:-0.5", "lenience"), ("cascade-opt:2", "alpha"), ("cascade-chow:nan", "alpha"),
        ("cascade-token:-1", "alpha"), ("typical:0", "epsilon"), ("typical:-1", "epsilon"),
        ("typical:inf", "epsilon"), ("typical:1e39", "epsilon"), ("exact:0.5", "takes no parameter"),
        ("plain:1", "takes no parameter"), ("dynamic", "weight function"))],
    (["--head", "{root}"], "is for verification 'diversed' without a head of its own, not 'exact'"),
    (["--verification", "diversed:gsm8k@+1", "--head", "{root}"],
     "is for verification 'diversed' without a head of its own"),
    (["--verification", "bogus:1"], "--verification must be one of"),
    (["--verification", "diversed:gsm8k@nan"], "finite number"),
    *[(["--verification", m, "--delta", "0.5"], "--delta is typical's entropy factor")
      for m in ("diversed", "plain", "cactus:0.1")],
    *[(["--verification", m], e) for m, e in (
        ("cactus:-1", "delta"), ("judi:-0.1", "epsilon"), ("lossy-entropy:1", "lenience"))],
    (["--draft-schedule", "banana"], "--draft-schedule must be one of"),
    (["--draft-schedule", "auto", "--draft-length", "40"], "--draft-length"),
    (["--dtype", "banana"], "invalid choice"),
    (["--backend", "banana"], "invalid choice"),
    (["--device", "banana"], "is not a device"),
    (["--device", "cuda:7"], "no CUDA GPU" if not torch.cuda.is_available() else "CPU"),
    (["--draft-quant", "Q9"], "invalid choice"),
    (["--draft-quant", "Q3_K_S"], "--draft-quant"),
    (["--draft-vocab", "0"], "draft_vocab"),
    (["--draft-vocab", "-5"], "draft_vocab"),
    (["--threads", "4"], "--threads sets llama.cpp"),
    (["--stop", ""], "stop string 1 must be a non-empty string"),
    (["--system", " "], "--system is empty"),
    (["--file", "{missing}"], "no such file"),
    (["--file", "{root}"], "no such file"),
    (["--file", "{blank.txt}"], "only blank lines"),
    (["--file", "{empty.txt}"], "only blank lines"),
    (["--file", "{latin1.txt}"], "not UTF-8"),
    (["--file", "{binary.txt}"], "not UTF-8"),
    (["--file", "{bad.jsonl}"], "bad.jsonl:2"),
    (["--file", "{number.jsonl}"], "must be a string"),
    (["--file", "{noprompt.jsonl}"], "\"prompt\" field"),
]
PROMPTS = [
    ([""], "prompt is empty"),
    (["   "], "prompt is empty"),
    (["t3", "\t"], "prompt 2 is empty"),
    (["t3 \udcff"], "lone surrogate"),  # what Python makes of a non-UTF-8 byte in argv
]
MODELS = [
    (["--draft", "{missing}", "--target", "{target}"], "no such file"),
    (["--draft", "{draft}", "--target", "{missing}"], "no such file"),
    (["--draft", "{draft}"], "name both"),
    (["--target", "{target}"], "name both"),
    (["--draft", "{file.txt}", "--target", "{target}"], "is a file"),
    (["--draft", "{missing.gguf}", "--target", "{gguf}"], "no such file"),
    (["--draft", "{folder.gguf}", "--target", "{gguf}"], "is a folder"),
    (["--draft", "{draft}", "--target", "{target}", "--backend", "llama.cpp"], "loads .gguf files"),
    (["--draft", "", "--target", "{target}"], "must name"),
]


def _fill(args: list[str], files: dict) -> list[str]:
    """The arguments with each {name} replaced by that path of the `files` fixture."""
    filled = []
    for arg in args:
        for name, path in files.items():
            arg = arg.replace("{" + name + "}", path)
        filled.append(arg)
    return filled


@pytest.mark.parametrize(("args", "message"), GENERATE, ids=[" ".join(a) or "-" for a, _ in GENERATE])
def test_generate_refuses_before_loading(files, capsys, no_loading, args, message):
    code, err = run(["generate", "--draft", files["draft"], "--target", files["target"], *_fill(args, files),
                     "t3"], capsys)
    assert code == 2 and "Traceback" not in err
    assert message in err.strip().splitlines()[-1], err  # one line says it (argparse prints its usage above)


@pytest.mark.parametrize(("prompts", "message"), PROMPTS, ids=[repr(p) for p, _ in PROMPTS])
def test_prompts_are_refused_before_loading(files, capsys, no_loading, prompts, message):
    code, err = run(["generate", "--draft", files["draft"], "--target", files["target"], *prompts], capsys)
    assert code == 2 and message in err, err


@pytest.mark.parametrize(("args", "message"), MODELS, ids=[" ".join(a) for a, _ in MODELS])
def test_model_paths_are_refused_before_loading(files, capsys, no_loading, args, message):
    code, err = run(["generate", *_fill(args, files), "t3"], capsys)
    assert code == 2 and message in err, err


@pytest.mark.parametrize(("stdin", "message"), [(b"", "no prompts on stdin"), (b"\n \n", "no prompts on stdin"),
                                                (b"\xff\xfe t3\n", "not UTF-8"), (b"ok\n\xc3\x28\n", "not UTF-8")])
def test_stdin_is_checked_before_loading(files, capsys, no_loading, stdin, message):
    code, err = run(["generate", "--draft", files["draft"], "--target", files["target"], "-"], capsys, stdin)
    assert code == 2 and message in err, err


# Refused once the models are there (a file that is not what it claims to be, a context too small): still one
# clear line and exit 2.
LATE = [
    (["--draft", "{empty}", "--target", "{target}"], "cannot load the model"),
    (["--draft", "{truncated}", "--target", "{target}"], "cannot load the model"),
    (["--draft", "{short.gguf}", "--target", "{gguf}"], "cannot"),
    (["--draft", "{text.gguf}", "--target", "{gguf}"], "cannot"),
    (["--draft", "{draft}", "--target", "{target}", "--max-new-tokens", "100000"], "context"),
    (["--draft", "{draft}", "--target", "{target}", "--draft-length", "1000000"], "context"),
    (["--draft", "{draft}", "--target", "{target}", "--verification", "diversed", "--head", "{missing}"],
     "no head checkpoint"),
    (["--draft", "{draft}", "--target", "{target}", "--verification", "diversed", "--head", "{head}"], "corrupt head"),
    (["--draft", "{draft}", "--target", "{target}", "--verification", "diversed"], "trained for"),
]


@pytest.mark.parametrize(("args", "message"), LATE, ids=[" ".join(a) for a, _ in LATE])
def test_bad_files_and_sizes_found_at_loading_get_one_clear_line(files, capsys, args, message):
    code, err = run(["generate", "--no-chat", *_fill(args, files), "t3"], capsys)
    assert code == 2 and message in err and "Traceback" not in err, err


def test_a_very_long_prompt_is_refused_for_the_context(files, capsys):
    code, err = run(["generate", "--draft", files["draft"], "--target", files["target"], "--no-chat",
                     " ".join(["t3"] * 5000)], capsys)
    assert code == 2 and "context" in err


EVAL = [
    *[(["--limit", v], m) for v, m in (("0", "limit"), ("-1", "limit"), ("x", "invalid int"))],
    *[(["--max-new-tokens", v], "--max-new-tokens must be an integer >= 1") for v in ("0", "-1")],
    *[(["--temperature", v], "temperature") for v in ("-1", "nan", "inf")],
    (["--draft-length", "0"], "--draft-length"),
    (["--draft-confidence", "1"], "confidence"),
    (["--seed", "-1"], "seed"),
    (["--split", "banana"], "split"),
    (["--task", "banana"], "unknown task"),
    (["--task", "jsonl:{missing}"], "not found"),
    (["--verifications", ""], "no verifications"),
    (["--verifications", "plain,banana"], "verification must be one of"),
    (["--verifications", "exact,exact"], "listed twice"),
    (["--verifications", "static:2"], "weight must be in"),
    (["--verifications", "hf-static:1.5"], "hf-static:W"),
    (["--out", "{file.txt}"], "is a file"),
    (["--out", "{file.txt}/sub"], "is a file"),
]


def run_with_defaults(command: str, args: list[str], defaults: dict[str, str], files: dict, capsys
                      ) -> tuple[int, str]:
    """Run `command` on the tiny pair with `args`, and each default option the case does not set itself."""
    args = _fill(args, files)
    unset = [x for option, value in defaults.items() if option not in args[::2] for x in (option, value)]
    return run([command, "--draft", files["draft"], "--target", files["target"], *args, *unset], capsys)


@pytest.mark.parametrize(("args", "message"), EVAL, ids=[" ".join(a) for a, _ in EVAL])
def test_eval_refuses_before_loading_and_writes_nothing(files, capsys, no_loading, tmp_path, args, message):
    defaults = {"--task": "humaneval", "--out": str(tmp_path / "out"), "--verifications": "plain,exact"}
    code, err = run_with_defaults("eval", args, defaults, files, capsys)
    assert code == 2 and message in err, err
    assert not (tmp_path / "out").exists()


TRAIN = [
    *[(["--lambda", v], "lambda") for v in ("inf", "nan", "-1", "1e999")],
    *[(["--lr", v], "lr") for v in ("0", "-1", "nan", "inf")],
    *[(["--clip", v], "clip") for v in ("0", "-0.2", "nan")],
    *[([flag, "0"], name) for flag, name in (("--ppo-epochs", "ppo_epochs"), ("--minibatches", "minibatches"),
                                            ("--prompts-per-step", "prompts_per_step"), ("--epochs", "epochs"),
                                            ("--checkpoint-every", "checkpoint_every"),
                                            ("--max-new-tokens", "max_new_tokens"), ("--draft-length", "draft_length"),
                                            ("--limit", "limit"))],
    (["--samples-per-prompt", "1"], "samples_per_prompt"),
    (["--minibatches", "100"], "minibatches"),
    (["--temperature", "0"], "temperature must be > 0"),
    *[(["--initial-weight", v], "initial") for v in ("0", "1", "nan", "2")],
    (["--seed", "-1"], "seed"),
    (["--architecture", "banana"], "invalid choice"),
    (["--task", "banana"], "unknown task"),
    (["--task", "humaneval", "--split", "x"], "unrecognized arguments"),
    (["--out", "{file.txt}"], "is a file"),
    (["--resume"], "nothing to resume"),
    (["--until-step", "0"], "--until-step must be >= 1"),
]


@pytest.mark.parametrize(("args", "message"), TRAIN, ids=[" ".join(a) for a, _ in TRAIN])
def test_train_refuses_before_loading(files, capsys, no_loading, tmp_path, args, message):
    code, err = run_with_defaults("train", args, {"--task": "humaneval", "--out": str(tmp_path / "run")}, files, capsys)
    assert code == 2 and message in err, err
    assert not (tmp_path / "run").exists()


# The Python API: each call must raise the named error with a message that names the problem.
API = [
    (lambda: Request.of([]), "prompts must be a non-empty list"),
    (lambda: Request.of(None), "prompts must be a non-empty list"),
    (lambda: Request.of([""]), "prompt is empty"),
    (lambda: Request.of(["ok", " "]), "prompt 2 is empty"),
    (lambda: Request.of(["ok", 5]), "prompt 2 must be a string"),
    (lambda: Request.of([b"bytes"]), "prompt must be a string"),
    (lambda: Request.of(["\ud800"]), "lone surrogate"),
    (lambda: Request.of("x", max_new_tokens=0), "max_new_tokens"),
    (lambda: Request.of("x", max_new_tokens=2.5), "max_new_tokens"),
    (lambda: Request.of("x", max_new_tokens=True), "max_new_tokens"),
    (lambda: Request.of("x", temperature=math.nan), "temperature"),
    (lambda: Request.of("x", temperature="1"), "temperature"),
    (lambda: Request.of("x", temperature=-1), "temperature"),
    (lambda: Request.of("x", top_k=-1), "top_k"),
    (lambda: Request.of("x", top_p=0), "top_p"),
    (lambda: Request.of("x", top_p=math.inf), "top_p"),
    (lambda: Request.of("x", batch_size=0), "batch_size"),
    (lambda: Request.of("x", seed=-1), "seed"),
    (lambda: Request.of("x", seed=2**64), "seed"),
    (lambda: Request.of("x", verification="banana"), "verification must be one of"),
    (lambda: Request.of("x", verification=5), "verification must be a string"),
    (lambda: Request.of("x", draft_length=0), "draft_length"),
    (lambda: Request.of("x", draft_length=1.5), "draft_length"),
    (lambda: Request.of("x", stop=[""]), "stop string 1 must be a non-empty string"),
    (lambda: Request.of("x", stop=[None]), "stop string 1 must be a non-empty string"),
    (lambda: Verification.parse("static:"), "needs weight"),
    (lambda: Verification("static", weight=float("nan")), "weight must be in"),
    (lambda: Verification("lossy", lenience=1.0), "lenience"),
    (lambda: Verification("exact", weight=0.5), "does not apply"),
    (lambda: Verification("typical", epsilon=0.0), "epsilon"),
    (lambda: Verification("static", weight=0.5, shift=1.0), "shift is for verification 'diversed'"),
    (lambda: Verification.parse("diversed:gsm8k@nan"), "finite number"),
    (lambda: Verification.parse("static:0.7@+1"), "cannot read verification"),
    (lambda: Sampling(temperature=math.inf), "temperature"),
    (lambda: Sampling(top_p=1.5), "top_p"),
    (lambda: Drafting(0), "draft_length"),
    (lambda: Drafting(3, "banana"), "schedule"),
    (lambda: Drafting(3, confidence=math.nan), "confidence"),
    (lambda: check_load_options("a", None), "name both"),
    (lambda: check_load_options(None, None, backend="banana"), "backend must be one of"),
    (lambda: check_load_options(None, None, dtype="float8"), "dtype"),
    (lambda: check_load_options(None, None, device="banana"), "is not a device"),
    (lambda: check_load_options(None, None, threads=0), "threads"),
    (lambda: check_load_options(None, None, threads=10**6), "threads"),
    (lambda: check_load_options(None, None, draft_quant="Q9"), "draft_quant"),
    (lambda: check_load_options(None, None, draft_vocab=8), "--draft-vocab is a transformers"),
    (lambda: check_load_options("/no/such/draft", "/no/such/target"), "no such file"),
    (lambda: EvalConfig("humaneval", limit=0), "limit"),
    (lambda: EvalConfig("humaneval", max_new_tokens=0), "max_new_tokens"),
    (lambda: EvalConfig("humaneval", temperature=math.nan), "temperature"),
    (lambda: EvalConfig("humaneval", seed=-3), "seed"),
    (lambda: EvalConfig("humaneval", seed=2**63), "seed"),
    (lambda: TrainConfig(seed=2**32), "seed"),
    (lambda: Verification("plain", weight=0.5), "takes no weight"),
    (lambda: Verification("diversed", weight=0.3), "takes no weight"),
    (lambda: parse_verifications(["exact", "static:x"]), "cannot read verification"),
    (lambda: TrainConfig(lam=math.inf), "lambda"),
    (lambda: TrainConfig(lam=-0.1), "lambda"),
    (lambda: TrainConfig(lr=math.nan), "lr"),
    (lambda: TrainConfig(samples_per_prompt=1), "samples_per_prompt"),
    (lambda: HeadConfig(8, 8, initial_weight=1.0), "initial weight"),
    (lambda: HeadConfig(8, 8, architecture="rnn"), "architecture"),
    (lambda: EnsembleHead.load("/no/such/head"), "no head checkpoint"),
    (lambda: get_task("banana"), "unknown task"),
    (lambda: get_task("gsm8k").examples("banana"), "split"),
    (lambda: get_task("mbpp").examples("banana"), "split"),
    (lambda: get_task("humaneval").examples("banana"), "split"),
    (lambda: get_task("humaneval-plus").examples("banana"), "split"),
]


@pytest.mark.parametrize(("call", "message"), API, ids=[str(i) for i in range(len(API))])
def test_api_refuses_with_a_clear_error(call, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message.replace("(", r"\(")):
        call()


def test_inputs_that_are_fine_give_the_right_result():
    """Not errors: a single stop string is one string (not its characters), greedy is temperature 0, top-k 0 is
    off, a NUL inside a prompt is text like any other, a prompt of 100,000 characters is only long."""
    request = Request.of("t3", stop="t5", temperature=0, top_k=0, seed=0)
    assert request.stop == ("t5",) and request.sampling.greedy and request.prompts == ("t3",)
    assert Request.of(["a\x00b", "x" * 100_000]).prompts == ("a\x00b", "x" * 100_000)
    assert Request.of("x", stop="\n").stop == ("\n",)  # a newline is a stop string, blank or not
    assert Verification.parse("static:0").weight == 0.0 and Verification.parse("static:1").weight == 1.0
    assert Verification.parse("diversed:gsm8k@+1") == Verification("diversed", head="gsm8k", shift=1.0)
    assert Verification.parse("diversed:@-0.5") == Verification("diversed", shift=-0.5)
    assert Verification.parse("diversed:runs@v2/head").head == "runs@v2/head"  # '@' without a number is the folder's
    assert [Verification.parse(t).label for t in ("diversed:x@1.50", "diversed:@-2", "diversed:x")] == \
        ["diversed:x@+1.5", "diversed:@-2", "diversed:x"]
    assert check_load_options(None, None) == "llama.cpp"


SERVE = [
    (["--head", "flat"], "NAME=DIR"),
    (["--head", "flat={missing}"], "no head checkpoint"),
    (["--port", "0"], "--port"),
    (["--port", "70000"], "--port"),
    (["--host", "999.1.1.1"], "--host"),
    (["--verification", "dynamic"], "weight function"),
    (["--verification", "strict"], "--verification must be one of"),
    (["--verification", "static:2"], "static"),
    (["--verification", "diversed:nothere"], "no head named 'nothere'"),
    (["--verification", "diversed:nothere", "--head", "flat={head}"], "no head named 'nothere'"),
    (["--max-batch", "0"], "max_batch"),
    (["--max-waiting", "-1"], "max_waiting"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--model-name", " "], "model_name"),
    (["--drafter", "prediction"], "drafter 'prediction'"),
    (["--draft-length", "0"], "--draft-length"),
]


@pytest.mark.parametrize(("args", "message"), SERVE, ids=[" ".join(a) for a, _ in SERVE])
def test_serve_refuses_before_loading(files, capsys, no_loading, args, message):
    code, err = run(["serve", "--draft", files["draft"], "--target", files["target"], *_fill(args, files)], capsys)
    assert code == 2 and "Traceback" not in err
    assert message in err.strip().splitlines()[-1], err


def test_serve_refuses_a_taken_port_before_loading(files, capsys, no_loading):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        code, err = run(["serve", "--draft", files["draft"], "--target", files["target"], "--port", port], capsys)
    assert code == 2 and "Traceback" not in err
    assert f"cannot listen on 127.0.0.1:{port}" in err.strip().splitlines()[-1], err


@pytest.mark.parametrize(("args", "message"), [(["--head", "flat={head}"], "corrupt head"),
                                               (["--verification", "diversed:gsm8k"], "fit the built-in pair only"),
                                               (["--verification", "diversed"], "no head fits this pair")])
def test_serve_refuses_bad_heads_once_the_models_load(files, capsys, args, message):
    code, err = run(["serve", "--draft", files["draft"], "--target", files["target"], *_fill(args, files)], capsys)
    assert code == 2 and message in err and "Traceback" not in err, err


def test_report_refuses_a_folder_without_an_evaluation(files, capsys):
    code, err = run(["report", files["root"]], capsys)
    assert code == 2 and "no evaluation" in err and "Traceback" not in err


def test_report_refuses_verifications_for_a_training_run(tmp_path, capsys):
    (tmp_path / "log.jsonl").write_text("")
    code, err = run(["report", str(tmp_path), "--verifications", "exact"], capsys)
    assert code == 2 and "--verifications and --to are for evaluations" in err and "Traceback" not in err
