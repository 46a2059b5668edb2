"""Generated data for the token-classification, question-answering, masked-LM and seq2seq
tasks, so each runs with no download (tests, smoke runs, `data=synthetic`).

    python -m rapidformer.data.synthetic_tasks ner DIR [--train 2000 --eval 200 --seed 1234]

writes DIR/train.jsonl and DIR/validation.jsonl in the layout each task reads by default:
ner (tokens, ner_tags: CoNLL-style BIO names), squad (id, question, context, answers:
{text, answer_start}), text (text), summaries (document, summary), chat (messages: a list of
{role, content}) and instructions (prompt, response): questions with fixed, learnable answers;
instruction_chat: chats of the lengths of real instruction data (about 250 words on average, up
to 4,096), each answer first, then the rest of the reply.
"""
from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

from rapidformer.data.synthetic import SLOTS

PEOPLE = [["anna"], ["ben", "carter"], ["chen", "li"], ["dora"], ["emil", "novak"], ["fatima"],
          ["gustav", "berg"], ["hana"], ["ivan", "petrov"], ["julia", "santos"]]
CITIES = [["paris"], ["new", "york"], ["lagos"], ["osaka"], ["lima"], ["cape", "town"],
          ["oslo"], ["san", "diego"], ["cairo"], ["quito"]]
COMPANIES = [["acme"], ["blue", "river", "bank"], ["nordic", "steel"], ["zenith"],
             ["orbit", "labs"], ["maple", "foods"], ["kite", "air"], ["polar", "energy"]]
VERB_WORDS = ["met", "called", "visited", "thanked", "hired", "helped", "followed", "saw"]


def _entity(kind: str, names: list[str]) -> tuple[list[str], list[str]]:
    return names, [f"B-{kind}"] + [f"I-{kind}"] * (len(names) - 1)


def ner_example(rng: random.Random) -> dict:
    """A sentence with people, a city and a company, each word tagged (BIO)."""
    person, other = rng.sample(PEOPLE, 2)
    parts = [_entity("PER", person), (["yesterday"] if rng.random() < 0.3 else [], []),
             ([rng.choice(VERB_WORDS)], ["O"]), _entity("PER", other),
             (["from"], ["O"]), _entity("ORG", rng.choice(COMPANIES)),
             (["in"], ["O"]), _entity("LOC", rng.choice(CITIES)), (["."], ["O"])]
    tokens, tags = [], []
    for words, labels in parts:
        tokens += words
        tags += labels or ["O"] * len(words)
    return {"tokens": tokens, "ner_tags": tags}


def squad_example(rng: random.Random, idx: int) -> dict:
    """A context of three facts in random order and a question about one of them."""
    person, worker, buyer = (" ".join(p) for p in rng.sample(PEOPLE, 3))
    city, company = " ".join(rng.choice(CITIES)), " ".join(rng.choice(COMPANIES))
    thing = rng.choice(rng.choice(SLOTS[2]))
    # (fact, question, answer, where the answer starts in the fact)
    facts = [(f"{person} lives in {city} .", f"where does {person} live ?", city,
              len(f"{person} lives in ")),
             (f"{worker} works for {company} .", f"who works for {company} ?", worker, 0),
             (f"{buyer} bought {thing} .", f"what did {buyer} buy ?", thing,
              len(f"{buyer} bought "))]
    rng.shuffle(facts)
    context = " ".join(f[0] for f in facts)
    fact, question, answer, offset = rng.choice(facts)
    start = context.index(fact) + offset
    return {"id": str(idx), "question": question, "context": context,
            "answers": {"text": [answer], "answer_start": [start]}}


def sentence(rng: random.Random) -> str:
    subject, verb, obj, place, time = (rng.choice(rng.choice(slot)) for slot in SLOTS)
    return f"{subject} {verb} {obj} {place} {time} ."


def summary_example(rng: random.Random) -> dict:
    """A two-sentence report and its one-line summary: who did what, where."""
    subject, verb, obj, place, time = (rng.choice(rng.choice(slot)) for slot in SLOTS)
    person = " ".join(rng.choice(PEOPLE))
    document = f"{time} , {subject} {verb} {obj} {place} . {person} saw it ."
    return {"document": document, "summary": f"{subject} {verb} {obj} {place}"}


# every person's city and employer, fixed: answers a fine-tuned model can learn
def _facts(person: int) -> dict:
    return {"live": " ".join(CITIES[person % len(CITIES)]),
            "work": " ".join(COMPANIES[person % len(COMPANIES)])}


QUESTIONS = {"live": "where does {} live ?", "work": "who does {} work for ?"}


def _question(rng: random.Random) -> tuple[str, str]:
    person = rng.randrange(len(PEOPLE))
    kind = rng.choice(sorted(QUESTIONS))
    return QUESTIONS[kind].format(" ".join(PEOPLE[person])), _facts(person)[kind]


def chat_example(rng: random.Random) -> dict:
    """A conversation of one or two questions about people's cities and employers (fixed
    answers), sometimes after a system message."""
    messages = ([{"role": "system", "content": "answer in a few words ."}]
                if rng.random() < 0.3 else [])
    for _ in range(1 if rng.random() < 0.7 else 2):
        question, answer = _question(rng)
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": answer}]
    return {"messages": messages}


# Conversation lengths of real instruction data, in words (about a token each with the
# WordPiece vocabulary trained on them): log-normal, as published length statistics are (the
# Llama-Nemotron post-training set in ShareGPT form: median 393 tokens, mean 528, so a log-normal
# sigma of about 0.77, 80 % of the tokens in the assistant's turns), here scaled to a mean of
# about 250 (between single-turn sets such as Alpaca and multi-turn chats), cut at 4,096
LENGTH_MEDIAN, LENGTH_SIGMA, LENGTH_RANGE = 180, 0.8, (24, 4096)
ASSISTANT_SHARE = 0.8


def _sentences(rng: random.Random, words: int) -> str:
    """Generated sentences of about `words` words in all (none for fewer than one sentence)."""
    out: list[str] = []
    while sum(len(x.split()) for x in out) < words - 4:
        out.append(sentence(rng))
    return " ".join(out)


def instruction_chat_example(rng: random.Random) -> dict:
    """A conversation of the lengths of real instruction data (LENGTH_*): each user turn is a
    passage and a question about a person's city or employer, each assistant turn begins with the
    fixed answer (what a fine-tuned model learns) and goes on for most of the words."""
    low, high = LENGTH_RANGE
    words = min(high, max(low, int(rng.lognormvariate(math.log(LENGTH_MEDIAN), LENGTH_SIGMA))))
    turns = 1 if rng.random() < 0.7 else 2
    messages = ([{"role": "system", "content": "answer first , then explain ."}]
                if rng.random() < 0.3 else [])
    for _ in range(turns):
        question, answer = _question(rng)
        share = words / turns
        passage = _sentences(rng, int(share * (1 - ASSISTANT_SHARE)))
        messages += [{"role": "user", "content": f"{passage} {question}".strip()},
                     {"role": "assistant", "content": f"{answer} . "
                      f"{_sentences(rng, int(share * ASSISTANT_SHARE))}".strip()}]
    return {"messages": messages}


def instruction_example(rng: random.Random) -> dict:
    question, answer = _question(rng)
    return {"prompt": f"question : {question} answer :", "response": f" {answer}"}


KINDS = {"ner": lambda rng, i: ner_example(rng), "squad": squad_example,
         "chat": lambda rng, i: chat_example(rng),
         "instruction_chat": lambda rng, i: instruction_chat_example(rng),
         "instructions": lambda rng, i: instruction_example(rng),
         "text": lambda rng, i: {"text": sentence(rng)},
         "summaries": lambda rng, i: summary_example(rng)}
# task -> the kind of data it reads
TASK_KINDS = {"token_classification": "ner", "question_answering": "squad", "masked_lm": "text",
              "seq2seq_lm": "summaries", "sft": "chat"}


def write_task_dataset(kind: str, root: str | Path, train_size: int, eval_size: int,
                       seed: int = 1234) -> None:
    rng = random.Random(seed)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for split, size in (("train", train_size), ("validation", eval_size)):
        tmp = root / f".{split}.jsonl.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            for i in range(size):
                f.write(json.dumps(KINDS[kind](rng, i)) + "\n")
        tmp.rename(root / f"{split}.jsonl")  # complete or absent


# data.synthetic_lengths=instruction: the kind of the task's data with real instruction lengths
INSTRUCTION_LENGTH_KINDS = {"sft": "instruction_chat"}


def writer_for(task: str, lengths: str = "short"):
    """`write(root, train_size, eval_size, seed)` for a task's generated data."""
    kind = INSTRUCTION_LENGTH_KINDS[task] if lengths == "instruction" else TASK_KINDS[task]

    def write(root, train, evaluation, seed):
        return write_task_dataset(kind, root, train, evaluation, seed)

    write.kind = kind  # which data a folder holds (data/text_classification.generate_once)
    return write


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rapidformer.data.synthetic_tasks")
    parser.add_argument("kind", choices=sorted(KINDS))
    parser.add_argument("directory")
    parser.add_argument("--train", type=int, default=2000)
    parser.add_argument("--eval", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    write_task_dataset(args.kind, args.directory, args.train, args.eval, args.seed)
    print(f"wrote {args.directory}/train.jsonl and validation.jsonl")


if __name__ == "__main__":
    main()
