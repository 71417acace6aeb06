"""The machine a run was on, in one line for evaluation rows and benchmark tables: the CPU's model, its cores,
its widest vector instructions, whether it is virtualized, and, on a CPU with AMX, whether the llama.cpp in use
has AMX kernels. Timings, and llama.cpp's sampled texts, depend on it (`python -m diversed.machine` prints it)."""

from __future__ import annotations

import os

from diversed.cpu import cpu_flags, cpuinfo_fields, virtualized

# From the widest down: the first the CPU has names its class (AVX-512 with AMX, AVX-512 alone, AVX2).
VECTOR_LEVELS = (("amx_int8", "AVX-512 + AMX"), ("avx512f", "AVX-512"), ("avx2", "AVX2"))


def describe(cpuinfo: str | None = None) -> str:
    """'Intel(R) Xeon(R) Processor, 2 cores, AVX-512 + AMX, virtualized; llama.cpp without AMX', say."""
    flags = cpu_flags(cpuinfo)
    level = next((name for flag, name in VECTOR_LEVELS if flag in flags), "no AVX2")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parts = [cpuinfo_fields(cpuinfo).get("model name", "unknown CPU"), f"{cores} cores", level]
    if virtualized(cpuinfo):
        parts.append("virtualized")
    line = ", ".join(parts)
    if "amx_int8" not in flags:  # the llama.cpp build can only matter where the CPU has AMX
        return line
    try:  # only here: llama-cpp-python is optional
        from diversed.backends.llama_cpp import amx_build
    except ImportError:
        return line
    return f"{line}; llama.cpp {'with' if amx_build() else 'without'} AMX kernels"


if __name__ == "__main__":
    print(describe())
