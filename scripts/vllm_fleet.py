"""A local vLLM fleet for `serve_vllm.py --replicas N --router POLICY[,POLICY]`: N vLLM CPU replicas of one model
and one vLLM router (`vllm-router`, PyPI) per policy in front of them, all on loopback.

Replica i serves on PORT + i, confined to core i (modulo the cores: all its processes, its model's threads bound
there; vLLM's own choice put every replica's model on the same core), and publishes its KV events on
tcp://*:KV_PORT + 2i (replay on KV_PORT + 2i + 1): tcp, because the router's `kv_aware` policy reads the same events
and accepts only tcp endpoints. Router j serves on ROUTER_PORT + j, its Prometheus metrics on
ROUTER_METRICS_PORT + j, and checks the replicas' health every 2 s (default 60 s), so a replica that dies is routed
around within seconds. The router lives in a venv of its own (`--router-venv`, made on first use from
`locks/vllm-router.txt`: `vllm-router`, a Rust binary in a wheel, and what it needs, at exact versions and hashes).

`--wait` starts everything, waits for every /health and prints the app's command line; `--stop` stops them all.
Stdlib only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from copy import copy
from pathlib import Path

import serve_vllm as single

ROUTER_LOCK = single.REPO / "locks" / "vllm-router.txt"
HEALTH_CHECK_S = 2


def replica_args(args: argparse.Namespace, i: int) -> argparse.Namespace:
    """The single-server arguments of replica ``i``."""
    replica = copy(args)
    replica.port = args.port + i
    replica.kv_events = f"tcp://*:{args.kv_port + 2 * i}"
    replica.kv_replay = f"tcp://*:{args.kv_port + 2 * i + 1}"
    replica.log = args.venv / "run" / f"server-{replica.port}.log"
    replica.pid_file = args.venv / "run" / f"server-{replica.port}.pid"
    # vLLM binds its model's OpenMP threads by itself ("auto"), and every replica picked the same core: two
    # replicas then share one core and leave the other idle. Replica i gets core i (modulo the cores it may use),
    # its model's threads and its whole process tree (``serve_vllm.confined``): with only the model's thread
    # bound, one replica's API server and engine core ran beside the other's busy model on its core, and both
    # replicas' streams stalled 0.3-0.8 s whenever both ran; confined, the longest gap between two chunks was 65 ms.
    allowed = sorted(os.sched_getaffinity(0))
    replica.cores = {allowed[i % len(allowed)]}
    return replica


def router_args(args: argparse.Namespace, j: int, policy: str) -> argparse.Namespace:
    router = copy(args)
    router.policy = policy
    router.port = args.router_port + j
    router.metrics_port = args.router_metrics_port + j
    router.log = args.router_venv / "run" / f"router-{router.port}.log"
    router.pid_file = args.router_venv / "run" / f"router-{router.port}.pid"
    return router


def kv_endpoint(replica: argparse.Namespace, bound: str) -> str:
    """Where a subscriber connects for a publisher bound at ``tcp://*:PORT``."""
    return bound.replace("*", replica.host)


def ensure_router_venv(venv: Path) -> None:
    single.install_lock(venv, ROUTER_LOCK, venv / ".astrai-router-installed", "vllm-router")


def router_command(router: argparse.Namespace, replicas: list[argparse.Namespace]) -> list[str]:
    urls = [f"http://{r.host}:{r.port}" for r in replicas]
    cmd = [str(router.router_venv / "bin" / "vllm-router"), "--host", router.host, "--port", str(router.port)]
    cmd += ["--worker-urls", *urls, "--policy", router.policy]
    cmd += ["--prometheus-host", router.host, "--prometheus-port", str(router.metrics_port)]
    cmd += ["--health-check-interval-secs", str(HEALTH_CHECK_S), "--health-failure-threshold", "1"]
    if router.policy == "kv_aware":
        for url, replica in zip(urls, replicas, strict=True):
            cmd += ["--kv-event-source", f"{url}={kv_endpoint(replica, replica.kv_events)}"]
        cmd += ["--kv-event-block-size", str(router.block_size), "--kv-event-model", router.served_model_name]
    return cmd


def start_router(router: argparse.Namespace, replicas: list[argparse.Namespace]) -> subprocess.Popen:
    if single._port_in_use(router.host, router.port):
        raise single.LaunchError(f"port {router.port} is already in use (a router already running? try --stop)")
    router.log.parent.mkdir(parents=True, exist_ok=True)
    cmd = router_command(router, replicas)
    single._log(f"starting: {' '.join(cmd)}")
    with open(router.log, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    router.pid_file.write_text(f"{proc.pid}\n")
    return proc


def pss_mib(pid: int) -> float:
    """Proportional set size of a process and its descendants (shared pages split between their users), MiB."""
    total, todo = 0, [pid]
    while todo:
        current = todo.pop()
        try:
            text = Path(f"/proc/{current}/smaps_rollup").read_text()
            total += next(int(line.split()[1]) for line in text.splitlines() if line.startswith("Pss:"))
            children = Path(f"/proc/{current}/task/{current}/children").read_text().split()
        except (OSError, StopIteration, ValueError):
            continue
        todo += [int(c) for c in children]
    return total / 1024


def app_command(replicas: list[argparse.Namespace], routers: list[argparse.Namespace]) -> list[str]:
    """The app's arguments to attach to this fleet."""
    cmd = ["python", "app.py"]
    for r in replicas:
        cmd += ["--vllm-url", f"http://{r.host}:{r.port}"]
    for r in replicas:
        cmd += ["--kv-events", kv_endpoint(r, r.kv_events), "--kv-replay", kv_endpoint(r, r.kv_replay)]
    for r in routers:
        cmd += ["--router-url", f"{r.policy}=http://{r.host}:{r.port}"]
        cmd += ["--router-metrics", f"http://{r.host}:{r.metrics_port}"]
    return cmd


def serve(args: argparse.Namespace) -> int:
    """Start the replicas (together), then the routers; wait for every /health; print the app's command."""
    replicas = [replica_args(args, i) for i in range(args.replicas)]
    routers = [router_args(args, j, policy) for j, policy in enumerate(args.router)]
    for replica in replicas:
        single._check_ready_to_serve(replica)
    ensure_router_venv(args.router_venv)
    start = time.monotonic()
    procs = [(replica, single.start_detached(replica)) for replica in replicas]
    try:
        for replica, proc in procs:
            single.wait_ready(replica, proc, start)
        ready = time.monotonic() - start
        for router in routers:
            single.wait_ready(router, start_router(router, replicas), time.monotonic(), what="vllm-router")
    except single.LaunchError:
        stop(args)
        raise
    single._log(f"{len(replicas)} replicas ready in {ready:.1f} s, routers in {time.monotonic() - start - ready:.1f} s")
    memory = {f"{t.port}": round(pss_mib(int(t.pid_file.read_text())), 1) for t in [*replicas, *routers]}
    single._log(f"memory (PSS of each process tree, MiB, by port): {memory}")
    report = {"seconds": round(time.monotonic() - start, 1), "replicas_ready_s": round(ready, 1)}
    print(json.dumps(report | {"pss_mib": memory, "app": app_command(replicas, routers)}))
    return 0


def stop(args: argparse.Namespace) -> int:
    targets = [replica_args(args, i) for i in range(args.replicas)]
    targets += [router_args(args, j, policy) for j, policy in enumerate(args.router)]
    for target in targets:
        if target.pid_file.exists():
            pid = target.pid_file.read_text().strip()
            if pid.isdigit():
                single._stop_pid(int(pid), grace=10.0)
                single._log(f"stopped pid {pid} (port {target.port})")
            target.pid_file.unlink(missing_ok=True)
    return 0
