"""Prompt lookup: the longest recent n-gram of a row's own text (prompt and output so far) that occurred
earlier in that text proposes what followed it there (Saxena's prompt lookup decoding; vLLM's n-gram drafter;
llama.cpp's ngram-simple). Free to run, and right where the answer copies its input: code edits, summaries,
quotations, a revised answer in a conversation."""

from __future__ import annotations

from collections.abc import Sequence

from diversed.decoding.drafters.base import LONGEST_MATCH, Candidate, CopyDrafter, match_class


class NgramIndex:
    """Where each n-gram (1 <= n <= longest) of a growing text last occurred with a token after it."""

    def __init__(self, longest: int = LONGEST_MATCH) -> None:
        self.longest = longest
        self.latest: dict[tuple[int, ...], int] = {}  # n-gram -> position of the token that followed it

    def extend(self, text: Sequence[int], start: int) -> None:
        """Index the n-grams that end right before each of text[start:]."""
        for i in range(max(start, 1), len(text)):
            for n in range(1, min(self.longest, i) + 1):
                self.latest[tuple(text[i - n:i])] = i

    def find(self, text: Sequence[int]) -> tuple[int, int] | None:
        """(where the continuation starts, n) for the longest suffix n-gram of text seen before; None if none."""
        for n in range(min(self.longest, len(text)), 0, -1):
            if (position := self.latest.get(tuple(text[-n:]))) is not None:
                return position, n
        return None


class LookupDrafter(CopyDrafter):
    """Prompt lookup over each row's own text. Once a row's text follows what it copied, it keeps copying from
    that place (`places`) as long as the text agrees with it, instead of looking up its latest n-gram again:
    in code, a short n-gram recurs, and its latest occurrence is often in the answer itself, not the place
    being copied."""

    name = "lookup"

    def __init__(self) -> None:
        self.indexes: list[NgramIndex] = []
        self.places: list[int | None] = []  # per row, where the copy under way continues
        self.starts: list[int] = []  # per row, where its latest candidate was copied from
        super().__init__()

    def _open(self, prompt: Sequence[int], prediction: Sequence[int] | None) -> list[int]:
        text = list(prompt)
        self.indexes.append(NgramIndex())
        self.indexes[-1].extend(text, 0)
        self.places.append(None)
        self.starts.append(0)
        return text

    def select(self, rows: Sequence[int]) -> None:
        self.indexes = [self.indexes[r] for r in rows]
        self.places = [self.places[r] for r in rows]
        self.starts = [self.starts[r] for r in rows]
        super().select(rows)

    def advance(self, emitted: Sequence[Sequence[int]]) -> None:
        for row, (last, written) in enumerate(zip(self.last, emitted, strict=True)):
            start, text = self.starts[row], self.texts[row]
            agrees = last is not None and text[start:start + len(written)] == list(written)
            self.places[row] = start + len(written) if agrees else None
        super().advance(emitted)

    def candidate(self, row: int, cap: int) -> Candidate | None:
        text, place = self.texts[row], self.places[row]
        if place is not None:
            start, n = place, LONGEST_MATCH
        elif (found := self.indexes[row].find(text)) is not None:
            start, n = found
        else:
            return None
        self.starts[row] = start
        bucket = self.bucket(row, (match_class(n), self.outcomes[row]))
        return Candidate(text[start:start + cap], bucket, self.acceptance.rate(bucket))

    def _append(self, row: int, tokens: Sequence[int]) -> None:
        start = len(self.texts[row])
        super()._append(row, tokens)
        self.indexes[row].extend(self.texts[row], start)
