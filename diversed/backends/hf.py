"""The transformers backend: any Hugging Face causal LM, on any device, in one batched KV cache.

Rows in a batch advance by different amounts. Rather than re-pack the cache, every call appends the same
number of slots to every row and marks the ones that hold no real token (left padding of a short row's
new tokens, rejected drafts a neighbour's longer run kept in the cache) as holes. Holes are masked out of
attention and skipped by the position ids, so each row sees exactly its own tokens at 0, 1, 2, ...

On a CPU, attention runs row by row over each row's own tokens (`row_attention`): batched attention over
holes sums in another order than the same row alone, and those last bits turned a near-tie into another
token, so a request's result depended on its company. Row by row, a row's attention is the same computation
alone and in any batch; the linear layers already are (CPU kernels give each row of a call what it gets
alone: diversed.models.quantize).

The prompt cache (diversed.backends.prompt_cache) keeps finished rows' keys and values in host memory, and a
joining row whose prompt begins with one of them gets them in slots that were holes for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.functional import scaled_dot_product_attention
from transformers import AttentionInterface, DynamicCache, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from diversed.backends.prompt_cache import DEFAULT_CACHE_MIB, PromptCache

ROW_ATTENTION = "diversed-rows"


class TransformersModel:
    """A frozen transformers causal LM behind the backend interface (diversed.backends.base.Model)."""

    backend = "transformers"
    pass_tile = 1  # not measured for its kernels: every width is weighed

    def __init__(self, model: PreTrainedModel, name: str = "", cache_mib: int = DEFAULT_CACHE_MIB) -> None:
        unsupported = _unsupported_feature(model.config)
        if unsupported:
            raise ValueError(f"{name or type(model).__name__} uses {unsupported}, which the decoding loop "
                             "does not support")
        self.model = model
        self.name = name or str(getattr(model.config, "name_or_path", "") or type(model).__name__)
        self.vocab_size = model.get_output_embeddings().out_features
        self.hidden_size = model.config.hidden_size
        self.context_length = getattr(model.config, "max_position_embeddings", None)
        configured = getattr(model.generation_config, "eos_token_id", None) if model.generation_config else None
        self.eos_token_ids = tuple(configured if isinstance(configured, list) else
                                   [] if configured is None else [configured])
        self.device = model.device
        if (self.device.type == "cpu" and model.config._attn_implementation in ("sdpa", "eager")
                and getattr(model, "_supports_attention_backend", False)):
            # One small attention call per row and layer: cheap next to a CPU's linear layers, not on a GPU.
            model.set_attn_implementation(ROW_ATTENTION)
        self.kv_bytes_per_token = _kv_bytes_per_token(model)
        budget = cache_mib * 2**20 // self.kv_bytes_per_token
        self.cache = TransformersPromptCache(budget) if budget else None

    def rows(self, count: int, capacity: int | None = None) -> TransformersRows:  # a cache grows as it needs
        return TransformersRows(self.model, torch.zeros(count, 0, dtype=torch.bool, device=self.device),
                                self.cache)


class TransformersRows:
    """A batch's DynamicCache; `valid` [B, L] marks the cache slots that hold real tokens, `tokens[r]` row r's."""

    def __init__(self, model: PreTrainedModel, valid: Tensor, prompt_cache: TransformersPromptCache | None = None
                 ) -> None:
        self.model, self.valid, self.cache, self.prompt_cache = model, valid, DynamicCache(), prompt_cache
        self.tokens: list[list[int]] = [[] for _ in range(len(valid))]

    @property
    def lengths(self) -> list[int]:
        return self.valid.sum(-1).tolist()

    def feed(self, tokens: Sequence[Sequence[int]], outputs: int, hidden: bool = False
             ) -> tuple[Tensor | None, Tensor]:
        width = max(len(t) for t in tokens)
        ids = torch.zeros(len(tokens), width, dtype=torch.long)
        valid = torch.zeros(len(tokens), width, dtype=torch.bool)
        for row, new in enumerate(tokens):  # left-padded with holes, so every row's outputs line up at the end
            ids[row, width - len(new):] = torch.as_tensor(new, dtype=torch.long)
            valid[row, width - len(new):] = True
        for held, new in zip(self.tokens, tokens, strict=True):
            held += new
        ids, valid = ids.to(self.valid.device), valid.to(self.valid.device)
        position_ids = (self.valid.sum(-1, keepdim=True) + valid.long().cumsum(-1) - 1).clamp_min(0)
        self.valid = torch.cat([self.valid, valid], dim=-1)
        # The layout only where attention reads it: on a GPU its per-row indexing would be work for nothing.
        layout = RowLayout.of(self.valid, width) if self.model.config._attn_implementation == ROW_ATTENTION else None
        out = self.model.base_model(input_ids=ids, attention_mask=self.valid.long(), position_ids=position_ids,
                                    cache=self.cache, use_cache=True, row_layout=layout)
        last = out.last_hidden_state[:, width - outputs:]
        # Only the requested slots are projected onto the vocabulary: most of a small model's step.
        return last, self.model.get_output_embeddings()(last).float()

    def truncate(self, lengths: Sequence[int]) -> None:
        for held, keep in zip(self.tokens, lengths, strict=True):
            del held[keep:]
        keep = torch.as_tensor(list(lengths), device=self.valid.device).unsqueeze(-1)
        self.valid &= self.valid.long().cumsum(-1) <= keep
        used = self.valid.any(0)
        cut = self.valid.shape[1] - (int(used.nonzero().max()) + 1 if used.any() else 0)
        if cut:  # trailing slots no row holds are cropped off the cache; the others stay as holes
            self.cache.crop(-cut)
            self.valid = self.valid[:, :-cut]

    def select(self, rows: Sequence[int]) -> None:
        if self.prompt_cache is not None:  # rows that leave offer what they hold to the prompt cache
            for row in sorted(set(range(len(self.tokens))) - set(rows)):
                self.prompt_cache.keep(self.tokens[row], self._row_kv(row))
        index = torch.as_tensor(list(rows), dtype=torch.long, device=self.valid.device)
        self.cache.batch_select_indices(index)
        self.valid = self.valid[index]
        self.tokens = [self.tokens[r] for r in rows]

    def reuse(self, row: int, prompt: Sequence[int]) -> int:
        """Give an empty row the longest prefix of `prompt` the prompt cache holds, less its last token (which
        the row's first feed reads, for its logits), in its first slots (holes for it until now); how many
        tokens the row now holds."""
        cache = self.prompt_cache
        key, n = (None, 0) if cache is None or self.tokens[row] else cache.longest(prompt[:-1])
        if not n:
            return 0
        held = cache.kv[key]
        if n > self.valid.shape[1]:  # the batch's slots are too few: more, holes for every row
            extra = n - self.valid.shape[1]
            for layer, (keys, values) in enumerate(held):
                shape = (len(self.valid), keys.shape[0], extra, keys.shape[-1])
                self.cache.update(keys.new_zeros(shape, device=self.valid.device),
                                  values.new_zeros(shape, device=self.valid.device), layer)
            self.valid = torch.cat([self.valid, self.valid.new_zeros(len(self.valid), extra)], dim=-1)
        for layer, (keys, values) in zip(self.cache.layers, held, strict=True):
            layer.keys[row, :, :n] = keys[:, :n].to(self.valid.device)
            layer.values[row, :, :n] = values[:, :n].to(self.valid.device)
        self.valid[row, :n] = True
        self.tokens[row] = list(prompt[:n])
        return n

    def _row_kv(self, row: int) -> Callable[[int], list[tuple[Tensor, Tensor]]]:
        """What the prompt cache stores of a row: its first `count` tokens' keys and values, per layer, in host
        memory ([kv heads, count, head size] each); read only if the cache keeps them."""
        slots = self.valid[row].nonzero().squeeze(-1)

        def first(count: int) -> list[tuple[Tensor, Tensor]]:
            return [(layer.keys[row][:, slots[:count]].cpu(), layer.values[row][:, slots[:count]].cpu())
                    for layer in self.cache.layers]
        return first

    def extend(self, count: int) -> None:
        if not len(self.valid):  # an emptied batch starts afresh (its cache would keep a batch size of 0)
            self.cache, self.valid = DynamicCache(), self.valid.new_zeros(0, 0)
        # New rows hold holes in every existing slot: zero keys and values that the mask hides.
        for layer in self.cache.layers:
            if getattr(layer, "keys", None) is not None and layer.keys.numel():
                layer.keys = torch.cat([layer.keys, layer.keys.new_zeros(count, *layer.keys.shape[1:])])
                layer.values = torch.cat([layer.values, layer.values.new_zeros(count, *layer.values.shape[1:])])
        self.valid = torch.cat([self.valid, self.valid.new_zeros(count, self.valid.shape[1])])
        self.tokens += [[] for _ in range(count)]


class TransformersPromptCache(PromptCache):
    """The prompt cache in host memory: each entry's keys and values per layer, [kv heads, tokens, head size],
    at most MOST_ENTRIES of them (every lookup reads each entry's tokens)."""

    MOST_ENTRIES = 32

    def __init__(self, budget: int) -> None:
        super().__init__(budget)
        self.kv: dict[int, list[tuple[Tensor, Tensor]]] = {}
        self._keys = itertools.count()

    def has_room(self, count: int) -> bool:
        return len(self.entries) < self.MOST_ENTRIES and super().has_room(count)

    def store(self, source: Callable[[int], list[tuple[Tensor, Tensor]]], count: int) -> int:
        key = next(self._keys)
        self.kv[key] = source(count)
        return key

    def release(self, key: int) -> None:
        del self.kv[key]


@dataclass(frozen=True)
class RowLayout:
    """Per row of a call: its cache slots that hold tokens (keys), its new tokens among the call's (queries),
    and which keys each of those sees (a causal mask ending at the row's last token)."""

    keys: list[Tensor]
    queries: list[Tensor]
    masks: list[Tensor]

    @staticmethod
    def of(valid: Tensor, width: int) -> RowLayout:
        keys = [row.nonzero().squeeze(-1) for row in valid]
        queries = [row[-width:].nonzero().squeeze(-1) for row in valid]
        masks = [torch.ones(len(q), len(k), dtype=torch.bool, device=valid.device).tril(len(k) - len(q))
                 for k, q in zip(keys, queries, strict=True)]
        return RowLayout(keys, queries, masks)


def row_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                  scaling: float | None = None, dropout: float = 0.0, row_layout: RowLayout | None = None,
                  **kwargs) -> tuple[Tensor, None]:
    """transformers' attention interface, one row at a time over its own tokens (the module docstring says
    why); query [B, heads, width, d], key and value [B, kv heads, slots, d]. Holes' outputs are zeros.
    Calls from elsewhere (transformers' own generate() on the same model) have no layout: batched SDPA."""
    if row_layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    out = query.new_zeros(*query.shape[:3], value.shape[-1])
    for row, (keys, queries, mask) in enumerate(zip(row_layout.keys, row_layout.queries, row_layout.masks,
                                                    strict=True)):
        if len(queries):
            out[row, :, queries] = scaled_dot_product_attention(
                query[row, :, queries].unsqueeze(0), key[row, :, keys].unsqueeze(0),
                value[row, :, keys].unsqueeze(0), attn_mask=mask, scale=scaling, enable_gqa=True)[0]
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ROW_ATTENTION, row_attention)
# The mask SDPA gets: what row_attention hands to SDPA when a call has no layout (transformers' generate()).
AttentionMaskInterface.register(ROW_ATTENTION, sdpa_mask)


def _kv_bytes_per_token(model: PreTrainedModel) -> int:
    """Bytes of keys and values one token takes over every layer, in the activations' dtype."""
    config = model.config
    heads = config.num_attention_heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    element = model.get_input_embeddings().weight.element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_size * element


def _unsupported_feature(config) -> str | None:
    """Features that the backend's own LM-head call or its cache holes would get silently wrong."""
    if getattr(config, "final_logit_softcapping", None):
        return "logit soft-capping"
    if getattr(config, "logit_scale", None) not in (None, 1, 1.0) or getattr(config, "logits_scaling", 1.0) != 1.0:
        return "logit scaling"
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "sliding-window attention"
    return None
