"""The `diversed` command: a thin layer over the library API."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import replace
from pathlib import Path

# Only modules that import no torch: `diversed --help` and a refused argument answer at once; each command
# imports what it runs.
from diversed.head.config import TRAINING_DRAFTERS, TrainConfig
from diversed.head.names import ARCHITECTURES, DEFAULT_HEAD, KINDS, PRETRAINED_HEADS, head_folder
from diversed.models.options import BACKENDS, DTYPE_NAMES, QUANTIZATIONS
from diversed.request import (
    DEFAULT_DRAFTING,
    DRAFTERS,
    RENAMED_SCHEDULES,
    RULE_SPECS,
    SCHEDULES,
    Drafting,
    RequestError,
)

TASK_HELP = ("gsm8k, gsm8k-plain, mbpp, mbpp-sanitized, mbpp-edit, mbpp-edit-2turn, file-edit, humaneval, "
             "humaneval-plus (offline), cnn_dailymail, xsum (online) or jsonl:PATH")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except RequestError as err:  # a request's value, said with its flag
        print(f"diversed {args.command}: error: {_one_line(err.message_for(_flag(err.field)))}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError, NotADirectoryError, IsADirectoryError) as err:  # what the user asked
        print(f"diversed {args.command}: error: {_one_line(err)}", file=sys.stderr)
        return 2
    except (RuntimeError, OSError) as err:  # what the machine could not do
        print(f"diversed {args.command}: failed: {_one_line(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"diversed {args.command}: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    """The command line: each command's parser, with the function that runs it (`run`)."""
    parser = argparse.ArgumentParser(
        prog="diversed", description="Relaxed speculative decoding with learned dynamic ensemble verification.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text with a draft/target pair and a verification rule")
    gen.add_argument("prompts", nargs="*", help="prompts; '-' or none reads them from stdin, one per line")
    gen.add_argument("--file", type=Path, help="read prompts from a file: one per line, or JSONL with 'prompt'")
    gen.add_argument("--verification", default="exact", metavar="RULE",
                     help="plain (the target alone), diversed[:HEAD[@SHIFT]] (a trained head) or a rule, with its "
                          "parameter as NAME:VALUE, e.g. static:0.7, and its others as ,NAME=VALUE: "
                          + "; ".join(f"{name} ({spec.summary})" for name, spec in RULE_SPECS.items()
                                      if name != "dynamic"))
    _old_spelling(gen, "--method", "--verification")
    gen.add_argument("--head", help="a trained head for --verification diversed: its folder, or the name of a head "
                                    f"shipped for the built-in pair ({', '.join(PRETRAINED_HEADS)}; default "
                                    f"{DEFAULT_HEAD}); --verification diversed:HEAD@+1 shifts its logit by +1 "
                                    "(stricter)")
    gen.add_argument("--delta", type=float, help=argparse.SUPPRESS)  # typical:EPS,delta=D; one release more
    _add_model_options(gen)
    gen.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    gen.add_argument("--top-k", type=int, default=0, help="0 = off")
    gen.add_argument("--top-p", type=float, default=1.0)
    _add_drafting_options(gen)
    gen.add_argument("--max-new-tokens", type=int,
                     help="at most so many new tokens (default: until the answer ends, within the context)")
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    gen.add_argument("--prediction", metavar="FILE",
                     help="a file ('-': stdin) the answer is expected to repeat, most of it (OpenAI's Predicted "
                          "Outputs: a file to return with one change); the auto drafter drafts from it first")
    gen.add_argument("--no-chat", action="store_true", help="do not wrap prompts in the chat template")
    gen.add_argument("--system", help="a system message for the chat template")
    gen.add_argument("--batch-size", type=int, default=1)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt with all metrics")
    gen.add_argument("--stream", action="store_true", help="print each prompt's text as it is generated")
    gen.add_argument("--provenance", action="store_true",
                     help="with --json: how each token was made (kept, relaxed, correction, bonus, target; by which "
                          "drafter, with p, q and the acceptance), as the server's provenance extension")
    gen.add_argument("--profile", action="store_true",
                     help="time each phase of the rounds (draft and target forwards, sampling, head, verifier, "
                          "cache, other) and print the split")
    gen.set_defaults(run=_generate)

    train = commands.add_parser("train", help="train a DIVERSED head (a weight or a lenience per token) for the pair "
                                              "on a task")
    train.add_argument("--task", required=True, help=TASK_HELP)
    train.add_argument("--out", required=True, type=Path, help="folder for checkpoints, log.jsonl and the head")
    train.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    train.add_argument("--until-step", type=int,
                       help="stop after this step (checkpoint and head written); --resume continues the run later")
    train.add_argument("--lambda", dest="lam", type=float, default=TrainConfig.lam,
                       help="weight of the acceptance reward: the speed/quality dial")
    for name, kind in (("temperature", float), ("draft_length", int), ("max_new_tokens", int), ("lr", float),
                       ("epochs", int), ("prompts_per_step", int), ("samples_per_prompt", int), ("limit", int),
                       ("checkpoint_every", int), ("initial_weight", float), ("seed", int), ("ppo_epochs", int),
                       ("minibatches", int), ("clip", float), ("max_lenience", float), ("initial_lenience", float)):
        train.add_argument("--" + name.replace("_", "-"), type=kind, default=getattr(TrainConfig, name))
    _old_spelling(train, "--draft-len", "--draft-length", type=int)
    train.add_argument("--kind", choices=KINDS, default=TrainConfig.kind,
                       help="what the head sets per drafted token: mixture (the paper's weight w, rule dynamic), "
                            "lenience (rule lossy's L, below --max-lenience, from the target and the draft "
                            "distribution) or lenience-target (L from the target alone: serves copied drafts)")
    train.add_argument("--drafter", choices=TRAINING_DRAFTERS, default=TrainConfig.drafter,
                       help="whose drafts the rollouts verify: the draft model's, or copied ones (lookup, suffix, "
                            "prediction: each example's input text, as --prediction in eval) for a lenience head")
    train.add_argument("--architecture", choices=ARCHITECTURES, default=TrainConfig.architecture)
    train.add_argument("--informative-only", action="store_true",
                       help="update only on the prompts whose samples' rewards differ (a step without any is "
                            "skipped), so the acceptance term never pulls where the reward cannot object")
    train.add_argument("--init-head", metavar="DIR",
                       help="start from this head's weights (a warm start; same pair and architecture): a head or "
                            "checkpoint folder, or a shipped head's name")
    _add_sandbox_option(train)
    _add_model_options(train)
    train.set_defaults(run=_train)

    ev = commands.add_parser("eval", help="compare verification rules on a task: table, pictures, resumable, "
                                          "data-parallel")
    ev.add_argument("--task", required=True, help=TASK_HELP)
    ev.add_argument("--verifications", default="plain,exact,static:0.9,static:0.7,static:0.5", metavar="LIST",
                    help="comma-separated: plain, exact, static:W, lossy:L, cascade-*:A, typical, diversed:DIR, "
                         "and transformers' assisted generation hf-exact, hf-static:W, hf-default")
    _old_spelling(ev, "--methods", "--verifications")
    ev.add_argument("--out", required=True, type=Path, help="folder for results.jsonl, summaries and plots")
    ev.add_argument("--resume", action="store_true", help="continue the evaluation in --out")
    ev.add_argument("--temperature", type=float, default=1.0)
    _old_spelling(ev, "--draft-len", "--draft-length", type=int)
    ev.add_argument("--draft-length", type=int, default=5,
                    help="drafted tokens per round (default 5; hf-exact drafts as many)")
    ev.add_argument("--draft-confidence", type=float, default=0.0,
                    help="stop drafting below this draft probability (default 0: a constant draft length, so that "
                         "acceptance rates compare across verifications)")
    ev.add_argument("--draft-schedule", default="constant", metavar="|".join(SCHEDULES), type=_schedule,
                    help="constant (default), heuristic, or speed (the speed model; --draft-length is then the "
                         "longest)")
    ev.add_argument("--drafter", default="model", metavar="|".join(DRAFTERS),
                    help="what drafts: model (default, the draft model), lookup, suffix or auto (see generate)")
    ev.add_argument("--prediction", action="store_true",
                    help="send each example's input text as its predicted output (Predicted Outputs; file-edit: "
                         "the file the request shows), with --drafter auto or prediction")
    ev.add_argument("--max-new-tokens", type=int, help="default: the task's")
    ev.add_argument("--split", default="test")
    ev.add_argument("--limit", type=int, help="the first LIMIT examples of the split")
    ev.add_argument("--seed", type=int, default=0)
    ev.add_argument("--batch-size", type=int, default=1,
                    help="examples decoded together per verification: more throughput, and tokens/s that are no "
                         "longer a single request's")
    _add_sandbox_option(ev)
    _add_model_options(ev)
    ev.set_defaults(run=_eval)

    rep = commands.add_parser("report", help="the table and pictures of an evaluation or a head's training so far "
                                             "(running or stopped)")
    rep.add_argument("out", type=Path, help="the evaluation's or the training run's --out folder")
    rep.add_argument("--verifications", metavar="LIST",
                     help="an evaluation's verifications to report, comma-separated (default: all; the examples "
                          "compared are those every one of them finished)")
    _old_spelling(rep, "--methods", "--verifications")
    rep.add_argument("--to", type=Path, help="write the evaluation's summary and pictures here instead of into "
                                             "OUT (a report of some verifications that keeps OUT's own)")
    rep.set_defaults(run=_report)

    srv = commands.add_parser("serve", help="an OpenAI-compatible server with a verification dial per request")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--verification", default="exact", metavar="RULE",
                     help="the rule of requests that name none (a request's 'verification' field overrides it)")
    _old_spelling(srv, "--method", "--verification")
    srv.add_argument("--head", action="append", default=[], metavar="NAME=DIR",
                     help="load a trained head under a name that requests pick with 'head' (repeatable; the "
                          f"heads shipped for the built-in pair are loaded as {', '.join(PRETRAINED_HEADS)} and "
                          f"'default' ({DEFAULT_HEAD}))")
    srv.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default 8)")
    srv.add_argument("--max-waiting", type=int, default=64,
                     help="requests queued beyond the batch; more are refused with 503 (default 64)")
    srv.add_argument("--max-tokens", type=int,
                     help="a chat request's limit when it sets none (default: what the context leaves)")
    srv.add_argument("--model-name", help="the model id clients see (default: the target's name)")
    _add_drafting_options(srv)
    _add_model_options(srv)
    srv.set_defaults(run=_serve)

    prep = commands.add_parser("prepare", help="assemble, check and convert the built-in default pair")
    prep.set_defaults(run=_prepare)
    return parser


def _one_line(error: BaseException | str) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _flag(field: str) -> str:
    """The option that sets a request's field (diversed.request's names) on the command line."""
    return {"prompt": "prompt", "chat": "--no-chat"}.get(field, "--" + field.replace("_", "-"))


def _add_sandbox_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-unsandboxed", action="store_true",
                        help="where bubblewrap cannot isolate generated code, run it anyway with only resource "
                             "limits (otherwise code tasks refuse)")


class _OldSpelling(argparse.Action):
    """An option's spelling before it was renamed: it works for one release more, with a warning."""

    def __init__(self, option_strings: list[str], dest: str, new: str, **kwargs) -> None:
        # No default of its own: the new spelling's stands unless the old one is given.
        super().__init__(option_strings, dest, help=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)
        self.new = new

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"{parser.prog}: warning: {option_string} is now {self.new}; {option_string} stops working in the "
              "next release", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _old_spelling(parser: argparse.ArgumentParser, old: str, new: str, **kwargs) -> None:
    parser.add_argument(old, dest=new.lstrip("-").replace("-", "_"), action=_OldSpelling, new=new, **kwargs)


def _add_drafting_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", default="auto", metavar="|".join(DRAFTERS),
                        help="what drafts: auto (default: each round the fastest of copying text, the draft model, "
                             "or none), model (the draft model), lookup (prompt lookup in the row's own text), "
                             "suffix (a suffix cache over the text and earlier outputs)")
    parser.add_argument("--draft-length", type=int,
                        help="drafted tokens per round N (the first round's N of the other schedules)")
    _old_spelling(parser, "--draft-len", "--draft-length", type=int)
    parser.add_argument("--draft-schedule", metavar="|".join(SCHEDULES), type=_schedule,
                        help="constant N; heuristic (+2 after a fully kept round, -1 after a rejection); speed (each "
                             "round the N, 0 = the target alone, that the speed model predicts fastest, from "
                             "measured costs and running acceptance)")
    parser.add_argument("--draft-confidence", type=float,
                        help="stop drafting once a drafted token's probability is below this (0 = off)")


def _schedule(name: str) -> str:
    """--draft-schedule's value, an old spelling said in the new one with a warning (Drafting checks it)."""
    if name in RENAMED_SCHEDULES:
        print(f"diversed: warning: --draft-schedule {name} is now {RENAMED_SCHEDULES[name]}; {name} stops working in "
              "the next release", file=sys.stderr)
    return RENAMED_SCHEDULES.get(name, name)


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", choices=BACKENDS,
                        help="llama.cpp (.gguf files as they are quantized; the default on a CPU for the built-in "
                             "pair and .gguf files) or transformers (hub ids, folders, .gguf converted)")
    parser.add_argument("--threads", type=int, help="llama.cpp threads (default: every core)")
    parser.add_argument("--cache-ram", type=int, metavar="MIB",
                        help="each model's prompt cache, in MiB of KV memory (host memory on transformers), for "
                             "prompts that begin with what an earlier one read (llama-server's flag; 0 turns it "
                             "off; default 1024)")
    parser.add_argument("--draft-quant", choices=QUANTIZATIONS,
                        help="llama.cpp: the built-in draft requantized to fewer bits (a cheaper step; made once)")
    parser.add_argument("--draft", help="draft model: hub id, folder or .gguf (default: built-in pair)")
    parser.add_argument("--target", help="target model: hub id, folder or .gguf (default: built-in pair)")
    parser.add_argument("--dtype", choices=DTYPE_NAMES, default="float16",
                        help="transformers backend: float16 (default; on a CPU float16 weights with float32 "
                             "arithmetic), float32, bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--draft-vocab", type=int, metavar="K",
                        help="the draft scores only its K most frequent tokens: a cheaper draft, still lossless")
    parser.add_argument("--draft-int8", action=argparse.BooleanOptionalAction, default=True,
                        help="run a CPU draft in dynamic int8: cheaper, still lossless (default: on)")


def _generate(args: argparse.Namespace) -> int:
    # Everything is checked before the models load (tens of seconds): a typo costs nothing.
    request = _request(args)
    if request.verification.name == "diversed":
        head_folder(request.verification.head)  # its files only: a missing head is refused before the models load
    if args.stream and (args.json or args.batch_size > 1):
        raise ValueError("--stream prints one prompt's text at a time: not with --json or --batch-size > 1")
    if args.provenance and not args.json:
        raise ValueError("--provenance adds each token's origin to the JSON output: use it with --json")
    from tqdm import tqdm

    from diversed.decoding.drafters import SuffixCache
    from diversed.decoding.schedule import CostMemory
    from diversed.generation import run
    from diversed.models.default_pair import costs_file

    pair = _load(args)
    costs, cache = CostMemory(costs_file()), SuffixCache()  # costs: what earlier runs measured
    try:
        if args.stream:  # prompt by prompt (as --batch-size 1 runs them, seeds included): text as it comes
            for i, (prompt, prediction) in enumerate(zip(request.prompts, request.predictions, strict=True)):
                one = replace(request, prompts=(prompt,), predictions=(prediction,), seed=request.seed + i)
                completion, = run(pair, one, profile=args.profile, cache=cache, costs=costs,
                                  on_text=lambda _, piece: print(piece, end="", flush=True))
                _print_completion(completion, args, streamed=True)
            return 0
        # A progress line on stderr for a generation that takes a while (a terminal only; gone when it ends).
        with tqdm(desc="generating", unit=" tokens", delay=2, leave=False, disable=None, file=sys.stderr) as bar:
            completions = run(pair, request, profile=args.profile, cache=cache, costs=costs,
                              on_tokens=lambda _, new: bar.update(len(new)))
    finally:
        costs.save()
    for c in completions:
        _print_completion(c, args)
    return 0


def _request(args: argparse.Namespace):
    """The command line's words as a Request (diversed.request checks each): --verification with --head, the
    sampling numbers, the drafting flags over the backend's default, the prompts and --prediction read."""
    from diversed.request import Request, Sampling, Verification

    verification = Verification.parse(args.verification).with_head(args.head)  # a folder as it is, '@' and all
    if args.delta is not None:
        print("diversed generate: warning: --delta is now --verification typical:EPSILON,delta=DELTA; --delta stops "
              "working in the next release", file=sys.stderr)
        if verification.name != "typical":
            raise ValueError(f"--delta is typical's entropy factor, not {verification.label!r}'s")
        verification = replace(verification, delta=args.delta)
    backend = _check_load_options(args)
    prediction = None if args.prediction is None else _read_prediction(args)
    return Request(_read_prompts(args), verification, Sampling(args.temperature, args.top_k, args.top_p),
                   args.drafter, _drafting(args, DEFAULT_DRAFTING[backend]), None, args.max_new_tokens,
                   tuple(args.stop), args.seed, prediction, args.provenance, False if args.no_chat else None,
                   args.system, args.batch_size)


def _print_completion(c, args: argparse.Namespace, streamed: bool = False) -> None:
    if args.json:
        print(json.dumps(c.to_dict()), flush=True)
        return
    m = c.metrics
    rate = "-" if m["acceptance_rate"] is None else f"{m['acceptance_rate']:.1%}"
    print("" if streamed else c.text)
    drafted = ", ".join(f"{name} {d['accepted']}/{d['drafted']}" for name, d in m["drafters"].items()) or "none"
    print(f"[{m['verification']}] {m['new_tokens']} tokens in {m['wall_time']:.2f} s "
          f"({m['tokens_per_s']:.2f} tok/s), acceptance {rate}, tau {m['tau']:.2f}; kept/drafted: {drafted}; "
          f"{m['rule_tokens']} tokens by the rule, {m['target_tokens']} by the target alone", flush=True)
    if args.profile:
        from diversed.decoding.profile import profile_table

        print(profile_table(m["profile"]), flush=True)


def _serve(args: argparse.Namespace) -> int:
    from diversed.server import ServerConfig, check_address, serve

    heads = {}
    for spec in args.head:
        name, _, folder = spec.partition("=")
        if not name or not folder:
            raise ValueError(f"--head takes NAME=DIR, got {spec!r}")
        heads[name] = str(head_folder(folder))
    try:
        check_address(args.host, args.port)
    except ValueError as error:
        raise ValueError(f"--host/--port: {error}") from None
    backend = _check_load_options(args)
    config = ServerConfig(args.verification, heads, args.max_batch, args.max_waiting, args.max_tokens,
                          _drafting(args, DEFAULT_DRAFTING[backend]), args.model_name, args.drafter)
    serve(_load(args), config, host=args.host, port=args.port)
    return 0


def _drafting(args: argparse.Namespace, default: Drafting) -> Drafting:
    """The backend's default drafting with what the user set of it replaced (--draft-length alone: the constant
    schedule, up to N a round: the confidence cut-off stays unless --draft-confidence changes it)."""
    schedule = args.draft_schedule or ("constant" if args.draft_length is not None else default.schedule)
    if schedule != default.schedule:
        default = Drafting(Drafting.initial, schedule, confidence=default.confidence)
    return Drafting(default.initial if args.draft_length is None else args.draft_length, schedule, default.maximum,
                       default.confidence if args.draft_confidence is None else args.draft_confidence)


def _train(args: argparse.Namespace) -> int:
    from diversed.evaluation.report import plot_training
    from diversed.head.train import LOG_FILE, check_run_folder, train_head
    from diversed.tasks import get_task
    from diversed.tasks.task import predicted_outputs

    _sandbox(args)
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    config = TrainConfig(**{k: v for k, v in vars(args).items() if k in fields})
    if args.until_step is not None and args.until_step < 1:
        raise ValueError(f"--until-step must be >= 1, got {args.until_step}")
    task = get_task(args.task)
    examples = task.examples("train", limit=config.limit)  # the data loads (and is checked) before the models
    if config.drafter == "prediction":
        predicted_outputs(args.task, examples)
    check_run_folder(args.out, config, args.resume)
    _check_load_options(args)
    train_head(_load(args), task, config, args.out, resume=args.resume, until_step=args.until_step)
    plot_training(args.out / LOG_FILE, args.out / "training.png")
    print(args.out)
    return 0


def _eval(args: argparse.Namespace) -> int:
    from diversed.decoding.schedule import CostMemory
    from diversed.evaluation.report import markdown_table
    from diversed.evaluation.run import EvalConfig, check_out_dir, evaluate, parse_verifications
    from diversed.models.default_pair import costs_file
    from diversed.tasks import get_task

    _sandbox(args)
    verifications = parse_verifications(args.verifications)
    task = get_task(args.task)
    # Built before the models load, so that a bad setting is refused at once; the names come after.
    config = EvalConfig(args.task, temperature=args.temperature, draft_length=args.draft_length,
                        draft_confidence=args.draft_confidence, draft_schedule=args.draft_schedule,
                        drafter=args.drafter,
                        max_new_tokens=task.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens,
                        split=args.split, limit=args.limit, seed=args.seed, dtype=args.dtype,
                        draft_int8=args.draft_int8, backend=_check_load_options(args), batch_size=args.batch_size,
                        prediction=args.prediction)
    task.examples(config.split, limit=config.limit)  # the task refuses a split it does not have
    check_out_dir(args.out, args.resume)
    _init_distributed(args)
    pair = _load(args)
    config = replace(config, draft_model=pair.draft_name, target_model=pair.target_name)
    costs = CostMemory(costs_file())  # what earlier runs measured, for the speed schedule
    try:
        summaries = evaluate(pair, task, verifications, config, args.out, resume=args.resume, costs=costs)
    finally:
        costs.save()
    if summaries:
        print(markdown_table(summaries, task.metric))
    return 0


def _report(args: argparse.Namespace) -> int:
    from diversed.evaluation.report import markdown_table, plot_training, training_table
    from diversed.evaluation.run import CONFIG_FILE, report
    from diversed.head.train import LOG_FILE
    from diversed.tasks import get_task

    config = args.out / CONFIG_FILE
    if not config.is_file() and (args.out / LOG_FILE).is_file():  # a head's training run
        if args.verifications is not None or args.to is not None:
            raise ValueError(f"--verifications and --to are for evaluations; {args.out} holds a head's training run")
        plot_training(args.out / LOG_FILE, args.out / "training.png")
        print(training_table(args.out / LOG_FILE))
        return 0
    if not config.is_file():
        raise FileNotFoundError(f"no evaluation or training run in {args.out}: neither {CONFIG_FILE} nor "
                                f"{LOG_FILE} is there")
    metric = get_task(json.loads(config.read_text())["task"]).metric
    print(markdown_table(report(args.out, metric, args.verifications, args.to), metric))
    return 0


def _sandbox(args: argparse.Namespace) -> None:
    if args.allow_unsandboxed:
        from diversed.tasks.sandbox import allow_unsandboxed

        allow_unsandboxed()


def _init_distributed(args: argparse.Namespace) -> None:
    """Under torchrun: one process group, gloo on CPU and nccl on GPUs, one GPU per local rank."""
    import datetime
    import os

    import torch
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if args.device.startswith("cuda"):
            args.device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
            torch.cuda.set_device(args.device)
        # Ranks wait for the slowest at the end: allow far more than the default 10-30 minutes.
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo",
                                timeout=datetime.timedelta(hours=12))


def _prepare(args: argparse.Namespace) -> int:
    from diversed.models.default_pair import default_draft_gguf, default_gguf_pair, prepare_default_pair

    for path in (*default_gguf_pair(), default_draft_gguf("Q3_K_S"), *prepare_default_pair()):
        print(path)
    return 0


def _read_prompts(args: argparse.Namespace) -> list[str]:
    if args.file is not None:
        if not args.file.is_file():
            raise FileNotFoundError(f"--file {str(args.file)!r}: no such file")
        lines = [(i, line) for i, line in enumerate(_utf8(args.file.read_bytes(), f"--file {args.file}")
                                                    .splitlines(), 1) if line.strip()]
        if not lines:
            raise ValueError(f"--file {str(args.file)!r} holds no prompt (only blank lines)")
        if args.file.suffix == ".jsonl":
            return [_jsonl_prompt(line, args.file, i) for i, line in lines]
        return [line for _, line in lines]
    if args.prompts and args.prompts != ["-"]:
        return args.prompts
    if sys.stdin.isatty() and args.prompts != ["-"]:
        raise ValueError("give a prompt, --file, or prompts on stdin")
    prompts = [line for line in _utf8(sys.stdin.buffer.read(), "standard input").splitlines() if line.strip()]
    if not prompts:
        raise ValueError("no prompts on stdin")
    return prompts


def _read_prediction(args: argparse.Namespace) -> str:
    """--prediction's text: a file, or stdin ('-') when the prompts come from elsewhere."""
    if args.prediction == "-":
        if args.file is None and args.prompts in ([], ["-"]):
            raise ValueError("--prediction - reads stdin, which then cannot hold the prompts: give them as "
                             "arguments or with --file")
        return _utf8(sys.stdin.buffer.read(), "standard input (--prediction -)")
    path = Path(args.prediction)
    if not path.is_file():
        raise FileNotFoundError(f"--prediction {args.prediction!r}: no such file")
    return _utf8(path.read_bytes(), f"--prediction {path}")


def _utf8(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{source} is not UTF-8 text (byte {data[error.start]:#04x} at offset {error.start})"
                         ) from None


def _jsonl_prompt(line: str, path: Path, number: int) -> str:
    try:
        prompt = json.loads(line)["prompt"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ValueError(f"{path}:{number}: expected a JSON object with a \"prompt\" field") from None
    if not isinstance(prompt, str):
        raise ValueError(f"{path}:{number}: \"prompt\" must be a string, got {type(prompt).__name__}")
    return prompt


def _check_load_options(args: argparse.Namespace) -> str:
    """load_pair's checks, before anything loads; the backend the pair will run on."""
    from diversed.models.options import check_load_options

    return check_load_options(args.draft, args.target, backend=args.backend, dtype=args.dtype, device=args.device,
                              draft_vocab=args.draft_vocab, threads=args.threads, draft_quant=args.draft_quant,
                              cache_ram=args.cache_ram)


def _load(args: argparse.Namespace):
    from tqdm import tqdm

    from diversed.models.loading import load_pair

    with tqdm(total=1, desc="loading models", file=sys.stderr, bar_format="{desc}: {elapsed}") as bar:
        pair = load_pair(args.draft, args.target, backend=args.backend, dtype=args.dtype, device=args.device,
                         draft_vocab=args.draft_vocab, draft_int8=args.draft_int8, threads=args.threads,
                         cache_ram=args.cache_ram,
                         draft_quant=args.draft_quant)
        bar.update()
    return pair


if __name__ == "__main__":
    sys.exit(main())
