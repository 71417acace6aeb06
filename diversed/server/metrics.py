"""The server's Prometheus metrics (prometheus-client), named like vLLM's where vLLM has one, with the
verification rule as a label on the speculative counters: the rule's name, and for "diversed" the head's
(verification_label). A rule's parameters are left out of it: clients choose them freely, and a label per
value would grow the registry without bound.

Each server has its own registry, so several can live in one process (the tests start many)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from diversed.request import Verification

# Seconds: from a few milliseconds (a kept draft) to minutes (a long prompt behind a full batch).
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0)


class Metrics:
    """What /metrics exposes."""

    def __init__(self) -> None:
        self.registry = registry = CollectorRegistry()
        self.running = Gauge("diversed:num_requests_running", "Requests in the decoding batch.", registry=registry)
        self.waiting = Gauge("diversed:num_requests_waiting", "Requests queued for the batch.", registry=registry)
        self.requests = Counter("diversed:request_success",
                                "Finished requests, by finish reason (eos, stop, length, cancelled).",
                                ["finished_reason"], registry=registry)
        self.errors = Counter("diversed:request_errors", "Refused or failed requests, by HTTP status.", ["status"],
                              registry=registry)
        self.prompt_tokens = Counter("diversed:prompt_tokens", "Prompt tokens of admitted requests.",
                                     registry=registry)
        self.generation_tokens = Counter("diversed:generation_tokens", "Generated tokens.", registry=registry)
        self.prefix_cache_queries = Counter("diversed:prefix_cache_queries",
                                            "Prompt tokens looked up in the prompt cache.", registry=registry)
        self.prefix_cache_hits = Counter("diversed:prefix_cache_hits",
                                         "Prompt tokens the prompt cache held (not read again).", registry=registry)
        self.time_to_first_token = Histogram("diversed:time_to_first_token_seconds",
                                             "From arrival to the first generated token.",
                                             buckets=_LATENCY_BUCKETS, registry=registry)
        self.inter_token_latency = Histogram("diversed:inter_token_latency_seconds",
                                             "Between consecutive generated tokens of a request (the tokens of "
                                             "one round share its interval).", buckets=_LATENCY_BUCKETS,
                                             registry=registry)
        self.e2e_latency = Histogram("diversed:e2e_request_latency_seconds", "From arrival to the last token.",
                                     buckets=_LATENCY_BUCKETS, registry=registry)
        self.drafts = Counter("diversed:spec_decode_num_drafts", "Rounds that drafted (per request row).",
                              ["verification"], registry=registry)
        self.draft_tokens = Counter("diversed:spec_decode_num_draft_tokens", "Drafted tokens.", ["verification"],
                                    registry=registry)
        self.accepted_tokens = Counter("diversed:spec_decode_num_accepted_tokens", "Drafted tokens kept.",
                                       ["verification"], registry=registry)
        self.accepted_per_position = Counter("diversed:spec_decode_num_accepted_tokens_per_pos",
                                             "Drafted tokens kept, by position in the round (0 = first draft).",
                                             ["verification", "position"], registry=registry)
        self.drafter_tokens = Counter("diversed:spec_decode_num_draft_tokens_by_drafter",
                                      "Drafted tokens, by drafter (model, lookup, suffix).", ["drafter"],
                                      registry=registry)
        self.drafter_accepted = Counter("diversed:spec_decode_num_accepted_tokens_by_drafter",
                                        "Drafted tokens kept, by drafter.", ["drafter"], registry=registry)

    def record_rounds(self, verification: Verification, drafted: int, accepted: int, rounds: int, kept: list[int],
                      by_drafter: dict[str, list[int]]) -> None:
        """Add a finished request's speculative counters (SequenceStats: rounds that drafted, tokens drafted and
        kept, how many rounds kept each position, and drafted and kept per drafter)."""
        for name, (drafter_drafted, drafter_kept) in by_drafter.items():
            self.drafter_tokens.labels(name).inc(drafter_drafted)
            self.drafter_accepted.labels(name).inc(drafter_kept)
        label = verification_label(verification)
        self.drafts.labels(label).inc(rounds)
        self.draft_tokens.labels(label).inc(drafted)
        self.accepted_tokens.labels(label).inc(accepted)
        for position, count in enumerate(kept):
            self.accepted_per_position.labels(label, str(position)).inc(count)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def verification_label(verification: Verification) -> str:
    """'static' for static:0.7, 'diversed:gsm8k' for diversed:gsm8k@+1: a set as small as the rules and the
    heads the server loaded."""
    return f"diversed:{verification.head}" if verification.name == "diversed" else verification.name
