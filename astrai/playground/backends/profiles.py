"""Profiles: a model plus the settings of an engine over it. Each profile the playground serves has one engine.

The lesson's scenarios name their profiles (``scenarios.py``); a visitor's own settings (the Engine settings panel)
make a custom profile. Profiles are plain values: two visitors with equal settings name the same profile, and so
share its engine.

Which models may be loaded is the operator's choice, never a visitor's: the embedded model always; the small hub
checkpoints only when the operator enables them (``--allow-hub-models`` or ``ASTRAI_ALLOW_HUB_MODELS=1``), since
loading one downloads it into the shared process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from astrai import SUPPORTED_DTYPES
from astrai.eviction import POLICIES
from astrai.playground import knobs

EMBEDDED_MODEL = os.environ.get(
    "ASTRAI_EMBEDDED_MODEL", str(Path(__file__).resolve().parents[3] / "assets" / "models" / "tinystories-llama")
)
EMBEDDED_LABEL = "tinystories-llama (embedded, offline)"
HUB_MODELS = {
    "SmolLM2-135M-Instruct (hub)": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "Qwen2.5-0.5B-Instruct (hub)": "Qwen/Qwen2.5-0.5B-Instruct",
    "Qwen3-0.6B (hub)": "Qwen/Qwen3-0.6B",
}
HUB_MODELS_ENV = "ASTRAI_ALLOW_HUB_MODELS"
PAGE_SIZES = (4, 8, 16, 32, 64)
DTYPES = tuple(SUPPORTED_DTYPES)
POOL_PAGES = (8, 4096)
BATCH_SIZES = (1, knobs.MAX_BATCH)


def hub_models_allowed(flag: bool = False) -> bool:
    """The operator's switch: the command-line flag, or the environment variable set to 1/true/yes."""
    return flag or os.environ.get(HUB_MODELS_ENV, "").strip().lower() in ("1", "true", "yes")


def model_choices(allow_hub: bool) -> dict[str, str]:
    """The models a visitor may pick, label -> checkpoint: the embedded one, and the hub ones only when allowed."""
    return {EMBEDDED_LABEL: EMBEDDED_MODEL, **(HUB_MODELS if allow_hub else {})}


# where a profile's second tier lives and when a page is written to it: host memory, as the pool evicts the page
TIER_STORE = "memory"
TIER_WRITE = "on_evict"


@dataclass(frozen=True)
class EngineSettings:
    page_size: int = 16
    n_pages: int = 2048  # room for a full batch of 128 requests (~8 pages each: 32 four-panel runs) without preempting
    max_batch_size: int = knobs.MAX_BATCH_SIZE  # knobs.py says why 128; docs/benchmarks.md: the load curve
    prefix_caching: bool = True
    dtype: str = "float32"
    eviction: str = "lru"  # which cached page a full pool gives up first: astrai.eviction.POLICIES
    # a second tier of this many pages in host memory (``TIER_STORE``), written as ``TIER_WRITE`` says
    # (``InferenceEngine``'s and ``add_tenant``'s ``offload_pages``, ``offload_to``, ``offload_policy``); 0: none.
    # Lesson profiles set it, the Engine settings panel does not offer it
    offload_pages: int = 0

    def validate(self) -> None:
        if self.page_size not in PAGE_SIZES:
            raise ValueError(f"page size must be one of {', '.join(map(str, PAGE_SIZES))}")
        if not POOL_PAGES[0] <= self.n_pages <= POOL_PAGES[1]:
            raise ValueError(f"pool size must be between {POOL_PAGES[0]} and {POOL_PAGES[1]} pages")
        if not BATCH_SIZES[0] <= self.max_batch_size <= BATCH_SIZES[1]:
            raise ValueError(f"max batch must be between {BATCH_SIZES[0]} and {BATCH_SIZES[1]}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}")
        if self.eviction not in POLICIES:
            raise ValueError(f"eviction must be one of {', '.join(POLICIES)}")
        if self.offload_pages < 0 or (self.offload_pages and not self.prefix_caching):
            raise ValueError("a second tier needs prefix caching, and a number of pages >= 0")

    def describe(self) -> str:
        """In words, for the stats line and the engine status."""
        caching = "" if self.prefix_caching else ", prefix caching off"
        eviction = "" if self.eviction == "lru" else f", {self.eviction.upper()} eviction"
        pool = f"{self.n_pages} pages × {self.page_size} tokens, batch {self.max_batch_size}, {self.dtype}"
        tier = f", a second tier of {self.offload_pages} pages in memory" if self.offload_pages else ""
        return pool + caching + eviction + tier


@dataclass(frozen=True)
class Profile:
    """A model and the settings of the engine that serves it. ``name`` is what visitors read; equality (and so
    sharing an engine) is by model and settings alone."""

    model: str = EMBEDDED_LABEL  # a label of ``model_choices``
    settings: EngineSettings = field(default_factory=EngineSettings)
    name: str = field(default="default", compare=False)
    custom: bool = field(default=False, compare=False)  # made from a visitor's settings: counts against the bound
    # a lesson's small pool each visitor gets one of their own (``own``), unless they choose the shared one
    per_visitor: bool = field(default=False, compare=False)
    # whose own pool this is (an opaque digest of their session): a tenant of the default engine, served in its
    # forwards, never shared; None, an engine of its own that every visitor on the profile shares
    owner: str | None = None

    @property
    def engine(self) -> str:
        """Its engine in a sentence: "the “your own settings” engine" (a name in running text needs its quotes:
        "Building the your own settings engine" read as a typo)."""
        if self.owner is not None:
            return f"your own “{self.name}” pool"
        return f"the “{self.name}” engine"

    @property
    def key(self) -> str:
        """A stable text key (gr.State and logs): equal profiles have equal keys."""
        s = self.settings
        caching = "cache" if s.prefix_caching else "nocache"
        key = f"{self.model}|p{s.page_size}|n{s.n_pages}|b{s.max_batch_size}|{caching}|{s.dtype}|{s.eviction}"
        key += f"|tier{s.offload_pages}" if s.offload_pages else ""
        return key if self.owner is None else f"{key}|own:{self.owner}"

    def own(self, session: str) -> Profile:
        """This pool's settings as a pool of ``session``'s own (a tenant of the default engine)."""
        return dataclasses.replace(self, owner=owner_of(session))

    def shared(self) -> Profile:
        """The profile every visitor shares: this one without an owner."""
        return self if self.owner is None else dataclasses.replace(self, owner=None)


def owner_of(session: str) -> str:
    """The opaque digest that names ``session``'s own pools (``Profile.owner``): a session hash never reaches a log."""
    return hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=8).hexdigest()


DEFAULT_PROFILE = Profile()
# The lesson's small pools teach what pool pressure does to a visitor's own requests: each visitor gets one of
# their own (``per_visitor``), served in the default engine's forwards, so a class pressing Run at once queues on
# nothing, and no one's run evicts or preempts another's
SMALL_POOL_PROFILE = Profile(
    settings=EngineSettings(page_size=16, n_pages=40, max_batch_size=8), name="small pool", per_visitor=True
)
# One request at a time in 9 pages: each panel of "Why did it miss?" finds the cache as the panels before it left it
ONE_AT_A_TIME_PROFILE = Profile(
    settings=EngineSettings(page_size=16, n_pages=9, max_batch_size=1), name="one at a time, 9 pages", per_visitor=True
)

# "A second tier": one request at a time in 8 pages of each visitor's own, and a tier of their own in memory that
# keeps what the pool evicts. The step's four stories fill at most 5 full pages each (prompt and output): 32 pages
# (1.5 MB of float32 KV on the embedded model) keep all of them, with room to spare
SECOND_TIER_PROFILE = Profile(
    settings=EngineSettings(page_size=16, n_pages=8, max_batch_size=1, offload_pages=32),
    name="8 pages and a second tier",
    per_visitor=True,
)


def without_caching(profile: Profile) -> Profile:
    """The same engine with prefix caching off: where Compare runs its second half. A pool of its own, so the
    comparison's pages never take the place of anyone's cached pages, and its lookups never lower the hit rate of the
    engine that visitors share."""
    settings = dataclasses.replace(profile.settings, prefix_caching=False, offload_pages=0)  # nothing looked up
    return dataclasses.replace(profile, settings=settings, name=f"{profile.name}, caching off")
