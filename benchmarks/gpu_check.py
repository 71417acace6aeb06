"""The decoding loop on a CUDA device: exactness and determinism there, then the per-forward costs of
models shaped like the default pair (random weights: no hub, nothing to download), for the speed model.

    python benchmarks/gpu_check.py            # prints PASS/FAIL lines and a cost table; exit 1 on a failure
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from diversed.backends.hf import TransformersModel
from diversed.decoding.engine import decode
from diversed.head.model import EnsembleHead, HeadConfig
from diversed.request import Drafting, Sampling, Verification

DEVICE = "cuda"
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16], [40]]


def model(seed: int, hidden: int, layers: int, vocab: int, dtype=torch.float32, heads: int = 4,
          intermediate: int | None = None) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=2,
                         max_position_embeddings=4096)
    return Qwen2ForCausalLM(config).to(DEVICE, dtype).eval()


def checks() -> list[tuple[str, bool]]:
    target = model(0, 128, 3, 500)
    target.lm_head.weight.data *= 8
    draft = Qwen2ForCausalLM(target.config).to(DEVICE).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.05 * torch.randn_like(p) * p.abs().mean())
    greedy = Sampling(0)
    plain = decode(target, PROMPTS, verification=Verification("plain"), sampling=greedy, max_new_tokens=32).tokens
    results = []
    for n in (1, 3, 5):
        spec = decode(target, PROMPTS, draft=draft, sampling=greedy, drafting=Drafting(n), max_new_tokens=32)
        results.append((f"greedy exact == target alone, N={n}, batch 4", spec.tokens == plain))
    alone = [decode(target, [p], draft=draft, sampling=greedy, max_new_tokens=32).tokens[0] for p in PROMPTS]
    results.append(("batch == one by one", alone == plain))
    kwargs = dict(draft=draft, sampling=Sampling(1.0), max_new_tokens=32, seed=5)
    exact = decode(target, PROMPTS, verification=Verification("exact"), **kwargs).tokens
    static = decode(target, PROMPTS, verification=Verification("static", weight=1.0), **kwargs).tokens
    results.append(("sampling: static w=1 == exact, same seed", exact == static))
    results.append(("sampling: same seed, same tokens", exact == decode(target, PROMPTS, **kwargs).tokens))
    head = EnsembleHead(HeadConfig(128, 128)).to(DEVICE)
    out = decode(target, PROMPTS, verification=Verification("dynamic"), head=head, **kwargs)
    results.append(("dynamic rule with a head on the GPU", all(len(t) == 32 for t in out.tokens)))
    return results


@torch.inference_mode()
def costs(dtype: torch.dtype) -> dict[str, float]:
    """Median ms of a draft step, a target step and a target pass over 6 tokens after a 200-token prompt."""
    # The shapes of Qwen2.5-0.5B and -1.5B.
    pair = {"draft": model(1, 896, 24, 151936, dtype, heads=14, intermediate=4864),
            "target": model(2, 1536, 28, 151936, dtype, heads=12, intermediate=8960)}
    prompt = torch.randint(0, 151936, (1, 200), device=DEVICE)
    result = {}
    for name, width in (("draft", 1), ("target", 1), ("target", 6)):
        state = TransformersModel(pair[name]).rows(1)
        state.feed(prompt.tolist(), 1)
        tokens = prompt[0, :width].tolist()
        times = []
        for _ in range(23):
            torch.cuda.synchronize()
            start = time.perf_counter()
            state.feed([tokens], width)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            state.truncate([200])
        result[f"{name} x{width}"] = 1e3 * statistics.median(times[3:])
    return result


def main() -> int:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    results = checks()
    for name, ok in results:
        print(("PASS" if ok else "FAIL"), name)
    for dtype in (torch.float32, torch.bfloat16):
        c = costs(dtype)
        step = c["target x1"]
        ratios = f"draft/target {c['draft x1'] / step:.2f}, verify6/target {c['target x6'] / step:.2f}"
        print(f"{dtype}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in c.items()) + "; " + ratios)
    return 0 if all(ok for _, ok in results) else 1


if __name__ == "__main__":
    sys.exit(main())
