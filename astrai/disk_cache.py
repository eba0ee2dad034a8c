"""Where astrai keeps what it builds for this machine, and what identifies this machine's CPU.

What it builds (the C attention kernels, the compiled forward) lives under ``$XDG_CACHE_HOME/astrai`` (by default
``~/.cache/astrai``), each entry under a key of everything its content depends on, this CPU among it: code built
with ``-march=native`` or by inductor for this CPU's vector width must never reach another CPU through a cache
shared between machines (a home on NFS, a copied image).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cache_dir(kind: str) -> Path:
    """The folder of one kind of cached build (not created here)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "astrai" / kind


def cpu_identity() -> str:
    """The architecture and, on Linux, the CPU's model and feature flags: what native code depends on."""
    identity = platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags", "Features")):
                identity += line
                if line.startswith(("flags", "Features")):
                    break
    except OSError:
        pass
    return identity
