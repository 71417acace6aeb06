"""A suffix cache shared by every request of a process: the n-grams of the running rows' texts and of earlier
requests' outputs, each with where it occurred, so that a row's recent tokens find what followed them in any
of those texts (SuffixDecoding, Oliaro et al. 2024, with an index of n-grams in place of a suffix tree). The
drafter proposes the most frequent continuation, token by token, and its empirical frequency is the
proposal's confidence. Memory is bounded: past `max_tokens` held, the oldest finished outputs are forgotten.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence

from diversed.decoding.drafters.base import LONGEST_MATCH, Candidate, CopyDrafter, DrafterSetup, match_class

MAX_OCCURRENCES = 16  # occurrences kept per n-gram, the most recent: enough to tell a majority
MAJORITY = 0.5  # a continuation stops where no next token follows more than this share of its occurrences


class SuffixCache:
    """Texts by id and, per n-gram, its most recent occurrences (text id, position of the token after it).

    A running row's text is a document that grows; when the row finishes (`finish`), its prompt is forgotten
    and its output kept, as an earlier request's output. Thread-safe: a server's engine thread writes it while
    another process-wide user may read it."""

    def __init__(self, max_tokens: int = 200_000, longest: int = LONGEST_MATCH) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens, self.longest = max_tokens, longest
        self.texts: OrderedDict[int, list[int]] = OrderedDict()  # oldest first
        self.starts: dict[int, int] = {}  # a text's first indexed position (a finished row's output start)
        self.occurrences: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        self.finished: set[int] = set()
        self.held = 0
        self._next_id = 0
        self._lock = threading.Lock()

    def open(self, prompt: Sequence[int]) -> int:
        """A new text (a row's), beginning with its prompt; returns its id."""
        with self._lock:
            text_id, self._next_id = self._next_id, self._next_id + 1
            self.texts[text_id], self.starts[text_id] = [], 0
        self.extend(text_id, prompt)
        return text_id

    def extend(self, text_id: int, tokens: Sequence[int]) -> None:
        with self._lock:
            text = self.texts[text_id]
            start = len(text)
            text.extend(tokens)
            for i in range(max(start, self.starts[text_id] + 1), len(text)):
                for n in range(1, min(self.longest, i - self.starts[text_id]) + 1):
                    places = self.occurrences.setdefault(tuple(text[i - n:i]), [])
                    places.append((text_id, i))
                    if len(places) > MAX_OCCURRENCES:
                        del places[0]
            self.held += len(tokens)
            self._evict()

    def finish(self, text_id: int, output_start: int) -> None:
        """A row is done: keep what it wrote from output_start on, for later requests."""
        with self._lock:
            self._unindex(text_id, self.starts[text_id], output_start)
            self.held -= output_start - self.starts[text_id]
            self.starts[text_id] = output_start
            self.finished.add(text_id)
            self.texts.move_to_end(text_id)

    def continuation(self, text: Sequence[int], cap: int) -> tuple[list[int], int, float] | None:
        """For the longest suffix n-gram of `text` seen in the cache: its most frequent continuation (up to cap
        tokens, each followed by more than half of the occurrences still agreeing), n, and the continuation's
        frequency (the product of each token's share). None if no suffix n-gram was seen."""
        with self._lock:
            for n in range(min(self.longest, len(text)), 0, -1):
                places = self.occurrences.get(tuple(text[-n:]))
                if places:
                    tokens, frequency = self._follow(list(places), cap)
                    return tokens, n, frequency
        return None

    def _follow(self, places: list[tuple[int, int]], cap: int) -> tuple[list[int], float]:
        tokens, frequency = [], 1.0
        while len(tokens) < cap:
            nexts = Counter(self.texts[t][i] for t, i in places if i < len(self.texts[t]))
            if not nexts:
                break
            token, count = nexts.most_common(1)[0]
            share = count / sum(nexts.values())
            if tokens and share <= MAJORITY:
                break
            tokens.append(token)
            frequency *= share
            places = [(t, i + 1) for t, i in places if i < len(self.texts[t]) and self.texts[t][i] == token]
        return tokens, frequency

    def _unindex(self, text_id: int, start: int, end: int) -> None:
        """Forget the occurrences whose n-gram starts in text[start:end]."""
        text = self.texts[text_id]
        for i in range(start + 1, min(end + self.longest, len(text))):
            for n in range(max(1, i - end + 1), min(self.longest, i - start) + 1):  # n-grams from before end
                key = tuple(text[i - n:i])
                places = self.occurrences.get(key)
                if places is not None:
                    places[:] = [place for place in places if place != (text_id, i)]
                    if not places:
                        del self.occurrences[key]

    def _evict(self) -> None:
        while self.held > self.max_tokens:
            oldest = next((t for t in self.texts if t in self.finished), None)
            if oldest is None:  # only running rows: they stay, whatever they hold
                return
            self._unindex(oldest, self.starts[oldest], len(self.texts[oldest]))
            self.held -= len(self.texts[oldest]) - self.starts[oldest]
            del self.texts[oldest], self.starts[oldest]
            self.finished.discard(oldest)


class SuffixDrafter(CopyDrafter):
    """The most frequent continuation in a SuffixCache (shared with other drafters and requests) of each row's
    recent tokens."""

    name = "suffix"

    def __init__(self, cache: SuffixCache) -> None:
        self.cache = cache
        self.ids: list[int] = []
        self.prompt_lengths: list[int] = []
        super().__init__()

    @classmethod
    def build(cls, setup: DrafterSetup) -> SuffixDrafter:
        return cls(setup.cache if setup.cache is not None else SuffixCache())

    def _open(self, prompt: Sequence[int], prediction: Sequence[int] | None) -> list[int]:
        self.ids.append(self.cache.open(prompt))
        self.prompt_lengths.append(len(prompt))
        return self.cache.texts[self.ids[-1]]  # the cache's own list: one copy of the text

    def select(self, rows: Sequence[int]) -> None:
        for row in set(range(len(self.ids))) - set(rows):
            self.cache.finish(self.ids[row], self.prompt_lengths[row])
        self.ids = [self.ids[r] for r in rows]
        self.prompt_lengths = [self.prompt_lengths[r] for r in rows]
        super().select(rows)

    def candidate(self, row: int, cap: int) -> Candidate | None:
        found = self.cache.continuation(self.texts[row], cap)
        if found is None or not found[0]:
            return None
        tokens, n, frequency = found
        bucket = self.bucket(row, (match_class(n), "agreed" if frequency == 1.0 else "split", self.outcomes[row]))
        return Candidate(tokens, bucket, self.acceptance.rate(bucket))

    def _append(self, row: int, tokens: Sequence[int]) -> None:
        self.cache.extend(self.ids[row], tokens)  # grows self.texts[row] too
