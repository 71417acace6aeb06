"""The machine a run was on, in one line for evaluation rows and benchmark tables: the CPU's model, its cores,
its widest vector instructions, whether it is virtualized, and what runs narrower than the CPU: a llama.cpp
without its AMX or AVX-512 kernels, torch's kernels forced narrower. Timings, llama.cpp's sampled texts and the
int8 draft depend on it (`python -m diversed.machine` prints it)."""

from __future__ import annotations

import os

from diversed.cpu import cpu_flags, cpuinfo_fields, virtualized

# From the widest down: the first the CPU has names its class (AVX-512 with AMX, AVX-512, AVX2). AVX-512 without
# VNNI is a class of its own: FBGEMM's int8 sums saturate there (diversed/models/quantize.py).
VECTOR_LEVELS = (("amx_int8", "AVX-512 + AMX"), ("avx512_vnni", "AVX-512"), ("avx512f", "AVX-512 without VNNI"),
                 ("avx2", "AVX2"))
# What makes torch's CPU kernels narrower than the CPU's (ATen's, FBGEMM's, oneDNN's, MKL's): runs standing in
# for a narrower CPU set them.
KERNEL_CHOICES = ("ATEN_CPU_CAPABILITY", "FBGEMM_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                  "MKL_ENABLE_INSTRUCTIONS")


def describe(cpuinfo: str | None = None) -> str:
    """'Intel(R) Xeon(R) Processor, 2 cores, AVX-512 + AMX, virtualized; llama.cpp without AMX kernels', say.
    Kernels narrower than the CPU's, chosen by hand, are named too: torch's forced by KERNEL_CHOICES, a llama.cpp
    built without AVX-512 on a CPU that has it (runs that stand in for an AVX2-only CPU)."""
    flags = cpu_flags(cpuinfo)
    level = next((name for flag, name in VECTOR_LEVELS if flag in flags), "no AVX2")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    parts = [cpuinfo_fields(cpuinfo).get("model name", "unknown CPU"), f"{cores} cores", level]
    if virtualized(cpuinfo):
        parts.append("virtualized")
    notes = [", ".join(parts), *_llama_cpp_build(flags)]
    if forced := [f"{name}={os.environ[name]}" for name in KERNEL_CHOICES if os.environ.get(name)]:
        notes.append(f"kernels forced by {', '.join(forced)}")
    return "; ".join(notes)


def _llama_cpp_build(flags: set[str]) -> list[str]:
    """What the llama.cpp in use leaves out of the CPU's widest instructions, asked only where the CPU has
    AVX-512: the one place a build can differ from the CPU."""
    if "avx512f" not in flags:
        return []
    try:  # only here: llama-cpp-python is optional
        from diversed.backends.llama_cpp import build_features
    except ImportError:
        return []
    built = build_features()
    notes = [f"llama.cpp {'with' if 'AMX_INT8' in built else 'without'} AMX kernels"] if "amx_int8" in flags else []
    return notes + ([] if "AVX512" in built else ["llama.cpp without AVX-512 kernels"])


if __name__ == "__main__":
    print(describe())
