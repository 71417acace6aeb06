"""diversed: relaxed speculative decoding with learned dynamic ensemble verification (arXiv 2604.07622).

generate() is text in, text out; decode() the same on token ids; Batch, Job and Policy the continuous batch
underneath (what `diversed serve` runs, diversed.server); verify() the rules as tensor functions."""

from diversed.decoding.engine import Batch, Job, decode
from diversed.decoding.method import Method
from diversed.decoding.policy import Policy
from diversed.generation import Completion, generate
from diversed.models.loading import Pair, load_pair
from diversed.verify import verify

__all__ = ["Batch", "Completion", "Job", "Method", "Pair", "Policy", "decode", "generate", "load_pair", "verify"]
