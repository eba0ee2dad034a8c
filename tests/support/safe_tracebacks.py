"""A pytest plugin: on CPython 3.11, no garbage collection runs inside an ``ast.parse``.

Why: CPython 3.11's AST constructor keeps its recursion depth in state that every ``ast.parse`` shares (CPython
gh-106905, fixed in 3.12). The objects a parse makes can start a collection, and a collection runs finalizers and
``gc.callbacks``; when one of those parses too, the outer parse ends on a depth it did not start with and raises
``SystemError: AST constructor recursion depth mismatch``. A finalizer that raises is enough: its traceback is
printed, and 3.11's traceback module parses the source line for its carets. pytest parses a failing test's source
to print it, so the SystemError came out of the failure report: pytest stopped with an INTERNALERROR, the tests after
it never ran and no failure was listed. A fresh install hit it in tests/test_vllm_hardening.py, where half-built
openai clients failed in ``__del__`` (the clients are fixed; this makes the crash impossible whatever else fails).

With the collector off for the length of a parse, the parse runs nobody else's Python code, so nothing nests in it.
Every caller is covered (pytest's reports and assertion rewriting, the traceback module), since each looks
``ast.parse`` up when it calls it. tests/test_safe_tracebacks.py forces the nesting in a child pytest and checks
that the failure is reported by name.
"""

from __future__ import annotations

import ast
import functools
import gc
import sys
from typing import Any

_parse = ast.parse


@functools.wraps(_parse)
def _parse_without_collecting(*args: Any, **kwargs: Any) -> Any:
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _parse(*args, **kwargs)
    finally:
        if enabled:
            gc.enable()


if sys.version_info[:2] == (3, 11):
    ast.parse = _parse_without_collecting
