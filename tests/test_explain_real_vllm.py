"""Why each token missed, on a real vLLM server: a server of its own with a pool of 20 blocks (the recorded
"evict" phase's, tests/data/vllm/README.md), six distinct stories, then four of them again. Needs the vLLM venv
(tests/support/needs.NO_VLLM says how to get it; .ci/run has it)."""

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
        first = backend.submit(list(STORIES), params, None)
        list(first)
        time.sleep(1.0)  # the events of the first round reach the subscriber before the second is sent
        second = backend.submit(list(STORIES[2:]), params, None)
        list(second)
        ids = second.request_ids
        assert wait_until(lambda: all(i.cached_tokens is not None for i in backend.request_info(ids)), timeout=10)
        time.sleep(1.0)  # and the second round's
        whys = backend.explain(ids, lambda request: True)
        infos = {i.id: i for i in backend.request_info(ids)}
        seen: set[Cause] = set()
        for why in whys:
            info = infos[why.request]
            assert sum(why.counts.values()) == info.prompt_tokens, why
            assert why.counts[Cause.CACHED] == info.cached_tokens, "cached is the server's usage.cached_tokens"
            assert not why.namespaces_known, "a server sends no salts"
            seen |= {cause for cause, n in why.counts.items() if n}
        firsts = backend.explain(first.request_ids, lambda request: True)
        seen |= {cause for why in firsts for cause, n in why.counts.items() if n}
        assert {Cause.NEW, Cause.CACHED, Cause.PARTIAL_PAGE, Cause.EVICTED} <= seen, seen
    finally:
        if backend is not None:
            backend.shutdown()
        subprocess.run([*serve, "--stop"], check=False, cwd=ROOT)
