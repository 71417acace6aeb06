"""The llama.cpp backend: GGUF models on the CPU through llama-cpp-python's low-level API.

One llama.cpp context per model; the rows of a batch are sequence ids of that context, each with its own
positions and its own KV stream. Several batches may be live at once (a loop's and a fresh check's): each
takes its sequence ids from the context's free ones and gives them back when it is dropped.

A feed is one `llama_decode` over every row's new tokens, asking for logits only at the positions the loop
reads (the batch's `logits` flags), never the whole prompt. When the DIVERSED head needs hidden states,
embeddings are turned on for that decode (pooling none): llama.cpp then returns the last hidden state after
the final norm, the quantity the head was trained on with transformers, alongside the logits of the same
positions. With embeddings on llama.cpp outputs every token of the batch, so the tokens before the outputs
(a prompt) go through first in a decode of their own, with embeddings off. Rollback is
`llama_memory_seq_rm` from the kept length on.

The high-level `llama_cpp.Llama` class is not used: it keeps per-position scores only with logits_all=True,
which projects every prompt token onto the vocabulary.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import warnings
import weakref
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import llama_cpp as llama
import numpy as np
import torch
from torch import Tensor

from diversed.backends.prompt_cache import DEFAULT_CACHE_MIB, PromptCache
from diversed.cpu import virtualized

# Positions each row may hold unless asked otherwise: a long prompt and 512 new tokens fit with room.
DEFAULT_CONTEXT = 4096

# llama.cpp logs every load to stderr. We keep its last lines instead, to explain our own errors.
_LOG: deque[str] = deque(maxlen=12)


def _keep_log(level: int, text: bytes, data: ctypes.c_void_p) -> None:
    _LOG.append(text.decode(errors="replace"))


def _last_log() -> str:
    """What llama.cpp said last, on one line."""
    return " ".join("".join(_LOG).split())[-600:]


_LOG_CALLBACK = llama.llama_log_callback(_keep_log)  # kept referenced: llama.cpp holds a raw pointer to it
llama.llama_log_set(_LOG_CALLBACK, ctypes.c_void_p(0))
llama.llama_backend_init()


def _free(model, held: list) -> None:
    """Free a model's context (held[0], if any) and weights (a finalizer: it runs at garbage collection or
    at exit, while the llama_cpp module is still loaded)."""
    if held[0]:
        llama.llama_free(held[0])
    llama.llama_model_free(model)


def build_features(info: str | None = None) -> set[str]:
    """The instruction sets this llama.cpp was compiled for, as it names them: AVX2, AVX512, AMX_INT8, ...
    (`info`: its system info line, "CPU : SSE3 = 1 | AVX = 1 | ..."; default: this build's)."""
    if info is None:
        info = llama.llama_print_system_info().decode(errors="replace")
    return {name.rsplit(":", 1)[-1].strip() for name, _, value in (item.partition("=") for item in info.split("|"))
            if value.strip() == "1"}


def amx_build() -> bool:
    """Whether this llama.cpp was compiled with its AMX matrix kernels (a native build on an AMX CPU)."""
    return "AMX_INT8" in build_features()


def extra_buffers_safe(has_amx_kernels: bool, under_hypervisor: bool) -> bool:
    """Whether llama.cpp may use its extra buffer types (AMX and repacked weights). Its AMX kernels segfault
    on the first decode on virtualized AMX CPUs (ggml-org/llama.cpp issue 20824); there the extra buffers go
    (both: llama.cpp has no switch for AMX alone), at the cost of the repacked weights' speed. setup.sh builds
    llama.cpp without AMX on such CPUs, which keeps the repacked weights: this guards other builds."""
    return not (has_amx_kernels and under_hypervisor)


def default_threads() -> int:
    """The cores this process may use: both models run in turn, each on all of them."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class LlamaCppModel:
    """A GGUF model behind the backend interface (diversed.backends.base.Model).

    context: positions per row. threads: llama.cpp's threads (default: every core of the process).
    extra_buffers: llama.cpp's extra buffer types (repacked weights, AMX), its `use_extra_bufts` (default:
    on, unless this build's AMX kernels would fault here: extra_buffers_safe). cache_mib: the prompt cache's
    bound in MiB of keys and values, in host memory (LlamaCppPromptCache; 0: none)."""

    backend = "llama.cpp"
    # On a CPU llama.cpp's matrix kernels take a pass's tokens 16 at a time and the rest more slowly: a pass over
    # 16 tokens costs less than one over 15 (widths 1-65 timed: benchmarks/results/whole-file-edits.md).
    pass_tile = 16

    def __init__(self, path: str | Path, name: str = "", *, context: int = DEFAULT_CONTEXT,
                 threads: int | None = None, extra_buffers: bool | None = None,
                 cache_mib: int = DEFAULT_CACHE_MIB) -> None:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if cache_mib < 0:
            raise ValueError(f"cache_mib must be >= 0 (0: no prompt cache), got {cache_mib}")
        params = llama.llama_model_default_params()
        params.n_gpu_layers = 0
        if extra_buffers is None:
            extra_buffers = extra_buffers_safe(amx_build(), virtualized())
            if not extra_buffers:
                warnings.warn("this llama.cpp was built with AMX kernels, which segfault on virtualized CPUs: "
                              "loading without them or repacked weights (slower); ./setup.sh builds llama.cpp "
                              "without AMX", RuntimeWarning, stacklevel=2)
        params.use_extra_bufts = extra_buffers
        self._model = llama.llama_model_load_from_file(str(path).encode(), params)
        if not self._model:
            raise ValueError(f"llama.cpp cannot load {path}: not a complete GGUF model it supports "
                             f"(llama.cpp: {_last_log()})")
        vocab = llama.llama_model_get_vocab(self._model)
        self.path, self.name = path, name or path.stem
        self.vocab_size = llama.llama_vocab_n_tokens(vocab)
        self.hidden_size = llama.llama_model_n_embd(self._model)
        self.context_length = min(context, llama.llama_model_n_ctx_train(self._model))
        special = (llama.llama_vocab_eos(vocab), llama.llama_vocab_eot(vocab))
        self.eos_token_ids = tuple(sorted({t for t in special if t >= 0}))
        self.device = torch.device("cpu")
        self.threads = threads or default_threads()
        n_head = llama.llama_model_n_head(self._model)
        # f16 keys and values (llama.cpp's default cache type) of every layer's KV heads
        self.kv_bytes_per_token = (2 * 2 * llama.llama_model_n_layer(self._model)
                                   * llama.llama_model_n_head_kv(self._model) * self.hidden_size // max(n_head, 1))
        budget = cache_mib * 2**20 // self.kv_bytes_per_token
        self.cache = LlamaCppPromptCache(budget) if budget else None
        # What this model's measured speed depends on (diversed.decoding.schedule keeps costs by it): the file as
        # loaded, and the threads.
        stat = path.stat()
        self.cost_identity = f"llama.cpp:{path.resolve()}:{stat.st_size}:{int(stat.st_mtime)}:threads={self.threads}"
        self._context, self._capacity, self._free_seqs = None, 0, []
        self._live: weakref.WeakSet[LlamaCppRows] = weakref.WeakSet()
        self._held = [None]  # the context the finalizer frees with the model: never one already freed
        weakref.finalize(self, _free, self._model, self._held)

    def rows(self, count: int, capacity: int | None = None) -> LlamaCppRows:
        """An empty batch of `count` rows, on free sequence ids of the model's context; a context with room
        for `capacity` rows is made first when the present one has too few free and no other batch is live."""
        rows = LlamaCppRows(self, self._take(count, max(count, capacity or 0)))
        self._live.add(rows)
        return rows

    def _take(self, count: int, room: int = 0) -> list[int]:
        """`count` free sequence ids, emptied; with no batch live, a context with `room` free ones first."""
        limit = llama.llama_max_parallel_sequences()
        if max(count, room) > limit:
            raise ValueError(f"llama.cpp decodes at most {limit} rows together, got {max(count, room)}: use "
                             "smaller batches")
        if max(count, room) > len(self._free_seqs) and not self._live:
            self._new_context(min(max(count, room, 4, 2 * self._capacity), limit))
        if count > len(self._free_seqs):
            raise RuntimeError(f"{self.name}'s context has {len(self._free_seqs)} free rows of "
                               f"{self._capacity} and {count} were asked for while other batches are live")
        taken, self._free_seqs = self._free_seqs[:count], self._free_seqs[count:]
        return taken

    def _give_back(self, seqs: list[int], tokens: list[list[int]], context) -> None:
        """Offer what these sequence ids hold (`tokens`, one list each) to the prompt cache, empty them and return
        them to the free ones (if they belong to the live context)."""
        if context is self._context and context:
            for seq, held in zip(seqs, tokens, strict=True):
                if self.cache is not None:
                    self.cache.keep(held, (context, seq))
                llama.llama_memory_seq_rm(self._memory, seq, -1, -1)
            self._free_seqs += seqs

    def _new_context(self, sequences: int) -> None:
        if self._context:
            self._held[0] = None
            llama.llama_free(self._context)
            self._context = None
        params = llama.llama_context_default_params()
        params.n_seq_max = sequences
        params.n_ctx = self.context_length * sequences
        params.n_batch = params.n_ctx  # a whole batch of prompts is one decode call
        params.n_threads = params.n_threads_batch = self.threads
        params.pooling_type = llama.LLAMA_POOLING_TYPE_NONE
        # One KV buffer for every row, as llama-server's default: with a buffer per row llama.cpp splits a decode
        # into one pass per run of consecutive sequence ids, and the rows of a batch that jobs join and leave
        # are seldom consecutive. A row attends over its own tokens only either way (the mask).
        params.kv_unified = True
        params.embeddings = False
        self._context = llama.llama_init_from_model(self._model, params)
        if not self._context:
            raise RuntimeError(f"llama.cpp could not create a context of {sequences} x {self.context_length} "
                               f"positions for {self.name} (out of memory?)")
        self._capacity, self._memory, self._embeddings = sequences, llama.llama_get_memory(self._context), False
        self._free_seqs = list(range(sequences))
        self._held[0] = self._context

    def _decode(self, rows: Sequence[tuple[int, int, Sequence[int]]], outputs: int, hidden: bool
                ) -> tuple[Tensor | None, Tensor]:
        """One llama_decode over (sequence id, first position, tokens) per row; logits (and hidden states)
        of each row's last `outputs` tokens, [B, outputs, ...]."""
        total = sum(len(tokens) for _, _, tokens in rows)
        batch = llama.llama_batch_init(total, 0, 1)
        try:
            i, flagged = 0, []
            for seq, start, tokens in rows:
                first_output = len(tokens) - outputs
                for j, token in enumerate(tokens):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + j, 1
                    batch.seq_id[i][0] = seq
                    batch.logits[i] = j >= first_output
                    if j >= first_output:
                        flagged.append(i)
                    i += 1
            batch.n_tokens = total
            if hidden != self._embeddings:
                llama.llama_set_embeddings(self._context, hidden)
                self._embeddings = hidden
            status = llama.llama_decode(self._context, batch)
            if status != 0:
                raise RuntimeError(f"llama_decode failed on {self.name} with status {status} "
                                   f"({total} tokens over {len(rows)} rows; llama.cpp: {_last_log()})")
        finally:
            llama.llama_batch_free(batch)
        shape = (len(rows), outputs)
        if not outputs:  # a decode that only fills the KV cache
            return None, torch.empty(*shape, self.vocab_size)
        logits = _outputs(llama.llama_get_logits_ith, self._context, flagged, shape, self.vocab_size)
        states = (_outputs(llama.llama_get_embeddings_ith, self._context, flagged, shape, self.hidden_size)
                  if hidden else None)
        return states, logits

class LlamaCppRows:
    """A batch of rows of one LlamaCppModel: row r is sequence id `seq[r]` of the model's context, holding the
    tokens `tokens[r]`."""

    def __init__(self, model: LlamaCppModel, seqs: list[int]) -> None:
        self.model, self.seq, self.tokens = model, seqs, [[] for _ in seqs]
        # The sequence ids go back to the model when the batch is dropped (both lists are edited in place).
        weakref.finalize(self, model._give_back, self.seq, self.tokens, model._context)

    @property
    def lengths(self) -> list[int]:
        return [len(t) for t in self.tokens]

    def reuse(self, row: int, prompt: Sequence[int]) -> int:
        """Give an empty row the longest prefix of `prompt` the prompt cache holds, less its last token (which
        the row's first feed reads, for its logits); how many tokens the row now holds."""
        cache = self.model.cache
        key, n = (None, 0) if cache is None or self.tokens[row] else cache.longest(prompt[:-1])
        if not n or not cache.load(key, self.model._context, self.seq[row]):
            return 0
        llama.llama_memory_seq_rm(self.model._memory, self.seq[row], n, -1)  # the shared prefix only
        self.tokens[row] = list(prompt[:n])
        return n

    def feed(self, tokens: Sequence[Sequence[int]], outputs: int, hidden: bool = False
             ) -> tuple[Tensor | None, Tensor]:
        if hidden and any(len(t) > outputs for t in tokens):
            # With embeddings on, llama.cpp outputs (projects onto the vocabulary) every token of a batch: the
            # tokens before the outputs (a prompt, mostly) go first, in a decode with embeddings off.
            before = [t[:len(t) - outputs] for t in tokens]
            self.model._decode([(seq, len(held), b) for seq, held, b in zip(self.seq, self.tokens, before,
                                                                             strict=True) if b], 0, False)
            for held, b in zip(self.tokens, before, strict=True):
                held += b
            tokens = [t[len(t) - outputs:] for t in tokens]
        out = self.model._decode([(seq, len(held), t) for seq, held, t in zip(self.seq, self.tokens, tokens,
                                                                                 strict=True)], outputs, hidden)
        for held, t in zip(self.tokens, tokens, strict=True):
            held += t
        return out

    def truncate(self, lengths: Sequence[int]) -> None:
        for seq, held, keep in zip(self.seq, self.tokens, lengths, strict=True):
            if keep < len(held):
                llama.llama_memory_seq_rm(self.model._memory, seq, keep, -1)
                del held[keep:]

    def select(self, rows: Sequence[int]) -> None:
        kept = set(rows)
        dropped = [(seq, held) for row, (seq, held) in enumerate(zip(self.seq, self.tokens, strict=True))
                   if row not in kept]
        self.seq[:] = [self.seq[r] for r in rows]
        self.tokens[:] = [self.tokens[r] for r in rows]
        self.model._give_back([seq for seq, _ in dropped], [held for _, held in dropped], self.model._context)

    def extend(self, count: int) -> None:
        self.seq += self.model._take(count)
        self.tokens += [[] for _ in range(count)]


class LlamaCppPromptCache(PromptCache):
    """The prompt cache in host memory: an entry is a finished row's sequence state (`llama_state_seq_get_data`:
    its cells' keys and values), which a joining row loads into its own sequence and cuts to the prefix it
    shares. Not in the context's KV buffer: every pass attends over each cell of the buffer's used span, masked
    or not, so cached prompts kept there would slow every live row. States outlive the context they came from
    (the same model reads them into the next)."""

    def __init__(self, budget: int) -> None:
        super().__init__(budget)
        self.states: dict[int, ctypes.Array] = {}
        self._keys = itertools.count()

    def store(self, source: tuple, count: int) -> int:
        context, seq = source  # a sequence holding exactly the entry's tokens
        size = llama.llama_state_seq_get_size(context, seq)
        state = (ctypes.c_uint8 * size)()
        llama.llama_state_seq_get_data(context, state, size, seq)
        key = next(self._keys)
        self.states[key] = state
        return key

    def release(self, key: int) -> None:
        del self.states[key]

    def load(self, key: int, context, seq: int) -> bool:
        """Put an entry's cells in sequence `seq` (empty) of `context`; False where llama.cpp finds no room for
        them in one run of free cells (the row then reads its prompt whole)."""
        state = self.states[key]
        return llama.llama_state_seq_set_data(context, state, len(state), seq) > 0


# Cheaper weights for a draft (llama.cpp's own quantizer): a draft's precision changes how often its tokens are
# accepted, never what lossless verification writes.
QUANTIZATIONS = {"Q3_K_S": llama.LLAMA_FTYPE_MOSTLY_Q3_K_S, "Q2_K": llama.LLAMA_FTYPE_MOSTLY_Q2_K}


def requantize(source: Path, dest: Path, kind: str) -> Path:
    """Write `source` GGUF requantized to `kind` (one of QUANTIZATIONS) as `dest`, which appears only once
    complete (written beside it, then renamed)."""
    if kind not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {tuple(QUANTIZATIONS)}, got {kind!r}")
    params = llama.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = QUANTIZATIONS[kind], True, default_threads()
    partial = dest.with_name(dest.name + ".partial")
    if llama.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
        partial.unlink(missing_ok=True)
        raise ValueError(f"llama.cpp could not requantize {source} to {kind} (llama.cpp: {_last_log()})")
    partial.replace(dest)
    return dest


def _outputs(get, context, indices: list[int], shape: tuple[int, int], width: int) -> Tensor:
    """[*shape, width] float32 for the batch positions `indices`, copied out of the buffers llama.cpp owns
    (and overwrites at the next decode). By batch position: with embeddings on (pooling none) llama.cpp
    outputs every token of the batch, flagged or not, so neither llama_get_logits' base pointer nor an
    index counted among the flagged outputs points at the right row; the batch position always does."""
    block = np.empty((len(indices), width), dtype=np.float32)
    for row, index in enumerate(indices):
        block[row] = np.ctypeslib.as_array(get(context, index), shape=(width,))
    return torch.from_numpy(block).view(*shape, width)
