"""AstrAI playground, a Hugging Face Space: `python app.py` (host and port from GRADIO_SERVER_NAME/PORT).

Without options it serves the embedded in-process engine. Attached to a vLLM server instead (operator settings, never
a field in the UI):

    python app.py --vllm-url http://127.0.0.1:8011 [--kv-events ipc:///tmp/astrai-vllm-kv.sock]
                  [--kv-replay ipc:///tmp/astrai-vllm-kv-replay.sock] [--model-name NAME]

or the same through ASTRAI_VLLM_URL, ASTRAI_VLLM_KV_EVENTS, ASTRAI_VLLM_KV_REPLAY, ASTRAI_VLLM_MODEL.

The embedded playground runs one engine per profile (the default's, the lesson's, visitors' own settings). Operator
bounds: ASTRAI_MAX_ENGINES, ASTRAI_MAX_CUSTOM_ENGINES, ASTRAI_KV_BUDGET_MB, ASTRAI_ENGINE_IDLE_S (see
astrai/playground/backends/engines.py). Hub models are offered only with --allow-hub-models or
ASTRAI_ALLOW_HUB_MODELS=1.
"""

import argparse
import logging
import os
import sys

from astrai.playground import create_app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(description="AstrAI playground")
    parser.add_argument("--vllm-url", default=env("ASTRAI_VLLM_URL"), help="a vLLM OpenAI-compatible server")
    parser.add_argument("--kv-events", default=env("ASTRAI_VLLM_KV_EVENTS"), help="its KV-event ZMQ endpoint")
    parser.add_argument("--kv-replay", default=env("ASTRAI_VLLM_KV_REPLAY"), help="its KV-event replay endpoint")
    parser.add_argument("--model-name", default=env("ASTRAI_VLLM_MODEL"), help="the served model (default: the only)")
    parser.add_argument(
        "--allow-hub-models", action="store_true", help="offer the small hub checkpoints (downloads them on use)"
    )
    args, _ = parser.parse_known_args(argv)  # gradio's and pytest's own arguments pass through
    return args


def make_engines(args: argparse.Namespace):
    """None (in-process engines) without a vLLM URL; a clear exit when the vLLM server cannot be used."""
    if not args.vllm_url:
        return None
    from astrai.playground.backends.profiles import DEFAULT_PROFILE
    from astrai.playground.backends.protocol import BackendError, SingleServer
    from astrai.playground.backends.vllm.backend import VllmBackend

    try:
        backend = VllmBackend(args.vllm_url, args.kv_events or None, args.kv_replay or None, args.model_name or None)
    except (BackendError, ValueError) as exc:
        sys.exit(f"app.py: cannot attach to vLLM: {exc}")
    return SingleServer(backend, DEFAULT_PROFILE)


# the engine's own lines (a first start compiling the model, an engine serving eager and why) reach the console
logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
logging.getLogger("astrai").setLevel(logging.INFO)
ARGS = parse_args()
demo = create_app(make_engines(ARGS), allow_hub_models=ARGS.allow_hub_models)

if __name__ == "__main__":
    demo.launch()
