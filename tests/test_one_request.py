"""One request, admitted once: each bad field of a request, sent through every edge that has it (Python, the
command line, an HTTP body, an evaluation's settings, the vLLM plugin), is refused by the same function; what
needs the models is refused by admit() for generate() and the server alike; the command line reaches the
verifier in a few frames; the decoding loop writes no file and keeps no module-level state."""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import pkgutil
import traceback
import types
import typing
from pathlib import Path

import pytest
import torch

import diversed
import diversed.decoding
import diversed.decoding.policy as policy
from diversed import cli
from diversed.decoding.schedule import CostMemory
from diversed.evaluation.run import EvalConfig, parse_verifications
from diversed.generation import generate
from diversed.integrations.vllm import request_verification
from diversed.request import Drafting, RequestError, Verification
from diversed.server.app import Server, ServerConfig
from diversed.server.protocol import BadRequest, parse_call

from tiny import toy_pair

PACKAGE = Path(diversed.__file__).parent


@pytest.fixture(scope="module")
def pair():
    return toy_pair()


def origin(error: BaseException) -> tuple[str, str]:
    """The function (file, name) that raised the RequestError behind an error: an edge that says it in its own
    words (a 400, the vLLM plugin's ValueError) keeps the original as its context."""
    while not isinstance(error, RequestError) and (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    assert isinstance(error, RequestError), f"{type(error).__name__}: {error} is no request's error"
    frame = traceback.extract_tb(error.__traceback__)[-1]
    return Path(frame.filename).name, frame.name


def refusal(call) -> tuple[str, str]:
    with pytest.raises(Exception) as caught:  # noqa: PT011 - which exception, origin() says
        call()
    return origin(caught.value)


def python(**fields):
    return lambda: generate(None, fields.pop("prompts", "a prompt"), **fields)


def command_line(*flags: str, prompt: str = "a prompt"):
    return lambda: cli._request(cli.build_parser().parse_args(["generate", prompt, *flags]))


def http(chat: bool = False, **body):
    body = ({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "a prompt"}) | body
    return lambda: parse_call(body, chat, Verification("exact"), Drafting(), "auto")


def evaluation(**settings):
    return lambda: EvalConfig("gsm8k", **settings)


# field -> the same bad value as each edge spells it
EDGES = {
    "prompt": [python(prompts=""), command_line(prompt=" "), http(prompt="")],
    "prompt of no text": [python(prompts=5), http(prompt=5)],
    "verification": [python(verification="banana"), command_line("--verification", "banana"),
                     http(verification="banana"), lambda: parse_verifications("exact,banana"),
                     lambda: request_verification({"verification": "banana"})],
    "dynamic": [python(verification="dynamic"), command_line("--verification", "dynamic"),
                http(verification="dynamic"), lambda: parse_verifications("dynamic"),
                lambda: request_verification({"verification": "dynamic"})],
    "temperature": [python(temperature=-1), command_line("--temperature", "-1"), http(temperature=-1),
                    evaluation(temperature=-1)],
    "top_k": [python(top_k=-1), command_line("--top-k", "-1"), http(top_k=-1)],
    "top_p": [python(top_p=0), command_line("--top-p", "0"), http(top_p=0)],
    "max_new_tokens": [python(max_new_tokens=0), command_line("--max-new-tokens", "0"), http(max_tokens=0),
                       evaluation(max_new_tokens=0)],
    "drafter": [python(drafter="banana"), command_line("--drafter", "banana"), http(drafter="banana"),
                evaluation(drafter="banana")],
    "draft_length": [python(draft_length=0), command_line("--draft-length", "0"), http(draft_length=0),
                     evaluation(draft_length=0)],
    "draft_schedule": [lambda: Drafting(3, "sometimes"), command_line("--draft-schedule", "sometimes"),
                       evaluation(draft_schedule="sometimes")],
    "stop": [python(stop=[""]), command_line("--stop", ""), http(stop=[""])],
    "seed": [python(seed=-1), command_line("--seed", "-1"), http(seed=-1), evaluation(seed=-1)],
    "batch_size": [python(batch_size=0), command_line("--batch-size", "0"), evaluation(batch_size=0)],
    "head": [lambda: Verification.parse("static:0.7").with_head("gsm8k"),
             command_line("--verification", "static:0.7", "--head", "gsm8k"),
             http(verification="static:0.7", head="gsm8k")],
    "provenance": [python(provenance="yes"), http(provenance="yes")],
    "prediction": [python(prediction=" ", drafter="auto"), http(prediction={"type": "content", "content": " "})],
}


@pytest.mark.parametrize("field", list(EDGES))
def test_each_field_is_refused_by_one_function_whatever_the_edge(field):
    where = {refusal(call) for call in EDGES[field]}
    assert len(where) == 1, f"{field} is checked in {sorted(where)}"
    filename, _ = where.pop()
    assert filename == "request.py"  # the request's own module, before any model loads


def test_the_http_edge_answers_a_request_error_with_400_naming_the_field(pair):
    server = Server(pair, ServerConfig())
    with pytest.raises(BadRequest) as caught:
        server.call({"prompt": "a prompt", "temperature": -1}, False)
    assert caught.value.status == 400 and caught.value.param == "temperature"
    assert origin(caught.value) == refusal(python(temperature=-1))
    with pytest.raises(BadRequest) as caught:
        server.call({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, True)
    assert caught.value.param == "max_tokens" and "max_tokens must be an integer >= 1" in caught.value.message


ADMISSION = [  # what only the loaded pair can tell: the context, a draft model, a chat template, a head
    dict(max_new_tokens=10**6),
    dict(verification="diversed", drafter="lookup"),  # a mixture head reads the draft model's hidden states
    dict(drafter="model"),  # on a pair without a draft model
    dict(prompts=[[{"role": "user", "content": "hi"}]]),  # the toy tokenizer has no chat template
]


@pytest.mark.parametrize("fields", ADMISSION)
def test_what_needs_the_models_is_refused_by_admit_for_python_and_the_server(pair, fields):
    if fields.get("drafter") == "model":
        pair = copy.copy(pair)
        pair.draft = None
    prompt = fields.get("prompts", ["t1 t2 t3"])[0]
    head = (lambda h_draft, h_target: torch.ones(h_draft.shape[:2])) if "verification" in fields else None
    in_python = refusal(lambda: generate(pair, [prompt], head=head,
                                         **{k: v for k, v in fields.items() if k != "prompts"}))
    server = Server(pair, ServerConfig(heads={}))
    server.heads["mixture"] = head
    chat = isinstance(prompt, list)
    body = ({"messages": prompt} if chat else {"prompt": prompt}) | \
        ({"max_tokens": fields["max_new_tokens"]} if "max_new_tokens" in fields else {}) | \
        ({"drafter": fields["drafter"]} if "drafter" in fields else {}) | \
        ({"verification": fields["verification"], "head": "mixture"} if "verification" in fields else {})
    with pytest.raises(BadRequest) as caught:
        server.job(server.call(body, chat))
    assert caught.value.status == 400
    assert in_python == origin(caught.value) and in_python[0] == "admission.py"


def test_the_command_line_reaches_the_verifier_in_six_frames(monkeypatch, pair, capsys):
    """From cli.main to diversed.verify.verify, counting the frames of the package's own functions."""
    stacks, real = [], policy.verify

    def recording(*args, **kwargs):
        stacks.append([f for f in inspect.stack()[1:] if Path(f.filename).is_relative_to(PACKAGE)])
        return real(*args, **kwargs)

    monkeypatch.setattr(policy, "verify", recording)
    monkeypatch.setattr(cli, "_load", lambda args: pair)
    monkeypatch.setattr(cli, "_check_load_options", lambda args: "transformers")
    assert cli.main(["generate", "t3 t4 t5", "--verification", "static:0.7", "--max-new-tokens", "8",
                     "--temperature", "0", "--drafter", "model", "--no-chat"]) == 0
    assert stacks
    frames = [f.function for f in stacks[0]]
    assert frames[-1] == "main" and len(frames) + 1 <= 6, frames[::-1]  # + 1: verify itself


def test_decoding_writes_no_file_and_the_caller_keeps_the_costs(pair, tmp_path, monkeypatch):
    monkeypatch.setenv("DIVERSED_COSTS", str(tmp_path / "costs.json"))
    monkeypatch.setenv("HOME", str(tmp_path))
    costs = CostMemory(tmp_path / "kept.json")
    generate(pair, "t3 t4 t5", verification="exact", max_new_tokens=12, costs=costs,
             drafting=Drafting(2, "speed", maximum=4))
    assert list(tmp_path.iterdir()) == []  # nothing written by decoding
    assert costs.kept  # the speed model's costs came back to the caller's memory


def _modules(package: types.ModuleType):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        yield importlib.import_module(info.name)


IMMUTABLE = (int, float, str, bytes, bool, tuple, frozenset, type(None), typing.TypeVar)
TYPE_ALIASES = ("typing", "types", "collections.abc")  # Callable[...], X | Y: names for types


def test_the_decoding_package_keeps_no_module_level_mutable_state():
    """Every name a module of diversed.decoding assigns at its top level is a constant: a number, a string, a
    tuple, a type alias (what it imports is its source module's business)."""
    found = []
    for module in [diversed.decoding, *_modules(diversed.decoding)]:
        tree = ast.parse(Path(module.__file__).read_text())
        names = [target.id for node in tree.body if isinstance(node, ast.Assign | ast.AnnAssign)
                 for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
                 if isinstance(target, ast.Name) and target.id != "__all__"]
        for name in names:
            value = getattr(module, name)
            if not (isinstance(value, IMMUTABLE) or type(value).__module__ in TYPE_ALIASES):
                found.append(f"{module.__name__}.{name}: {type(value).__name__}")
    assert found == []


def test_a_head_declares_its_rule():
    from diversed.head.model import EnsembleHead, HeadConfig, LenienceHead, build

    assert build(HeadConfig(8, 8)).rule == "dynamic" and EnsembleHead.rule == "dynamic"
    assert LenienceHead.rule == "lossy"
    assert policy.Policy(Verification("diversed"), head=build(HeadConfig(8, 8, kind="lenience"))).rule == "lossy"
    assert policy.Policy(Verification("dynamic"), head=lambda h_draft, h_target: h_target[..., 0]).rule == "dynamic"
    assert policy.Policy(Verification("static", weight=0.5)).rule == "static"


@pytest.mark.parametrize(("body", "param"), [({"verification": "diversed:nope"}, "verification"),
                                             ({"verification": "diversed", "head": "nope"}, "head")])
def test_a_head_the_server_has_not_loaded_is_named_in_the_field_that_named_it(pair, body, param):
    server = Server(pair, ServerConfig(heads={}))
    server.heads["mine"] = lambda h_draft, h_target: torch.ones(h_draft.shape[:2])
    with pytest.raises(BadRequest) as caught:
        server.job(server.call({"prompt": "t1 t2"} | body, False))
    error = caught.value
    assert (error.status, error.param, error.code) == (400, param, "head_not_found")
    assert error.message == "no head named 'nope' is loaded (loaded: mine)"
