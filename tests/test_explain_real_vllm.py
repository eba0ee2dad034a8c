"""Why each token missed, on a real vLLM server: a server of its own with a pool of 20 blocks (the recorded
"evict" phase's, tests/data/vllm/README.md), six distinct stories, then four of them again (two cached, two
evicted), one at a time. Needs the vLLM venv (tests/support/needs.NO_VLLM says how to get it; .ci/run has it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from astrai.explain import Cause
from astrai.playground.backends.vllm.backend import VllmBackend
from astrai.sampling import SamplingParams
from tests.support.needs import NO_VLLM
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[1]
STORIES = json.loads((ROOT / "tests" / "data" / "vllm" / "prompts.json").read_text())["distinct"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def submitted(backend: VllmBackend, prompt: str, params: SamplingParams) -> list[int]:
    """Run one prompt to its end; its request ids."""
    run = backend.submit([prompt], params, None)
    list(run)
    return run.request_ids


@pytest.mark.vllm
@pytest.mark.timeout(900)  # a server start, a minute or more on 2 busy cores
def test_a_real_servers_misses_are_explained_new_cached_partial_and_evicted(tmp_path):
    if not os.environ.get("ASTRAI_VLLM_URL"):
        pytest.skip(NO_VLLM)  # its venv is what CI's server runs from
    port = free_port()
    events, replay = f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/kv-replay.sock"
    serve = [sys.executable, str(ROOT / "scripts" / "serve_vllm.py"), "--port", str(port)]
    serve += ["--pid-file", str(tmp_path / "vllm.pid"), "--log", str(tmp_path / "vllm.log")]
    serve += ["--kv-events", events, "--kv-replay", replay, "--num-gpu-blocks-override", "20", "--max-model-len", "512"]
    subprocess.run([*serve, "--wait", "--timeout", "600"], check=True, cwd=ROOT)
    backend = None
    try:
        backend = VllmBackend(f"http://127.0.0.1:{port}", events, replay, sample_every_s=0.2)
        params = SamplingParams(max_tokens=128)
        # one story at a time, each over 6 of the 20 blocks (32 tokens each; ~55 prompt and 128 generated tokens):
        # after all six, the last two stories' pages are still cached and the first two's were taken by later ones
        first_ids, ids = [], []
        for story in STORIES:
            first_ids += submitted(backend, story, params)
        time.sleep(1.0)  # the events of the first round reach the subscriber before the second is sent
        for story in [*STORIES[4:], *STORIES[:2]]:  # hits first, then the evicted: a miss's pages evict no hit
            ids += submitted(backend, story, params)
        assert wait_until(lambda: all(i.cached_tokens is not None for i in backend.request_info(ids)), timeout=10)
        wanted = {Cause.NEW, Cause.CACHED, Cause.PARTIAL_PAGE, Cause.EVICTED}

        def causes_seen() -> set[Cause]:
            """Every cause counted for either round, as the events received so far explain them (on a busy machine
            the second round's may take a while to arrive)."""
            whys = backend.explain([*first_ids, *ids], lambda request: True)
            return {cause for why in whys for cause, n in why.counts.items() if n}

        assert wait_until(lambda: wanted <= causes_seen(), timeout=30, interval=0.5), causes_seen()
        infos = {i.id: i for i in backend.request_info(ids)}
        for why in backend.explain(ids, lambda request: True):
            info = infos[why.request]
            assert sum(why.counts.values()) == info.prompt_tokens, why
            assert why.counts[Cause.CACHED] == info.cached_tokens, "cached is the server's usage.cached_tokens"
            assert not why.namespaces_known, "a server sends no salts"
    finally:
        if backend is not None:
            backend.shutdown()
        subprocess.run([*serve, "--stop"], check=False, cwd=ROOT)
