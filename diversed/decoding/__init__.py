"""Drafting and the decoding loop."""
