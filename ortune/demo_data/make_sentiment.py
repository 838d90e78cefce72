"""Regenerate the demo's sentiment data: `python ortune/demo_data/make_sentiment.py`.

Sentences are composed from hand-written parts (subjects, opinion phrases, contexts), some with negation,
so that a bag of words is not enough and a pretrained encoder has something to learn. Deterministic.
"""

import json
import random
from pathlib import Path

SUBJECTS = [
    "The movie",
    "This restaurant",
    "The new phone",
    "Our hotel room",
    "The concert",
    "This book",
    "The service",
    "The customer support team",
    "The coffee",
    "This laptop",
    "The tour guide",
    "The delivery",
    "The app update",
    "The museum",
    "The soundtrack",
    "The pasta",
    "The airline",
    "The headphones",
    "The training course",
    "The game",
]
POSITIVE = [
    "was wonderful",
    "exceeded every expectation",
    "was a real delight",
    "felt warm and welcoming",
    "works beautifully",
    "made my whole week",
    "was absolutely fantastic",
    "is worth every penny",
    "left me smiling",
    "was thoughtful and kind",
    "turned out brilliant",
    "was pleasantly surprising",
    "is a joy to use",
    "was superb from start to finish",
    "impressed everyone",
]
NEGATIVE = [
    "was a huge disappointment",
    "felt cold and rude",
    "broke after two days",
    "was painfully boring",
    "is a waste of money",
    "left me frustrated",
    "was dirty and loud",
    "turned out awful",
    "crashed constantly",
    "was bland and overpriced",
    "ruined the evening",
    "was slow and confusing",
    "made me angry",
    "fell apart immediately",
    "was the worst I have tried",
]
NEG_OF_POS = [
    "was not wonderful at all",
    "was far from fantastic",
    "was not worth the money",
    "never felt welcoming",
    "did not impress anyone",
]
NEG_OF_NEG = [
    "was not boring at all",
    "was never rude to us",
    "did not disappoint",
    "was far from awful",
    "never crashed once",
]
CONTEXTS = [
    "",
    " last weekend",
    " on our trip",
    " for the price",
    " this time",
    " honestly",
    " if you ask me",
    " overall",
]
ENDINGS = [".", "!", ". I would say so again.", ", truly.", "."]


def sentences(rng: random.Random, n: int) -> list[dict[str, str]]:
    rows = []
    for i in range(n):
        positive = i % 2 == 0
        r = rng.random()
        if r < 0.2:
            phrase = rng.choice(NEG_OF_NEG if positive else NEG_OF_POS)
        else:
            phrase = rng.choice(POSITIVE if positive else NEGATIVE)
        text = f"{rng.choice(SUBJECTS)} {phrase}{rng.choice(CONTEXTS)}{rng.choice(ENDINGS)}"
        rows.append({"text": text, "label": "positive" if positive else "negative"})
    rng.shuffle(rows)
    return rows


def main() -> None:
    here = Path(__file__).parent
    rng = random.Random(20261203)
    rows = sentences(rng, 480)
    for name, part in (("sentiment_train.jsonl", rows[:360]), ("sentiment_valid.jsonl", rows[360:])):
        with (here / name).open("w") as fh:
            for row in part:
                fh.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
