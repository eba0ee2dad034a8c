"""The C attention kernels of one git revision against the working tree's: ``python -m benchmarks.kernel_ab
[--base HEAD~1] [--rounds 3] [--calls 400]``.

Both sources, with the headers they include, are built as ``astrai/native.py`` builds them (same compiler flags)
into a temporary folder and loaded into this process. Each case is one layer's call on random caches: decode for a
batch of 8 requests of unequal contexts (W2's lengths after about 40 generated tokens), of equal ones (W1's) and a
single request, on the embedded model's head layout (2 KV heads of 4 query heads, head size 32) in both dtypes and a
SmolLM2-135M-shaped one (3 KV heads of 3, head size 64) in bfloat16; then prefill (prompts of 16 to 300 tokens,
W2's, from nothing). These caches stay in the CPU's caches from call to call; the last two cases decode on 30
layers in turn, as a step does, whose caches do not: each request's pages in random order, as a pool hands them out
after a while, then in order, as a fresh pool does (times per layer).
The two builds take turns call after call; each round prints both medians and their ratio (base over the tree's:
above 1, the tree is faster). The outputs must be equal, bit for bit, or the run stops; ``--tolerance`` allows a
difference, for a change that computes in another order.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from astrai import native
from astrai.paged_kernel import PagedKernel
from benchmarks.host_cpu import cpu_name

PAGE_SIZE = 16
LAYERS = 30  # a SmolLM2-135M-shaped model's
W2_LENGTHS = [16 + (300 - 16) * i // 7 for i in range(8)]
LAYOUTS = [((2, 4, 32), torch.bfloat16), ((2, 4, 32), torch.float32), ((3, 3, 64), torch.bfloat16)]


def build(revision: str | None, folder: Path) -> PagedKernel:
    """The attention kernel (its source and the headers it includes) as of ``revision`` (None: the working tree),
    built in ``folder``."""
    folder.mkdir()
    for path in [native.SOURCES["paged_attention"], *native.HEADERS]:
        relative = path.relative_to(Path.cwd().resolve())
        if revision is None:
            code = relative.read_bytes()
        else:
            shown = subprocess.run(["git", "show", f"{revision}:{relative}"], capture_output=True)
            if shown.returncode != 0:  # a header the revision did not have yet
                continue
            code = shown.stdout
        (folder / path.name).write_bytes(code)
    built = folder / "paged_attention.so"
    source = folder / "paged_attention.c"
    subprocess.run(["gcc", *native.FLAGS, "-o", str(built), str(source), "-lm"], check=True)
    return PagedKernel(ctypes.CDLL(str(built)))


def caches(layout: tuple[int, int, int], dtype: torch.dtype, lengths: list[int], shuffled: bool = True):
    """Random K and V caches holding ``lengths`` tokens, each request's pages in random order or side by side."""
    kv_heads, groups, head_dim = layout
    width = max(-(-n // PAGE_SIZE) for n in lengths)
    k_cache = torch.randn(kv_heads, (len(lengths) * width + 1) * PAGE_SIZE, head_dim).to(dtype)
    order = torch.randperm(len(lengths) * width) if shuffled else torch.arange(len(lengths) * width)
    pages = order.view(len(lengths), width) + 1
    return k_cache, torch.randn_like(k_cache), pages.contiguous(), kv_heads * groups


def decode_call(layout: tuple[int, int, int], dtype: torch.dtype, lengths: list[int], shuffled: bool = True):
    k_cache, v_cache, pages, heads = caches(layout, dtype, lengths, shuffled)
    query = torch.randn(1, heads, len(lengths), layout[2]).to(dtype)
    lengths_t = torch.tensor(lengths)
    return lambda k: k.attend(query, k_cache, v_cache, pages, lengths_t, PAGE_SIZE, 0.125)


def model_call(shuffled: bool):
    """Decode on every layer of a SmolLM2-135M-shaped model in turn (W1's contexts): 56 MB of K and V in bfloat16,
    more than the CPU's caches hold, so each layer reads its pool from memory, as in a decode step."""
    layers = [decode_call((3, 3, 64), torch.bfloat16, [301] * 8, shuffled) for _ in range(LAYERS)]
    return lambda k: torch.cat([layer(k) for layer in layers])


def prefill_call(layout: tuple[int, int, int], dtype: torch.dtype, lengths: list[int]):
    k_cache, v_cache, pages, heads = caches(layout, dtype, lengths)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    spans = torch.tensor([[start, n, 0] for start, n in zip(starts, lengths, strict=True)])
    query = torch.randn(1, heads, sum(lengths), layout[2]).to(dtype)

    def call(kernel: PagedKernel) -> torch.Tensor:
        out = torch.empty(sum(lengths), heads, layout[2], dtype=dtype)
        kernel.prefill(query, k_cache, v_cache, pages, spans, PAGE_SIZE, 0.125, out)
        return out

    return call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD~1", help="the git revision to compare the working tree with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=400, help="calls per build per case and round")
    parser.add_argument(
        "--tolerance", type=float, default=0.0, help="the largest difference allowed between outputs (0: bit-equal)"
    )
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads; base {args.base} / working tree")
    with tempfile.TemporaryDirectory() as folder:
        kernels = {"base": build(args.base, Path(folder) / "base"), "tree": build(None, Path(folder) / "tree")}
        cases = []
        for layout, dtype in LAYOUTS:
            name = f"{layout} {str(dtype).removeprefix('torch.')}"
            cases += [
                (f"decode W2 {name}", decode_call(layout, dtype, [n + 40 for n in W2_LENGTHS]), 1),
                (f"decode W1 {name}", decode_call(layout, dtype, [320] * 8), 1),
                (f"decode one {name}", decode_call(layout, dtype, [500]), 1),
                (f"prefill W2 {name}", prefill_call(layout, dtype, W2_LENGTHS), 1),
            ]
        cases += [
            (f"decode a layer of 30, {order} pages, (3, 3, 64) bfloat16", model_call(shuffled), LAYERS)
            for order, shuffled in (("shuffled", True), ("ordered", False))
        ]
        for name, call, layers in cases:
            base, tree = (call(kernel).float() for kernel in kernels.values())
            difference = (base - tree).abs().max().item()
            if difference > args.tolerance:
                raise SystemExit(f"{name}: the two builds differ by up to {difference:g}")
            if difference:
                print(f"{name}: the two builds differ by up to {difference:g}")
            for round_ in range(1, args.rounds + 1):
                times: dict[str, list[float]] = {key: [] for key in kernels}
                for _ in range(args.calls):
                    for key, kernel in kernels.items():
                        started = time.perf_counter()
                        call(kernel)
                        times[key].append(time.perf_counter() - started)
                base, tree = (statistics.median(times[key]) * 1e6 / layers for key in kernels)
                print(f"{name}, round {round_}: base {base:.1f} us, tree {tree:.1f} us, base/tree {base / tree:.3f}")


if __name__ == "__main__":
    main()
