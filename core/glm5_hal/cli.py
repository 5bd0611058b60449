"""The `glm5-hal` command.

Imports nothing heavy at module level: `glm5-hal doctor` must run where `import torch` fails.
"""
from __future__ import annotations

import argparse
import json
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
    if args.collectives:
        from .bench import collectives
        sizes = collectives.parse_sizes(args.sizes) if args.sizes else collectives.DEFAULT_SIZES
        report = collectives.launch(world_size=args.world_size, sizes=sizes)
        print(collectives.format_report(report))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"collectives": report}, f, indent=2)
        return 0 if collectives.total_wrong(report) == 0 else 1
    from .bench import dispatch
    rows = dispatch.measure()
    print("dispatch overhead (glm5_hal.ops.<op> minus a direct call of the chosen implementation)")
    print(dispatch.format_rows(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dispatch": rows}, f, indent=2)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="glm5-hal", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list registered backends, their availability and ops")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_backends)

    p = sub.add_parser("doctor", help="diagnose torch, vendor bridges, toolchains and backends")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser("bench", help="benchmarks (ratios against the reference; not tests)")
    p.add_argument("--json", metavar="F", help="also write the results as JSON to F")
    p.add_argument("--collectives", action="store_true",
                   help="collective bandwidth through glm5_hal.dist (nccl-tests' algbw/busbw) "
                        "on --world-size spawned local ranks")
    p.add_argument("--world-size", type=int, default=2, metavar="N", help="ranks for --collectives")
    p.add_argument("--sizes", metavar="LIST", help="message sizes for --collectives, e.g. 4K,1M,64M")
    p.set_defaults(func=_cmd_bench)
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
