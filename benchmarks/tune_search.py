"""accelerate=auto against the default configuration and the hand-picked fastest rows, end to
end through the CLI, on issue 38's three workloads, one GPU.

    python benchmarks/tune_search.py                              # GPU: every workload
    python benchmarks/tune_search.py --workloads mrpc_small mrpc_base
    python benchmarks/tune_search.py --smoke                      # CPU, tiny, in about 2 min
    # a workload longer than one GPU call, in two: the baseline rows, then the search's rows
    # judged with the first call's (its JSON given back)
    python benchmarks/tune_search.py --workloads llama_sft --rows default hand-picked --out A.json
    python benchmarks/tune_search.py --workloads llama_sft --rows auto --earlier A.json

Workloads (the data and models of the padding and LoRA benchmarks, built locally, nothing
downloaded):
  mrpc_small, mrpc_base   sentence-pair fine-tuning, 4,076 MRPC-length pairs, 3 epochs, batch
                          32, a 6x384 and a 12x768 BERT (benchmarks/finetune_padding.py)
  bert_pretrain           BERT-base masked LM + NSP on short documents, seq 128, batch 32
                          (benchmarks/pretrain_padding.py's short corpus)
  llama_sft               Llama-3.2-1B-shaped LoRA SFT on instruction-length chats, seq 2048,
                          random weights at bf16 values (model.init_dtype=bf16, as the
                          published checkpoint's), 200 steps of 16 examples (on one H200 the
                          default row about 5 minutes, a packed bf16 row 75 s: the rows fit
                          two calls of 10 minutes) (benchmarks/lora_sft.py's workload). Its
                          packed rows hold the 16 examples a step in fewer rows
                          (examples_kept: the default row's log says how many a packed row
                          holds), as accelerate=auto's packing candidate does: packing 16
                          rows a step would train 4x the examples
Rows of each: `default` (the workload's command, no accelerator setting), each hand-picked row
(the fastest of docs/benchmarks.md for it), `auto` (accelerate=auto with an empty cache: the
search, then the run with its choice, in one wall time) and `auto-cached` (the same command
again: the cache holds the choice, so its wall time is the chosen configuration's training
alone). Each row reports the process's wall seconds (time to result, startup, compilation and
evaluation included), the mean real tokens/s after the first windows, the last logged loss;
`auto` also the search's seconds, its choice and its table.

The goal (issue 38): the configuration auto picks (`auto-cached`) trains within 5 % of the
fastest hand-picked row's wall time and never slower than default, at equal loss, and the
search costs at most 5 minutes. The search is let spend its budget (--budget, 180 s) whatever
the run's length (accelerate.max_fraction=100, as for a configuration that will be trained
again: the cache serves every later run): with the default share of a run (10 %) a run of a
few minutes is too short for any second measurement, and auto trains the default. Writes
docs/benchmarks/tune_search.json.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import tempfile
import time
from pathlib import Path

from _report import finish, portable_command, run_cli

SKIP_WINDOWS = 2  # the first log windows (compile, warm-up) are not in the mean rate

# workload -> hand-picked rows (name -> overrides), from docs/benchmarks.md
HAND_PICKED = {
    "mrpc_small": {"unpad-compile-cudagraphs": ["precision=bf16", "trainer.unpad=true",
                                                "graph=compile", "graph.mode=reduce-overhead"],
                   "unpad-bf16": ["precision=bf16", "trainer.unpad=true"]},
    "mrpc_base": {"unpad-compile-cudagraphs": ["precision=bf16", "trainer.unpad=true",
                                               "graph=compile", "graph.mode=reduce-overhead"],
                  "unpad-bf16": ["precision=bf16", "trainer.unpad=true"]},
    "bert_pretrain": {"unpad-compile": ["precision=bf16", "trainer.unpad=true", "graph=compile"],
                      "unpad-bf16": ["precision=bf16", "trainer.unpad=true"]},
    # LoRA SFT, round 3: the recipe packed in bf16, and the same with peft.fused (the base in
    # bf16 there too: the workload's weights are bf16 values, as Llama 3.2 1B's checkpoint)
    "llama_sft": {"lora-packed-bf16": ["precision=bf16", "data.packing=true"],
                  "lora-packed-bf16-fused": ["precision=bf16", "data.packing=true",
                                             "peft.fused=true"]},
}
SMOKE_HAND_PICKED = {"mrpc_small": {"unpad": ["trainer.unpad=true"]},
                     "bert_pretrain": {"unpad": ["trainer.unpad=true"]},
                     "llama_sft": {"packed": ["data.packing=true"]}}


def workload_args(name: str, work: Path, smoke: bool) -> list[str]:
    """The workload's command line (data and models made under `work` on first use)."""
    common = ["trainer.progress_bar=false", "trainer.export_hf=false", "trainer.save_last=false",
              "trainer.log_interval=5"]
    if name.startswith("mrpc"):
        if smoke:
            return ["+recipe=quickstart", "data.synthetic_train_size=600",
                    "data.synthetic_eval_size=64", "trainer.epochs=1", *common]
        import finetune_padding as fp

        data = work / "pairs"
        if not data.exists():
            fp.write_pairs(work, 4076, 408)
        size = name.split("_")[1]
        model = work / f"bert_{size}"
        if not model.exists():
            fp.write_checkpoints(work, fp._words(8000), [size])
        return ["task=sequence_classification", "model=hf", f"model.name_or_path={model}",
                "data=pairs_local", f"data.path={data}", "data.max_seq_length=128",
                "trainer.micro_batch_size=32", "trainer.epochs=3", "trainer.lr=5e-5",
                "trainer.keep_last=1", *common]
    if name == "bert_pretrain":
        import pretrain_padding as pp

        prefix, vocab = pp.make_data(work, "short", 1.0 if smoke else 20.0)
        shape = ["model=bert_tiny", "data.max_seq_length=64", "trainer.train_iters=40",
                 "trainer.micro_batch_size=8", "trainer.global_batch_size=8"] if smoke else \
            ["trainer.train_iters=2000", "trainer.micro_batch_size=32",
             "trainer.global_batch_size=32"]
        return ["+recipe=bert_pretrain", f"data.path={prefix}", f"model.tokenizer={vocab}",
                "trainer.lr=1e-4", "scheduler=constant", "trainer.eval_iters=1", *shape, *common]
    if name == "llama_sft":
        shape = ["model=llama_tiny", "data.max_seq_length=256", "model.embedding_rows=4096",
                 "data.synthetic_train_size=200", "trainer.train_iters=30",
                 "trainer.micro_batch_size=4", "trainer.global_batch_size=4"] if smoke else \
            ["model=llama_1b", "data.max_seq_length=2048", "model.max_position_embeddings=2048",
             "model.embedding_rows=128256", "data.synthetic_train_size=6000",
             "trainer.train_iters=200", "trainer.micro_batch_size=16",
             "trainer.global_batch_size=16"]
        # random weights at bf16 values, as the published checkpoint holds them: what
        # peft.base_dtype=auto makes of the frozen base is what it makes of the real model's
        return ["+recipe=llama_lora", "peft.modules_to_save=null", f"data.path={work / 'sft'}",
                "model.init_dtype=bf16",
                "data.synthetic_lengths=instruction", "data.synthetic_eval_size=16",
                "trainer.epochs=null", "trainer.lr=2e-4", "scheduler=constant",
                "task.sample_generations=0", *shape, *common]
    raise SystemExit(f"no workload {name!r}")


def examples_kept(extra: list[str], base: list[str], default_log: Path) -> list[str]:
    """A packing row's overrides with its global batch in packed rows that hold the workload's
    examples a step (as accelerate=auto's packing candidate: tuning/space.py packed_batch), from
    what the default row's log says packing makes of the data: at the workload's rows a step, a
    packed run of trainer.train_iters steps trains several times the examples, another run."""
    if "data.packing=true" not in extra:
        return extra
    from rapidformer.tuning.measure import PACKING_HINT
    from rapidformer.tuning.space import packed_rows_a_step

    text = default_log.read_text() if default_log.is_file() else ""
    if not (found := PACKING_HINT.search(text)):
        raise SystemExit(f"a packed row needs the default row's log ({default_log}) to say what "
                         f"packing makes of the data: run the default row in the same call")
    given = dict(a.split("=", 1) for a in base if "=" in a)
    examples, rows = int(found.group(1)), int(found.group(2))
    batch, micro = packed_rows_a_step(int(given["trainer.global_batch_size"]),
                                      int(given["trainer.micro_batch_size"]), 1, examples / rows)
    return [*extra, f"trainer.global_batch_size={batch}", f"trainer.micro_batch_size={micro}",
            f"trainer.eval_micro_batch_size={given['trainer.micro_batch_size']}"]


def row(workload: str, name: str, args_: list[str], work: Path, timeout: float) -> dict:
    out = work / f"{workload}_{name}"
    command = [sys.executable, "-m", "rapidformer", *args_, f"trainer.output_dir={out}"]
    started = time.perf_counter()
    base, result, windows = run_cli(name, command, work, timeout=timeout)
    base = {"workload": workload, **base, "wall_s": round(time.perf_counter() - started, 1)}
    if windows is None:  # a run cut after its search still says what the search took
        if "exit_code" in base:
            base["out_of_memory_in_training"] = out_of_memory_in_training(result, out, args_)
        return {**base, **searched(result.stderr)}
    later = windows[SKIP_WINDOWS:] or windows
    base.update(tokens_per_s=round(sum(r["tokens_per_s"] for r in later) / len(later)),
                loss_at_end=round(windows[-1]["loss"], 4),
                peak_mem_gb=round(max(r.get("peak_mem_gb", 0) for r in windows), 2))
    tuning = out / "tuning.json"
    if tuning.exists():
        record = json.loads(tuning.read_text())
        base.update(search_s=None if record.get("cached") else record.get("search_s"),
                    cached=record.get("cached"),
                    choice=record["choice"]["label"], choice_overrides=record["choice"]["overrides"],
                    table=record["table"])
    return base


# the search's last line on stderr (tuning/search.py _measure_all)
CHOSE = re.compile(r"rapidformer: tuning: chose (.+) after ([\d,.]+) s$", re.MULTILINE)


def searched(stderr: str) -> dict:
    """The search's choice and seconds from a row's stderr (its tuning.json is written when
    the run starts: a row cut before has none), or nothing."""
    found = CHOSE.search(stderr or "")
    return {"choice": found.group(1), "search_s": float(found.group(2).replace(",", ""))} \
        if found else {}


AUTO_ROWS = ("auto", "auto-cached")
# --rows: which rows this call runs; auto is both of its rows (the second reads the first's
# cache, in this call's temporary folder)
ROW_GROUPS = ("default", "hand-picked", "auto")


def earlier_rows(paths: list[str], workloads: list[str]) -> list[dict]:
    """The rows of `workloads` in the reports of earlier calls (--earlier)."""
    rows = []
    for path in paths:
        report = json.loads(Path(path).read_text())
        rows += [{**r, "call": report.get("date")} for r in report["rows"]
                 if r.get("workload") in workloads]
    return rows
LOSS_TOLERANCE = 0.1  # the last logged loss against the default's, as accelerate.loss_tolerance


OOM_PREFIX = "rapidformer: error: out of GPU memory"  # errors.out_of_memory, as reported


def out_of_memory_in_training(result, out: Path, args_: list[str]) -> bool:
    """The run stopped on rapidformer's out-of-memory exit before its last training step (one
    out of memory in the final evaluation trained the whole run: it did fit); the search's own
    words for a child's out of memory (tuning/measure.py) must be in its output too."""
    from rapidformer.errors import EXIT_OUT_OF_MEMORY
    from rapidformer.observability.records import read_metrics
    from rapidformer.tuning.measure import OOM

    if result.returncode != EXIT_OUT_OF_MEMORY or not OOM.search(result.stderr or ""):
        return False
    iters = [int(a.split("=", 1)[1]) for a in args_ if a.startswith("trainer.train_iters=")]
    trained = max((r["step"] for r in read_metrics(out) if "tokens_per_s" in r), default=0)
    return bool(iters) and trained < iters[-1]


def out_of_memory(row: dict) -> bool:
    """The default row did not fit: judged when it ran (`out_of_memory_in_training`); a row
    recorded before that was kept, on its message alone."""
    if "out_of_memory_in_training" in row:
        return row["out_of_memory_in_training"]
    return "exit_code" not in row and row.get("error", "").startswith(OOM_PREFIX)


def verdict(rows: list[dict]) -> dict:
    """The issue's goals for one workload's rows."""
    ok = {r["row"]: r for r in rows if "error" not in r}
    # an auto row its limit cut after the search still holds the search's choice and seconds
    auto = ok.get("auto") or next((r for r in rows if r["row"] == "auto" and
                                   r.get("search_s") is not None), None)
    chosen, default = ok.get("auto-cached"), ok.get("default")
    picked = [r for name, r in ok.items() if name not in (*AUTO_ROWS, "default")]
    # a default that ran out of GPU memory (an unpacked batch the card cannot hold): nothing
    # is slower than it, and the loss is held to the fastest hand-picked row's
    # (a default that trained, from another call, is the comparison: no verdict by omission)
    no_fit = None if default else next((r["error"] for r in rows if r["row"] == "default" and
                                        out_of_memory(r)), None)
    if auto is None or chosen is None or (default is None and not no_fit) or not picked:
        return {"complete": False}
    if not chosen.get("cached") or chosen.get("choice") != auto.get("choice"):
        # auto-cached trained something the search did not pick: no verdict on the choice
        return {"complete": False, "why": "auto-cached was not served the search's choice "
                                          "from the cache"}
    best = min(picked, key=lambda r: r["wall_s"])
    held_to = default or best
    loss_change = abs(chosen["loss_at_end"] - held_to["loss_at_end"]) / \
        max(abs(held_to["loss_at_end"]), 1e-9)
    same = auto.get("choice") == "reference"  # the default's own configuration
    return {"complete": True, "choice": auto.get("choice"),
            "fastest_hand_picked": best["row"],
            "choice_vs_fastest_wall": round(chosen["wall_s"] / best["wall_s"], 3),
            "choice_vs_default_wall": None if no_fit else
            round(chosen["wall_s"] / default["wall_s"], 3),
            "default_did_not_fit": no_fit,
            "within_5_percent": chosen["wall_s"] <= 1.05 * best["wall_s"],
            # the default's configuration is not slower than itself: two runs of it differ by
            # the machine's noise only
            "not_slower_than_default": bool(no_fit) or same or
            chosen["wall_s"] <= default["wall_s"],
            "loss_change_vs_default" if default else "loss_change_vs_fastest_hand_picked":
            round(loss_change, 3),
            "at_equal_loss": loss_change <= LOSS_TOLERANCE,
            "search_s": auto.get("search_s"),
            "search_under_5_min": auto.get("search_s") is not None and auto["search_s"] <= 300,
            "auto_with_search_vs_default_wall": None if "error" in auto or no_fit else
            round(auto["wall_s"] / default["wall_s"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=list(HAND_PICKED),
                        choices=list(HAND_PICKED))
    parser.add_argument("--budget", type=float, default=180.0, help="accelerate.budget_s")
    parser.add_argument("--timeout", type=float, default=3600.0, help="each row's limit (s)")
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, a few steps")
    parser.add_argument("--out", default="docs/benchmarks/tune_search.json")
    parser.add_argument("--overrides", nargs="*", default=[])
    parser.add_argument("--rows", nargs="+", default=list(ROW_GROUPS), choices=ROW_GROUPS,
                        help="the rows this call runs (a workload longer than a call in two)")
    parser.add_argument("--earlier", nargs="*", default=[],
                        help="reports of earlier calls whose rows join this call's verdict")
    args = parser.parse_args()
    picked = HAND_PICKED
    search = [f"accelerate.budget_s={args.budget}", "accelerate.max_fraction=100"]
    if args.smoke:
        args.workloads = [w for w in args.workloads if w in SMOKE_HAND_PICKED]
        picked = SMOKE_HAND_PICKED
        args.overrides = [*args.overrides, "trainer.device=cpu"]
        # a tiny run is shorter than any search: let it take longer than the run
        search += ["accelerate.max_candidates=2", "accelerate.steps=5",
                   "accelerate.warmup_steps=2", "accelerate.axes=[sequences,micro_batch_size]"]
    rows, verdicts = [], {}
    earlier = earlier_rows(args.earlier, args.workloads)
    with tempfile.TemporaryDirectory(prefix="rapidformer-tune-search-") as temp:
        work = Path(temp)
        cache = [f"accelerate.cache_dir={work / 'cache'}"]  # empty: auto pays for its search
        for workload in args.workloads:
            base = [*workload_args(workload, work, args.smoke), *args.overrides]
            runs = {}
            if "default" in args.rows:
                runs["default"] = base
            if "hand-picked" in args.rows:
                runs.update({name: [*base, *extra] for name, extra in picked[workload].items()})
            if "auto" in args.rows:
                runs.update({name: [*base, "accelerate=auto", *search, *cache]
                             for name in AUTO_ROWS})
            done = []
            default_log = work / f"{workload}_default" / "rapidformer.log"
            for name, command in runs.items():
                if name in picked[workload]:  # after the default row: its log says
                    command = [*base, *examples_kept(picked[workload][name], base, default_log)]
                done.append(row(workload, name, command, work, args.timeout))
                print(json.dumps({k: v for k, v in done[-1].items() if k != "table"}), flush=True)
            rows += done
            before = [r for r in earlier if r["workload"] == workload and r["row"] not in runs]
            verdicts[workload] = verdict(before + done)
            rows += before
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    finish(args.out, {"date": datetime.date.today().isoformat(), "device": device,
                      "torch": torch.__version__, "goals": verdicts,
                      "command": portable_command(" ".join(sys.argv)), "rows": rows})


if __name__ == "__main__":
    main()
