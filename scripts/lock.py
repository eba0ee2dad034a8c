#!/usr/bin/env python3
"""Lock every environment the project installs: exact versions and hashes of the whole dependency closure.

    python scripts/lock.py      # rewrite all four locks from their .in files (needs `uv`: requirements-dev.txt)

tests/test_locks.py fails while a lock does not pin what its .in file pins, or a package lacks a hash.

| input | lock | installed by |
|---|---|---|
| requirements.in | requirements.txt | README's app command (`pip install -r requirements.txt`) |
| requirements-dev.in | requirements-dev.txt | README's test command and `.ci/run` |
| locks/vllm.in | locks/vllm.txt | `scripts/serve_vllm.py` (the vLLM CPU server's venv) |
| locks/vllm-router.in | locks/vllm-router.txt | `scripts/vllm_fleet.py` (the vllm-router venv) |

Why a lock: `requirements.txt` used to pin only the direct dependencies, so a fresh machine resolved the others
anew while CI reused what its machine already had. `openai==3.57.0` asks for `httpx2>=2.12,<3`: releases up to
2.16.2 took the playground's `httpx.Timeout` without a check, and a fresh install got 2.17.0, which refuses it.

The locks are for Linux x86_64 and CPython 3.11, the machines the project runs and is tested on. torch is its CPU
build (`2.13.0+cpu`): pip finds it where its configuration points (this kind of machine keeps the wheel in
/opt/wheels); elsewhere add PyTorch's CPU index (`PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu`).
The development lock keeps the app lock's pins (it is resolved with requirements.txt as constraints), so the tests
run on exactly what the app installs. vLLM's lock leaves out torchvision, torchaudio and torchcodec: their PyPI
wheels are CUDA builds that break `import vllm` beside a CPU torch, and vLLM serves text without them
(`serve_vllm.py` installs the lock with `--no-deps`).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
NOT_IN_VLLM = ("torchvision", "torchaudio", "torchcodec")


def locks() -> list[tuple[Path, Path, list[str]]]:
    """(input, lock, extra uv arguments) in the order they must be made: the dev lock is constrained by the app's."""
    app = REPO / "requirements.txt"
    return [
        (REPO / "requirements.in", app, []),
        (REPO / "requirements-dev.in", REPO / "requirements-dev.txt", ["--constraint", str(app)]),
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
    cmd = [
        uv, "pip", "compile", str(source.relative_to(REPO)), "--output-file", str(lock.relative_to(REPO)),
        "--generate-hashes", "--python-version", "3.11", "--python-platform", "x86_64-manylinux_2_28",
        "--custom-compile-command", "python scripts/lock.py", "--quiet", *torch_sources(), *extra,
    ]  # fmt: skip
    print("+", shlex.join(cmd), flush=True)
    subprocess.run(cmd, cwd=REPO, check=True)


def stale(source: Path, lock: Path) -> list[str]:
    """The direct requirements of ``source`` (``name==version`` lines) that ``lock`` does not pin as given."""
    pinned = {
        line.split("==")[0].strip().lower().replace("_", "-"): line.split("==")[1].split()[0].split("+")[0]
        for line in lock.read_text().splitlines()
        if "==" in line and not line.startswith((" ", "#"))
    }
    wrong = []
    for line in source.read_text().splitlines():
        line = line.split("#")[0].strip()
        if "==" not in line:
            continue
        name, version = (part.strip() for part in line.split("==", 1))
        if pinned.get(name.lower().replace("_", "-")) != version:
            wrong.append(f"{source.name}: {line} (lock: {pinned.get(name.lower().replace('_', '-'))})")
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
