"""The two Python steps of scripts/gpu_check.sh:

    gpu_check_report.py environment OUT.json   the machine: torch, CUDA, nvcc, driver, the GPU's
                                               properties, FlashMLA / DeepGEMM versions
    gpu_check_report.py summary OUTDIR         OUTDIR/summary.json and OUTDIR/summary.md from
                                               the step files: steps.tsv, environment.json,
                                               conformance_{tiny,glm5,own_kernels}.json,
                                               bench_target_<op>.json, bench_own_kernels.json,
                                               bench_<op>.json

The summary reports what was measured; it asserts nothing. The issue-14 targets (sparse MLA
decode and the paged indexer at >= 5x torch.compile of the reference) are shown as measured
ratios next to the target.
"""
from __future__ import annotations

import collections
import csv
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

TARGETS = {"sparse_mla_decode_paged": 5.0, "indexer_topk_paged": 5.0}  # x torch.compile of the reference


def _command(*argv: str) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError) as exc:
        return f"failed: {exc}"


def _version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def environment(path: str) -> None:
    import torch
    data: dict = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                  "nvcc": _command("nvcc", "--version"), "nvidia_smi": _command("nvidia-smi", "-L"),
                  "driver": _command("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"),
                  "triton": _version("triton"), "flash_mla": _version("flash_mla", "flash-mla"),
                  "deep_gemm": _version("deep_gemm", "deep-gemm")}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        data["device"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                          "multiprocessors": props.multi_processor_count,
                          "memory_gib": round(props.total_memory / 2**30, 1),
                          "shared_memory_per_multiprocessor": getattr(props, "shared_memory_per_multiprocessor", None),
                          "count": torch.cuda.device_count()}
    if importlib.util.find_spec("glm5_hal") is not None:
        from glm5_hal.backends.cuda import runtime
        data["cuda_backend_libraries"] = runtime.CudaRuntime(torch).package_versions()
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    print(json.dumps(data, indent=1))


# -- summary ---------------------------------------------------------------------------------------
def _load(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _steps(out: Path) -> list[dict]:
    try:
        with (out / "steps.tsv").open() as f:
            return list(csv.DictReader(f, delimiter="\t"))
    except OSError:
        return []


def _conformance(*parts: dict | None) -> dict | None:
    if not any(parts):
        return None
    records = [r for data in parts if data for r in data.get("records", [])]
    by_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in records:
        by_op[r["op"]][r["status"]] += 1
    problems = [{"case": r["case"], "status": r["status"], "impl": r.get("impl"), "reason": r.get("reason", "")[:300]}
                for r in records if r["status"] in ("fail", "error")]
    declined = sorted({(r["op"], r.get("reason", "")[:200]) for r in records if r["status"] in ("fallback", "skip")})
    return {"totals": dict(collections.Counter(r["status"] for r in records)),
            "by_op": {op: dict(c) for op, c in sorted(by_op.items())}, "problems": problems,
            "declined": [{"op": op, "reason": reason} for op, reason in declined]}


def _bench_rows(data: dict | None) -> list[dict]:
    """One row per (op, implementation) with the ratios against the reference and torch.compile."""
    rows = []
    for case in (data or {}).get("ops", []):
        timings = {t["who"]: t for t in case["timings"]}
        ref = (timings.get("reference") or {}).get("ms")
        compiled = (timings.get("compiled") or {}).get("ms")
        for t in case["timings"]:
            ms = t.get("ms")
            rows.append({"op": case["op"], "shape": case["shape"], "who": t["who"], "ms": ms,
                         "x_reference": ref / ms if ms and ref else None,
                         "x_compiled": compiled / ms if ms and compiled else None,
                         "roofline_pct": t.get("roofline_pct"), "bound": t.get("bound"),
                         "peak_flops_pct": t.get("peak_flops_pct"), "peak_bytes_pct": t.get("peak_bytes_pct"),
                         "note": t.get("note", "")})
    return rows


def _fmt(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summary(out_dir: str) -> None:
    out = Path(out_dir)
    env = _load(out / "environment.json") or {}
    result: dict = {"environment": env, "steps": _steps(out)}
    result["conformance"] = _conformance(_load(out / "conformance_tiny.json"), _load(out / "conformance_glm5.json"))
    result["conformance_own_kernels"] = _conformance(_load(out / "conformance_own_kernels.json"))
    own = _bench_rows(_load(out / "bench_own_kernels.json"))
    targets = []
    for op, wanted in TARGETS.items():
        data = _load(out / f"bench_target_{op}.json")
        rows = [r for r in _bench_rows(data) if r["op"] == op]
        backend = next((r for r in rows if r["who"] == f"cuda.{op}"), None)
        kernel = next((r for r in own if r["op"] == op and r["who"] == f"cuda.{op}"), None)
        targets.append({"op": op, "shape": rows[0]["shape"] if rows else None, "target_x_compiled": wanted,
                        "rows": rows, "cuda": backend, "own_kernel": kernel,
                        "roofline": (data or {}).get("roofline")})
    result["targets"] = targets
    result["bench"] = [row for path in sorted(out.glob("bench_*.json"))
                       if not path.name.startswith(("bench_target_", "bench_own_kernels"))
                       for row in _bench_rows(_load(path))]
    result["bench_own_kernels"] = own
    (out / "summary.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / "summary.md").write_text(_markdown(result))
    print((out / "summary.md").read_text())


def _markdown(result: dict) -> str:
    env, lines = result["environment"], ["# gpu_check: the cuda backend on a GPU", ""]
    device = env.get("device") or {}
    lines += [f"- device: {device.get('name', '?')} (capability {device.get('capability', '?')}, "
              f"{device.get('multiprocessors', '?')} SMs, {device.get('memory_gib', '?')} GiB), driver "
              f"{env.get('driver', '?')}",
              f"- torch {env.get('torch', '?')} (CUDA {env.get('cuda', '?')}), triton {env.get('triton')}, "
              f"FlashMLA {env.get('flash_mla')}, DeepGEMM {env.get('deep_gemm')}",
              f"- cuda backend libraries: {env.get('cuda_backend_libraries')}", "",
              "## Steps", "", "| step | seconds | status |", "|---|---|---|"]
    lines += [f"| {s['step']} | {s['seconds']} | {s['status']} |" for s in result["steps"]]
    lines += ["", "## Targets (issue 14; measured, not asserted)", ""]
    for t in result["targets"]:
        lines.append(f"### `{t['op']}` {t['shape'] or '(not measured)'}")
        lines.append("")
        lines.append("| implementation | ms | x reference | x torch.compile | % roof | % peak flops | % peak bytes |")
        lines.append("|---|---|---|---|---|---|---|")
        rows = t["rows"] + ([dict(t["own_kernel"], who=t["own_kernel"]["who"] + " (own kernel)")]
                            if t["own_kernel"] else [])
        for r in rows:
            lines.append(f"| {r['who']} | {_fmt(r['ms'], 3)} | {_fmt(r['x_reference'])} | {_fmt(r['x_compiled'])} | "
                         f"{_fmt(r['roofline_pct'], 1)} {r['bound'] or ''} | {_fmt(r['peak_flops_pct'], 1)} | "
                         f"{_fmt(r['peak_bytes_pct'], 1)} |" + (f" {r['note']}" if r['note'] else ""))
        cuda = t["cuda"]
        got = cuda and cuda["x_compiled"]
        verdict = ("not measured" if not got else
                   f"{got:.2f}x torch.compile: {'meets' if got >= t['target_x_compiled'] else 'misses'} the "
                   f"{t['target_x_compiled']:g}x target")
        lines += ["", f"cuda backend: {verdict}", ""]
    for title, key in (("Conformance (cuda, --ref cuda)", "conformance"),
                       ("Conformance of the own kernels (FlashMLA disabled)", "conformance_own_kernels")):
        conf = result[key]
        if conf is None:
            continue
        lines += [f"## {title}", "", f"totals: {conf['totals']}", "", "| op | " + " | ".join(
            ("pass", "fail", "error", "fallback", "skip")) + " |", "|---|---|---|---|---|---|"]
        for op, c in conf["by_op"].items():
            lines.append(f"| `{op}` | " + " | ".join(str(c.get(s, 0)) for s in ("pass", "fail", "error", "fallback",
                                                                               "skip")) + " |")
        if conf["problems"]:
            lines += ["", "failures and errors (first 30):", ""]
            lines += [f"- `{p['case']}` {p['status']} ({p['impl']}): {p['reason']}" for p in conf["problems"][:30]]
        if conf["declined"]:
            lines += ["", "declined (fallback / skip), one line per op and reason:", ""]
            lines += [f"- `{d['op']}`: {d['reason']}" for d in conf["declined"]]
        lines.append("")
    if result["bench"]:
        lines += ["## Bench: DSA, MoE and GEMM ops (glm5 preset)", "",
                  "| op | shape | implementation | ms | x reference | x torch.compile | % roof | % peak f/b |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in result["bench"]:
            lines.append(f"| `{r['op']}` | {r['shape']} | {r['who']} | {_fmt(r['ms'], 3)} | {_fmt(r['x_reference'])} | "
                         f"{_fmt(r['x_compiled'])} | {_fmt(r['roofline_pct'], 1)} | "
                         f"{_fmt(r['peak_flops_pct'], 1)}/{_fmt(r['peak_bytes_pct'], 1)} |"
                         + (f" {r['note']}" if r['note'] else ""))
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "environment":
        environment(argv[1])
        return 0
    if len(argv) == 2 and argv[0] == "summary":
        summary(argv[1])
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
