"""diversed inside other serving engines: diversed.integrations.vllm puts our verification rules into vLLM."""
