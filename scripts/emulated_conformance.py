#!/usr/bin/env python3
"""Runs the conformance suite over the emulated vendor labs, one report per lab.

Each lab (tests/emulators/labs.py: a vendor adapter over its CPU emulator, on one chip) is
installed the way a vendor's plugin is: through the `glm5_hal.backends` entry-point group,
from a generated `.dist-info` under build/emulated-labs/ put on PYTHONPATH. Then the
ordinary command runs, exactly as in a vendor's lab:

    GLM5_HAL_DISABLE=cpu glm5-hal conformance --backend ascend_emu --preset tiny --json OUT/ascend-910B.json

(the cpu backend is disabled as on a device host, where it cannot take device tensors).
`glm5-hal conformance merge` then combines these reports with the cpu one (.ci/run).

    scripts/emulated_conformance.py --out reports/labs [--preset tiny] [--op O] [--jobs 2] [LAB ...]

Exit status 1 iff some lab's run failed (a case failed or errored, or the run broke).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = REPO / "tests"
sys.path.insert(0, str(TESTS))

from emulators.labs import LABS  # noqa: E402


def install(lab, root: Path) -> Path:
    """A folder holding what `pip install` of a plugin leaves: a .dist-info with the entry point."""
    site = root / lab.key
    info = site / f"glm5_hal_emulated_{lab.attribute}-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: glm5-hal-emulated-{lab.attribute}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(
        f"[glm5_hal.backends]\n{lab.backend_name} = emulators.labs:{lab.attribute}\n")
    return site


def run(lab, site: Path, out: Path, presets: list[str], ops: list[str], workers: str
        ) -> tuple[str, int, float, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GLM5_HAL_")}
    env["GLM5_HAL_DISABLE"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(TESTS), *filter(None, [env.get("PYTHONPATH")])])
    command = [sys.executable, "-m", "glm5_hal.cli", "conformance", "--backend", lab.backend_name,
               *[a for p in presets for a in ("--preset", p)], *[a for o in ops for a in ("--op", o)],
               "-n", workers,
               "--json", str(out / f"{lab.key}.json")]
    start = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    total = next((line for line in proc.stdout.splitlines() if line.startswith("total:")), "")
    detail = total if proc.returncode in (0, 1) else (proc.stderr.strip().splitlines() or ["?"])[-1]
    if proc.returncode == 1:
        detail += "\n" + proc.stdout[-4000:]
    return lab.key, proc.returncode, time.perf_counter() - start, detail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("labs", nargs="*", metavar="LAB", help=f"labs to run (default: all of {', '.join(LABS)})")
    parser.add_argument("--out", required=True, type=Path, help="folder for the reports (LAB.json)")
    parser.add_argument("--preset", action="append", choices=("tiny", "glm5"),
                        help="case preset (repeatable; default: tiny)")
    parser.add_argument("--op", action="append", default=[], help="only this op (repeatable; default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="labs run at the same time (default 1)")
    parser.add_argument("-n", default="1", help="worker processes of each lab's run (default 1)")
    args = parser.parse_args(argv)
    unknown = [k for k in args.labs if k not in LABS]
    if unknown:
        parser.error(f"unknown lab(s) {unknown}; labs: {', '.join(LABS)}")
    labs = [LABS[k] for k in args.labs or LABS]
    args.out.mkdir(parents=True, exist_ok=True)
    root = REPO / "build" / "emulated-labs"
    sites = {lab.key: install(lab, root) for lab in labs}
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        futures = [pool.submit(run, lab, sites[lab.key], args.out, args.preset or ["tiny"], args.op, args.n)
                   for lab in labs]
        for future in futures:
            key, rc, seconds, detail = future.result()
            print(f"{key:<18} {'ok' if rc == 0 else f'FAILED (exit {rc})':<16} {seconds:6.1f}s  {detail}",
                  flush=True)
            failed += rc != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
