"""scripts/gpu_check.sh as far as a machine without a GPU can check it: it says so and exits 0
(CI runs it that way); in --dry-run its steps are the documented ones and every glm5-hal
command it would run parses; its summary writer reads what the bench and the conformance
runner write (their own serialisers build the inputs here) and reports the issue targets."""
from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys

import pytest
import torch

from glm5_hal import cli
from glm5_hal.bench import cases as bench_cases, runner
from glm5_hal.conformance import report
from glm5_hal.conformance.record import Record

from conftest import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"


def gpu_check(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    import os
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, **(env or {})})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_without_an_nvidia_gpu_it_says_so_and_exits_0(tmp_path):
    done = gpu_check(str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    message = (f"gpu_check: no NVIDIA GPU here: torch {torch.__version__} is not a CUDA build for NVIDIA "
               f"(torch.version.cuda = None, torch.version.hip = None); nothing to check (exit 0).")
    assert done.stdout.strip() == message
    assert (tmp_path / "out" / "summary.md").read_text().strip() == message


def test_bad_options_are_refused(tmp_path):
    assert gpu_check(str(tmp_path), "--fast").returncode == 2
    assert gpu_check().returncode == 2


def dry_run(tmp_path, *options: str, libs: str = "flash_mla deep_gemm") -> list[tuple[str, int, list[str]]]:
    done = gpu_check(str(tmp_path), "--dry-run", *options, env={"GPU_CHECK_LIBS": libs})
    assert done.returncode == 0, done.stderr
    steps = []
    for line in done.stdout.splitlines():
        if line.startswith("DRY "):
            head, command = line[4:].split(":", 1)
            step, limit = head.split()
            steps.append((step, int(limit), shlex.split(command)))
    return steps


def glm5_hal_args(command: list[str]) -> list[str] | None:
    """The glm5-hal arguments of a step's command (after `-m glm5_hal.cli`), or None."""
    if "glm5_hal.cli" not in command:
        return None
    return command[command.index("glm5_hal.cli") + 1:]


def test_the_dry_run_lists_the_steps_in_budget_order_and_every_command_parses(tmp_path):
    steps = dry_run(tmp_path)
    names = [s for s, _, _ in steps]
    assert names[:9] == ["build", "environment", "backends", "conformance_tiny",
                         "bench_target_sparse_mla_decode_paged", "bench_target_indexer_topk_paged",
                         "bench_own_kernels", "conformance_glm5", "conformance_own_kernels"]
    assert {"bench_grouped_gemm", "bench_moe_permute", "bench_sparse_mla_attention"} <= set(names[9:])
    assert sum(limit for _, limit, _ in steps) > 450  # the budget, not the sum of the limits, bounds the run
    parser = cli.build_parser()
    for step, _, command in steps:
        args = glm5_hal_args(command)
        if args is not None:
            parser.parse_args(args)  # SystemExit on an option the CLI does not have
    by_step = {s: c for s, _, c in steps}
    build = by_step["build"]
    assert build[1:8] == ["-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index", "-e"]
    assert "-Ccmake.define.GLM5_HAL_CUDA_ARCHS=90" in build
    decode = glm5_hal_args(by_step["bench_target_sparse_mla_decode_paged"])
    assert decode[:3] == ["bench", "--device", "cuda"] and "--batch" in decode and "64" in decode
    assert ["--preset", "long"] == glm5_hal_args(by_step["bench_target_indexer_topk_paged"])[7:9]
    conformance = glm5_hal_args(by_step["conformance_tiny"])
    assert conformance[:5] == ["conformance", "--backend", "cuda", "--ref", "cuda"]
    assert by_step["conformance_own_kernels"][:2] == ["env", "GLM5_HAL_CUDA_DISABLE=flash_mla"]
    assert by_step["bench_own_kernels"][1] == "GLM5_HAL_CUDA_DISABLE=flash_mla,deep_gemm"


def test_quick_stops_after_the_targets_and_no_libraries_skip_the_own_kernel_runs(tmp_path):
    names = [s for s, _, _ in dry_run(tmp_path, "--quick", "--no-compile", "--skip-build", libs="")]
    assert names == ["environment", "backends", "conformance_tiny", "bench_target_sparse_mla_decode_paged",
                     "bench_target_indexer_topk_paged"]
    assert all("--no-compile" in c for s, _, c in dry_run(tmp_path, "--no-compile") if s.startswith("bench"))


# -- the summary -------------------------------------------------------------------------------------
def _report_module():
    spec = importlib.util.spec_from_file_location("gpu_check_report", REPO / "scripts" / "gpu_check_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_json(op: str, timings: list[runner.Timing], preset: str = "glm5") -> dict:
    case = next(c for c in bench_cases.cases(preset, batch=64) if c.op == op)
    return {"ops": runner.to_json([(case, timings)]), "roofline": {"device": "NVIDIA H200"}}


def test_the_summary_reports_the_targets_conformance_and_steps(tmp_path):
    out = tmp_path
    (out / "steps.tsv").write_text("step\tseconds\tstatus\nbuild\t61\tok\nconformance_glm5\t150\tstopped at its "
                                   "150s limit\n")
    (out / "environment.json").write_text(json.dumps({"torch": "2.11.0+cu130", "device": {"name": "NVIDIA H200"}}))
    T = runner.Timing
    (out / "bench_target_sparse_mla_decode_paged.json").write_text(json.dumps(_bench_json(
        "sparse_mla_decode_paged", [T("reference", 4.0), T("compiled", 2.0),
                                    T("cuda.sparse_mla_decode_paged", 0.25, 16.0, 40.0, "bytes", "", 7.1, 38.5)])))
    (out / "bench_own_kernels.json").write_text(json.dumps(_bench_json(
        "sparse_mla_decode_paged", [T("reference", 4.0), T("cuda.sparse_mla_decode_paged", 1.0, 4.0)])))
    (out / "bench_grouped_gemm.json").write_text(json.dumps(_bench_json(
        "grouped_gemm", [T("reference", 1.0), T("compiled", None, note="torch.compile failed: X"),
                         T("cuda.grouped_gemm", 0.5, 2.0)])))
    records = [Record("cuda", "cuda:0", "rms_norm", "rms_norm/tiny/a/bfloat16", "tiny", "bfloat16", "pass",
                      impl="cuda.rms_norm"),
               Record("cuda", "cuda:0", "sparse_mla_attention", "sparse_mla_attention/tiny/b/bfloat16", "tiny",
                      "bfloat16", "fail", "out[0]: 3 of 9 elements outside", impl="cuda.sparse_mla_attention"),
               Record("cuda", "cuda:0", "apply_rope", "apply_rope/tiny/c/float32", "tiny", "float32", "fallback",
                      "op not implemented by cuda")]
    report.write_json(out / "conformance_tiny.json", records, {"ref": "cuda"})
    _report_module().summary(str(out))
    summary = json.loads((out / "summary.json").read_text())
    decode = next(t for t in summary["targets"] if t["op"] == "sparse_mla_decode_paged")
    assert decode["cuda"]["x_compiled"] == pytest.approx(8.0) and decode["own_kernel"]["ms"] == 1.0
    assert next(t for t in summary["targets"] if t["op"] == "indexer_topk_paged")["cuda"] is None
    assert summary["conformance"]["totals"] == {"pass": 1, "fail": 1, "fallback": 1}
    text = (out / "summary.md").read_text()
    assert "cuda backend: 8.00x torch.compile: meets the 5x target" in text
    assert "| cuda.sparse_mla_decode_paged | 0.250 | 16.00 | 8.00 | 40.0 bytes | 7.1 | 38.5 |" in text
    assert "cuda.sparse_mla_decode_paged (own kernel) | 1.000" in text
    assert "cuda backend: not measured" in text
    assert "| conformance_glm5 | 150 | stopped at its 150s limit |" in text
    assert "- `sparse_mla_attention/tiny/b/bfloat16` fail (cuda.sparse_mla_attention): out[0]" in text
    assert "- `apply_rope`: op not implemented by cuda" in text
    assert "| `grouped_gemm` |" in text and "torch.compile failed: X" in text
