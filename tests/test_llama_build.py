"""llama.cpp as setup.sh builds it runs on this CPU: no AMX kernels where they fault, a first decode of the
default target through plain llama-cpp-python and through our backend, and the load-time guard for builds
that do have them. The decodes run in a child process, so that a segfault fails the test instead of pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from diversed.backends.llama_cpp import amx_build, build_features, extra_buffers_safe
from diversed.cpu import cpu_flags
from diversed.models.default_pair import default_gguf_pair


def _in_child(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300)


def _default_target() -> Path:
    try:
        return default_gguf_pair()[1]
    except FileNotFoundError as error:
        pytest.skip(f"the default pair is not prepared here: {error}")


def test_the_build_has_no_amx_kernels_on_an_amx_cpu():
    if "amx_tile" not in cpu_flags():
        pytest.skip("this CPU has no AMX: the plain native build cannot hold AMX kernels")
    assert not amx_build(), "llama-cpp-python was built with AMX kernels: rerun ./setup.sh to rebuild it"


def test_the_build_s_instruction_sets_are_read_from_its_system_info():
    info = "CPU : SSE3 = 1 | AVX = 1 | AVX2 = 1 | AVX512 = 0 | AMX_INT8 = 1 | LLAMAFILE = 1 | REPACK = 1 | "
    assert build_features(info) == {"SSE3", "AVX", "AVX2", "AMX_INT8", "LLAMAFILE", "REPACK"}
    assert "AVX2" in build_features()  # every x86 CPU this project runs on has AVX2, and setup.sh builds natively


def test_the_guard_drops_extra_buffers_only_for_amx_kernels_under_a_hypervisor():
    assert extra_buffers_safe(has_amx_kernels=False, under_hypervisor=True)
    assert extra_buffers_safe(has_amx_kernels=True, under_hypervisor=False)
    assert extra_buffers_safe(has_amx_kernels=False, under_hypervisor=False)
    assert not extra_buffers_safe(has_amx_kernels=True, under_hypervisor=True)


@pytest.mark.slow
def test_plain_llama_cpp_python_completes_on_the_default_target():
    """What a llama-cpp-python user (and the benchmarks' plain baseline) runs: its first completion segfaulted
    on virtualized AMX CPUs with llama.cpp's native build."""
    result = _in_child(f"""
        import llama_cpp
        llm = llama_cpp.Llama(model_path={str(_default_target())!r}, n_ctx=256, n_threads=2, verbose=False)
        out = llm.create_completion("def reverse(s):", max_tokens=8, temperature=0)
        print(repr(out["choices"][0]["text"]), out["usage"]["completion_tokens"])
        """)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    text, count = result.stdout.strip().rsplit(" ", 1)
    assert int(count) > 0 and eval(text).strip()


@pytest.mark.slow
def test_a_batch_decode_through_the_backend_on_the_default_target():
    """Our backend's decode, several rows and widths at once (where llama.cpp's matrix kernels run)."""
    result = _in_child(f"""
        import warnings
        warnings.simplefilter("error")  # the guard's warning would mean this build has AMX kernels
        from diversed.backends.llama_cpp import LlamaCppModel
        model = LlamaCppModel({str(_default_target())!r}, context=512)
        _, logits = model.rows(3).feed([[9707, 11, 1879] * 8, [785, 3974], [16, 17]], 2)
        print(tuple(logits.shape[:2]), bool(logits.isfinite().all()), logits.shape[2] == model.vocab_size)
        """)
    assert result.returncode == 0, f"exit {result.returncode}: {result.stderr[-2000:]}"
    assert result.stdout.strip().splitlines()[-1] == "(3, 2) True True"
