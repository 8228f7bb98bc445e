"""Writes the JSON lines the lm-eval task YAMLs here read (run from the repo root; the files are
committed, so an evaluation needs no download):

    mc.jsonl      40 four-way multiple-choice questions: 20 sums of two numbers, 20 capitals
    ruler.jsonl   RULER-style passkey and single-needle samples (profiling/ruler.py), 12 each,
                  fitted to 512 prompt tokens of SmolLM2's tokenizer

    .venv/bin/python benchmarks/lm_eval_tasks/make_data.py
"""

import json
import random
from pathlib import Path

from spin_cluster.model_store import default_model_path
from spin_cluster.profiling import ruler
from spin_cluster.tokenizer import Tokenizer

HERE = Path(__file__).resolve().parent
CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"), ("Japan", "Tokyo"),
            ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Norway", "Oslo"), ("Peru", "Lima"), ("Kenya", "Nairobi"),
            ("Greece", "Athens"), ("Austria", "Vienna"), ("Poland", "Warsaw"), ("Portugal", "Lisbon"),
            ("Russia", "Moscow"), ("China", "Beijing"), ("Ireland", "Dublin"), ("Sweden", "Stockholm"),
            ("Finland", "Helsinki"), ("Cuba", "Havana")]


def multiple_choice() -> list[dict]:
    rng = random.Random("spin-mc")
    docs, seen = [], set()
    while len(docs) < 20:
        a, b = rng.randrange(2, 50), rng.randrange(2, 50)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        wrong = rng.sample([a + b + d for d in (-10, -2, -1, 1, 2, 10) if a + b + d > 0], 3)
        choices = [str(a + b), *map(str, wrong)]
        rng.shuffle(choices)
        docs.append({"question": f"What is {a} plus {b}?", "choices": choices, "answer": choices.index(str(a + b))})
    cities = [c for _, c in CAPITALS]
    for country, city in CAPITALS:
        choices = [city, *rng.sample([c for c in cities if c != city], 3)]
        rng.shuffle(choices)
        docs.append({"question": f"What is the capital of {country}?", "choices": choices,
                     "answer": choices.index(city)})
    return docs


def ruler_samples(tokenizer: Tokenizer) -> list[dict]:
    docs = []
    for task in ("passkey", "niah_single"):
        for seed in range(12):
            s = ruler.make_sample(task, tokenizer, 512, seed)
            docs.append({"task": task, "seed": seed, "text": s.text, "answer_prefix": s.answer_prefix,
                         "answers": list(s.answers)})
    return docs


def write(name: str, docs: list[dict]) -> None:
    (HERE / name).write_text("".join(json.dumps(d) + "\n" for d in docs))


if __name__ == "__main__":
    write("mc.jsonl", multiple_choice())
    write("ruler.jsonl", ruler_samples(Tokenizer(default_model_path())))
