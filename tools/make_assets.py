"""Regenerate the tiny dataset and tokenizer shipped in monarch_sky/assets.

The corpus is synthetic (templated short stories from a fixed seed), so it can be
shipped and rebuilt without any download. The tokenizer is a byte-level BPE trained
on that corpus. Run: .venv/bin/python tools/make_assets.py
"""

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).resolve().parent.parent / "monarch_sky" / "assets"
SEED = 1234
N_STORIES = 2400
VOCAB_SIZE = 512
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

NAMES = ["Mia", "Leo", "Ava", "Sam", "Zoe", "Max", "Lily", "Tom", "Nora", "Ben"]
ANIMALS = ["dog", "cat", "bird", "fox", "rabbit", "horse", "duck", "frog"]
PLACES = ["park", "forest", "beach", "garden", "river", "hill", "farm", "town"]
OBJECTS = ["ball", "kite", "book", "hat", "box", "cake", "boat", "map"]
COLORS = ["red", "blue", "green", "yellow", "big", "small", "old", "new"]
FEELINGS = ["happy", "sad", "tired", "brave", "excited", "calm", "curious"]
WEATHER = ["sunny", "rainy", "windy", "cold", "warm", "quiet"]


def story(rng: random.Random) -> str:
    name, friend = rng.sample(NAMES, 2)
    animal, place, obj = rng.choice(ANIMALS), rng.choice(PLACES), rng.choice(OBJECTS)
    color, feeling = rng.choice(COLORS), rng.choice(FEELINGS)
    lines = [
        f"One {rng.choice(WEATHER)} day, {name} went to the {place}.",
        f"{name} had a {color} {obj} and a {animal} named {friend}.",
        f"The {animal} liked to play with the {obj} near the {place}.",
    ]
    for _ in range(rng.randint(2, 5)):
        lines.append(
            rng.choice(
                [
                    f"{name} felt {rng.choice(FEELINGS)} and ran to the {rng.choice(PLACES)}.",
                    f"The {animal} found a {rng.choice(COLORS)} {rng.choice(OBJECTS)} under a tree.",
                    f"{friend} the {animal} jumped over the {rng.choice(OBJECTS)}.",
                    f"It was {rng.choice(WEATHER)}, so {name} went home with the {animal}.",
                    f"{name} gave the {obj} to {rng.choice(NAMES)}, who said thank you.",
                ]
            )
        )
    lines.append(f"At the end of the day, {name} was {feeling}.")
    return " ".join(lines)


def write_dataset(rng: random.Random) -> list[str]:
    texts = [story(rng) for _ in range(N_STORIES)]
    out = ASSETS / "data"
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "train.jsonl", "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return texts


def write_tokenizer(texts: list[str]) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out = ASSETS / "tokenizer"
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "model_max_length": 4096}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


if __name__ == "__main__":
    write_tokenizer(write_dataset(random.Random(SEED)))
    print(f"wrote {ASSETS}/data/train.jsonl and {ASSETS}/tokenizer/")
