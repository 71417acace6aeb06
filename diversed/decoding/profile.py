"""Where a decoding call's time goes: seconds per phase of the round, for `--profile` (the speed schedule times
its own: diversed.decoding.schedule.stopwatch)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# "draft" is the drafter's whole proposal (the draft model's forwards and sampling, a copy's search); "other"
# is whatever no phase covers: the loop's own Python, bookkeeping, stop strings.
PHASES = ("draft", "target forward", "sampling", "head", "verify", "cache", "other")


class PhaseClock:
    """Accumulates wall time per phase. With synchronize=True on a GPU it waits for the device around each
    phase, so that the times are the phases' own (slower, so only when they are needed); on a CPU every
    call is synchronous anyway."""

    def __init__(self, device: torch.device, synchronize: bool = False) -> None:
        self.seconds = dict.fromkeys(PHASES[:-1], 0.0)
        self.rounds = 0
        self._sync = synchronize and device.type == "cuda"
        self._device = device
        self._start = time.perf_counter()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._sync:
            torch.cuda.synchronize(self._device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._sync:
                torch.cuda.synchronize(self._device)
            self.seconds[name] += time.perf_counter() - start

    def report(self) -> dict[str, float]:
        """Seconds per phase (PHASES, "other" included), the total and the number of rounds."""
        total = time.perf_counter() - self._start
        return {**self.seconds, "other": max(total - sum(self.seconds.values()), 0.0), "total": total,
                "rounds": self.rounds}


def profile_table(profile: dict[str, float]) -> str:
    """A plain-text table of a profile: seconds, share of the total and milliseconds per round per phase."""
    rounds = max(int(profile["rounds"]), 1)
    lines = [f"{'phase':<16}{'seconds':>9}{'share':>8}{'ms/round':>10}"]
    for name in PHASES:
        seconds = profile[name]
        lines.append(f"{name:<16}{seconds:>9.3f}{seconds / profile['total']:>8.1%}{1000 * seconds / rounds:>10.1f}")
    lines.append(f"{'total':<16}{profile['total']:>9.3f}{1:>8.0%}{1000 * profile['total'] / rounds:>10.1f}"
                 f"   ({rounds} rounds)")
    return "\n".join(lines)
