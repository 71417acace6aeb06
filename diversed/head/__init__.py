"""The DIVERSED weight head and its training."""
