"""Models: loading a draft/target pair, the built-in default pair, GGUF conversion."""
