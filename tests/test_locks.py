"""The locks agree with what they lock: README's commands, CI, a Space's builder and the vLLM venvs install exactly
these files."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from packaging.version import Version

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


def test_torch_is_the_cpu_build_from_pytorchs_index_and_only_in_pre_requirements():
    """PyPI's torch is the CUDA build: a torch pinned in requirements*.txt would pull it on a Space (or fail there,
    as a local version), so only pre-requirements.txt pins torch, with PyTorch's CPU index as its first line."""
    pre = ROOT / "pre-requirements.txt"
    assert pre.read_text().splitlines()[0] == "--extra-index-url https://download.pytorch.org/whl/cpu"
    assert Version(pins(pre)["torch"][0]).local == "cpu"
    for name in ("requirements.txt", "requirements-dev.txt"):
        assert "torch" not in pins(ROOT / name), f"{name} pins torch"


def test_pre_requirements_installs_torchs_dependencies_at_the_app_locks_versions():
    app, pre = pins(ROOT / "requirements.txt"), pins(ROOT / "pre-requirements.txt")
    assert set(pre) - set(app) == {"torch"}
    assert {name: app[name] for name in pre if name != "torch"} == {n: v for n, v in pre.items() if n != "torch"}


def stale(tmp_path: Path, source: str, locked: str, **included: str) -> list[str]:
    """lock.stale on a source and a lock written from text (``included``: other .in files, by stem)."""
    for stem, text in included.items():
        (tmp_path / f"{stem}.in").write_text(text)
    (tmp_path / "x.in").write_text(source)
    (tmp_path / "x.txt").write_text(locked)
    return lock.stale(tmp_path / "x.in", tmp_path / "x.txt")


@pytest.mark.parametrize(
    "source, locked",
    [
        ("uvicorn[standard]==0.30.0\n", "uvicorn==0.30.0 \\\n    --hash=sha256:aa\n"),
        ("zope.interface==7.0\n", "zope-interface==7.0 \\\n    --hash=sha256:bb\n"),
        ("Foo_Bar>=1,<2  # a comment\n", "foo-bar==1.4 \\\n    --hash=sha256:cc\n"),
        ('foo==1.0 ; python_version >= "3.11"\n', "foo==1.0 \\\n    --hash=sha256:cc\n"),
        ('foo==1.0\nwinonly==2.0 ; sys_platform == "win32"\n', "foo==1.0 \\\n    --hash=sha256:cc\n"),
        ("torch==2.13.0+cpu\n", "torch==2.13.0+cpu \\\n    --hash=sha256:dd\n"),
        (
            "torch==2.13.0+cpu\nfoo==1.0\n",
            "foo==1.0\n\n# The following packages were excluded from the output:\n# torch\n",
        ),
    ],
    ids=["extras", "dotted-name", "range-and-comment", "marker", "marker-elsewhere", "local-version", "left-out"],
)
def test_stale_takes_a_lock_that_pins_what_its_input_asks(tmp_path, source, locked):
    assert stale(tmp_path, source, locked) == []


@pytest.mark.parametrize(
    "source, locked",
    [
        ("torch==2.13.0\n", "torch==2.13.0+cu128 \\\n    --hash=sha256:ee\n"),
        ("torch==2.13.0+cpu\n", "torch==2.13.0+cu128 \\\n    --hash=sha256:ee\n"),
        ("torch>=2.13\n", "torch==2.13.0+cpu \\\n    --hash=sha256:ee\n"),
        ("foo==1.0\n", "foo==1.1 \\\n    --hash=sha256:cc\n"),
        ("foo==1.0\nbar==2.0\n", "foo==1.0 \\\n    --hash=sha256:cc\n"),
    ],
    ids=["cuda-for-plain", "cuda-for-cpu", "local-for-range", "other-version", "missing"],
)
def test_stale_rejects_a_lock_that_pins_otherwise(tmp_path, source, locked):
    assert len(stale(tmp_path, source, locked)) == 1


def test_stale_follows_included_files_relative_to_the_includer(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "deep.in").write_text("bar==2.0\n")
    found = stale(tmp_path, "-r base.in\nfoo==1.0\n", "foo==1.0\nbar==1.0\n", base="-r sub/deep.in\n")
    assert found == ["deep.in:1: bar==2.0 (lock: 1.0)"]


def test_stale_names_a_line_that_is_no_requirement(tmp_path):
    with pytest.raises(ValueError, match=r"x.in:2: not a requirement"):
        stale(tmp_path, "foo==1.0\nfoo bar baz\n", "foo==1.0\n")
