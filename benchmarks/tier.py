"""The second tier against recomputing: ``python -m benchmarks.tier [--model embedded|smollm]
[--dtypes float32,bfloat16] [--lengths 16,64,256,1024,2048] [--rounds 3] [--folder DIR]``.

For each dtype and shared-prefix length L (tokens, whole pages of 16), in each round, on one engine with a file tier
(``offload_to=DIR``, "on_evict") and a pool that holds one request:

* recomputed: ``clear()`` (both tiers), then prompt A (L + 1 random tokens, one output token; at the model's
  context limit, as many as fit with the output token, of which the lookup serves the full pages before the last
  token): its TTFT computes the whole prompt;
* loaded: prompt B (the longest length, other tokens) evicts A's pages from the pool into the tier, then A again:
  its TTFT loads the prefix from the tier (``CacheStats.second_tier``: pages loaded, seconds loading) and computes
  the rest; and A once more, for reference: its TTFT with the same prefix a hit in the pool.

It prints, per dtype and length, min / median / max over the rounds of: load time per page (the tier's own
``load_seconds`` over its pages: reading the file into the pool's pages), recompute time per page (the recomputed
TTFT over the pages loaded), and the three TTFTs; loading wins from the shortest length whose loaded TTFT is below the
recomputed one (the break-even, in tokens of shared prefix). Then, per length, the tier's load bandwidth against this
machine's own bound, measured right after each load: one ``os.preadv`` of as many bytes of the same file (what the
OS page cache holds, as the load read) into memory touched before, as the pool's pages were; and their ratio.
Engines run eager (``compile=False``): no compile on 2 cores; a warm-up prompt before the rounds is not counted.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Sequence

from astrai import InferenceEngine
from astrai.tier import FileStore
from benchmarks.bench import embedded, smollm_shaped
from benchmarks.host_cpu import cpu_name

PAGE = 16


def spread(values: Sequence[float], scale: float = 1e3) -> str:
    """min / median / max, scaled (ms by default)."""
    return f"{min(values) * scale:8.3f} / {statistics.median(values) * scale:8.3f} / {max(values) * scale:8.3f}"


def ttft(engine: InferenceEngine, ids: list[int]) -> float:
    stream = engine.generate_ids([ids], max_tokens=1, stream=True)
    for _ in stream:
        pass
    (info,) = engine.request_info(stream.request_ids)
    assert info.ttft is not None
    return info.ttft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["embedded", "smollm"], default="embedded")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--lengths", default="16,64,256,1024,2048")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--folder", default=None, help="where the tier's file goes (default: a temporary folder)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if any(n % PAGE for n in lengths):
        parser.error(f"lengths must be whole pages of {PAGE} tokens")
    print(cpu_name())
    rng = random.Random(0)
    for dtype in args.dtypes.split(","):
        model, tokenizer = embedded() if args.model == "embedded" else smollm_shaped()
        vocab = len(tokenizer)
        limit = model.config.max_position_embeddings - 1  # the longest prompt: its output token takes the last place
        longest = min(max(lengths) + 1, limit)
        pages = -(-(longest + 1) // PAGE)  # the longest prompt and its output token: B takes the whole pool
        with tempfile.TemporaryDirectory(dir=args.folder) as folder:
            engine = InferenceEngine(
                model, tokenizer, page_size=PAGE, n_pages=pages, max_batch_size=1, max_batched_tokens=4096,
                dtype=dtype, compile=False, offload_pages=2 * pages, offload_to=folder, offload_policy="on_evict",
            )  # fmt: skip
            tier = engine.cache.tier
            assert tier is not None and isinstance(tier.store, FileStore)
            with engine, open(tier.store.path, "rb", buffering=0) as file:
                buffer = memoryview(bytearray(file.seek(0, os.SEEK_END)))  # touched, as the pool's pages are
                figures: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
                ttft(engine, [rng.randrange(1, vocab) for _ in range(longest)])  # a warm-up: not counted
                for _ in range(args.rounds):
                    for length in lengths:
                        a = [rng.randrange(1, vocab) for _ in range(min(length + 1, limit))]
                        b = [rng.randrange(1, vocab) for _ in range(longest)]
                        engine.clear()
                        recomputed = ttft(engine, a)
                        ttft(engine, b)
                        before = engine.cache_stats().second_tier
                        loaded = ttft(engine, a)
                        after = engine.cache_stats().second_tier
                        assert before is not None and after is not None and after.enabled
                        moved = after.loaded_pages - before.loaded_pages
                        expected = (len(a) - 1) // PAGE  # every full page but a last one that ends the prompt
                        assert moved == expected, f"{moved} pages loaded of {expected}"
                        nbytes = after.bytes_loaded - before.bytes_loaded
                        started = time.perf_counter()  # the bound: as many bytes of the same file, read at once
                        assert os.preadv(file.fileno(), [buffer[:nbytes]], 0) == nbytes
                        read = nbytes / (time.perf_counter() - started)
                        cached = ttft(engine, a)  # A's pages are in the pool now: a plain hit, for reference
                        row = figures[length]
                        row["load"].append((after.load_seconds - before.load_seconds) / moved)
                        row["recompute"].append(recomputed / moved)
                        row["ttft_recomputed"].append(recomputed)
                        row["ttft_loaded"].append(loaded)
                        row["ttft_cached"].append(cached)
                        row["bandwidth"].append(nbytes / (after.load_seconds - before.load_seconds))
                        row["read"].append(read)
                        row["ratio"].append(row["bandwidth"][-1] / read)
        page_kib = tier.store.page_bytes / 1024
        print(f"\n{args.model} model, {dtype}, pages of {PAGE} tokens ({page_kib:.0f} KiB of KV), ", end="")
        print(f"{args.rounds} rounds, min / median / max")
        print(f"{'prefix':>7} | {'load ms/page':>28} | {'recompute ms/page':>28} | {'TTFT loaded ms':>28} | "
              f"{'TTFT recomputed ms':>28} | {'TTFT pool hit ms':>28}")  # fmt: skip
        wins = None
        for length in lengths:
            row = figures[length]
            print(f"{length:7d} | {spread(row['load'])} | {spread(row['recompute'])} | {spread(row['ttft_loaded'])} | "
                  f"{spread(row['ttft_recomputed'])} | {spread(row['ttft_cached'])}")  # fmt: skip
            if wins is None and statistics.median(row["ttft_loaded"]) < statistics.median(row["ttft_recomputed"]):
                wins = length
        print("loading wins (median TTFT) from", f"{wins} tokens of shared prefix" if wins else "none of these lengths")
        print(f"{'prefix':>7} | {'tier load MB/s':>28} | {'sequential read MB/s':>28} | {'load / read, %':>28}")
        for length in lengths:
            row = figures[length]
            print(f"{length:7d} | {spread(row['bandwidth'], 1e-6)} | {spread(row['read'], 1e-6)} | "
                  f"{spread(row['ratio'], 100)}")  # fmt: skip


if __name__ == "__main__":
    main()
