"""Synthetic paraphrase pairs, MRPC-shaped, so that a run needs no download.

A sentence says who did what to what, where and when. A paraphrase says the same with other
words (each concept has two wordings; each slot keeps the first wording or takes the other)
and sometimes another word order; a
non-paraphrase tells of another event (every fact differs). Neither sentence alone gives the
label away: a model must compare the two, as in MRPC, yet a tiny BERT learns it in well under
a minute on a CPU.

    python -m rapidformer.data.synthetic DIR [--train 4000 --eval 400 --seed 1234]

writes DIR/{train,validation,test}.jsonl with columns idx, sentence1, sentence2, label.
"""
from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

# each inner list: the words for one concept
SUBJECTS = [["the doctor", "the physician"], ["the teacher", "the instructor"],
            ["the company", "the firm"], ["the minister", "the official"],
            ["the child", "the kid"], ["the farmer", "the grower"],
            ["the police", "the officers"], ["the student", "the pupil"]]
VERBS = [["bought", "purchased"], ["sold", "traded away"], ["fixed", "repaired"],
         ["painted", "coloured"], ["found", "discovered"], ["lost", "misplaced"],
         ["built", "constructed"], ["cleaned", "washed"]]
OBJECTS = [["a car", "an automobile"], ["a house", "a home"], ["the boat", "the ship"],
           ["a gift", "a present"], ["the road", "the street"], ["a bag", "a sack"],
           ["the shop", "the store"], ["a picture", "an image"]]
PLACES = [["in the city", "in town"], ["near the river", "by the stream"],
          ["at the market", "at the bazaar"], ["in the village", "in the hamlet"],
          ["on the hill", "on the slope"], ["at school", "at the academy"]]
TIMES = [["yesterday", "the day before"], ["last week", "seven days ago"],
         ["this morning", "earlier today"], ["on monday", "at the start of the week"],
         ["in spring", "during springtime"], ["at night", "after dark"]]
SLOTS = (SUBJECTS, VERBS, OBJECTS, PLACES, TIMES)


def _realize(concepts: tuple[int, ...], rng: random.Random,
             like: tuple[str, ...] | None = None) -> tuple[str, tuple[str, ...]]:
    """A sentence for these concepts, and its words per slot. With `like` (a paraphrase), each
    slot keeps the first sentence's wording with probability 0.6, else takes a synonym."""
    words = []
    for i, (slot, c) in enumerate(zip(SLOTS, concepts)):
        if like is not None and like[i] in slot[c] and rng.random() < 0.85:
            words.append(like[i])
        else:
            words.append(rng.choice(slot[c]))
    subject, verb, obj, place, time = words
    if rng.random() < 0.5:
        return f"{subject} {verb} {obj} {place} {time} .", tuple(words)
    return f"{time} , {subject} {verb} {obj} {place} .", tuple(words)


def make_pair(rng: random.Random) -> tuple[str, str, int]:
    concepts = tuple(rng.randrange(len(slot)) for slot in SLOTS)
    label = rng.random() < 0.5
    other = list(concepts)
    if not label:
        other = [rng.choice([c for c in range(len(slot)) if c != concepts[i]])
                 for i, slot in enumerate(SLOTS)]
    first, words = _realize(concepts, rng)
    second, _ = _realize(tuple(other), rng, like=words)
    return first, second, int(label)


def make_split(size: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for idx in range(size):
        a, b, label = make_pair(rng)
        rows.append({"idx": idx, "sentence1": a, "sentence2": b, "label": label})
    return rows


def write_dataset(out_dir: str | os.PathLike, train_size: int = 4000, eval_size: int = 400,
                  seed: int = 1234) -> Path:
    """Write the three splits as jsonl (atomically: a reader never sees half a file)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sizes = {"train": train_size, "validation": eval_size, "test": eval_size}
    for offset, (split, size) in enumerate(sizes.items()):
        target = out / f"{split}.jsonl"
        tmp = target.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for row in make_split(size, seed + offset):
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, target)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--train", type=int, default=4000)
    parser.add_argument("--eval", type=int, default=400)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    out = write_dataset(args.out_dir, args.train, args.eval, args.seed)
    print(f"wrote {out}/train.jsonl, validation.jsonl, test.jsonl")


if __name__ == "__main__":
    main()
