"""The second tier against recomputing: ``python -m benchmarks.tier [--model embedded|smollm] [--stores file,memory]
[--dtypes float32,bfloat16] [--lengths 16,64,256,1024,2048] [--rounds 3] [--folder DIR]``.

For each store (a file tier, ``offload_to=DIR``, and a memory tier, ``offload_to="memory"``), dtype and
shared-prefix length L (tokens, whole pages of 16), in each round, on one engine with that tier ("on_evict") and a
pool that holds one request:

* recomputed: ``clear()`` (both tiers), then prompt A (L + 1 random tokens, one output token; at the model's
  context limit, as many as fit with the output token, of which the lookup serves the full pages before the last
  token): its TTFT computes the whole prompt;
* loaded: prompt B (the longest length, other tokens) evicts A's pages from the pool into the tier, then A again:
  its TTFT loads the prefix from the tier (``CacheStats.second_tier``: pages loaded, seconds loading) and computes
  the rest; and A once more, for reference: its TTFT with the same prefix a hit in the pool.

It prints, per dtype and length, min / median / max over the rounds of: load time per page (the tier's own
``load_seconds`` over its pages: reading the store into the pool's pages), recompute time per page (the recomputed
TTFT over the pages loaded), and the three TTFTs; loading wins from the shortest length whose loaded TTFT is below the
recomputed one (the break-even, in tokens of shared prefix). Then, per length, the tier's load bandwidth against this
machine's own bound, measured right after each load, into memory touched before, as the pool's pages were: for the
file, one ``os.preadv`` of as many bytes of the same file (what the OS page cache holds, as the load read); for
memory, one ``memcpy`` (``ctypes.memmove``) of as many bytes of the store's own memory; and their ratio.
Engines run eager (``compile=False``): no compile on 2 cores; a warm-up prompt before the rounds is not counted.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import random
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from astrai import InferenceEngine
from astrai.tier import FileStore, MemoryStore, TierStore
from benchmarks.bench import embedded, smollm_shaped
from benchmarks.host_cpu import cpu_name

PAGE = 16
Figures = dict[int, dict[str, list[float]]]  # per prefix length, each figure's values over the rounds


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


@contextmanager
def bound_of(store: TierStore) -> Iterator[Callable[[int], float]]:
    """This machine's bound for ``store``: a function that moves ``nbytes`` the plainest way its medium allows (see
    the module docstring) into a buffer touched before, and returns its bytes per second."""
    if isinstance(store, FileStore):
        with open(store.path, "rb", buffering=0) as file:
            buffer = memoryview(bytearray(file.seek(0, os.SEEK_END)))
            buffer[:] = b"\1" * len(buffer)  # touched, as the pool's pages are

            def read(nbytes: int) -> float:
                started = time.perf_counter()
                assert os.preadv(file.fileno(), [buffer[:nbytes]], 0) == nbytes
                return nbytes / (time.perf_counter() - started)

            yield read
    else:
        assert isinstance(store, MemoryStore)
        target = bytearray(b"\1" * store.data.numel())  # touched
        into, source = ctypes.addressof(ctypes.c_char.from_buffer(target)), store.data.data_ptr()

        def memcpy(nbytes: int) -> float:
            started = time.perf_counter()
            ctypes.memmove(into, source, nbytes)
            return nbytes / (time.perf_counter() - started)

        yield memcpy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["embedded", "smollm"], default="embedded")
    parser.add_argument("--stores", default="file,memory", help="file, memory or both")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--lengths", default="16,64,256,1024,2048")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--folder", default=None, help="where the tier's file goes (default: a temporary folder)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    if any(n % PAGE for n in lengths):
        parser.error(f"lengths must be whole pages of {PAGE} tokens")
    stores = args.stores.split(",")
    if not set(stores) <= {"file", "memory"}:
        parser.error("stores are file, memory or both")
    print(cpu_name())
    rng = random.Random(0)
    for store in stores:
        for dtype in args.dtypes.split(","):
            model, tokenizer = embedded() if args.model == "embedded" else smollm_shaped()
            with tempfile.TemporaryDirectory(dir=args.folder) as folder:
                figures, page_bytes = measure(model, tokenizer, dtype, folder if store == "file" else "memory",
                                              lengths, args.rounds, rng)  # fmt: skip
            print(f"\n{args.model} model, {store} tier, {dtype}, pages of {PAGE} tokens ({page_bytes / 1024:.0f} KiB "
                  f"of KV), {args.rounds} rounds, min / median / max")  # fmt: skip
            report(figures, lengths, "sequential read" if store == "file" else "memcpy")


def measure(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    dtype: str,
    offload_to: str,
    lengths: list[int],
    rounds: int,
    rng: random.Random,
) -> tuple[Figures, int]:
    """One engine's rounds (see the module docstring): per length, each figure's values; and a page's bytes."""
    vocab = len(tokenizer)
    limit = model.config.max_position_embeddings - 1  # the longest prompt: its output token takes the last place
    longest = min(max(lengths) + 1, limit)
    pages = -(-(longest + 1) // PAGE)  # the longest prompt and its output token: B takes the whole pool
    engine = InferenceEngine(
        model, tokenizer, page_size=PAGE, n_pages=pages, max_batch_size=1, max_batched_tokens=4096,
        dtype=dtype, compile=False, offload_pages=2 * pages, offload_to=offload_to, offload_policy="on_evict",
    )  # fmt: skip
    tier = engine.cache.tier
    assert tier is not None
    figures: Figures = defaultdict(lambda: defaultdict(list))
    with engine, bound_of(tier.store) as bound:
        ttft(engine, [rng.randrange(1, vocab) for _ in range(longest)])  # a warm-up: not counted
        for _ in range(rounds):
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
                best = bound(nbytes)  # right after the load: as many bytes, moved at once
                cached = ttft(engine, a)  # A's pages are in the pool now: a plain hit, for reference
                row, seconds = figures[length], after.load_seconds - before.load_seconds
                row["load"].append(seconds / moved)
                row["recompute"].append(recomputed / moved)
                row["ttft_recomputed"].append(recomputed)
                row["ttft_loaded"].append(loaded)
                row["ttft_cached"].append(cached)
                row["bandwidth"].append(nbytes / seconds)
                row["bound"].append(best)
                row["ratio"].append(nbytes / seconds / best)
    return figures, tier.store.page_bytes


def report(figures: Figures, lengths: list[int], bound: str) -> None:
    """The two tables: times per length, then bandwidth against the bound; and where loading starts to win."""
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
    print(f"{'prefix':>7} | {'tier load MB/s':>28} | {bound + ' MB/s':>28} | {'load / ' + bound + ', %':>28}")
    for length in lengths:
        row = figures[length]
        print(f"{length:7d} | {spread(row['bandwidth'], 1e-6)} | {spread(row['bound'], 1e-6)} | "
              f"{spread(row['ratio'], 100)}")  # fmt: skip


if __name__ == "__main__":
    main()
