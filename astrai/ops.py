"""Registers the engine's opaque ops (``astrai::packed_linear``, ``astrai::paged_attention``) with torch's dispatcher.

A compiled forward calls each op as one opaque node: inductor compiles the model around them, and each call goes
through the dispatcher to the op's Python kernel. How an op is registered decides that call's fixed cost, paid 31
times a step on the embedded model (25 products, 6 attentions) and 151 times on a SmolLM2-135M-shaped one:

- ``torch.library.custom_op`` wraps the kernel in its own Python layers: a packed product of 8 rows cost 9.9-10.3
  us more through it than called directly (3 rounds, 2-core AMD EPYC, no AMX);
- ``Library.define`` and ``Library.impl`` hand the dispatcher the kernel itself: 6.2-6.3 us more. A compiled float32
  decode step of the embedded model (8 requests at 300 tokens) was 1.023-1.034x faster with the product
  registered this way (3 rounds of 200 alternated steps, one process, same CPU; docs/benchmarks.md).

Invariant: an op's fake (shape) function describes exactly what its kernel returns, a new tensor: the schemas
declare no aliasing and no mutation, as the graph needs them to be used (each op's docstring says what it does
beyond its result).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_library = torch.library.Library("astrai", "FRAGMENT")  # lives as long as the process: the ops stay registered


def define(
    schema: str, kernel: Callable[..., torch.Tensor], fake: Callable[..., torch.Tensor], dispatch_key: str
) -> Callable[..., torch.Tensor]:
    """Define ``astrai::<schema>``, with ``kernel`` for ``dispatch_key`` and ``fake`` for tracing; return its
    overload (``torch.ops.astrai.<name>.default``), to call as a function."""
    name = schema.split("(", 1)[0]
    _library.define(schema)
    _library.impl(name, kernel, dispatch_key)
    torch.library.register_fake(f"astrai::{name}", fake, lib=_library)
    return getattr(torch.ops.astrai, name).default
