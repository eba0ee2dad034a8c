"""Builds astrai's C kernels (``kernels/*.c``) for this machine, once, with the system's C compiler.

They are plain C, no PyTorch headers: ``gcc`` builds each in about a second, into ``~/.cache/astrai/kernels`` under
a name that hashes the source, the flags and this CPU's model and flags (``-march=native``; ``disk_cache.py``).
Each is built with OpenMP, whose runtime the loader resolves to the one torch already loaded (torch is imported
first, and its bundled libgomp carries the name the library asks for): the kernels run on torch's own intra-op pool.
Where one cannot be built or loaded (no compiler, a read-only cache), ``load`` logs why and returns None: every
kernel is only a speed-up, and its caller serves without it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from astrai.disk_cache import cache_dir, cpu_identity

log = logging.getLogger("astrai")

KERNELS = Path(__file__).with_name("kernels")
SOURCES = {name: KERNELS / f"{name}.c" for name in ("paged_attention", "skinny_linear")}
HEADERS = [KERNELS / "bfloat16.h"]  # included by the sources: part of every library's key
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}  # the suffixes of every kernel's C functions


def build(name: str) -> Path:
    """The shared library of kernel ``name`` (a key of ``SOURCES``), built now if this machine has not built it."""
    source = SOURCES[name]
    code = b"".join(path.read_bytes() for path in [source, *HEADERS])
    key = hashlib.sha256(code + " ".join(FLAGS).encode() + cpu_identity().encode()).hexdigest()[:16]
    cache = cache_dir("kernels")
    library = cache / f"{name}-{key}.so"
    if library.exists():
        return library
    compiler = shutil.which(os.environ.get("CC", "gcc"))
    if compiler is None:
        raise RuntimeError("no C compiler (gcc) on PATH")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as scratch:  # built aside, then renamed: never half a library
        built = Path(scratch) / library.name
        subprocess.run([compiler, *FLAGS, "-o", str(built), str(source), "-lm"], check=True, capture_output=True)
        os.replace(built, library)
    return library


def load(name: str, fallback: str) -> ctypes.CDLL | None:
    """Kernel ``name``'s library, built if need be; None where that fails, logged once per caller as ``<name>
    kernel unavailable (<why>); <fallback>`` (callers cache their answer)."""
    try:
        return ctypes.CDLL(str(build(name)))
    except Exception as error:  # no compiler, a read-only cache, an unknown CPU
        detail = error.stderr.decode(errors="replace") if isinstance(error, subprocess.CalledProcessError) else error
        log.warning("%s kernel unavailable (%s); %s", name, detail, fallback)
        return None
