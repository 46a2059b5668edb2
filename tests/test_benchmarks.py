"""The speed suite's runner in --smoke mode: every workload and system runs on a CPU, the rows
carry what docs/benchmarks needs, and the markdown table replaces its previous version."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import assert_ok

REPO = Path(__file__).resolve().parents[1]


def test_suite_smoke_writes_results_and_table(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\nearlier text\n")
    for _ in range(2):  # the second run replaces the first table
        assert_ok(subprocess.run([sys.executable, str(REPO / "benchmarks" / "run.py"), "--smoke",
                                  "--out-dir", str(tmp_path)], capture_output=True, text=True,
                                 timeout=300, cwd=REPO))
    rows = json.loads((tmp_path / "benchmarks" / "results.json").read_text())
    assert {(r["workload"], r["system"]) for r in rows} == {
        (w, s) for w in ("bert_mlm", "gpt2_124m", "gpt_1p3b", "bert_mrpc")
        for s in ("hf-eager", "rapidformer-eager", "rapidformer-fp32")}
    for row in rows:
        assert {"workload", "system", "tokens_per_s", "mfu", "peak_mem_gb", "gpu", "date",
                "versions"} <= set(row)
        assert row["tokens_per_s"] > 0 and row["mfu"] is None  # a CPU has no peak in the table
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nearlier text\n")
    assert text.count("<!-- suite:start -->") == 1 and text.count("| bert_mrpc | hf-eager |") == 1
    assert "Framework overhead, bert_mlm: rapidformer-eager runs at" in text


def test_megatron_benchmark_profiles_steps_after_the_timed_ones(tmp_path):
    out = tmp_path / "megatron.json"
    assert_ok(subprocess.run([sys.executable, str(REPO / "benchmarks" / "megatron_attention.py"),
                              "--smoke", "--variants", "sdpa", "--profile", "2", "--out", str(out)],
                             capture_output=True, text=True, timeout=300, cwd=REPO))
    row = json.loads(out.read_text())["rows"][0]
    assert row["tokens_per_s"] > 0 and row["last_loss"] > 0
    profile = row["profile"]
    assert profile["steps"] == 2 and profile["kinds"]["matmul"]["ms_per_step"] > 0
    assert any(k["name"] == "aten::mm" for k in profile["top_kernels"])


def test_recorded_commands_name_no_machine_paths(monkeypatch):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from _report import portable_command

    monkeypatch.setenv("OUT", "/scratch/out")
    command = (f"python -m rapidformer.cli.console --user-script {REPO}/examples/x.py --data-path "
               "/tmp/seed4-abc/gpt_text_document --out /scratch/out/plan.json")
    assert portable_command(command, {Path("/tmp/seed4-abc"): "DATA"}) == (
        "python -m rapidformer.cli.console --user-script examples/x.py --data-path "
        "DATA/gpt_text_document --out plan.json")
    for report in (REPO / "docs").rglob("*.json"):
        text = report.read_text()
        assert str(REPO) not in text and "/tmp/" not in text and "/root/" not in text, report


def test_a_failed_row_keeps_its_exit_code_and_last_error_line(tmp_path, monkeypatch):
    """What tune_search's verdict reads: an out-of-memory exit is told from a crash by its
    code, not by its words alone."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from _report import run_cli

    monkeypatch.setenv("BENCH_LOG", str(tmp_path / "bench.log"))
    script = "import sys; print('step 1'); sys.exit('rapidformer: error: out of GPU memory (x)')"
    record, result, windows = run_cli("default", [sys.executable, "-c", script], tmp_path)
    assert windows is None and result.returncode == 1
    assert record["exit_code"] == 1
    assert record["error"] == "rapidformer: error: out of GPU memory (x)"
    assert "===== default (exit 1)" in (tmp_path / "bench.log").read_text()


def test_the_decoder_rows_leave_the_profiled_log_windows_out_of_their_rates():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from argparse import Namespace

    from decoder_speed import profiled_window

    args = Namespace(profile=[61, 65])  # log windows of 10 steps: (50, 60], (60, 70], ...
    assert [s for s in range(10, 90, 10) if profiled_window(s, args)] == [70]
    args = Namespace(profile=[58, 62])
    assert [s for s in range(10, 90, 10) if profiled_window(s, args)] == [60, 70]
    assert not profiled_window(70, Namespace(profile=None))


def test_the_tuning_benchmark_judges_the_choice_it_was_served():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from tune_search import verdict

    def rows(cached=True, chosen_loss=0.60, choice="unpad", auto_wall=60.0):
        return [{"row": "default", "wall_s": 30.0, "loss_at_end": 0.60},
                {"row": "unpad", "wall_s": 20.0, "loss_at_end": 0.61},
                {"row": "auto", "wall_s": auto_wall, "loss_at_end": 0.60, "choice": "unpad",
                 "search_s": 40.0},
                {"row": "auto-cached", "wall_s": 20.5, "loss_at_end": chosen_loss,
                 "cached": cached, "choice": choice}]

    good = verdict(rows())
    assert good["complete"] and good["within_5_percent"] and good["not_slower_than_default"]
    assert good["at_equal_loss"] and good["search_under_5_min"]
    assert not verdict(rows(cached=False))["complete"]
    assert not verdict(rows(choice="reference"))["complete"]  # not what the search picked
    assert not verdict(rows(chosen_loss=4.0))["at_equal_loss"]
    # a default the card cannot hold: nothing is slower, the loss held to the fastest row's
    oom = rows()
    oom[0] = {"row": "default", "error": "rapidformer: error: out of GPU memory (CUDA out of "
                                         "memory. Tried to allocate 15.66 GiB)"}
    judged = verdict(oom)
    assert judged["complete"] and judged["not_slower_than_default"] and judged["at_equal_loss"]
    assert judged["loss_change_vs_fastest_hand_picked"] == round(0.01 / 0.61, 3)
    for in_training in (True, False):  # judged when it ran: an out of memory in the final
        # evaluation trained the whole run, which fits
        run = {**oom[0], "exit_code": 5, "out_of_memory_in_training": in_training}
        assert verdict([run, *oom[1:]])["complete"] is in_training
    # a row with an exit code but no judgement, the message alone: not judged
    assert not verdict([{**oom[0], "exit_code": 5}, *oom[1:]])["complete"]
    # a default that trained (another call's) beside one out of memory: compared, not excused
    both = verdict([*rows(), oom[0]])
    assert both["choice_vs_default_wall"] == round(20.5 / 30.0, 3)
    slow = rows()
    slow[0]["wall_s"] = 10.0
    assert not verdict([*slow, oom[0]])["not_slower_than_default"]
    oom[0] = {"row": "default", "error": "ran past its 260 s limit"}
    assert not verdict(oom)["complete"]  # a default cut by its limit says nothing
    zero = rows()
    zero[0]["loss_at_end"] = 0.0
    assert verdict(zero)["complete"]  # no division by a zero loss
    # an auto row its limit cut after the search: judged on the search's own seconds
    from tune_search import searched

    cut = rows()
    cut[2] = {"row": "auto", "error": "ran past its 260 s limit", "wall_s": 260.0,
              **searched("rapidformer: tuning: measuring unpad\n"
                         "rapidformer: tuning: chose unpad after 1,171 s\nstep 1 ...")}
    assert cut[2]["search_s"] == 1171.0 and cut[2]["choice"] == "unpad"
    judged = verdict(cut)
    assert judged["complete"] and not judged["search_under_5_min"]
    assert judged["auto_with_search_vs_default_wall"] is None
    assert not verdict([*rows()[:2], {"row": "auto", "error": "crashed"}, rows()[3]])["complete"]
    no_seconds = rows()
    del no_seconds[2]["search_s"]
    assert not verdict(no_seconds)["search_under_5_min"]


def test_a_default_row_did_not_fit_only_when_it_ran_out_of_memory_in_training(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from subprocess import CompletedProcess

    from tune_search import out_of_memory_in_training

    single = "rapidformer: error: out of GPU memory (CUDA out of memory. Tried to allocate 754 MiB)"
    worker = "rapidformer: error (rank 1): out of GPU memory (CUDA out of memory.)"
    launcher = ("rapidformer: error: worker rank 1 failed with exit code 5. Its last output:\n"
                f"  | {worker}\n[W] ProcessGroupNCCL destroyed")
    args = ["model=llama_tiny", "trainer.train_iters=50", "trainer.train_iters=200"]
    for exit_code, stderr, trained, args_, expected in [
            (5, single, 15, args, True),
            (5, worker, 15, args, True),
            (5, launcher, 15, args, True),  # a rank's line quoted in the launcher's report
            (5, single, 200, args, False),  # out of memory in the final evaluation: it fit
            (5, single, None, args, True),  # before its first logged step
            (1, single, 15, args, False),  # the words with another exit: a crash
            (5, "RuntimeError: CUDA error: out of memory", 15, args, False),
            (-9, "", 15, args, False),
            (5, single, 15, ["trainer.epochs=3"], False)]:  # no step count to hold it to
        out = tmp_path / f"run{exit_code}_{trained}_{len(args_)}_{len(stderr)}"
        out.mkdir()
        if trained is not None:
            lines = [{"step": s, "loss": 1.0, "tokens_per_s": 9.0} for s in (5, trained)]
            lines.append({"step": trained, "validation/loss": 1.0})
            (out / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines))
        result = CompletedProcess([], exit_code, "", stderr)
        assert out_of_memory_in_training(result, out, args_) is expected, (exit_code, stderr)


def test_a_workload_measured_in_two_calls_is_judged_on_both(tmp_path):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from tune_search import earlier_rows, verdict

    first = {"date": "2026-12-05", "rows": [
        {"workload": "llama_sft", "row": "default", "wall_s": 30.0, "loss_at_end": 0.60},
        {"workload": "llama_sft", "row": "packed", "wall_s": 20.0, "loss_at_end": 0.61},
        {"workload": "mrpc_small", "row": "default", "wall_s": 9.0, "loss_at_end": 0.5}]}
    path = tmp_path / "base.json"
    path.write_text(json.dumps(first))
    before = earlier_rows([str(path)], ["llama_sft"])
    assert [(r["row"], r["call"]) for r in before] == [("default", "2026-12-05"),
                                                      ("packed", "2026-12-05")]
    auto = [{"workload": "llama_sft", "row": "auto", "wall_s": 80.0, "loss_at_end": 0.6,
             "choice": "packed", "search_s": 60.0},
            {"workload": "llama_sft", "row": "auto-cached", "wall_s": 20.4, "loss_at_end": 0.61,
             "cached": True, "choice": "packed"}]
    assert not verdict(auto)["complete"]  # no default, no hand-picked row: no verdict
    judged = verdict(before + auto)
    assert judged["complete"] and judged["within_5_percent"] and judged["not_slower_than_default"]
    assert judged["choice_vs_fastest_wall"] == 1.02


def test_the_tuning_benchmarks_llama_rows_are_configs_the_cli_accepts(tmp_path):
    """Each row of the LoRA SFT workload, at its GPU shape, passes the config checks: a
    hand-picked row the CLI refuses (LoRA with fp8, say) measures nothing."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from tune_search import HAND_PICKED, workload_args

    from rapidformer.config.compose import compose
    from rapidformer.preflight import settle

    base = [*workload_args("llama_sft", tmp_path, smoke=False), "trainer.device=cpu"]
    for extra in ([], ["accelerate=auto"], *HAND_PICKED["llama_sft"].values()):
        cfg = settle(compose([*base, *extra]), str(tmp_path / "out"))[1]
        assert cfg.model.init_dtype == "bf16" and cfg.peft.name == "lora"
