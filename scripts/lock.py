#!/usr/bin/env python3
"""Lock every environment the project installs: exact versions and hashes of the whole dependency closure.

    python scripts/lock.py      # rewrite all five locks from their .in files (needs `uv`: requirements-dev.txt)

tests/test_locks.py fails while a lock does not pin what its .in file pins, or a package lacks a hash.

| input | lock | installed by |
|---|---|---|
| requirements.in | requirements.txt | README's app command; a Space's builder (after pre-requirements.txt) |
| requirements-dev.in | requirements-dev.txt | README's test command and `.ci/run` |
| pre-requirements.in | pre-requirements.txt | README's two commands (second); a Space's builder (first) |
| locks/vllm.in | locks/vllm.txt | `scripts/serve_vllm.py` (the vLLM CPU server's venv) |
| locks/vllm-router.in | locks/vllm-router.txt | `scripts/vllm_fleet.py` (the vllm-router venv) |

Why a lock: `requirements.txt` used to pin only the direct dependencies, so a fresh machine resolved the others
anew while CI reused what its machine already had. `openai==3.57.0` asks for `httpx2>=2.12,<3`: releases up to
2.16.2 took the playground's `httpx.Timeout` without a check, and a fresh install got 2.17.0, which refuses it.

The locks are for Linux x86_64 and CPython 3.11, the machines the project runs and is tested on. torch is its CPU
build (`2.13.0+cpu`, pinned in pre-requirements.in), which PyPI cannot serve: PEP 440 keeps local versions off
public indexes, and PyPI's `torch` is the CUDA build. So requirements.txt and requirements-dev.txt resolve torch
(its dependencies stay in them) but leave torch itself out, and pre-requirements.txt holds torch and its
dependencies, at the app lock's versions, under a line that adds PyTorch's CPU index: the one file whose lookups
go there. A Space's builder installs it before requirements.txt; README installs it second. Here uv finds the
wheel where pip's configuration points (this kind of machine keeps it in /opt/wheels), elsewhere on PyTorch's CPU
index. The development lock and pre-requirements.txt keep the app lock's pins (requirements.txt is their
constraint), so the tests run on exactly what the app installs. vLLM's lock leaves out torchvision, torchaudio and
torchcodec: their PyPI wheels are CUDA builds that break `import vllm` beside a CPU torch, and vLLM serves text
without them (`serve_vllm.py` installs the lock with `--no-deps`).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import NormalizedName, canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
INDEX_LINE = f"--extra-index-url {TORCH_CPU_INDEX}"
PRE_REQUIREMENTS = REPO / "pre-requirements.txt"  # the one lock whose lookups go to PyTorch's index
NOT_IN_VLLM = ("torchvision", "torchaudio", "torchcodec")
EXCLUDED = "# The following packages were excluded from the output:"  # uv's list of --no-emit-package names
# The environment every lock is resolved for (the uv arguments in compile_lock): markers are evaluated in it.
TARGET = {
    "python_version": "3.11",
    "python_full_version": "3.11.0",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "os_name": "posix",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
}


def locks() -> list[tuple[Path, Path, list[str]]]:
    """(input, lock, extra uv arguments) in the order they must be made: the others keep the app lock's pins."""
    app = REPO / "requirements.txt"
    no_torch = ["--no-emit-package=torch"]
    return [
        (REPO / "requirements.in", app, no_torch),
        (REPO / "requirements-dev.in", REPO / "requirements-dev.txt", ["--constraint", str(app), *no_torch]),
        (REPO / "pre-requirements.in", PRE_REQUIREMENTS, ["--constraint", str(app)]),
        (REPO / "locks" / "vllm.in", REPO / "locks" / "vllm.txt", [f"--no-emit-package={p}" for p in NOT_IN_VLLM]),
        (REPO / "locks" / "vllm-router.in", REPO / "locks" / "vllm-router.txt", []),
    ]


def torch_sources() -> list[str]:
    """Where uv finds torch's CPU build: pip's configured find-links directories, else PyTorch's CPU index."""
    found = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True
    )
    dirs = [d for d in found.stdout.split() if Path(d).is_dir()] if found.returncode == 0 else []
    if dirs:
        return [arg for d in dirs for arg in ("--find-links", d)]
    return ["--extra-index-url", TORCH_CPU_INDEX, "--index-strategy", "unsafe-best-match"]


def compile_lock(uv: str, source: Path, lock: Path, extra: list[str]) -> None:
    """Run uv; then put PyTorch's index first in pre-requirements.txt (after uv, which reads the old lock)."""
    cmd = [
        uv, "pip", "compile", str(source.relative_to(REPO)), "--output-file", str(lock.relative_to(REPO)),
        "--generate-hashes", "--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28",
        "--custom-compile-command", "python scripts/lock.py", "--quiet", *torch_sources(), *extra,
    ]  # fmt: skip
    print("+", shlex.join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)
    if lock == PRE_REQUIREMENTS:
        lock.write_text(f"{INDEX_LINE}\n{lock.read_text()}")


def _lines(path: Path) -> list[tuple[int, str]]:
    """(first line's number, text) of a requirements file's logical lines: comments dropped, continuations
    (a trailing backslash) joined."""
    lines: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        text = "" if raw.lstrip().startswith("#") else raw.split(" #")[0]
        start = start or number
        if text.rstrip().endswith("\\"):
            pending += text.rstrip()[:-1] + " "
            continue
        if (pending + text).strip():
            lines.append((start, (pending + text).strip()))
        pending, start = "", 0
    return lines


def requirements(source: Path) -> list[tuple[str, Requirement]]:
    """The requirements of ``source`` and of the files it includes (``-r``, relative to the including file), each
    with where it was written (``file:line``). Other options (``-c``, index lines) are not requirements.
    Raises ValueError, naming the line, on one that is not a requirement."""
    found: list[tuple[str, Requirement]] = []
    for number, text in _lines(source):
        option, _, value = text.partition(" ")
        if option in ("-r", "--requirement"):
            found += requirements(source.parent / value.strip())
        elif not text.startswith("-"):
            try:  # a requirement's own options (a lock's --hash) follow it
                found.append((f"{source.name}:{number}", Requirement(text.split(" --")[0])))
            except InvalidRequirement as error:
                raise ValueError(f"{source}:{number}: not a requirement: {text!r} ({error})") from error
    return found


def pinned(lock: Path) -> dict[NormalizedName, Version]:
    """Name -> version of every package ``lock`` installs (its ``name==version`` lines, hashes aside)."""
    pins: dict[NormalizedName, Version] = {}
    for where, requirement in requirements(lock):
        exact = [spec.version for spec in requirement.specifier if spec.operator == "==" and "*" not in spec.version]
        if len(exact) != 1:
            raise ValueError(f"{lock}: {where}: a lock pins one exact version, not {requirement}")
        pins[canonicalize_name(requirement.name)] = Version(exact[0])
    return pins


def excluded(lock: Path) -> set[NormalizedName]:
    """The packages ``lock`` says it leaves out on purpose (uv's list for ``--no-emit-package``, at its end)."""
    _, found, names = lock.read_text().partition(EXCLUDED)
    return (
        {canonicalize_name(line.removeprefix("#").strip()) for line in names.splitlines() if line.strip()}
        if found
        else set()
    )


def stale(source: Path, lock: Path) -> list[str]:
    """The requirements of ``source`` (and its ``-r`` includes) that ``lock`` does not satisfy, as messages.

    A requirement whose marker is false on the locked platform (Linux x86_64, CPython 3.11) needs nothing, nor
    one the lock says it leaves out. Otherwise the lock must pin the package (names compared after PEP 503
    normalisation, extras aside) at a version the requirement allows, and a local version (``+cpu``, ``+cu128``)
    only where the requirement names that exact one: PEP 440's ``==2.13.0`` also allows ``2.13.0+cu128``, a CUDA
    build, where the CPU build is meant."""
    pins, left_out = pinned(lock), excluded(lock)
    wrong = []
    for where, requirement in requirements(source):
        name = canonicalize_name(requirement.name)
        if name in left_out or (requirement.marker is not None and not requirement.marker.evaluate(TARGET)):
            continue
        version = pins.get(name)
        exact = [Version(s.version) for s in requirement.specifier if s.operator == "==" and "*" not in s.version]
        if (
            version is None
            or not requirement.specifier.contains(version, prereleases=True)
            or (version.local is not None and version not in exact)
        ):
            wrong.append(f"{where}: {requirement} (lock: {version})")
    return wrong


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    uv = shutil.which("uv")
    if uv is None:
        print("scripts/lock.py needs uv: pip install -r requirements-dev.txt", file=sys.stderr)
        return 2
    for source, lock, extra in locks():
        compile_lock(uv, source, lock, extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
