"""The CPU a benchmark ran on, as every benchmark names it: its model name and the flags that decide which kernels
run (AVX-512, AVX512-BF16, AMX), read from ``/proc/cpuinfo``. Stdlib only.

Figures from two CPUs are not comparable (oneDNN takes AMX on one and AVX-512 BF16 on the other), so every output
starts with this line, and ``docs/benchmarks.md`` keeps a section per CPU.
"""

from __future__ import annotations

from pathlib import Path

FLAGS = ("avx512f", "avx512_bf16", "amx_tile")


def cpu_name(cpuinfo: str | None = None) -> str:
    """``AMD EPYC, 2 CPUs (avx512f: yes, avx512_bf16: yes, amx_tile: no)``; ``?`` where ``/proc/cpuinfo`` is
    missing (not Linux)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "? (no /proc/cpuinfo)"
    lines = cpuinfo.splitlines()
    name = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    count = sum(line.startswith("processor") for line in lines)
    present = ", ".join(f"{flag}: {'yes' if flag in flags else 'no'}" for flag in FLAGS)
    return f"{name}, {count} CPUs ({present})"


if __name__ == "__main__":
    print(cpu_name())
