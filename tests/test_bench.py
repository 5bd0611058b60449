"""Smoke tests of the benchmark harness on tiny shapes: it runs, covers every op, reports
what it must, and rejects bad options. Benchmarks are not tests: no timing is asserted."""
from __future__ import annotations

import json

import pytest
import torch

import glm5_hal as hal
from glm5_hal import cli
from glm5_hal.bench import cases as bench_cases, dispatch, dsa_vs_dense, runner
from glm5_hal.bench.roofline import Roofline
from glm5_hal.opdef import OPS

ROOF = Roofline(copy_gbps=10.0, gemm_gflops=100.0, threads=1)  # made up: only the arithmetic is tested


@pytest.mark.parametrize("preset", bench_cases.PRESETS)
def test_every_op_has_a_case_in_every_preset(preset):
    hal.ops.rms_norm  # noqa: B018  (defines every op)
    covered = {c.op for c in bench_cases.cases(preset)}
    assert covered == set(OPS)


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


def test_roofline_percent_picks_the_binding_limit():
    # 1 GFLOP at 100 GFLOP/s = 10 ms; 1 GB at 10 GB/s = 100 ms: bytes bind
    pct, bound = ROOF.percent(0.2, 1e9, 1e9)
    assert bound == "bytes" and pct == pytest.approx(50.0)
    pct, bound = ROOF.percent(0.02, 1e9, 0)
    assert bound == "flops" and pct == pytest.approx(50.0)


def test_dispatch_section_rows():
    rows = dispatch.measure(["rms_norm", "kv_cache_write"], repeats=1, min_time=0.001)
    assert [r["op"] for r in rows] == ["rms_norm", "kv_cache_write"]
    assert rows[0]["chosen"] == "cpu.rms_norm" and rows[1]["chosen"] == "cpu.kv_cache_write"
    assert all(r["direct_us"] > 0 and r["hal_us"] > 0 for r in rows)
    assert "overhead us" in dispatch.format_rows(rows)


def test_dsa_vs_dense_sweep_on_small_contexts(tmp_path):
    rows = dsa_vs_dense.sweep((256, 512), batch=1, repeats=1, min_time=0.001)
    assert [r["context"] for r in rows] == [256, 512]
    for r in rows:
        assert r["dsa_ms"] == pytest.approx(r["indexer_ms"] + r["sparse_ms"])
        assert r["dense_over_dsa"] > 0
    assert "dense/DSA" in dsa_vs_dense.format_header() and "256" in dsa_vs_dense.format_row(rows[0])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    png = tmp_path / "sweep.png"
    dsa_vs_dense.plot(rows, str(png))
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
    assert data["roofline"]["copy_gbps"] > 0


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
    roof = Roofline(copy_gbps=10.0, gemm_gflops=100.0, threads=1, device="NVIDIA H200", gemm_dtype="bfloat16",
                    peak_gflops=1000.0, peak_gbps=20.0)
    assert roof.peak_percents(1.0, 500e9, 10e9) == (50.0, 50.0)
    assert ROOF.peak_percents(1.0, 500e9, 10e9) == (None, None)
    case = next(c for c in bench_cases.cases("tiny") if c.op == "rms_norm")
    rows = [runner.Timing("reference", 1.0, 1.0, 10.0, "bytes", peak_flops_pct=None, peak_bytes_pct=12.5)]
    assert "% peak f/b" in runner.format_header(roof) and "-/12.5" in runner.format_rows(case, rows)


def test_bench_on_a_device_torch_does_not_have_is_an_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert cli.main(["bench", "--device", "cuda", "--preset", "tiny", "--op", "rms_norm"]) == 2
    assert "bench --device cuda: torch has no available cuda device here" in capsys.readouterr().err
