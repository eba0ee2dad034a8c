"""One-click lessons: each fills the panels, names the engine profile it runs on, and says in a sentence what to
watch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from astrai.playground.backends.profiles import (
    DEFAULT_PROFILE,
    ONE_AT_A_TIME_PROFILE,
    SECOND_TIER_PROFILE,
    SMALL_POOL_PROFILE,
    Profile,
    without_caching,
)
from astrai.playground.views import sizing

Namespace = Literal["shared", "mine", "fresh"]
NAMESPACES: dict[Namespace, str] = {  # the run form's choice, in words
    "shared": "shared with everyone on this engine",
    "mine": "mine (the hash salted with my session)",
    "fresh": "fresh for each run (a cold cache)",
}


@dataclass(frozen=True)
class Scenario:
    name: str
    explanation: str
    prompts: list[str]
    prefix: str = ""
    max_tokens: int = 64
    profile: Profile = DEFAULT_PROFILE  # the engine it runs on, shared by every visitor on this scenario
    # which cached pages a run may hit: everyone's on the engine, the visitor's own, or only its own run's. A claim
    # about a first run ("no panel gets a cached token") holds for every visitor only in a fresh namespace: on a
    # shared engine the same prompts, run earlier by anyone, would be hit.
    namespace: Namespace = "shared"


# The eviction step's prompts share their first pages (the prefix, with the start token) and then differ: the second
# run hits those pages in every panel, and misses the panel's own pages that the first run's answers evicted
EVICTION_OPENING_PAGES = 2  # (tests/test_scenarios.py checks the count on the embedded tokenizer)
FOLLOW_UP = " Then"  # what Follow-up turn appends after each prompt and its answer

# Both "same page" prompts end with this after a first sentence of equal token count, so from the second page on
# their pages hold equal tokens (checked by tests/test_scenarios.py).
SHARED_TAIL = (
    "She liked to play in the park with her friends every day after school. They ran, jumped and laughed "
    "until the sun went down and it was time to go home."
)

SCENARIOS = [
    Scenario(
        name="Shared system prompt",
        explanation="All panels start with the same prefix. Each run starts from a cold cache of its own, so its "
        "full pages are computed once, by the first panel the engine schedules (on a vLLM server, whichever request "
        "reaches it first), and the others hit them in the same run: watch the hit badges and the shared (x-marked) "
        "pages in the map.",
        prefix="Once upon a time, in a small village by the sea, there lived a kind old fisherman named Tom. "
        "Every morning he took his little boat out on the water, and every evening he came home with fish "
        "for his friends. ",
        prompts=[
            "One day, he found a",
            "One day, his cat",
            "One day, a big storm",
            "One day, a little girl named Lily",
        ],
        namespace="fresh",
    ),
    Scenario(
        name="Distinct prompts (no hits)",
        explanation="Each prompt fills two full pages, but no two start alike, and each run starts from a cold cache "
        "of its own: every prompt token is computed, the run's hit rate is 0 and each panel owns its own pages.",
        prompts=[
            "The little dog ran to the park with his red ball. He wanted to find his friend, the big brown cat, who "
            "liked to sleep under the old tree.",
            "Lily wanted to bake a cake for her mom. She got flour, eggs and sugar from the kitchen, and her dad "
            "helped her mix them in a big bowl.",
            "Ben and Mia found a box in the garden. It was old and dirty, and when they opened it, they saw a small "
            "toy car and a shiny key inside.",
            "The sun was hot and the bird was thirsty. It flew over the town to look for water, and at last it saw a "
            "little pond near a farm.",
        ],
        namespace="fresh",
    ),
    Scenario(
        name="Eviction pressure (small pool)",
        explanation=f"Six stories open with the same {EVICTION_OPENING_PAGES} pages (the shared prefix), then two "
        "pages of their own, and ask for long answers: a 40-page pool of your own cannot keep them all. Run twice: "
        "in the first run the LRU fills, evictions (red) make room and requests are preempted; in the second, every "
        "panel finds the opening cached, and the badges say which of its own pages were evicted, and when.",
        prefix="Once upon a time, in a small town by a green forest, there lived a girl named Lily. Every night, "
        "her mom told her a story. ",
        prompts=[
            "A tiny frog wanted to see the big blue sea, so he hopped down the road past the farm and the old mill. "
            "On the way he met a duck who said hello, and",
            "Tom had a red ball that rolled all the way down the hill, over the bridge and into the dark woods. He "
            "ran after it as fast as he could, and then he",
            "The princess looked at the moon from her tall tower and wished for a friend who could fly with her. "
            "That night a small white owl with big eyes came to her window and",
            "Sam the bear was very hungry after his long winter sleep, so he went to the river to catch a fish. The "
            "water was cold and fast, and the fish",
            "In the garden, a busy bee could not find her way back to the hive before the rain came down. She hid "
            "under a big leaf and waited, and soon",
            "Max and his mom went to the shop to buy a cake for his sister's birthday. When they got there, the shop "
            "was closed, so Max had an idea and he",
        ],
        max_tokens=160,
        profile=SMALL_POOL_PROFILE,
        namespace="mine",
    ),
    Scenario(
        name="Same page, different prefix",
        explanation="Both prompts end with the same long sentence, starting at the same offset, so their later pages "
        "hold equal tokens. They still do not hit: a page's key chains the hash of every page before it. Each run "
        "starts from a cold cache of its own, and the prefix tree shows your last run's pages.",
        prompts=[
            "Lily had a red ball. " + SHARED_TAIL,
            "Tom had a big kite. " + SHARED_TAIL,
        ],
        namespace="fresh",
    ),
    Scenario(
        name="Follow-up turn",
        explanation=f"Run once, then press 'Follow-up turn': each prompt becomes prompt + answer + '{FOLLOW_UP}'. "
        "Run again and watch the pages filled by the answer hit, not just the prompt's. Your runs share a namespace "
        "of your own, so only your first turn's pages can be hit.",
        prompts=["Once upon a time there was a little cat named Kitty", "Ben found a shiny stone in the river"],
        max_tokens=48,
        namespace="mine",
    ),
]
# Why did it miss? One run whose panels' prompt tokens miss for different reasons: on an engine that runs one request
# at a time in 9 pages, each panel finds the cache as the panels before it left it (tests/test_scenarios.py runs it).
FISHERMAN = (
    "Once upon a time, in a small village by the sea, there lived a kind old fisherman named Tom. "
    "Every morning he took his little boat out on the water. "
)
WHY = Scenario(
    name="Why did it miss?",
    explanation="A pool of your own of 9 pages that runs one request at a time, each run in a cold cache of its own: "
    "panel 1 computes its story, panel 2 an unrelated one, panel 3 asks for panel 1's story and more, panel 4 a "
    "variant of it. Open 'Prompt tokens' and hover each coloured run of tokens for why it was cached or computed.",
    prompts=[
        FISHERMAN + "One day, he found a shiny shell on the sand.",
        "Lily and Ben went to the park to play with their new ball. They ran and jumped and laughed all day, "
        "and when the sun went down they walked home together, tired and happy.",
        FISHERMAN + "One day, he found a shiny shell on the sand. He showed it to his friend",
        FISHERMAN.replace("little boat", "big red boat") + "One day, a storm came.",
    ],
    max_tokens=64,
    profile=ONE_AT_A_TIME_PROFILE,
    namespace="fresh",
)
# LRU or ARC? Six requests one at a time in a 9-page pool: a system prompt asked with twice, a pass of one-off stories,
# then the system prompt again. LRU evicts the system prompt's pages (the least recently used) for the stories; ARC
# evicts the stories' (seen once) and keeps the system prompt's (asked for twice). tests/test_scenarios.py runs it on
# engines under both policies, and through the lab as Replay my requests does.
SYSTEM_PROMPT_PAGES = 3  # the system prompt's full pages (with the start token; checked on the embedded tokenizer)
FARM = (
    "You are the storyteller of the Green Hill farm. The farm has three cows, a red barn, a big pond with ducks and "
    "an old pony named Pepper. Answer in one short, kind sentence. "
)
POLICY = Scenario(
    name="LRU or ARC: which page goes?",
    explanation=f"A 9-page pool of your own runs six requests one at a time and evicts the least recently used page "
    f"(LRU). Panels 1, 2 and 6 open with the same {SYSTEM_PROMPT_PAGES}-page system prompt; panels 3-5 are one-off "
    "stories passing through. Run, then press Replay my requests (under 'How big should the cache be?') to run "
    "your requests through each eviction policy, side by side.",
    prompts=[
        FARM + "Who lives in the barn?",
        FARM + "What do the ducks do all day?",
        "Lily and Ben went to the park to play with their new ball. They ran and jumped and laughed all day, and "
        "when the sun went down they walked home together, tired and happy. At home their mom made them hot soup "
        "and bread.",
        "The little dog ran to the park with his red ball. He wanted to find his friend, the big brown cat, who liked "
        "to sleep under the old tree by the pond. But the cat was not there, so the dog sat down.",
        "Tom had a big kite. One windy day he took it to the top of the hill, and the kite flew up and up, over the "
        "trees and the houses, until it was a tiny dot in the sky. Then the wind stopped.",
        FARM + "Where does Pepper sleep at night?",
    ],
    max_tokens=4,  # the prompts' pages are the point: short answers fill no page of their own
    profile=ONE_AT_A_TIME_PROFILE,
    namespace="fresh",
)
# A second tier: four stories of SECOND_TIER_PAGES full pages each (and a token or more: checked on the embedded
# tokenizer by tests/test_scenarios.py), one request at a time in an 8-page pool of the visitor's own, so each request
# evicts the one before it into the visitor's own tier, and a second run loads every story's pages back
SECOND_TIER_PAGES = 4
SECOND_TIER = Scenario(
    name="A second tier",
    explanation=f"One request at a time in a {SECOND_TIER_PROFILE.settings.n_pages}-page pool of your own, with a "
    f"second tier of {SECOND_TIER_PROFILE.settings.offload_pages} pages in memory that keeps what the pool evicts. "
    f"Each story fills {SECOND_TIER_PAGES} pages, so each request evicts the one before it into the tier. Run twice: "
    "the second run loads the stories' pages back from the tier instead of computing them.",
    prompts=[
        "Once upon a time, a little girl named Lily lived in a house by a big green forest. Every morning she walked "
        "to the river with her dog, Max, to look at the fish. She liked to count them and give each one a name, and "
        "the fish swam close to say hello. One day she saw",
        "Tom was a small boy who loved his red kite more than anything. On windy days he ran up the hill behind his "
        "house, and the kite flew high over the trees and the town. His mom made him a sandwich to eat at the top, "
        "and he sat in the grass and watched the kite dance. One day the wind",
        "In a quiet pond at the edge of the farm lived a happy duck named Daisy. She swam in circles all day and "
        "talked to the frogs, the fish and the old turtle who slept on a rock. The farmer fed them corn every day, "
        "and the children of the town came to throw bread into the water. One morning",
        "Ben and Mia built a big castle of sand on the beach with their dad. They made towers, a bridge and a deep "
        "moat, and they put shells on the walls to make it pretty. Their little sister brought a bucket of water and "
        "a flag made of a leaf and a stick. Then a big wave",
    ],
    max_tokens=16,
    profile=SECOND_TIER_PROFILE,
    namespace="mine",  # a run hits only the visitor's own pages (on a pool shared with the class too)
)
# A fleet behind two routers (round_robin and a prefix-aware policy) gets one more scenario and lesson step. Each
# tenant's system prompt is long (several full blocks of vLLM's 32 tokens) and its own, so where its requests land
# decides whether the system prompt is computed once or once per replica.
TENANTS = Scenario(
    name="Tenants behind a router",
    explanation="Three tenants, each with its own long system prompt, send a wave of requests at a time. Press "
    "Compare routing: the same waves go once through each router, and the chart shows what each policy computed.",
    prompts=[
        "You are the helper of the Green Hill farm. The farm has three cows named Daisy, Bella and Rosie, a red "
        "barn, a big pond with ducks and a small orchard of apple trees. Every morning the farmer, Mr. Brown, feeds "
        "the hens and milks the cows, and his daughter Anna picks eggs in a basket. In the summer the children of "
        "the town come to pick apples and to ride the old pony, Pepper. Answer every question about the farm in "
        "short, kind sentences for children. Question:",
        "You are the guide of the city zoo. The zoo has two lions, a family of elephants, a tall giraffe named "
        "Stretch and a house full of colorful birds. The zookeeper, Miss Rose, feeds the penguins fish at noon, "
        "and the monkeys play on ropes all day long. On Sundays the children may touch the soft goats and the "
        "slow old turtle, Tim, in the little farm by the gate. Answer every question about the animals in short, "
        "happy sentences for children. Question:",
        "You are the keeper of the old lighthouse by the sea. The lighthouse has a bright lamp, a spiral stair of "
        "one hundred steps and a small boat called Wave. Every evening the keeper, Old Sam, climbs the stair to "
        "light the lamp, and his cat Misty sleeps by the warm window. When the fog comes in, the big horn sounds "
        "so that the fishing boats can find their way home. Answer every question about the lighthouse in short, "
        "calm sentences for children. Question:",
    ],
    max_tokens=16,
)
ROUTING_WAVES = (" What is there to see?", " Who lives there?", " What happens at night?")
SCENARIOS += [POLICY, SECOND_TIER, WHY]
SCENARIO_BY_NAME = {s.name: s for s in (*SCENARIOS, TENANTS)}


def sizing_claim() -> str:
    """The cache-sizing step's text: what the chart shows on the conversation trace, read from the shipped curves
    (``assets/traces/curves.json``, which tests/test_sizing.py checks against fresh replays)."""
    curves = sizing.load()[0]
    at = curves.nearest(5859)
    full = min(p.capacity for p in curves.points if p.policy == sizing.OPTIMUM and p.hit_rate >= curves.ceiling)
    largest = next(p for p in curves.points if p.policy == "lru" and p.capacity == curves.capacities[-1])
    low, high = curves.capacities[0], curves.capacities[-1]
    return (
        f"Scroll to 'How big should the cache be?' and click through the capacities, {low:,} to {high:,} blocks, "
        f"each about {sizing.step_ratio(curves):.1f}× the one before: the curves and the table say what share of the "
        f"prompt tokens each eviction policy serves there. On an hour of Kimi's conversation traffic, at "
        f"{sizing.summary(curves, at)} The optimum reaches that ceiling at {full:,} blocks; LRU, even at "
        f"{largest.capacity:,}, serves {largest.hit_rate:.1%}."
    )


def policy_claim() -> str:
    """The eviction-policy step's text, its figures from the scenario: the system prompt's tokens, the pool's pages."""
    settings = POLICY.profile.settings
    system = SYSTEM_PROMPT_PAGES * settings.page_size
    return (
        "Press Run, then Replay my requests (in 'How big should the cache be?'). Six requests run one at a time in a "
        f"{settings.n_pages}-page pool of your own that evicts the least recently used page (LRU): panels 1, 2 and 6 "
        f"open with the same {SYSTEM_PROMPT_PAGES}-page system prompt, panels 3-5 are one-off stories passing "
        f"through. Panel 2 finds the system prompt cached ({system} cached); by panel 6 the stories have pushed it out "
        f"({system} evicted). "
        "Replay my requests runs your requests again through each eviction policy, side by side in the table: at "
        f"your pool's {settings.n_pages} blocks LRU serves {system} prompt tokens and ARC {2 * system}. ARC keeps the "
        "pages asked for twice apart from pages seen once, so a pass of one-off stories cannot flush them."
    )


# The second-tier step says a page loads at least this many times faster than it is computed, on the embedded model:
# tests/test_scenarios.py measures both on the machine that runs the suite (docs/benchmarks.md: 460× to 10,000×)
LOAD_FASTER_THAN_COMPUTE = 10


def second_tier_claim() -> str:
    """The second-tier step's text: its figures from the scenario and its pool's settings; its comparison of load
    and compute costs measured by tests/test_scenarios.py (``LOAD_FASTER_THAN_COMPUTE``)."""
    settings = SECOND_TIER.profile.settings
    loaded = SECOND_TIER_PAGES * settings.page_size
    return (
        f"Press Run twice. A pool of your own runs one request at a time in {settings.n_pages} pages and keeps what "
        f"it evicts in a second tier of {settings.offload_pages} pages in memory. Each story fills {SECOND_TIER_PAGES} "
        "pages, so each request evicts the one before it into the tier. In the second run every badge says "
        f"{loaded} cached, {loaded} of them loaded from the second tier (copied back, not computed), and the stats "
        "line's 'Second tier' says how many pages were loaded and in how many milliseconds. On this model loading "
        f"wins from the first full page: a page loads more than {LOAD_FASTER_THAN_COMPUTE}× faster than it is "
        "computed wherever the test suite runs, 460× to 10,000× on a 2-core Intel Xeon with AMX (docs/benchmarks.md). "
        "Recomputing wins only where a load costs more than a page's prefill: a large page from a slow disk or a "
        "network store, for a small model on a fast accelerator."
    )


@dataclass(frozen=True)
class LessonStep:
    """One step of the guided lesson: a scenario, the view to look at, and a claim the tests check."""

    title: str
    scenario: str
    look_at: str  # elem_id of the view to highlight
    text: str


_OPENING = EVICTION_OPENING_PAGES * SCENARIO_BY_NAME["Eviction pressure (small pool)"].profile.settings.page_size
LESSON = [
    LessonStep(
        "A shared system prompt is computed once",
        "Shared system prompt",
        "page_map",
        "Press Run. Panel 1 computes the prefix pages; panels 2–4 are admitted in the same step and share them "
        "(x-marked cells in the page map, while the run lasts: press ▶ slow to replay it step by step), so their "
        "badges show 32 or more cached tokens in the very first run.",
    ),
    LessonStep(
        "Nothing shared, nothing hit",
        "Distinct prompts (no hits)",
        "plot_2",
        "Press Run. Every prompt fills two full pages, but no two start alike and the run starts from a cold cache, "
        "so no panel gets a cached token: the dots of this run in the hit rate chart sit at 0%.",
    ),
    LessonStep(
        "Eviction costs hits",
        "Eviction pressure (small pool)",
        "plot_1",
        f"Press Run twice. Six stories open with the same {EVICTION_OPENING_PAGES} pages, then have two of their "
        "own, and ask for long answers: the 40-page pool cannot keep it all. In the first run the LRU fills, then "
        "evictions (red) make room and requests are preempted. In the second run every badge shows at least the "
        f"opening's {_OPENING} cached tokens, and some also 'evicted at step N': pages of the panel's own that the "
        "first run stored, evicted since to make room for others. Those tokens are computed again: that is what "
        "eviction cost you.",
    ),
    LessonStep(
        "The chained hash: same tokens, different key",
        "Same page, different prefix",
        "prefix_tree",
        "Press Run. Both prompts hold a page with the very same tokens, yet the second gets 0 cached tokens: each "
        "page's key hashes every page before it, so the tree of your run shows two separate branches from the root.",
    ),
    LessonStep(
        "A follow-up turn hits the answer too",
        "Follow-up turn",
        "tokens_accordion",
        "Press Run, then Follow-up turn, then Run again. The second turn's cached tokens go past the first prompt: "
        "pages filled by the generated answer were registered and hit too (open 'Prompt tokens' to see them green).",
    ),
    LessonStep(
        "Caching off versus on",
        "Shared system prompt",
        "savings",
        "Press Compare with caching off. The same batch runs twice, first with the prefix cache, then on an engine "
        "without it, and the chart counts the prefill tokens each computed: with the cache, the prefix's full pages "
        "are computed once, not once per panel. The badges and the table show both halves, each labelled. Times are "
        "not compared: the halves run one after the other, on two engines, and on the tiny embedded model a prompt's "
        "prefill is a small part of a step, so their times differ by what else the machine was doing.",
    ),
    LessonStep("How big should the cache be?", "Eviction pressure (small pool)", "sizing", sizing_claim()),
    LessonStep("LRU or ARC: which page goes?", POLICY.name, "sizing", policy_claim()),
    LessonStep(
        "A second tier: when is loading faster than recomputing?", SECOND_TIER.name, "stats", second_tier_claim()
    ),
    LessonStep(
        "Why did it miss?",
        WHY.name,
        "tokens_accordion",
        "Press Run and open 'Prompt tokens'. Panel 1's tokens are new. Panel 2's first page diverges from panel "
        "1's after its first token (every prompt starts with the start-of-text token, written `<s>`), the rest is "
        "new. Panel 3 repeats panel 1's prompt: its first pages are still cached, but the page after them was "
        "evicted to make room for panel 2's answer (red; hover for the step). Panel 4 shares panel 1's first page and "
        "diverges in its second. Whatever follows a prompt's last full page is computed (a partial page), and so is "
        "its last token, always.",
    ),
]


# Built at start: the engines the lesson's steps run on, and the one step 6 compares the default engine with.
LESSON_PROFILES = (
    *dict.fromkeys(SCENARIO_BY_NAME[step.scenario].profile for step in LESSON),
    without_caching(DEFAULT_PROFILE),
)
ROUTING_STEP = LessonStep(
    "Routing decides what is reused",
    TENANTS.name,
    "routing",
    "Press Compare routing. The tenants' waves go once through the round-robin router and once through the "
    "prefix-aware one, each pass on a cold cache: round robin sends a tenant's requests to both replicas, so its "
    "system prompt is computed on each; the prefix-aware router keeps a tenant where its prompt is cached, so "
    "fewer prefill tokens are computed (the bars on the left, as the servers reported them).",
)


@dataclass(frozen=True)
class LessonEnd:
    """The page after the last step: no scenario, the visitor's own runs counted by cause (``look_at`` shows them)."""

    title: str
    look_at: str  # elem_id of the view it fills
    text: str


WHAT_YOU_SAW = LessonEnd(
    "What you saw",
    "lesson_end",
    "Below: every prompt token of your runs since you opened the page (or restarted the lesson), counted by why it "
    "was served from the cache or computed, and the five reasons a token is computed. Under the hit rate chart, "
    "'Why is my hit rate low?' counts your engine's requests from the other end: pick 'your engine since it "
    "started' and press it for a ladder from every prompt token down to the tokens your engine served from its "
    "cache (its last rung, 'delivered'), each gap between two rungs split into its causes (hover it). Press Restart "
    "lesson to go through the steps again.",
)


@dataclass(frozen=True)
class Lesson:
    """The scenarios a deployment offers, its guided steps (a fleet with two routers adds routing) and its end.

    The pages of the lesson are numbered 0 .. ``length`` - 1: each step, then the end."""

    scenarios: tuple[Scenario, ...]
    steps: tuple[LessonStep, ...]
    end: LessonEnd = WHAT_YOU_SAW

    @classmethod
    def for_deployment(cls, routers: int) -> Lesson:
        if routers >= 2:
            return cls((*SCENARIOS, TENANTS), (*LESSON, ROUTING_STEP))
        return cls(tuple(SCENARIOS), tuple(LESSON))

    @property
    def length(self) -> int:
        return len(self.steps) + 1

    def is_end(self, index: int) -> bool:
        return index >= len(self.steps)

    def look_at(self) -> list[str]:
        """The view each page points at, by page."""
        return [step.look_at for step in self.steps] + [self.end.look_at]

    def note(self, index: int) -> str:
        """The note a page shows (the browser's highlight hook reads the page number back from it)."""
        page = self.end if self.is_end(index) else self.steps[index]
        title = page.title if page.title.endswith(("?", "!", ".")) else f"{page.title}."
        return f"**Lesson {index + 1}/{self.length}: {title}** {page.text}"
