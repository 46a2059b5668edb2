"""`rapidformer generate RUN_DIR --prompt TEXT` (or `--input FILE [--output FILE]`): answers of
a causal LM the run exported (RUN_DIR/hf_model, or `--model DIR` from `rapidformer export`).

A prompt is the user's turn: the tokenizer's chat template renders it with the assistant's
generation prompt, as task=sft trained (`--raw` continues the text as it is, which is what a
pretrained, template-less model does anyway). `--input` reads a jsonl of rows in the run's
form (data.messages_column: the conversation so far; or data.prompt_column) and writes the
rows with a `generated` column to `--output` (jsonl), or prints one answer per line.
Decoding is greedy unless `--temperature` is above 0.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rapidformer.errors import EXIT_WRITE_FAILED, InputError


def load_exported(directory: Path):
    """(model, tokenizer) of a Hugging Face causal LM directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if not (directory / "config.json").is_file() and \
            (directory / "adapter_config.json").is_file():
        raise InputError(f"{directory} holds LoRA adapters alone (an --adapter-only export): "
                         f"generate answers with a whole model; write one with `rapidformer "
                         f"export RUN_DIR --to DIR` (the adapters merged) and pass --model DIR")
    if not (directory / "config.json").is_file():
        raise InputError(f"{directory} holds no exported model (no config.json): the run exports "
                         f"to RUN_DIR/hf_model at its end (trainer.export_hf=true); or write one "
                         f"with `rapidformer export RUN_DIR --to DIR` (a Hugging Face model's "
                         f"checkpoints; a megatron run exports only at its end) and pass "
                         f"--model DIR")
    if not (directory / "tokenizer_config.json").is_file():
        raise InputError(f"{directory} has no tokenizer (no tokenizer_config.json); use the run's "
                         f"hf_model/ or a `rapidformer export` directory, which hold both")
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(str(directory))
    except (OSError, ValueError) as exc:
        raise InputError(f"{directory}: not a causal LM ({str(exc).splitlines()[0]}); generate "
                         f"answers with a model of task=sft or task=causal_lm") from exc
    return model, AutoTokenizer.from_pretrained(str(directory))


def prompt_texts(rows: list, tokenizer, data, raw: bool, where: str) -> list[str]:
    """The text each row is answered from: a conversation (or a prompt as the user's turn)
    rendered with the generation prompt, or the prompt itself (raw, or no template)."""
    from rapidformer.data.chat import Renderer, messages_of

    templated = bool(getattr(tokenizer, "chat_template", None)) and not raw
    renderer = Renderer(tokenizer)
    texts = []
    for index, row in enumerate(rows):
        if isinstance(row, str):
            row = {data.prompt_column: row}
        place = f"{where} row {index + 1}"
        if data.messages_column in row:
            messages = messages_of(row, "messages", data, place)
            if not templated:
                raise InputError(f"{place}: a conversation needs the tokenizer's chat template, "
                                 f"and {'--raw was given' if raw else 'the model has none'}; "
                                 f"give a {data.prompt_column} instead")
        elif isinstance(row.get(data.prompt_column), str):
            messages = [{"role": "user", "content": row[data.prompt_column]}]
        else:
            raise InputError(f"{place}: needs a '{data.messages_column}' conversation or a "
                             f"'{data.prompt_column}' text (data.messages_column, "
                             f"data.prompt_column); it has: {', '.join(row) or 'nothing'}")
        texts.append(renderer.text(messages, add_generation_prompt=True, where=place)
                     if templated else messages[-1]["content"])
    return texts


def answers(model, tokenizer, texts: list[str], max_new_tokens: int, temperature: float,
            device, bos_id: int | None = None) -> list[str]:
    """The model's answer to each text (`bos_id` first: a text without a template begins with
    the BOS the tokenizer adds, as training's rows did)."""
    import torch

    from rapidformer.data.chat import stop_token_ids, text_ids
    from rapidformer.models.pretrained_shape import new_token_room

    out = []
    stops = stop_token_ids(tokenizer, getattr(model, "generation_config", None))
    for number, text in enumerate(texts, start=1):
        ids = torch.tensor([text_ids(tokenizer, text, bos_id)], device=device)
        room = new_token_room(model.config, ids.shape[1], max_new_tokens)
        if room < 1:
            raise InputError(f"prompt {number} is {ids.shape[1]} tokens: the model "
                             f"({model.config.model_type}) has no position left to answer in; "
                             f"give a shorter prompt")
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else \
            {"do_sample": False}
        with torch.inference_mode():
            generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                       max_new_tokens=room, eos_token_id=stops,
                                       pad_token_id=tokenizer.pad_token_id, **sampling)
        out.append(tokenizer.decode(generated[0, ids.shape[1]:], skip_special_tokens=True).strip())
    return out


def generate(run_dir: Path, prompt: str | None, input_path: Path | None, model_dir: Path | None,
             max_new_tokens: int | None, temperature: float, raw: bool, device: str | None):
    """(rows, answers): the prompts read and what the model answered."""
    from rapidformer.inference import restore
    from rapidformer.inference.served import require_served
    from rapidformer.planning.run_plan import pick_device

    cfg = restore.one_process_config(restore.run_config(run_dir), run_dir)
    require_served("generate", cfg.task.name, run_dir)
    model, tokenizer = load_exported(model_dir or run_dir / "hf_model")
    if input_path is not None:
        rows = read_jsonl(input_path)
        where = str(input_path)
    else:
        rows, where = [prompt], "--prompt"
    texts = prompt_texts(rows, tokenizer, cfg.data, raw, where)
    target = pick_device(device or cfg.trainer.device)
    model.to(target).eval()
    from rapidformer.data.chat import bos_it_adds

    templated = bool(getattr(tokenizer, "chat_template", None)) and not raw
    return rows, answers(model, tokenizer, texts, max_new_tokens or cfg.task.max_new_tokens,
                         temperature, target, None if templated else bos_it_adds(tokenizer))


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise InputError(f"--input {path}: no such file")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{path}:{number}: not a JSON object ({exc.msg})") from exc
        if not isinstance(row, dict):
            raise InputError(f"{path}:{number}: a row must be a JSON object, not "
                             f"{type(row).__name__}")
        rows.append(row)
    if not rows:
        raise InputError(f"--input {path} holds no rows")
    return rows


def generate_command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rapidformer generate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a training run's directory")
    given = parser.add_mutually_exclusive_group(required=True)
    given.add_argument("--prompt", help="the user's turn (or, with --raw, text to continue)")
    given.add_argument("--input", type=Path, help="a .jsonl of conversations or prompts")
    parser.add_argument("--output", type=Path, help="--input's rows with a 'generated' column "
                                                    "(jsonl); default: one answer per line")
    parser.add_argument("--model", type=Path, help="an exported model directory (default "
                                                   "RUN_DIR/hf_model)")
    parser.add_argument("--max-new-tokens", type=int, help="default task.max_new_tokens")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy; above: sampling")
    parser.add_argument("--raw", action="store_true", help="no chat template: continue the text")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"),
                        help="default: the run's trainer.device")
    args = parser.parse_args(argv)
    if args.output is not None and args.input is None:
        parser.error("--output goes with --input")
    if args.output is not None and args.output.resolve() == args.input.resolve():
        parser.error("--output is the input file; give another name (the input is not "
                     "overwritten)")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be at least 1")
    rows, answered = generate(args.run_dir, args.prompt, args.input, args.model,
                              args.max_new_tokens, args.temperature, args.raw, args.device)
    if args.output is None:
        for answer in answered:
            print(answer)
        return 0
    try:
        with open(args.output, "w", encoding="utf-8") as f:
            for row, answer in zip(rows, answered):
                f.write(json.dumps({**row, "generated": answer}) + "\n")
    except OSError as exc:
        print(f"rapidformer: error: cannot write {exc.filename or args.output}: "
              f"{exc.strerror or exc}; give --output a path in a writable directory",
              file=sys.stderr)
        return EXIT_WRITE_FAILED
    print(f"wrote {len(rows)} answers to {args.output}")
    return 0
