"""The second KV tier: pages the pool stored or evicted live on in a larger, slower store (``InferenceEngine``'s
``offload_pages`` / ``offload_to`` / ``offload_policy``). ``store.py``: where the bytes live (memory, a file);
``tier.py``: ``SecondTier``, its index, eviction order, write policy, counters and events."""

from astrai.tier.store import FileStore, MemoryStore, TierStore, open_store
from astrai.tier.tier import WRITE_POLICIES, SecondTier, TierCounters, TierWrite, WritePolicy, by_rank

__all__ = [
    "WRITE_POLICIES",
    "FileStore",
    "MemoryStore",
    "SecondTier",
    "TierCounters",
    "TierStore",
    "TierWrite",
    "WritePolicy",
    "by_rank",
    "open_store",
]
