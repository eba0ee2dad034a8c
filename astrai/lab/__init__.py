"""The cache-sizing lab: replay request traces through the real page pool, without a model.

``trace`` reads and writes Mooncake's trace format, ``replay`` drives ``PagePool`` and ``KVCacheManager`` with a
trace under any eviction policy and capacity (Belady's MIN, ``belady``, included), ``record`` writes a trace of the
local engine's own requests; ``python -m astrai.lab`` is the command line.
"""
