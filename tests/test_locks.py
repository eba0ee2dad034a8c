"""The locks agree with what they lock: README's commands, CI and the vLLM venvs install exactly these files."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("lock", ROOT / "scripts" / "lock.py")
assert _spec is not None and _spec.loader is not None
lock = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(lock)

PIN = re.compile(r"^([A-Za-z0-9_.-]+)==(\S+)")


def pins(path: Path) -> dict[str, tuple[str, frozenset[str]]]:
    """name -> (version, hashes) of every package a lock installs."""
    found: dict[str, tuple[str, frozenset[str]]] = {}
    name = version = None
    hashes: set[str] = set()
    for line in path.read_text().splitlines():
        if (match := PIN.match(line)) is not None:
            if name is not None:
                found[name] = (version, frozenset(hashes))
            name, version, hashes = match[1].lower().replace("_", "-"), match[2], set()
        hashes.update(re.findall(r"--hash=sha256:([0-9a-f]{64})", line))
    if name is not None:
        found[name] = (version, frozenset(hashes))
    return found


@pytest.mark.parametrize("source, locked", [(s, lk) for s, lk, _ in lock.locks()], ids=lambda p: p.name)
def test_each_lock_pins_its_inputs_and_hashes_every_package(source, locked):
    assert lock.stale(source, locked) == [], f"run `python scripts/lock.py`: {locked.name} is older than {source.name}"
    unhashed = [name for name, (_, hashes) in pins(locked).items() if not hashes]
    assert not unhashed, f"{locked.name} has packages without a hash: {unhashed}"


def test_the_tests_run_on_exactly_what_the_app_installs():
    app, dev = pins(ROOT / "requirements.txt"), pins(ROOT / "requirements-dev.txt")
    assert app and set(app) <= set(dev)
    assert {name: dev[name] for name in app} == app


def test_the_vllm_lock_leaves_out_the_cuda_built_vision_packages():
    assert not set(lock.NOT_IN_VLLM) & set(pins(ROOT / "locks" / "vllm.txt"))
