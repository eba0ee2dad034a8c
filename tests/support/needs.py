"""What the tests that need something outside Python say when it is missing: the command that provides it.

`.ci/run` provides all three (it installs Debian's chromium and starts the vLLM server and fleet in the background);
a developer's machine may have none, and those tests then skip with these reasons."""

from __future__ import annotations

NO_CHROMIUM = (
    "Debian chromium is not installed: `apt-get install -y chromium` (the Python side, playwright, comes with "
    "requirements-dev.txt; .ci/run installs both)"
)
NO_VLLM = (
    "no vLLM server: ASTRAI_VLLM_URL is not set. Start one with `python scripts/serve_vllm.py --wait`, then set "
    "ASTRAI_VLLM_URL=http://127.0.0.1:8011 ASTRAI_VLLM_KV_EVENTS=ipc:///tmp/astrai-vllm-kv.sock "
    "ASTRAI_VLLM_KV_REPLAY=ipc:///tmp/astrai-vllm-kv-replay.sock (.ci/run does both)"
)
NO_FLEET = (
    "no vLLM fleet: ASTRAI_FLEET is not set. Start one with `python scripts/serve_vllm.py --replicas 2 --router "
    "round_robin,cache_aware --dev-mode --port 8051 --kv-port 5657 --router-port 8199 --router-metrics-port 29199 "
    "--wait > fleet.json`, then set ASTRAI_FLEET=fleet.json (.ci/run does both)"
)
NO_PYPI = "PyPI cannot be reached: the Space rehearsal installs the lock from it, as a Space's builder does"
