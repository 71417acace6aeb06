"""This CPU as /proc/cpuinfo describes it: its model name and its flags (instruction sets, and "hypervisor"
when it runs virtualized). Nothing is known where there is no /proc/cpuinfo (not Linux)."""

from __future__ import annotations

from pathlib import Path


def cpuinfo_fields(cpuinfo: str | None = None) -> dict[str, str]:
    """The fields of /proc/cpuinfo (`cpuinfo`: its text; default: read it) as name -> value: those of the last
    CPU listed, since a machine's CPUs are alike; empty where there is no /proc/cpuinfo."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    pairs = (line.split(":", 1) for line in cpuinfo.splitlines() if ":" in line)
    return {name.strip(): value.strip() for name, value in pairs}


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's flags: avx2, avx512f, amx_int8, hypervisor, ..."""
    return set(cpuinfo_fields(cpuinfo).get("flags", "").split())


def virtualized(cpuinfo: str | None = None) -> bool:
    """Whether the CPU runs under a hypervisor (its "hypervisor" flag)."""
    return "hypervisor" in cpu_flags(cpuinfo)
