"""AstrAI playground, a Hugging Face Space: `python app.py` (host and port from GRADIO_SERVER_NAME/PORT).

Without options it serves the embedded in-process engine. Attached to vLLM instead (operator settings, never a
field in the UI), one server:

    python app.py --vllm-url http://127.0.0.1:8011 [--kv-events ipc:///tmp/astrai-vllm-kv.sock]
                  [--kv-replay ipc:///tmp/astrai-vllm-kv-replay.sock] [--model-name NAME]

or a fleet: several replicas behind vLLM's router (runs go through the router, each replica is observed directly;
--kv-events and --kv-replay once per replica, in the order of the --vllm-url; a router as [POLICY=]URL, with its
Prometheus metrics in the same order):

    python app.py --vllm-url URL1 --vllm-url URL2 --kv-events tcp://HOST1:5557 --kv-events tcp://HOST2:5557
                  --router-url cache_aware=http://HOST:8099 --router-metrics http://HOST:29099
                  [--router-url round_robin=http://HOST:8098 --router-metrics http://HOST:29098]

or the same through ASTRAI_VLLM_URL, ASTRAI_VLLM_KV_EVENTS, ASTRAI_VLLM_KV_REPLAY, ASTRAI_ROUTER_URL,
ASTRAI_ROUTER_METRICS (comma-separated lists), ASTRAI_VLLM_MODEL.

The embedded playground runs one engine per profile (the default's, the lesson's, visitors' own settings). Operator
bounds: ASTRAI_MAX_ENGINES, ASTRAI_MAX_CUSTOM_ENGINES, ASTRAI_KV_BUDGET_MB, ASTRAI_ENGINE_IDLE_S (see
astrai/playground/backends/engines.py). Hub models are offered only with --allow-hub-models or
ASTRAI_ALLOW_HUB_MODELS=1.
"""

import argparse
import importlib
import logging
import os
import sys
import threading

from astrai.playground import create_app
from astrai.playground.backends.heap import limit_arenas


def _env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    parser = argparse.ArgumentParser(description="AstrAI playground")
    many = {"action": "append", "default": None}
    parser.add_argument("--vllm-url", **many, help="a vLLM OpenAI-compatible server (repeat: a fleet's replicas)")
    parser.add_argument("--kv-events", **many, help="its KV-event ZMQ endpoint (once per --vllm-url)")
    parser.add_argument("--kv-replay", **many, help="its KV-event replay endpoint (once per --vllm-url)")
    parser.add_argument("--router-url", **many, help="vLLM's router in front of the replicas: [POLICY=]URL")
    parser.add_argument("--router-metrics", **many, help="that router's Prometheus URL (once per --router-url)")
    parser.add_argument("--model-name", default=env("ASTRAI_VLLM_MODEL"), help="the served model (default: the only)")
    parser.add_argument(
        "--allow-hub-models", action="store_true", help="offer the small hub checkpoints (downloads them on use)"
    )
    args, _ = parser.parse_known_args(argv)  # gradio's and pytest's own arguments pass through
    for option, variable in (
        ("vllm_url", "ASTRAI_VLLM_URL"),
        ("kv_events", "ASTRAI_VLLM_KV_EVENTS"),
        ("kv_replay", "ASTRAI_VLLM_KV_REPLAY"),
        ("router_url", "ASTRAI_ROUTER_URL"),
        ("router_metrics", "ASTRAI_ROUTER_METRICS"),
    ):
        if getattr(args, option) is None:
            setattr(args, option, _env_list(variable))
    return args


def _per(values: list[str], count: int, option: str) -> list[str | None]:
    """One value per server (or router), in order; none given: None for each."""
    if not values:
        return [None] * count
    if len(values) != count:
        raise ValueError(f"{option}: give it once per server ({count}), in the same order; got {len(values)}")
    return [v or None for v in values]


def make_engines(args: argparse.Namespace):
    """None (in-process engines) without a vLLM URL; a clear exit when vLLM cannot be used."""
    if not args.vllm_url:
        return None
    from astrai.playground.backends.profiles import DEFAULT_PROFILE
    from astrai.playground.backends.protocol import BackendError, SingleServer
    from astrai.playground.backends.vllm.backend import ReplicaSpec, VllmBackend
    from astrai.playground.backends.vllm.router import RouterSpec

    try:
        urls = args.vllm_url
        events = _per(args.kv_events, len(urls), "--kv-events")
        replays = _per(args.kv_replay, len(urls), "--kv-replay")
        if len(urls) == 1 and not args.router_url:
            backend = VllmBackend(urls[0], events[0], replays[0], args.model_name or None)
        else:
            metrics = _per(args.router_metrics, len(args.router_url), "--router-metrics")
            routers = [RouterSpec.parse(url, m) for url, m in zip(args.router_url, metrics, strict=True)]
            replicas = [ReplicaSpec(*spec) for spec in zip(urls, events, replays, strict=True)]
            backend = VllmBackend.fleet(replicas, routers, args.model_name or None)
    except (BackendError, ValueError) as exc:
        sys.exit(f"app.py: cannot attach to vLLM: {exc}")
    return SingleServer(backend, DEFAULT_PROFILE)


# the engine's own lines (a first start compiling the model, an engine serving eager and why) reach the console
logging.basicConfig(format="%(asctime)s %(name)s: %(message)s")
logging.getLogger("astrai").setLevel(logging.INFO)


def check_knobs() -> None:
    """The operator's environment knobs (astrai/playground/knobs.py), checked before anything starts: one out of its
    range is one line and an exit, not a traceback."""
    try:
        importlib.import_module("astrai.playground.knobs")
    except ValueError as exc:
        sys.exit(f"app.py: {exc}")


def build_kernels_while(module: str) -> None:
    """Import ``module`` while the embedded engine's C kernels build (``native.py``): with an empty cache, as a
    Space's every start has, gcc takes seconds per kernel, in processes of its own, which an import on this thread
    does not wait for. Both are done before the engine is built (which then finds the kernels loaded)."""

    def build() -> None:
        from astrai.paged_kernel import load_paged_kernel
        from astrai.skinny_linear import load_skinny_kernel

        load_paged_kernel()
        load_skinny_kernel()

    kernels = threading.Thread(target=build, name="astrai-kernels", daemon=True)
    kernels.start()
    importlib.import_module(module)
    kernels.join()


ARGS = parse_args()
check_knobs()
limit_arenas()  # before the server's threads: each would otherwise hold free memory of an arena of its own
# before any thread (plotly's lazy imports race each other), after the knobs (the views' modules read them)
importlib.import_module("astrai.playground.views.charts").import_plotly_classes()
engines = make_engines(ARGS)
if engines is None:  # the embedded engine: its page answers within seconds of the process's start
    build_kernels_while("gradio")
demo = create_app(engines, allow_hub_models=ARGS.allow_hub_models)

if __name__ == "__main__":
    from astrai.playground.ui.app import launch_options

    demo.launch(**launch_options())
