"""diversed: relaxed speculative decoding with learned dynamic ensemble verification (arXiv 2604.07622)."""

from diversed.decoding.engine import decode
from diversed.decoding.method import Method
from diversed.generation import Completion, generate
from diversed.models.loading import Pair, load_pair
from diversed.verify import verify

__all__ = ["Completion", "Method", "Pair", "decode", "generate", "load_pair", "verify"]
