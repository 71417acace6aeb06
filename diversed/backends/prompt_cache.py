"""A backend's prompt cache, engine-free: which token lists it keeps, which one a new prompt starts from, and
which goes when room runs out. Each backend subclass stores and frees an entry's KV its own way (`store`,
`release`): llama.cpp in cache sequences of its context, transformers in host-memory tensors.

Entries are the token lists of finished rows (llama-server's prompt cache, vLLM's prefix caching). A new row
starts from the entry sharing the longest prefix with its prompt; an entry that a new one extends goes (the
new one holds it), and beyond the budget (tokens, counted as if entries shared nothing) the least recently
used entry goes first; a pinned entry (an evaluation's shared few-shot prompt) goes only when forgotten. A
live row holds its own copy of what it took, so an entry may go at any time.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

import numpy as np

# The default bound of each model's prompt cache, MiB of KV memory (llama-server's --cache-ram, 8192 there for
# all its slots): llama.cpp allocates it with the context, so it is kept small; at most two contexts' worth of
# cells a row there.
DEFAULT_CACHE_MIB = 1024


class PromptCache:
    """Entries (key -> tokens, least recently used first) within `budget` tokens; subclasses keep their KV."""

    def __init__(self, budget: int) -> None:
        self.budget, self.held = budget, 0
        self.entries: OrderedDict[Hashable, list[int]] = OrderedDict()
        self.pinned: set[Hashable] = set()  # entries that neither an extension nor the budget drops

    def longest(self, tokens: Sequence[int]) -> tuple[Hashable | None, int]:
        """The entry holding the longest prefix of `tokens`, and its length (None, 0: none)."""
        best, length = None, 0
        for key, held in self.entries.items():
            if (n := common_prefix(held, tokens)) > length:
                best, length = key, n
        if best is not None:
            self.entries.move_to_end(best)
        return best, length

    def keep(self, tokens: Sequence[int], source: object) -> None:
        """Keep `tokens`, whose KV `source` holds (what `store` reads), unless an entry holds them already."""
        if not tokens or len(tokens) > self.budget:
            return
        for key, held in list(self.entries.items()):
            shared = common_prefix(held, tokens)
            if shared == len(tokens):  # held already
                self.entries.move_to_end(key)
                return
            if shared == len(held) and key not in self.pinned:  # the new entry holds this one and more
                self._drop(key)
        while not self.has_room(len(tokens)) and (unpinned := [k for k in self.entries if k not in self.pinned]):
            self._drop(unpinned[0])
        if self.has_room(len(tokens)):
            self.entries[self.store(source, len(tokens))] = list(tokens)
            self.held += len(tokens)

    def forget(self, keys: Iterable[Hashable]) -> None:
        """Drop these entries (and free their KV), pinned or not."""
        for key in list(keys):
            if key in self.entries:
                self.pinned.discard(key)
                self._drop(key)

    def has_room(self, count: int) -> bool:
        """Whether `count` more tokens fit."""
        return self.held + count <= self.budget

    def store(self, source: object, count: int) -> Hashable:
        """Copy the first `count` tokens' KV out of `source`; the new entry's key."""
        raise NotImplementedError

    def release(self, key: Hashable) -> None:
        """Free an entry's KV."""
        raise NotImplementedError

    def _drop(self, key: Hashable) -> None:
        self.held -= len(self.entries.pop(key))
        self.release(key)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    return int(np.argmin(np.asarray(a[:n]) == np.asarray(b[:n])))
