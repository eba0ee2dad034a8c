"""Where an engine runs: the ``device`` option, checked once, and which of the CPU-only speed-ups apply there.

An engine runs on one ``torch.device``: the CPU, or one CUDA GPU. The model's weights, the KV pool, each step's
metadata and the sampling all live there, and only the sampled tokens come back to the host, once per step.

Three speed-ups are CPU code and nothing else: oneDNN weight packing (``packed_linear.py``), the C attention kernels
(``paged_kernel.py``, which reads host memory through raw pointers) and the release of idle OpenMP pools
(``openmp.py``). On CUDA they are switched off: weights stay transformers' own layers, decodes attend through
PyTorch (``attention.py``), and no OpenMP pool is released (the loop runs no OpenMP regions worth freeing).
Their options default to ``None``, "wherever they apply". Asking for one explicitly on CUDA is refused with a
``ValueError`` rather than ignored: an explicit ``True`` states an expectation (a packed, kernel-attended engine)
that the engine could not meet, and a silent no-op would leave a user measuring or debugging the wrong thing.
"""

from __future__ import annotations

import torch

DEVICE_TYPES = ("cpu", "cuda")
CPU_SPEEDUPS = {
    "packed_weights": "oneDNN weight packing",
    "attention_kernel": "the C decode-attention kernel",
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device an engine runs on: ``None`` picks CUDA where ``torch.cuda.is_available()``, else the CPU.

    Accepts ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a ``torch.device`` of those types; anything else, or a GPU this
    process cannot use, raises ``ValueError``. A CUDA device always comes back with its index (``"cuda"`` is the
    current device), so two spellings of one GPU compare equal where engines sharing a model must agree on it.
    """
    if device is None:
        return _cuda(None) if torch.cuda.is_available() else torch.device("cpu")
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or a torch.device, got {device!r}")
    try:
        parsed = torch.device(device)
    except RuntimeError:
        parsed = None
    if parsed is None or parsed.type not in DEVICE_TYPES:
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N' (or such a torch.device), got {device!r}")
    if parsed.type == "cpu":
        return torch.device("cpu")
    return _cuda(parsed.index)


def _cuda(index: int | None) -> torch.device:
    if not torch.cuda.is_available():
        raise ValueError(
            "device='cuda' was asked for, but this torch has no usable CUDA device "
            f"(torch {torch.__version__}, torch.cuda.is_available() is False): use device='cpu'"
        )
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if index is None else index
    if not 0 <= index < count:
        raise ValueError(f"device='cuda:{index}' does not exist: this process sees {count} CUDA device(s)")
    return torch.device("cuda", index)


def resolve_cpu_speedup(name: str, asked: bool | None, device: torch.device) -> bool:
    """Whether the CPU-only speed-up ``name`` (a key of ``CPU_SPEEDUPS``) runs: ``None`` means "where it applies",
    that is on the CPU; ``True`` on another device raises ``ValueError`` (see the module docstring for why)."""
    if asked is not None and not isinstance(asked, bool):
        raise ValueError(f"{name} must be True, False or None (where it applies), got {asked!r}")
    applies = device.type == "cpu"
    if asked and not applies:
        raise ValueError(
            f"{name}=True asks for {CPU_SPEEDUPS[name]}, a CPU-only speed-up, but the engine runs on {device}: "
            f"leave {name} unset (or False) there"
        )
    return applies if asked is None else asked


def uses_openmp(device: torch.device) -> bool:
    """Whether the engine computes on OpenMP threads, whose idle pools it then releases (``openmp.py``)."""
    return device.type == "cpu"


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` (made on the host) on ``device``, copied without a host sync: the copy is queued on the device's
    stream ahead of the work that reads it, so a step waits for the device only for its sampled tokens (where a
    plain ``.to(device)``, or ``torch.tensor(..., device=device)``, would wait for the queue to drain first). The
    same tensor where ``device`` is the CPU."""
    return tensor.to(device, non_blocking=True)
