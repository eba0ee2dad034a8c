"""``python -m tests.support.compiled_run SEED...``: one process's compiled engine on tiny Llamas, as JSON.

For each seed (a tiny Llama of that seed's weights, every layer packed so that the packed-linear op is in the
graph), an engine with ``compile=True`` generates greedily; printed per model: where its compiled forward came from
("loaded" from the cache, "compiled" now, or "eager"), its output ids and transformers' own, and how many
collections of the younger generations Python made since its last full one, once the engine was ready. The cache
is the one ``XDG_CACHE_HOME`` names. tests/test_compiled_forward.py runs it in fresh processes.
"""

from __future__ import annotations

import gc
import json
import sys

from astrai import InferenceEngine
from tests.support.tiny_models import make_model, make_tokenizer, reference_generate

PROMPTS = ["Once upon a time there was a little cat.", "The dog", "Lily and Tom went to the park."]
NEW_TOKENS = 12


def main(seeds: list[int]) -> None:
    tokenizer = make_tokenizer()
    results = []
    for seed in seeds:
        model = make_model("llama", len(tokenizer), seed=seed)
        reference = [reference_generate(model, tokenizer, p, NEW_TOKENS) for p in PROMPTS]
        with InferenceEngine(model, tokenizer, page_size=4, n_pages=64, compile=True) as engine:
            compiled = engine.runner.compiled
            source = "eager" if compiled is None else "loaded" if compiled.loaded else "compiled"
            since_full = gc.get_count()[2]  # collections of the younger generations since the last full one
            stream = engine.generate(PROMPTS, max_tokens=NEW_TOKENS, stream=True)
            for _ in stream:
                pass
            ids = [list(info.output_ids) for info in engine.request_info(stream.request_ids)]
        results.append({"seed": seed, "source": source, "ids": ids, "reference": reference, "since_full": since_full})
    print(json.dumps(results))


if __name__ == "__main__":
    main([int(seed) for seed in sys.argv[1:]])
