"""Both backends behind the one interface, on tiny models: transformers on the model itself, llama.cpp on a
float32 GGUF of the same weights that the tests write (tiny.tiny_gguf)."""

import json

import pytest
import torch
from closed_forms import first_two_token_marginals

from diversed.backends.hf import TransformersModel
from diversed.backends.llama_cpp import QUANTIZATIONS as LLAMA_FTYPES
from diversed.backends.llama_cpp import LlamaCppModel
from diversed.cli import main
from diversed.decoding.drafters import make_drafter
from diversed.decoding.engine import Batch, Job, decode
from diversed.decoding.policy import Policy
from diversed.decoding.profile import PHASES
from diversed.models.loading import load_pair
from diversed.models.options import QUANTIZATIONS
from diversed.models.quantize import quantize_linears
from diversed.request import Drafting, Sampling, Verification

from tiny import perturbed, tiny_gguf, tiny_model

GREEDY = Sampling(temperature=0)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [40]]
# llama.cpp's logits depend a little on the shape of the batch they were computed in (its matmuls split rows
# differently); on these float32 tiny models a row computed in another batch shape, or after a rollback,
# differs by at most ~2e-3 from a fresh decode (measured), against logits of order 10.
LLAMA_ATOL = 1e-2


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gguf")
    target = tiny_model(0, layers=3)
    models = {"target": target, "close": perturbed(target, 0.05, 1), "unrelated": tiny_model(5, hidden=32),
              "small-vocab": tiny_model(1, vocab=50)}
    return {name: (model, tiny_gguf(model, folder / f"{name}.gguf")) for name, model in models.items()}


@pytest.fixture(scope="module", params=["transformers", "llama.cpp"])
def backend(request, files):
    """name -> the backend model of that name, and the tolerance of comparisons across batch shapes."""
    if request.param == "transformers":
        models = {name: TransformersModel(model) for name, (model, _) in files.items()}
        return models, 1e-4
    return {name: LlamaCppModel(path) for name, (_, path) in files.items()}, LLAMA_ATOL


def _fresh(model, tokens: list[int]) -> torch.Tensor:
    """The next-token logits after `tokens`, decoded from scratch in a batch of one."""
    return model.rows(1).feed([tokens], 1)[1][0, -1]


def test_rollbacks_leave_each_row_as_a_fresh_decode_of_its_kept_tokens(backend):
    """Feed ragged blocks, keep a random prefix of each row's new tokens, as rounds do; each row's next
    logits must then be those of a fresh decode of exactly its kept tokens."""
    models, atol = backend
    target = models["target"]
    generator = torch.Generator().manual_seed(0)
    rows, kept = target.rows(3), [[], [], []]
    for _ in range(6):
        blocks = [torch.randint(0, 97, (int(torch.randint(1, 5, (1,), generator=generator)),),
                                generator=generator).tolist() for _ in range(3)]
        rows.feed(blocks, 1)
        cut = [int(torch.randint(1, len(b) + 1, (1,), generator=generator)) for b in blocks]
        rows.truncate([len(k) + c for k, c in zip(kept, cut, strict=True)])
        for row in range(3):
            kept[row] += blocks[row][:cut[row]]
    assert rows.lengths == [len(k) for k in kept]
    _, logits = rows.feed([[3], [4], [5]], 1)
    for row in range(3):
        torch.testing.assert_close(logits[row, -1], _fresh(target, kept[row] + [3 + row]), atol=atol, rtol=0)


def test_rows_are_independent_and_select_and_extend_keep_them_so(backend):
    models, atol = backend
    target = models["target"]
    rows = target.rows(3)
    _, logits = rows.feed(PROMPTS[:3], 2)
    for row, prompt in enumerate(PROMPTS[:3]):
        torch.testing.assert_close(logits[row], target.rows(1).feed([prompt], 2)[1][0], atol=atol, rtol=0)
    rows.select([2, 0])
    rows.extend(1)
    assert rows.lengths == [len(PROMPTS[2]), len(PROMPTS[0]), 0]
    _, logits = rows.feed([[6], [6], PROMPTS[3]], 1)
    for row, tokens in enumerate([PROMPTS[2] + [6], PROMPTS[0] + [6], PROMPTS[3]]):
        torch.testing.assert_close(logits[row, -1], _fresh(target, tokens), atol=atol, rtol=0)


def test_jobs_joining_a_running_batch_write_what_they_write_alone(backend):
    """Continuous batching on each backend: rows added to a live batch (llama.cpp: sequence ids reserved up
    front), each with its own rule, leaving as they finish, equal their solo runs at T = 0."""
    models, _ = backend
    target, draft = models["target"], models["close"]
    verifications = [Verification("exact"), Verification("static", weight=0.5), Verification("plain"),
                     Verification("lossy", lenience=0.5)]
    batch = Batch(target, make_drafter("model", draft, capacity=3), drafting=Drafting(3), capacity=3)
    jobs = [Job(prompt, Policy(verification, GREEDY), max_new_tokens=10 + 4 * i)
            for i, (prompt, verification) in enumerate(zip(PROMPTS, verifications, strict=True))]
    waiting, rounds = list(jobs), 0
    while waiting or batch.jobs:
        if waiting and rounds % 2 == 0 and len(batch.jobs) < batch.capacity:
            batch.add(waiting.pop(0))
        batch.step()
        rounds += 1
    for job in jobs:
        alone = decode(target, [job.prompt], draft=draft, verification=job.policy.verification, sampling=GREEDY,
                       draft_length=3, max_new_tokens=job.max_new_tokens)
        assert job.tokens == alone.tokens[0]


def test_hidden_states_are_the_last_layer_after_the_final_norm(files):
    model, path = files["target"]
    hidden, logits = LlamaCppModel(path).rows(1).feed([PROMPTS[2]], 3, hidden=True)
    with torch.no_grad():
        out = model(torch.tensor([PROMPTS[2]]), output_hidden_states=True)
    torch.testing.assert_close(hidden[0], out.hidden_states[-1][0, -3:], atol=LLAMA_ATOL, rtol=0)
    torch.testing.assert_close(logits[0], out.logits[0, -3:], atol=LLAMA_ATOL, rtol=0)


@pytest.mark.parametrize("draft", ["close", "unrelated"])
@pytest.mark.parametrize("verification", [Verification("exact"), Verification("static", weight=0.5)])
def test_greedy_batches_with_rows_that_keep_different_counts(backend, draft, verification):
    """Exact writes the target's own greedy tokens; every rule's batch equals its rows run alone."""
    models, _ = backend
    target = models["target"]
    plain = decode(target, PROMPTS, verification=Verification("plain"), sampling=GREEDY, max_new_tokens=20)
    out = decode(target, PROMPTS, draft=models[draft], verification=verification, sampling=GREEDY, draft_length=4,
                 max_new_tokens=20)
    if verification.name == "exact":
        assert out.tokens == plain.tokens
    kept = {s.accepted for s in out.stats}
    assert len(kept) > 1 or draft == "unrelated"
    for prompt, tokens in zip(PROMPTS, out.tokens, strict=True):
        alone = decode(target, [prompt], draft=models[draft], verification=verification, sampling=GREEDY,
                       draft_length=4, max_new_tokens=20)
        assert alone.tokens[0] == tokens


def test_exact_sampling_on_llama_cpp_gives_the_target_distribution(tmp_path):
    """The statistical test of exactness, as on transformers: over 6,000 sequences sampled by exact speculative
    decoding on llama.cpp, the first token follows the target's p and the second its marginal
    sum_t1 p(t1) p(t2 | t1), which goes through the second draft's verdict, the correction after a first
    rejection (and the cache's rollback before the next round) and the bonus (total variation below 0.04; the
    sampling noise alone is about 0.015 here)."""
    target, draft = tiny_model(0, vocab=12, hidden=32), tiny_model(3, vocab=12, hidden=32)
    target.lm_head.weight.data /= 4
    p1, p2 = first_two_token_marginals(target, [1, 2, 3])
    llama_target = LlamaCppModel(tiny_gguf(target, tmp_path / "t.gguf"))
    llama_draft = LlamaCppModel(tiny_gguf(draft, tmp_path / "d.gguf"))
    tokens = []
    for seed in range(30):  # 200 rows a call: a llama.cpp context holds at most 256 sequences
        out = decode(llama_target, [[1, 2, 3]] * 200, draft=llama_draft, verification=Verification("exact"),
                     draft_length=2, max_new_tokens=3, seed=seed)
        tokens += [t[:2] for t in out.tokens]
    for position, expected in ((0, p1), (1, p2)):
        empirical = torch.bincount(torch.tensor(tokens)[:, position], minlength=12) / len(tokens)
        assert 0.5 * (empirical - expected).abs().sum() < 0.04


def test_dynamic_rule_gets_both_hidden_states_and_profile_splits_time(backend):
    models, _ = backend
    seen = []

    def weight_fn(h_draft, h_target):
        seen.append((h_draft.shape, h_target.shape))
        return torch.full(h_draft.shape[:2], 0.5)

    out = decode(models["target"], PROMPTS, draft=models["close"], verification=Verification("dynamic"),
                 head=weight_fn, sampling=Sampling(1.0), drafting=Drafting(3), max_new_tokens=8,
                 profile=True)
    assert seen[0] == ((4, 3, 64), (4, 3, 64))
    assert out.profile["draft"] > 0 and out.profile["head"] > 0
    assert sum(out.profile[phase] for phase in PHASES) == pytest.approx(out.profile["total"])


def test_different_vocabularies_are_refused(backend):
    models, _ = backend
    with pytest.raises(ValueError, match="different vocabularies"):
        decode(models["target"], PROMPTS, draft=models["small-vocab"])


def test_bad_gguf_files_get_clear_errors(files, tmp_path):
    _, good = files["target"]
    with pytest.raises(FileNotFoundError, match="not found"):
        LlamaCppModel(tmp_path / "absent.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(open(good, "rb").read()[:5000])
    with pytest.raises(ValueError, match="cannot load"):
        LlamaCppModel(truncated)
    text = tmp_path / "text.gguf"
    text.write_text("not a model")
    with pytest.raises(ValueError, match="cannot"):
        load_pair(str(text), good)
    with pytest.raises(ValueError, match="tokenizers differ"):
        load_pair(files["small-vocab"][1], good)
    with pytest.raises(ValueError, match=".gguf"):
        load_pair(str(tmp_path), good, backend="llama.cpp")
    with pytest.raises(ValueError, match="no CUDA GPU" if not torch.cuda.is_available() else "CPU"):
        load_pair(good, good, backend="llama.cpp", device="cuda")


def test_generate_command_on_gguf_files(files, capsys):
    _, target = files["target"]
    _, draft = files["close"]
    outputs = {}
    for verification in ("plain", "exact"):
        code = main(["generate", "--draft", draft, "--target", target, "--json", "--verification", verification,
                     "--temperature", "0", "--max-new-tokens", "12", "--no-chat", "hello world"])
        assert code == 0
        outputs[verification] = json.loads(capsys.readouterr().out)
    assert outputs["exact"]["text"] == outputs["plain"]["text"] and outputs["exact"]["new_tokens"] == 12


def test_hidden_states_on_change_no_row_of_the_logits(backend):
    """With hidden states asked for, llama.cpp outputs every token of the batch: each row's logits must still
    be its own (a regression: they were read by their rank among the flagged outputs)."""
    models, atol = backend
    target = models["target"]
    hidden_off = target.rows(3).feed(PROMPTS[:3], 2)[1]
    states, hidden_on = target.rows(3).feed(PROMPTS[:3], 2, hidden=True)
    torch.testing.assert_close(hidden_on, hidden_off, atol=atol, rtol=0)
    for row, prompt in enumerate(PROMPTS[:3]):
        alone = target.rows(1).feed([prompt], 2, hidden=True)[0][0]
        torch.testing.assert_close(states[row], alone, atol=atol, rtol=0)
    greedy = dict(sampling=GREEDY, draft_length=3, max_new_tokens=16)
    exact = decode(target, PROMPTS, draft=models["close"], verification=Verification("exact"), **greedy)
    ones = decode(target, PROMPTS, draft=models["close"], verification=Verification("dynamic"),
                  head=lambda h_draft, h_target: torch.ones(h_draft.shape[:2]), **greedy)
    assert ones.tokens == exact.tokens


def test_a_trace_keeps_what_a_teacher_forced_pass_gives(backend):
    """The trainer's Trace, fed by decode's on_round, keeps at every emitted token the hidden states, p(y),
    q(y) and TV(q, p) that the verifier saw: those of a fresh teacher-forced pass of both models over the text
    (bonus tokens, which no draft predicted: draft state zeros, q(y) = p(y), TV 0). Rows end at different
    lengths (EOS, the cap)."""
    from head_weights import score_completions

    from diversed.head.train import Trace
    from diversed.models.loading import Pair

    models, atol = backend
    target, draft = models["target"], models["close"]
    traces = [Trace(target.hidden_size, target.device) for _ in PROMPTS]
    out = decode(target, PROMPTS, draft=draft, verification=Verification("dynamic"), sampling=Sampling(1.0),
                 head=lambda h_d, h_t: torch.full(h_d.shape[:2], 0.3), drafting=Drafting(3),
                 max_new_tokens=11, eos_token_ids=[4], seed=2,
                 on_round=lambda i, result, row, count: traces[i].add(result, row, count))
    assert any(t[-1] == 4 for t in out.tokens)
    kept_all = [trace.tensors() for trace in traces]
    bonus = [kept[7].tolist() for kept in kept_all]
    scores = score_completions(Pair(draft, target, None, "d", "t"), PROMPTS, out.tokens, bonus, Sampling(1.0))
    h_d, h_t, p_y, q_y, tv, mask, scored = (scores.h_draft, scores.h_target, scores.p_y, scores.q_y, scores.tv,
                                            scores.mask, scores.scored)
    assert 0 < (mask & ~scored).sum() and len(set(map(len, out.tokens))) > 1  # bonus tokens; rows end apart
    for row, kept in enumerate(kept_all):
        scores = scored[row][mask[row]]
        n = len(out.tokens[row])
        assert all(len(part) == n for part in kept) and 0 < scores.sum()
        expected = (h_d[row, :n], h_t[row, :n], p_y[row, :n], q_y[row, :n], tv[row, :n])
        for name, mine, theirs in zip(("h_draft", "h_target", "p_y", "q_y", "tv"), kept[:5], expected, strict=True):
            torch.testing.assert_close(mine[scores], theirs[scores], atol=atol, rtol=1e-3, msg=name)
        torch.testing.assert_close(kept[1], h_t[row, :n], atol=atol, rtol=1e-3)
        torch.testing.assert_close(kept[2], p_y[row, :n], atol=atol, rtol=1e-3)
        assert (kept[0][~scores] == 0).all() and (kept[4][~scores] == 0).all()
        assert torch.equal(kept[3][~scores], kept[2][~scores])


def test_the_draft_quantizations_checked_before_loading_are_those_llama_cpp_makes():
    # loading.py checks --draft-quant without importing llama.cpp, so it keeps the names apart from their types.
    assert QUANTIZATIONS == tuple(LLAMA_FTYPES)


def test_on_a_cpu_a_row_computes_the_same_bits_alone_and_beside_holes():
    """With float16-weight linear layers (whose CPU kernel gives each row of a call what it gets alone), a
    row fed the same chunks gets bitwise the logits it gets alone, holes and all, because attention runs row
    by row. (Batched SDPA over the holes summed in another order on one of the project's CPUs and not on
    another: a control that depends on the CPU, so not asserted here.)"""
    model = quantize_linears(tiny_model(0, layers=2, hidden=64), "float16")
    target = TransformersModel(model)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 90, (n,), generator=generator).tolist() for n in (37, 11)]
    chunks = [[prompts[0], [5, 6, 7], [9, 10]], [prompts[1], [8], [11, 12]]]
    rows = target.rows(2)
    for step in range(2):
        rows.feed([c[step] for c in chunks], 1)
    rows.truncate([len(prompts[0]) + 1, len(prompts[1]) + 1])  # row 0 keeps 1 of 3: row 1 gets holes
    _, logits = rows.feed([c[2] for c in chunks], 2)
    same = []
    for row, (prompt, drafts, last) in enumerate(chunks):
        alone = target.rows(1)
        alone.feed([prompt], 1)
        alone.feed([drafts], 1)
        alone.truncate([len(prompt) + 1])
        same.append(torch.equal(logits[row], alone.feed([last], 2)[1][0]))
    assert same == [True, True]
