"""The bench corpus: a few hundred varied texts, 10–80 tokens each.

Generated from templates and word lists (no copied text), with a fixed seed, so
every run and every machine benches the same inputs. `bench/corpus.txt` is the
shipped output (one text per line); `python -m fleet.bench corpus` rebuilds it and
prints its token-length distribution. Lengths are measured with the model's own
tokenizer (special tokens included, as the model sees them) and texts outside
[MIN_TOKENS, MAX_TOKENS] are redrawn.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

from fleet.bench.cli import bench

CORPUS_PATH = Path(__file__).with_name("corpus.txt")
SEED = 20261202
SIZE = 480
MIN_TOKENS, MAX_TOKENS = 10, 80

# One vocabulary per topic: (subjects, verbs, objects, qualifiers, places).
TOPICS: dict[str, tuple[list[str], list[str], list[str], list[str], list[str]]] = {
    "kitchen": (
        ["the head chef", "a home cook", "the bakery", "our test kitchen", "the pastry team"],
        ["roasts", "simmers", "ferments", "folds", "glazes", "slices"],
        ["winter squash", "sourdough starter", "a tomato broth", "brown butter", "pickled shallots", "rye crackers"],
        ["slowly", "over low heat", "with a pinch of salt", "for twenty minutes", "until golden"],
        ["in a cast iron pan", "on the back burner", "in the walk-in fridge", "at the farmers market"],
    ),
    "astronomy": (
        ["the survey telescope", "an amateur observer", "the probe", "the radio array", "a research team"],
        ["tracks", "measures", "images", "detects", "maps", "resolves"],
        ["a faint comet", "the rings of the gas giant", "a binary star", "dust lanes in the galaxy", "a transiting exoplanet"],
        ["at dawn", "over six nights", "in the infrared band", "with long exposures", "despite thin clouds"],
        ["from the southern site", "near the ecliptic", "beyond the asteroid belt", "in the northern sky"],
    ),
    "software": (
        ["the build server", "a junior developer", "the scheduler", "our deploy script", "the database replica"],
        ["retries", "caches", "indexes", "compiles", "rolls back", "profiles"],
        ["the failing migration", "a slow query", "the release branch", "stale session tokens", "the memory leak"],
        ["after every commit", "under heavy load", "without downtime", "in under a second", "on the staging cluster"],
        ["in the payments service", "behind the load balancer", "on the edge nodes", "in the nightly job"],
    ),
    "garden": (
        ["the allotment", "my neighbour", "the greenhouse", "a seed library", "the orchard keeper"],
        ["prunes", "waters", "mulches", "transplants", "harvests", "grafts"],
        ["the apple trees", "climbing beans", "a bed of garlic", "potted basil", "the raspberry canes"],
        ["before the frost", "every other morning", "in early spring", "with rainwater", "after the first bloom"],
        ["along the south wall", "under the netting", "by the compost heap", "in raised beds"],
    ),
    "finance": (
        ["the quarterly report", "a small retailer", "the central bank", "our treasury team", "the auditor"],
        ["forecasts", "hedges", "reconciles", "defers", "reviews", "allocates"],
        ["operating costs", "the currency exposure", "late invoices", "the capital budget", "interest payments"],
        ["for the next fiscal year", "ahead of the board meeting", "line by line", "at a lower rate"],
        ["across three regions", "in the annual filing", "for the retail segment", "on the balance sheet"],
    ),
    "travel": (
        ["the night train", "a tour guide", "the ferry", "our hotel desk", "a backpacker"],
        ["delays", "books", "reroutes", "upgrades", "cancels", "confirms"],
        ["the connecting flight", "a window seat", "the mountain pass tickets", "two rooms", "the airport shuttle"],
        ["because of the storm", "at no extra cost", "two days early", "during the festival"],
        ["through the old town", "along the coast road", "at the border crossing", "on the island"],
    ),
    "sport": (
        ["the home side", "a veteran striker", "the relay team", "the coach", "the young goalkeeper"],
        ["defends", "sprints past", "trains for", "wins", "loses", "celebrates"],
        ["the final set", "a narrow lead", "the regional title", "the penalty shootout", "a personal best"],
        ["in the last minute", "in front of a full stadium", "after a long injury", "on a wet pitch"],
        ["at the indoor arena", "in the away leg", "on the practice field", "at the championship"],
    ),
    "health": (
        ["the clinic", "a night nurse", "the pharmacist", "the patient", "a physiotherapist"],
        ["monitors", "adjusts", "prescribes", "records", "explains", "schedules"],
        ["the blood pressure readings", "a new dosage", "the follow-up visit", "a knee exercise plan", "the allergy test"],
        ["twice a day", "before surgery", "after the fever drops", "for six weeks"],
        ["on the ward", "in the outpatient wing", "at the rural practice", "through the telehealth line"],
    ),
    "history": (
        ["the archive", "a medieval guild", "the museum curator", "the harbour town", "a local historian"],
        ["preserves", "documents", "restores", "catalogues", "rebuilds", "translates"],
        ["the merchant letters", "a stone bridge", "the parish records", "old trade maps", "the clock tower"],
        ["after the great fire", "during the long winter", "over two centuries", "with public funds"],
        ["near the river crossing", "in the old quarter", "by the cathedral", "along the trade route"],
    ),
    "music": (
        ["the string quartet", "a session drummer", "the choir", "the producer", "a street busker"],
        ["rehearses", "records", "arranges", "tunes", "improvises", "remixes"],
        ["the second movement", "a slow ballad", "the bass line", "an old folk song", "the closing chorus"],
        ["in a minor key", "at half tempo", "without a click track", "late into the night"],
        ["in the basement studio", "on the main stage", "at the open-air concert", "in the church hall"],
    ),
    "support": (
        ["the customer", "our help desk", "the account owner", "a support agent", "the billing system"],
        ["reports", "resets", "escalates", "refunds", "closes", "reopens"],
        ["a duplicate charge", "the locked account", "a broken download link", "the missing parcel", "the expired licence"],
        ["within one hour", "after three attempts", "on the second call", "without a receipt"],
        ["through the web form", "over live chat", "at the service counter", "in the mobile app"],
    ),
    "chemistry": (
        ["the lab technician", "a graduate student", "the reactor", "the analysis team", "the supplier"],
        ["titrates", "distils", "filters", "heats", "dilutes", "crystallises"],
        ["the copper solution", "a sample of seawater", "the polymer resin", "a buffer at pH seven", "the catalyst"],
        ["at room temperature", "under nitrogen", "in small batches", "for exactly ten minutes"],
        ["in the fume hood", "at the pilot plant", "in a sealed flask", "on the bench scale"],
    ),
}

CONNECTORS = ["Meanwhile,", "Later that week,", "As a result,", "In contrast,", "By noon,", "Even so,", "Afterwards,"]
OPINIONS = [
    "It worked better than expected.", "Nobody was surprised.", "The results were mixed.",
    "Everyone agreed it was worth the effort.", "There is still a lot to learn.",
    "It took longer than planned.", "The numbers speak for themselves.",
]
QUESTIONS = [
    "How does {s} handle {o} {q}?", "Why would {s} choose to work on {o}?",
    "What happens when {s} {v} {o} {p}?", "Is it safe to leave {o} {p}?",
    "Where can I find notes on {o}?",
]


def _sentence(rng: random.Random, topic: str) -> str:
    subjects, verbs, objects, quals, places = TOPICS[topic]
    s, v, o = rng.choice(subjects), rng.choice(verbs), rng.choice(objects)
    shape = rng.randrange(4)
    if shape == 0:
        text = f"{s} {v} {o} {rng.choice(quals)}."
    elif shape == 1:
        text = f"{s} {v} {o} {rng.choice(places)} {rng.choice(quals)}."
    elif shape == 2:
        text = f"{rng.choice(quals).capitalize()}, {s} {v} {o}."
    else:
        text = f"{s} {v} {o} {rng.choice(places)}, and {rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}."
    return text[0].upper() + text[1:]


def _question(rng: random.Random, topic: str) -> str:
    subjects, verbs, objects, quals, places = TOPICS[topic]
    return rng.choice(QUESTIONS).format(
        s=rng.choice(subjects), v=rng.choice(verbs), o=rng.choice(objects),
        q=rng.choice(quals), p=rng.choice(places),
    ).capitalize()


def _text(rng: random.Random) -> str:
    """One corpus entry: a query, a title, a sentence or a short paragraph."""
    topic = rng.choice(list(TOPICS))
    kind = rng.choices(["question", "title", "sentence", "paragraph"], weights=[2, 1, 2, 6])[0]
    if kind == "question":
        return _question(rng, topic)
    if kind == "title":
        subjects, _, objects, quals, _ = TOPICS[topic]
        return f"{rng.choice(objects).title()} {rng.choice(quals)}: notes from {rng.choice(subjects)}"
    if kind == "sentence":
        return _sentence(rng, topic)
    parts = [_sentence(rng, topic)]
    for _ in range(rng.randint(1, 3)):
        nxt = _sentence(rng, rng.choice([topic, topic, rng.choice(list(TOPICS))]))
        parts.append(f"{rng.choice(CONNECTORS)} {nxt[0].lower()}{nxt[1:]}" if rng.random() < 0.5 else nxt)
    if rng.random() < 0.4:
        parts.append(rng.choice(OPINIONS))
    return " ".join(parts)


def generate(count_tokens, size: int = SIZE, seed: int = SEED) -> list[str]:
    """`size` distinct texts whose token counts lie in [MIN_TOKENS, MAX_TOKENS].

    `count_tokens(list[str]) -> list[int]` is injected so this stays free of
    tokenizer loading.
    """
    rng = random.Random(seed)
    out: list[str] = []
    seen: set[str] = set()
    while len(out) < size:
        batch = [t for t in (_text(rng) for _ in range(64)) if t not in seen]
        for text, n in zip(batch, count_tokens(batch)):
            if MIN_TOKENS <= n <= MAX_TOKENS and text not in seen and len(out) < size:
                seen.add(text)
                out.append(text)
    return out


def load(path: Path = CORPUS_PATH) -> list[str]:
    texts = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts:
        raise RuntimeError(f"{path} is empty; rebuild it with `python -m fleet.bench corpus`")
    return texts


@bench("corpus", summary="Rebuild bench/corpus.txt: a few hundred varied texts, 10-80 tokens each.")
def main(args: argparse.Namespace) -> None:
    from fleet.bench.tokens import TokenCounter, describe_lengths

    counter = TokenCounter.for_default_model()
    texts = generate(counter.count)
    CORPUS_PATH.write_text("\n".join(texts) + "\n", encoding="utf-8")
    print(f"wrote {len(texts)} texts to {CORPUS_PATH}", file=sys.stderr)
    print(describe_lengths(counter.count(texts)))
