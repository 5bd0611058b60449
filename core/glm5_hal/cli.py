"""The `glm5-hal` command.

Imports nothing heavy at module level: `glm5-hal doctor` must run where `import torch` fails.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys


def _cmd_backends(args: argparse.Namespace) -> int:
    import glm5_hal as hal
    rows = hal.backends()
    if args.json:
        print(json.dumps([_backend_json(r) for r in rows], indent=2))
        return 0
    print(f"{'backend':<12} {'device':<7} {'prio':>11}  {'status':<12} {'ops':>3}  reason")
    for r in rows:
        status = "available" if r.available else ("QUARANTINED" if r.error else "unavailable")
        prio = "last" if r.name == "reference" else str(r.priority)
        print(f"{r.name:<12} {r.device_type:<7} {prio:>11}  {status:<12} {len(r.ops):>3}  {r.error or r.reason}")
    return 0


def _backend_json(r) -> dict:
    caps = None
    if r.capabilities is not None:
        caps = {"dtypes": sorted(str(d).removeprefix("torch.") for d in r.capabilities.dtypes),
                "dist_backend": r.capabilities.dist_backend,
                "device_name": r.capabilities.device_name,
                "limits": {k: str(v) for k, v in r.capabilities.limits.items()}}
    return {"name": r.name, "device_type": r.device_type, "priority": r.priority,
            "available": r.available, "reason": r.reason, "versions": r.versions,
            "ops": list(r.ops), "error": r.error, "plugin": r.plugin, "capabilities": caps}


def _cmd_doctor(args: argparse.Namespace) -> int:
    from .doctor import diagnose, format_report
    report = diagnose()
    print(json.dumps(report, indent=2, default=str) if args.json else format_report(report))
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    """Benchmarks (docs/performance.md): the dispatch overhead, then every op at the preset's
    shapes (reference, torch.compile of it, each backend), or the collectives, or the DSA
    versus dense decode sweep. Prints a table; --json writes everything."""
    if args.collectives:
        from .bench import collectives
        sizes = collectives.parse_sizes(args.sizes) if args.sizes else collectives.DEFAULT_SIZES
        report = collectives.launch(world_size=args.world_size, sizes=sizes)
        print(collectives.format_report(report))
        _write_json(args.json, {"collectives": report})
        return 0 if collectives.total_wrong(report) == 0 else 1
    import torch

    from . import memory_env
    from .bench import cases as bench_cases, dispatch, runner
    from .errors import HalError
    ops = _bench_ops(args.op)
    device = torch.device(args.device)
    module = getattr(torch, device.type, None)
    if device.type != "cpu" and not (module is not None and module.is_available()):
        raise HalError(f"bench --device {args.device}: torch has no available {device.type} device here")
    backends = runner.candidate_backends(args.backend, device.type)
    report: dict = {"torch": torch.__version__, "threads": torch.get_num_threads(), "backends": backends,
                    "device": args.device, "memory": memory_env.describe()}
    if args.dsa_vs_dense:
        from .bench import dsa_vs_dense
        if args.plot:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise HalError("bench --plot needs matplotlib: pip install 'glm5-hal[plot]' "
                               "(or pip install matplotlib)") from None
        contexts = _contexts(args.contexts) if args.contexts else dsa_vs_dense.DEFAULT_CONTEXTS
        print("DSA vs dense decode (batch 4, 64 heads, top-2048, bf16; best available backend)")
        print(dsa_vs_dense.format_header(), flush=True)
        rows = dsa_vs_dense.sweep(contexts, repeats=args.repeats,
                                  on_row=lambda r: print(dsa_vs_dense.format_row(r), flush=True))
        report["dsa_vs_dense"] = rows
        if args.plot:
            dsa_vs_dense.plot(rows, args.plot)
            print(f"wrote {args.plot}")
        _write_json(args.json, report)
        return 0
    pinned = args.backend[0] if args.backend and len(args.backend) == 1 else None
    if device.type == "cpu":
        print("dispatch overhead (glm5_hal.ops.<op> minus a direct call of the chosen implementation)")
        rows = dispatch.measure(ops or None, backend=pinned)
        print(dispatch.format_rows(rows), flush=True)
        report["dispatch"] = rows
    elif args.dispatch:
        raise HalError("bench --dispatch measures on CPU inputs; run it without --device")
    if not args.dispatch:
        from .bench import roofline
        cases = [c for c in bench_cases.cases(args.preset, batch=args.batch) if not ops or c.op in ops]
        peaks = _device_peaks(backends, device.type)
        roof = roofline.measure(device=args.device, peaks=peaks)
        report["preset"] = args.preset
        report["batch"] = args.batch
        report["roofline"] = dataclasses.asdict(roof)
        print(f"\nops at preset {args.preset!r} (ms: median of {args.repeats} batches, min and max of them; "
              f"x ref = reference ms / ms; % roof of the machine's binding limit [named], f = flops, b = bytes; "
              f"% torch of torch's GEMM or copy_ in this run)")
        print(runner.format_header(roof, report["memory"]), flush=True)
        results = runner.run_cases(cases, roof, backends, compile_reference=not args.no_compile,
                                   repeats=args.repeats, device=args.device,
                                   on_case=lambda c, r: print(runner.format_rows(c, r, roof), flush=True))
        report["ops"] = runner.to_json(results)
    _write_json(args.json, report)
    return 0


def _device_peaks(backends: list[str], device_type: str) -> dict:
    """The datasheet peaks an available backend of the device states in its capabilities
    (limits peak_bf16_tflops, peak_hbm_tbps, peak_source), if any."""
    if device_type == "cpu":
        return {}
    import glm5_hal as hal
    for name in backends:
        limits = hal.get_backend(name).cached_capabilities().limits
        if "peak_bf16_tflops" in limits:
            return limits
    return {}


def _bench_ops(names) -> list[str]:
    if not names:
        return []
    from . import ops  # noqa: F401  (defines every op)
    from .opdef import OPS
    unknown = [n for n in names if n not in OPS]
    if unknown:
        from .errors import HalError
        raise HalError(f"bench --op: unknown op(s) {unknown}; known: {sorted(OPS)}")
    return list(names)


def _contexts(text: str) -> list[int]:
    from .bench.collectives import parse_sizes
    # 2K = 2048 tokens: the same K/M suffixes as --sizes
    return parse_sizes(text)


def _write_json(path: str | None, data: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
        print(f"wrote {path}")


def _cmd_conformance(args: argparse.Namespace) -> int:
    """Runs the conformance suite; exit status 1 iff a case failed or errored."""
    from .conformance import report, runner, suite
    from .conformance.progress import Progress
    runner.check_reference_mode(args.ref)
    backends = suite.resolve_backends(args.backend)
    ops, presets = suite.resolve_ops(args.op), suite.resolve_presets(args.preset)
    items = suite.plan(backends, ops, presets)
    workers = (os.cpu_count() or 1) if args.n == "auto" else int(args.n)
    print(f"conformance: {len(items)} cases, backends {', '.join(backends)}, presets "
          f"{', '.join(presets)}, reference {args.ref}, {workers} worker(s)", file=sys.stderr)
    progress = Progress(items)
    try:
        records = runner.run_all(items, args.ref, workers=workers, choices=(backends, ops, presets),
                                 on_record=progress)
    finally:
        progress.close()
    certification = None
    if args.certify:
        from .conformance import certify
        records = certify.relabel(records)
        certification = certify.verdict(records, backends)
    print(report.format_matrix(records))
    if certification is not None:
        print(certify.format_verdict(certification))
    if not args.backend:
        import glm5_hal as hal
        for r in hal.backends():
            if not r.available and r.name != "reference":
                print(f"note: not tested (unavailable): {r.name}: {r.error or r.reason}")
    missing = suite.ops_without_cases()
    if missing and not args.op:
        print(f"note: ops without conformance cases yet: {', '.join(missing)}")
    if args.json or args.junit or args.markdown:
        meta = report.metadata(backends, ops, presets, args.ref, workers, _conformance_command(args))
        if certification is not None:
            meta["certification"] = certification
        for path, write in ((args.json, report.write_json), (args.junit, report.write_junit),
                            (args.markdown, report.write_markdown)):
            if path:
                write(path, records, meta)
                print(f"wrote {path}")
    if certification is not None and not all(v["certified"] for v in certification.values()):
        return 1
    return 1 if report.failed(records) else 0


def _cmd_conformance_merge(args: argparse.Namespace) -> int:
    """Merges run reports into one matrix (Markdown, HTML, JSON); prints the Markdown when no
    output is named."""
    from .conformance import html, matrix
    _refuse_run_options(args, "merge")
    result = matrix.merge([matrix.load_run(path) for path in args.reports])
    for path, write in ((args.markdown_out, matrix.write_markdown), (args.html_out, html.write_html),
                        (args.json_out, matrix.write_json)):
        if path:
            write(path, result)
            print(f"wrote {path}")
    if not (args.markdown_out or args.html_out or args.json_out):
        print(matrix.to_markdown(result), end="")
    for line in result["differences"]:
        print(f"note: {line}", file=sys.stderr)
    return 0


def _cmd_conformance_diff(args: argparse.Namespace) -> int:
    """What got worse from OLD to NEW; exit status 1 iff a finding of a --fail-on kind."""
    from .conformance import diff
    _refuse_run_options(args, "diff")
    old, new = diff.load(args.old), diff.load(args.new)
    result = diff.compare(old, new, args.drift)
    fail_on = tuple(dict.fromkeys(args.fail_on or diff.DEFAULT_FAIL_ON))
    failing = result.failing(fail_on)
    if args.json_flag:
        print(json.dumps(dict(result.to_dict(), fail_on=list(fail_on), failing=failing), indent=1))
    else:
        print(diff.format_diff(result, args.old, args.new))
        print(f"failing on: {', '.join(failing)}" if failing else
              f"ok: none of {', '.join(fail_on)}")
    return 1 if failing else 0


def _refuse_run_options(args: argparse.Namespace, action: str) -> None:
    given = [flag for flag, value in (("--backend", args.backend), ("--op", args.op), ("--preset", args.preset),
                                      ("--json", args.json), ("--junit", args.junit),
                                      ("--markdown", args.markdown), ("--certify", args.certify)) if value]
    if given:
        from .errors import HalError
        raise HalError(f"conformance {action}: {', '.join(given)} belong to a conformance run; "
                       f"put {action}'s own options after '{action}'")


def _conformance_command(args: argparse.Namespace) -> str:
    """The command line that reproduces this run, with the settings that chose the plugins
    (defaults spelled out; report paths included)."""
    import shlex
    words = [f"{k}={os.environ[k]}" for k in ("GLM5_HAL_PLUGINS", "GLM5_HAL_DISABLE", "GLM5_HAL_STRICT")
             if os.environ.get(k)]
    words += ["glm5-hal", "conformance"]
    for flag, values in (("--backend", args.backend), ("--op", args.op), ("--preset", args.preset)):
        for value in values or ():
            words += [flag, value]
    words += ["--ref", args.ref, "-n", args.n] + (["--certify"] if args.certify else [])
    for flag, value in (("--json", args.json), ("--junit", args.junit), ("--markdown", args.markdown)):
        if value:
            words += [flag, value]
    return shlex.join(words)


def _workers(text: str) -> str:
    if text != "auto" and not (text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"expected a number >= 1 or 'auto', got {text!r}")
    return text


def _cmd_new_backend(args: argparse.Namespace) -> int:
    from pathlib import Path

    from .scaffold import scaffold
    root = scaffold(args.name, Path(args.dest), args.device_type, args.dist_backend)
    print(f"wrote {root}\nnext: pip install -e {root}[test] && pytest {root} && "
          f"glm5-hal conformance --backend {args.name}")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    """Generates with the tiny GLM-5-architecture model (glm5_hal.models) through the HAL."""
    import torch

    from .models import demo
    try:
        torch.empty(0, device=args.device)
    except (RuntimeError, AssertionError) as exc:   # unknown device string, or torch built without it
        print(f"glm5-hal demo: error: device {args.device!r} is not usable: {exc}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    demo.run(tokens=args.tokens, backend=args.backend, seed=args.seed, prompt_len=args.prompt_len,
             dtype=args.dtype, fp8_indexer=args.fp8_indexer, device=args.device, checkpoint=args.checkpoint,
             quantize=args.quantize, prompt_ids=args.prompt_ids, prompt=args.prompt)
    return 0


def _token_ids(text: str) -> list[int]:
    parts = [p for p in text.replace(",", " ").split()]
    if not parts or not all(p.isdigit() for p in parts):
        raise argparse.ArgumentTypeError(f"expected token ids such as '1,2,3', got {text!r}")
    return [int(p) for p in parts]


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glm5-hal", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list registered backends, their availability and ops")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_backends)

    p = sub.add_parser("doctor", help="diagnose torch, vendor bridges, toolchains and backends")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser("bench", help="benchmarks (ratios against the reference; not tests)",
                       description="Dispatch overhead, then every op at GLM-5 shapes: the reference, "
                                   "torch.compile of it and each backend, against the measured roofline "
                                   "(docs/performance.md). Benchmarks measure; they never fail on timings.")
    p.add_argument("--json", metavar="F", help="also write the results as JSON to F")
    p.add_argument("--preset", default="glm5", choices=("glm5", "long", "tiny"),
                   help="shapes: glm5 (decode at 8K context), long (decode at 32K), tiny (smoke test)")
    p.add_argument("--op", action="append", metavar="O", help="only this op (repeatable)")
    p.add_argument("--backend", action="append", metavar="B",
                   help="only this backend (repeatable; default: every available one)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile of the reference")
    p.add_argument("--device", default="cpu", metavar="D",
                   help="device the inputs live on: cpu (default), or e.g. cuda; backends of that device type "
                        "are timed, with device syncs, against the device's measured and datasheet limits")
    p.add_argument("--batch", type=_positive_int, metavar="N",
                   help="decode batch (sequences) instead of the preset's 4, e.g. 64")
    p.add_argument("--repeats", type=int, default=5, metavar="N", help="timed batches per measurement (median)")
    p.add_argument("--dispatch", action="store_true", help="only the dispatch-overhead section")
    p.add_argument("--dsa-vs-dense", action="store_true",
                   help="DSA (indexer_topk_paged + sparse_mla_decode_paged) vs dense_mla_decode_paged "
                        "decode over context 2K..64K")
    p.add_argument("--contexts", metavar="LIST", help="contexts for --dsa-vs-dense, e.g. 2K,8K,32K")
    p.add_argument("--plot", metavar="F", help="with --dsa-vs-dense: write a PNG plot to F (needs matplotlib)")
    p.add_argument("--collectives", action="store_true",
                   help="collective bandwidth through glm5_hal.dist (nccl-tests' algbw/busbw) "
                        "on --world-size spawned local ranks")
    p.add_argument("--world-size", type=int, default=2, metavar="N", help="ranks for --collectives")
    p.add_argument("--sizes", metavar="LIST", help="message sizes for --collectives, e.g. 4K,1M,64M")
    p.add_argument("--hf-decode", dest="func", action="store_const",
                   const=lambda args: __import__("glm5_hal.bench.hf_decode", fromlist=["command"]).command(args),
                   help="decode tokens/s of HF transformers' GLM-5 (eager, and on glm5_hal ops) and of "
                        "glm5_hal.models, same weights (needs glm5-hal[transformers]; --preset tiny: the tiny "
                        "config only)")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser("new-backend", help="scaffold an out-of-tree backend plugin package")
    p.add_argument("name", help="backend name, a lower-case identifier (also the entry-point name)")
    p.add_argument("--device-type", default="cpu", help="torch device type its kernels take (default: cpu)")
    p.add_argument("--dist-backend", default=None, help="torch.distributed backend of that device")
    p.add_argument("--dest", default=".", help="folder to create the package in (default: .)")
    p.set_defaults(func=_cmd_new_backend)

    p = sub.add_parser("conformance", help="judge backends against the reference (docs/conformance.md)")
    p.add_argument("--backend", action="append", metavar="B",
                   help="backend to test (repeatable; default: every available one except reference)")
    p.add_argument("--op", action="append", metavar="O", help="op to test (repeatable; default: all with cases)")
    p.add_argument("--preset", action="append", metavar="P", choices=("tiny", "glm5"),
                   help="case preset (repeatable; default: tiny and glm5)")
    p.add_argument("--ref", default="cpu", choices=("cpu", "cuda"),
                   help="reference: float64 on the CPU (default) or float64 on an NVIDIA GPU")
    p.add_argument("-n", default="1", type=_workers, metavar="N",
                   help="worker processes (a number or 'auto'; results equal -n 1)")
    p.add_argument("--json", metavar="F", help="write one record per case plus run metadata to F")
    p.add_argument("--junit", metavar="F", help="write JUnit XML to F (for CI)")
    p.add_argument("--markdown", metavar="F", help="write the matrix as Markdown to F (README, PR)")
    p.add_argument("--certify", action="store_true",
                   help="certification: also fail when the backend's own implementation takes less than half "
                        "of the cases of an op/dtype it declares, or declines one without a stated reason; list "
                        "every declined case; report expected errors the ops' own checks decided as 'contract' "
                        "(docs/conformance.md, Certification)")
    p.set_defaults(func=_cmd_conformance)
    actions = p.add_subparsers(dest="action", metavar="{merge,diff}",
                               help="instead of running the suite: merge or compare reports")
    m = actions.add_parser("merge", help="merge reports of many runs into one matrix",
                           description="One matrix over every report: rows op x dtype, columns backend @ "
                                       "chip, status counts per cell, failing cases with their worst "
                                       "element and margin; differences between the reports are stated.")
    m.add_argument("reports", nargs="+", metavar="REPORT.json", help="reports of glm5-hal conformance --json")
    m.add_argument("--markdown", dest="markdown_out", metavar="F", help="write the matrix as Markdown to F")
    m.add_argument("--html", dest="html_out", metavar="F", help="write a self-contained HTML page to F")
    m.add_argument("--json", dest="json_out", metavar="F",
                   help="write the matrix as JSON to F (a baseline for conformance diff)")
    m.set_defaults(func=_cmd_conformance_merge)
    d = actions.add_parser("diff", help="what got worse between two reports (exit 1 on a new failure, "
                                        "fallback or lost coverage)",
                           description="Regressions (fail/error in NEW where OLD passed, declined or lacked "
                                       "the case), new fallbacks, lost coverage (cases and columns) and "
                                       "margin drift from OLD to NEW, each a run report or a merged matrix. "
                                       "Exit status 1 on a finding of a --fail-on kind or an empty NEW, 2 on "
                                       "an unreadable or malformed report.")
    d.add_argument("old", metavar="OLD.json")
    d.add_argument("new", metavar="NEW.json")
    d.add_argument("--json", dest="json_flag", action="store_true", help="machine-readable output")
    d.add_argument("--drift", type=float, default=0.25, metavar="X",
                   help="report a passing case whose margin grew by more than X (default 0.25: a "
                        "quarter of its tolerance bound)")
    d.add_argument("--fail-on", action="append", choices=("regression", "fallback", "coverage", "drift"),
                   help="findings that make the exit status 1 (repeatable; the kinds given replace the "
                        "default: regression, fallback and coverage)")
    d.set_defaults(func=_cmd_conformance_diff)

    p = sub.add_parser("demo", help="generate with a GLM-5-architecture model through the HAL: the tiny one, "
                                    "or a checkpoint's (docs/models.md)")
    p.add_argument("--checkpoint", metavar="DIR", help="an HF-layout checkpoint directory (BF16 or FP8; "
                   "GLM5ForCausalLM.from_pretrained) instead of the tiny model with random weights")
    p.add_argument("--quantize", choices=("int8",), help="with --checkpoint: convert the weights to INT8 W8A8 at load")
    p.add_argument("--tokens", type=_positive_int, default=32, metavar="N", help="tokens to generate (default 32)")
    p.add_argument("--backend", metavar="B", help="pin dispatch to backend B (default: best available per op)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the weights and the prompt (default 0)")
    p.add_argument("--prompt-len", type=_positive_int, default=16, metavar="P",
                   help="random prompt length (default 16)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt-ids", type=_token_ids, metavar="IDS", help="the prompt as token ids, e.g. 1,2,3")
    prompt.add_argument("--prompt", metavar="TEXT", help="with --checkpoint: the prompt as text, encoded by the "
                        "checkpoint's tokenizer.json (needs the `tokenizers` package)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="model dtype (default: float32 for the tiny model, the checkpoint's with --checkpoint)")
    p.add_argument("--fp8-indexer", action="store_true", help="FP8 indexer keys and queries")
    p.add_argument("--device", default="cpu", help="torch device of the model and its cache (default cpu)")
    p.add_argument("--threads", type=_positive_int, metavar="T",
                   help="torch intra-op threads (default: torch's; the tiny model often runs "
                        "fastest with 1)")
    p.set_defaults(func=_cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # the CLI reports, it does not dump tracebacks at users
        from .errors import HalError
        if not isinstance(exc, HalError):
            raise
        print(f"glm5-hal: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
