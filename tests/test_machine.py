"""diversed.cpu and diversed.machine: what /proc/cpuinfo says, and the one line that names the machine a run was
on."""

from pathlib import Path

import diversed.cpu as cpu
import diversed.machine as machine

AMD = "model name\t: AMD EPYC 7B13\nflags\t\t: fpu sse avx2 avx512f avx512_vnni hypervisor\n"
INTEL = "model name\t: Intel(R) Xeon(R) Processor\nflags\t\t: fpu avx2 avx512f amx_tile amx_int8 hypervisor\n"
OLD = "model name\t: Some CPU\nflags\t\t: fpu sse avx2\n"


def _natural_kernels(monkeypatch) -> None:
    for name in machine.KERNEL_CHOICES:
        monkeypatch.delenv(name, raising=False)


def test_the_line_names_the_cpu_its_widest_vectors_and_a_hypervisor(monkeypatch):
    import diversed.backends.llama_cpp as backend

    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(backend, "build_features", lambda: {"AVX2", "AVX512"})
    _natural_kernels(monkeypatch)
    assert machine.describe(AMD) == "AMD EPYC 7B13, 2 cores, AVX-512, virtualized"
    assert machine.describe(OLD) == "Some CPU, 2 cores, AVX2"
    skylake = "model name\t: Xeon\nflags\t\t: fpu avx2 avx512f\n"  # its int8 kernels saturate: the line says why
    assert machine.describe(skylake) == "Xeon, 2 cores, AVX-512 without VNNI"
    assert machine.describe("flags\t: fpu\n") == "unknown CPU, 2 cores, no AVX2"


def test_on_an_amx_cpu_the_line_says_whether_llama_cpp_has_amx_kernels(monkeypatch):
    import diversed.backends.llama_cpp as backend

    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {0, 1})
    _natural_kernels(monkeypatch)
    for built, words in (({"AVX512", "AMX_INT8"}, "with"), ({"AVX512"}, "without")):
        monkeypatch.setattr(backend, "build_features", lambda built=built: built)
        assert machine.describe(INTEL) == (f"Intel(R) Xeon(R) Processor, 2 cores, AVX-512 + AMX, virtualized; "
                                           f"llama.cpp {words} AMX kernels")


def test_kernels_narrower_than_the_cpu_are_named(monkeypatch):
    """Runs that stand in for an AVX2-only CPU on a wider one say so in their machine line."""
    import diversed.backends.llama_cpp as backend

    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(backend, "build_features", lambda: {"AVX", "AVX2", "FMA"})
    monkeypatch.setenv("FBGEMM_ENABLE_INSTRUCTIONS", "AVX2")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    assert machine.describe(AMD) == ("AMD EPYC 7B13, 2 cores, AVX-512, virtualized; llama.cpp without AVX-512 "
                                     "kernels; kernels forced by ATEN_CPU_CAPABILITY=avx2, "
                                     "FBGEMM_ENABLE_INSTRUCTIONS=AVX2")
    assert machine.describe(OLD) == ("Some CPU, 2 cores, AVX2; kernels forced by ATEN_CPU_CAPABILITY=avx2, "
                                     "FBGEMM_ENABLE_INSTRUCTIONS=AVX2")


def test_virtualized_reads_the_hypervisor_flag_alone():
    assert cpu.virtualized(AMD)
    assert not cpu.virtualized(OLD)
    assert not cpu.virtualized("model name\t: hypervisor-brand CPU\n" + OLD.split("\n", 1)[1])


def test_without_proc_cpuinfo_nothing_is_known(monkeypatch):
    def unreadable(path):
        raise FileNotFoundError(path)

    monkeypatch.setattr(Path, "read_text", unreadable)
    assert cpu.cpuinfo_fields() == {} and cpu.cpu_flags() == set() and not cpu.virtualized()
    monkeypatch.setattr(machine.os, "sched_getaffinity", lambda pid: {0, 1})
    _natural_kernels(monkeypatch)
    assert machine.describe() == "unknown CPU, 2 cores, no AVX2"
