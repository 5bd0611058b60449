"""Smoke tests of the benchmark harness on tiny shapes: it runs, covers every op, reports
what it must, and rejects bad options. Benchmarks are not tests: no timing is asserted."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import glm5_hal as hal
from glm5_hal import cli
from glm5_hal.bench import cases as bench_cases, dispatch, dsa_vs_dense, roofline, runner
from glm5_hal.bench.roofline import Roofline
from glm5_hal.opdef import OPS

# made up: only the arithmetic is tested
ROOF = Roofline(threads=1, fp32_fma_gflops=100.0, bf16_dot_gflops=50.0, int8_dot_gops=400.0, amx_bf16_gflops=1000.0,
                amx_int8_gops=2000.0, triad_gbps=10.0, torch_fp32_gemm_gflops=80.0, torch_bf16_gemm_gflops=500.0,
                torch_copy_gbps=8.0)


@pytest.mark.parametrize("preset", bench_cases.PRESETS)
def test_every_op_has_a_case_in_every_preset(preset):
    hal.ops.rms_norm  # noqa: B018  (defines every op)
    covered = {c.op for c in bench_cases.cases(preset)}
    assert covered == set(OPS)


def test_quant_gemm_cases_at_prefill_and_decode():
    glm5 = bench_cases.cases("glm5")
    for op, compute in (("fp8_block_gemm", "bf16"), ("fp8_grouped_gemm", "bf16"), ("int8_gemm", "int8"),
                        ("int8_grouped_gemm", "int8")):
        prefill, decode = [c for c in glm5 if c.op == op]
        assert prefill.label.startswith("prefill") and decode.label.startswith("decode")
        assert prefill.compute == decode.compute == compute
        assert decode.rotate >= 1 and prefill.rotate == 1
    fp8 = next(c for c in glm5 if c.op == "fp8_block_gemm")
    assert fp8.flops == 2 * 4096 * 2048 * 6144 and fp8.baselines


def test_issue_target_shapes():
    glm5 = {c.op: c for c in bench_cases.cases("glm5")}
    long = {c.op: c for c in bench_cases.cases("long")}
    # sparse_mla_decode_paged: B=4, H=64, top-k 2048, d_qk 576, d_v 512
    assert glm5["sparse_mla_decode_paged"].flops == 2 * 4 * 64 * 2048 * (576 + 512)
    # indexer_topk_paged at 32K: 2 * B * Hi * D * ctx
    assert long["indexer_topk_paged"].flops == 2 * 4 * 32 * 128 * 32768
    # moe_permute: 1024 tokens x 6144, top-8: read + write of the 8192 permuted rows
    assert glm5["moe_permute"].nbytes == 2 * 8192 * 6144 * 2
    assert "ctx=8192" in glm5["kv_cache_gather"].label and "ctx=32768" in long["kv_cache_gather"].label


def test_tiny_cases_build_valid_inputs():
    for case in bench_cases.cases("tiny"):
        args = case.make()
        explanation = hal.explain(case.op, *args)
        assert explanation.error is None, (case.op, explanation.error)


def test_run_case_reports_reference_compiled_and_backends():
    case = next(c for c in bench_cases.cases("tiny") if c.op == "moe_permute")
    rows = runner.run_case(case, ROOF, ["cpu"], compile_reference=False, repeats=1, min_time=0.001)
    assert [r.who for r in rows] == ["reference", "cpu.moe_permute"]
    assert all(r.ms and r.ms > 0 and r.vs_reference and r.bound == "bytes" for r in rows)
    assert rows[0].vs_reference == 1.0
    table = runner.format_table([(case, rows)], ROOF)
    assert "moe_permute" in table and "cpu.moe_permute" in table
    data = runner.to_json([(case, rows)])
    assert data[0]["op"] == "moe_permute" and data[0]["timings"][1]["who"] == "cpu.moe_permute"


def test_every_row_reports_the_spread_of_its_repeats():
    case = next(c for c in bench_cases.cases("tiny") if c.op == "rms_norm")
    rows = runner.run_case(case, ROOF, ["cpu"], compile_reference=False, repeats=3, min_time=0.001)
    for r in rows:
        assert 0 < r.min_ms <= r.ms <= r.max_ms
    line = runner.format_rows(case, rows, ROOF).splitlines()[1]
    assert f"{rows[1].min_ms:9.3f}" in line and f"{rows[1].max_ms:9.3f}" in line
    assert runner.to_json([(case, rows)])[0]["timings"][1]["max_ms"] == rows[1].max_ms
    header = runner.format_header(ROOF, {"allocator": "glibc", "thp_enabled": "madvise", "thp_defrag": "never"})
    assert "min" in header and "max" in header
    assert "memory: allocator glibc; THP enabled=madvise defrag=never" in header


def test_batch_times_gives_every_repeat():
    from glm5_hal.bench.timing import batch_times, median_time
    calls = []
    samples = batch_times(lambda: calls.append(1), repeats=4, min_time=0.0, warmup=2)
    assert len(samples) == 4 and len(calls) == 2 + 1 + 4 and all(s > 0 for s in samples)
    assert median_time(lambda: None, repeats=3, min_time=0.0) > 0


def test_roofline_percent_picks_the_binding_limit():
    # 1 GFLOP at 100 GFLOP/s = 10 ms; 1 GB at 10 GB/s = 100 ms: bytes bind
    pct, bound = ROOF.percent(0.2, 1e9, 1e9)
    assert bound == "bytes" and pct == pytest.approx(50.0)
    pct, bound = ROOF.percent(0.02, 1e9, 0)
    assert bound == "flops" and pct == pytest.approx(50.0)


def test_roofline_holds_each_kind_of_product_to_the_fastest_instructions_for_it():
    assert ROOF.compute_limit("fp32") == (100.0, "fp32 FMA")
    assert ROOF.compute_limit("bf16") == (1000.0, "AMX bf16")
    assert ROOF.compute_limit("int8") == (2000.0, "AMX int8")
    no_amx = dataclasses.replace(ROOF, amx_bf16_gflops=0.0, amx_int8_gops=0.0)
    assert no_amx.compute_limit("bf16") == (100.0, "fp32 FMA")   # here vdpbf16ps is the slower one
    assert no_amx.compute_limit("int8") == (400.0, "VNNI int8")
    # 1 GFLOP of bf16 products at 1000 GFLOP/s = 1 ms; torch's bf16 GEMM would take 2 ms
    assert ROOF.percent(0.002, 1e9, 0, "bf16") == (pytest.approx(50.0), "flops")
    assert ROOF.torch_percent(0.002, 1e9, 0, "bf16") == pytest.approx(100.0)
    with pytest.raises(ValueError):
        ROOF.compute_limit("fp8")


def test_the_measured_limits_are_positive_where_the_cpu_has_them():
    roof = roofline.measure(seconds=0.02, gemm_n=128, copy_mib=4, repeats=1, triad_mib=4)
    assert roof.threads == torch.get_num_threads()
    assert roof.fp32_fma_gflops > 0 and roof.triad_gbps > 0 and roof.torch_bf16_gemm_gflops > 0
    assert all(v >= 0 for v in (roof.bf16_dot_gflops, roof.int8_dot_gops, roof.amx_bf16_gflops, roof.amx_int8_gops))
    assert "triad" in roof.describe() and "torch peers" in roof.describe()


def test_baselines_and_rotated_inputs_are_timed_on_the_same_arguments():
    made = []

    def make():
        made.append(torch.randn(4, 8))
        return made[-1], 1e-5

    seen = []
    case = runner.BenchCase("x", make, nbytes=64, rotate=3, baselines=(("echo", lambda x, eps: seen.append(x)),),
                            op="rms_norm")
    case = dataclasses.replace(case, make=lambda: (make()[0], torch.ones(8), 1e-5),
                               baselines=(("echo", lambda x, w, eps: seen.append(x)),))
    rows = runner.run_case(case, ROOF, [], compile_reference=False, repeats=1, min_time=0.001)
    assert [r.who for r in rows] == ["reference", "echo"] and rows[1].torch_pct is not None
    assert len(made) == 3 and {id(x) for x in seen} == {id(x) for x in made}   # every set, in turn


def test_dispatch_section_rows():
    rows = dispatch.measure(["rms_norm", "kv_cache_write"], repeats=1, min_time=0.001)
    assert [r["op"] for r in rows] == ["rms_norm", "kv_cache_write"]
    assert rows[0]["chosen"] == "cpu.rms_norm" and rows[1]["chosen"] == "cpu.kv_cache_write"
    assert all(r["direct_us"] > 0 and r["hal_us"] > 0 and math.isfinite(r["stub_overhead_us"]) for r in rows)
    assert [r["value_checks_us"] for r in rows] == [0.0, 0.0]   # the cpu kernels validate indices
    assert "overhead us" in dispatch.format_rows(rows) and "stub us" in dispatch.format_rows(rows)
    assert dispatch.STUB not in {b.name for b in hal.backends()}   # the stub backend is gone again


def test_dispatch_section_pinned_to_the_reference_times_the_value_checks():
    rows = dispatch.measure(["rms_norm", "kv_cache_write"], backend="reference", repeats=1, min_time=0.001)
    assert [r["chosen"] for r in rows] == ["reference.rms_norm", "reference.kv_cache_write"]
    assert rows[0]["value_checks_us"] == 0.0 and rows[1]["value_checks_us"] > 0


@pytest.fixture(scope="module")
def small_sweep():
    return dsa_vs_dense.sweep((256, 512), batch=1, repeats=1, min_time=0.001)


def test_dsa_vs_dense_sweep_on_small_contexts(small_sweep):
    rows = small_sweep
    assert [r["context"] for r in rows] == [256, 512]
    for r in rows:
        assert r["dsa_ms"] == pytest.approx(r["indexer_ms"] + r["sparse_ms"])
        assert r["dense_over_dsa"] > 0
    assert "dense/DSA" in dsa_vs_dense.format_header() and "256" in dsa_vs_dense.format_row(rows[0])


def test_dsa_vs_dense_plot(small_sweep, tmp_path):
    """Needs the plot extra (matplotlib), which CI installs (requirements/cpu.txt)."""
    pytest.importorskip("matplotlib")
    png = tmp_path / "sweep.png"
    dsa_vs_dense.plot(small_sweep, str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_cli_bench_tiny_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = cli.main(["bench", "--preset", "tiny", "--op", "rms_norm", "--op", "moe_unpermute", "--no-compile",
                     "--repeats", "1", "--json", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert "dispatch overhead" in text and "roofline" in text and "cpu.moe_unpermute" in text
    data = json.loads(out.read_text())
    assert {r["op"] for r in data["dispatch"]} == {"rms_norm", "moe_unpermute"}
    assert [c["op"] for c in data["ops"]] == ["rms_norm", "moe_unpermute"]
    assert data["roofline"]["triad_gbps"] > 0 and data["roofline"]["torch_copy_gbps"] > 0
    from glm5_hal import memory_env
    assert data["memory"] == memory_env.describe()
    assert "memory: " + memory_env.summary(data["memory"]) in text
    assert all(t["min_ms"] <= t["ms"] <= t["max_ms"] for c in data["ops"] for t in c["timings"] if t["ms"])


def test_cli_bench_rejects_unknown_op_and_backend(capsys):
    assert cli.main(["bench", "--op", "no_such_op"]) == 2
    assert "unknown op" in capsys.readouterr().err
    assert cli.main(["bench", "--backend", "no_such_backend", "--dispatch"]) == 2


def test_cli_plot_without_matplotlib_says_how_to_get_it(monkeypatch, capsys):
    import builtins
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert cli.main(["bench", "--dsa-vs-dense", "--contexts", "256", "--plot", "x.png"]) == 2
    assert "glm5-hal[plot]" in capsys.readouterr().err


def test_threads_are_torchs():
    assert dispatch.measure(["silu_and_mul"], repeats=1, min_time=0.001)[0]["chosen"] == "cpu.silu_and_mul"
    assert torch.get_num_threads() >= 1


def test_the_decode_batch_can_be_overridden_for_the_gpu_targets():
    glm5 = {c.op: c for c in bench_cases.cases("glm5", batch=64)}
    # issue 14: sparse_mla_decode_paged at B=64, 64 heads, top-2048, d_qk 576, d_v 512
    assert glm5["sparse_mla_decode_paged"].flops == 2 * 64 * 64 * 2048 * (576 + 512)
    assert "B=64" in glm5["sparse_mla_decode_paged"].label
    assert "B=64 ctx=32768" in {c.op: c for c in bench_cases.cases("long", batch=64)}["indexer_topk_paged"].label


def test_datasheet_peaks_give_both_percentages_and_a_column():
    roof = dataclasses.replace(ROOF, device="NVIDIA H200", peak_gflops=1000.0, peak_gbps=20.0)
    assert roof.peak_percents(1.0, 500e9, 10e9) == (50.0, 50.0)
    assert ROOF.peak_percents(1.0, 500e9, 10e9) == (None, None)
    case = next(c for c in bench_cases.cases("tiny") if c.op == "rms_norm")
    rows = [runner.Timing("reference", 1.0, 1.0, 10.0, "bytes", peak_flops_pct=None, peak_bytes_pct=12.5)]
    assert "% peak f/b" in runner.format_header(roof) and "-/12.5" in runner.format_rows(case, rows, roof)
    assert "NVIDIA H200: torch's GEMMs" in runner.format_header(roof)
    assert roof.compute_limit("bf16")[1] == "bf16 GEMM"


def test_bench_on_a_device_torch_does_not_have_is_an_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert cli.main(["bench", "--device", "cuda", "--preset", "tiny", "--op", "rms_norm"]) == 2
    assert "bench --device cuda: torch has no available cuda device here" in capsys.readouterr().err


def _steady_state_script():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[1] / "scripts" / "steady_state.py"
    spec = importlib.util.spec_from_file_location("steady_state", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_steady_state_script_measures_an_op_against_its_bound():
    script = _steady_state_script()
    run = script.measure(repeats=2, ops=["moe_unpermute"])
    (row,) = run["rows"]
    assert row["op"] == "moe_unpermute" and 0 < row["min_ms"] <= row["median_ms"] <= row["max_ms"]
    assert row["bound"].startswith("copy_") and row["pct_of_bound"] == pytest.approx(
        100 * row["bound_ms"] / row["median_ms"])
    assert run["memory"]["allocator"] and run["output_cache"]["hits"] >= 2   # steady state: reused
    table = script.format_run(1, run)
    assert "moe_unpermute" in table and f"{row['pct_of_bound']:7.1f}%" in table
