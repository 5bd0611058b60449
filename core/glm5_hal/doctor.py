"""`glm5-hal doctor`: diagnose the environment without ever crashing.

Everything that could take the process down (importing torch, vendor bridges, plugins)
runs in a subprocess; this module itself imports only the standard library and the
torch-free `glm5_hal.vendors`. The classic failure it explains: a vendor bridge such as
torch_npu installed without its runtime (CANN) makes `import torch` itself fail, because
torch auto-loads device bridges from the `torch.backends` entry-point group.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
from typing import Any

from . import memory_env
from .vendors import CUDA_TOOLCHAIN_ENV, VENDORS

AUTOLOAD_VAR = "TORCH_DEVICE_BACKEND_AUTOLOAD"

_TORCH_PROBE = r"""
import json, torch
info = {"version": torch.__version__, "cuda": torch.version.cuda,
        "hip": getattr(torch.version, "hip", None), "debug": torch.version.debug,
        "cxx11_abi": torch.compiled_with_cxx11_abi(), "threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0}
from glm5_hal.vendors import identify
info["stack"] = identify(torch)  # which vendor a `cuda` device is: torch.corex, torch.gcu, ...
try:
    acc = torch.accelerator.current_accelerator()
    info["accelerator"] = str(acc) if acc is not None else None
except Exception as exc:
    info["accelerator"] = f"unknown ({type(exc).__name__})"
print(json.dumps(info))
"""

_BACKENDS_PROBE = r"""
import json, glm5_hal
rows = []
for b in glm5_hal.backends():
    rows.append({"name": b.name, "device_type": b.device_type, "available": b.available,
                 "reason": b.reason, "error": b.error, "versions": b.versions,
                 "ops": len(b.ops)})
print(json.dumps(rows))
"""


@dataclasses.dataclass
class Probe:
    ok: bool
    data: Any
    error: str


def _run(code: str, env_extra: dict[str, str] | None = None, timeout: float = 120) -> Probe:
    env = dict(os.environ)
    env.update(env_extra or {})
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Probe(False, None, f"timed out after {timeout:.0f}s")
    except OSError as exc:
        return Probe(False, None, f"could not start {sys.executable}: {exc}")
    if proc.returncode != 0:
        return Probe(False, None, _last_error(proc.stderr) or f"exit code {proc.returncode}")
    try:
        return Probe(True, json.loads(proc.stdout.strip().splitlines()[-1]), "")
    except (ValueError, IndexError):
        return Probe(False, None, f"unexpected output: {proc.stdout[-300:]!r}")


def _last_error(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln or "Exception" in ln:
            return ln.strip()
    return lines[-1].strip() if lines else ""


def torch_device_bridges() -> list[str]:
    """Distributions registering `torch.backends` entry points (auto-loaded by torch)."""
    try:
        eps = importlib.metadata.entry_points(group="torch.backends")
    except Exception:
        return []
    return sorted(f"{ep.name} = {ep.value}" for ep in eps)


def diagnose() -> dict:
    report: dict[str, Any] = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": f"{platform.system()} {platform.release()} {platform.machine()}",
        "glm5_hal_env": {k: v for k, v in os.environ.items() if k.startswith("GLM5_HAL_")},
    }
    bridges = torch_device_bridges()
    report["torch_autoload_bridges"] = bridges
    torch_probe = _run(_TORCH_PROBE)
    findings: list[str] = []
    report["torch"] = torch_probe.data if torch_probe.ok else {"import_error": torch_probe.error}
    extra_env: dict[str, str] = {}
    if not torch_probe.ok:
        retry = _run(_TORCH_PROBE, {AUTOLOAD_VAR: "0"})
        if retry.ok:
            report["torch"] = dict(retry.data, import_error=torch_probe.error,
                                   imports_with=f"{AUTOLOAD_VAR}=0")
            extra_env = {AUTOLOAD_VAR: "0"}
            findings.append(
                f"`import torch` fails ({torch_probe.error}) but works with {AUTOLOAD_VAR}=0: "
                f"torch auto-loads the device bridges registered under the 'torch.backends' "
                f"entry-point group ({', '.join(bridges) or 'none listed'}), and one of them cannot "
                f"load its vendor runtime. Typical case: torch_npu installed without the CANN "
                f"toolkit (libhccl.so, libascendcl.so missing). Fix: install and source the vendor "
                f"runtime (for Ascend: `source $ASCEND_HOME_PATH/set_env.sh`), or uninstall the "
                f"bridge, or export {AUTOLOAD_VAR}=0 to use torch without it.")
        else:
            findings.append(f"`import torch` fails: {torch_probe.error}. Install a torch build "
                            f"(CPU: `pip install -r requirements/cpu.txt`).")

    vendors = {}
    for v in VENDORS.values():
        root = next((os.environ[e] for e in v.toolchain_env if os.environ.get(e)), None)
        vendors[v.backend] = {
            "bridge": v.bridge,
            "bridge_installed": (v.bridge is None) or importlib.util.find_spec(v.bridge) is not None,
            "toolchain_root": root,
            "compiler": shutil.which(v.compiler),
            "device_tool": shutil.which(v.smi),
            "smi": v.smi,
            "visible_devices": {v.visible_devices: os.environ.get(v.visible_devices)},
            "dist_backend": v.dist_backend,
        }
    report["vendors"] = vendors
    report["toolchains"] = {
        "cuda": next((os.environ[e] for e in CUDA_TOOLCHAIN_ENV if os.environ.get(e)), None),
        "nvcc": shutil.which("nvcc"), "cmake": shutil.which("cmake"),
        "c++": shutil.which("c++") or shutil.which("g++") or shutil.which("clang++"),
    }
    native = _run("import json, glm5_hal._C as c; "
                  "print(json.dumps({'openmp': c.has_openmp, 'tensor_reading': c.tensor_reading()}))",
                  extra_env)
    report["native_extension"] = native.data if native.ok else {"error": native.error}
    if not native.ok and torch_probe.ok:
        findings.append(f"the native extension glm5_hal._C does not import ({native.error}); "
                        f"reinstall glm5_hal (`pip install -e .`) so the cpu backend is available.")
    elif native.ok and native.data.get("tensor_reading") != "getters":
        findings.append("glm5_hal._C.call_key found none of torch.Tensor's C getters it reads metadata "
                        "through: every op call runs its Python checks (several us). Reinstall glm5_hal "
                        "(`pip install --no-build-isolation -e .`) against the torch you run.")

    if report["torch"].get("version"):
        backends = _run(_BACKENDS_PROBE, extra_env)
        report["backends"] = backends.data if backends.ok else {"error": backends.error}
        if not backends.ok:
            findings.append(f"listing glm5_hal backends failed: {backends.error}")
        else:
            for row in backends.data:
                if row["error"]:
                    findings.append(f"plugin {row['name']} is quarantined: {row['error']}")
    # The allocator and THP mode: this process's own (LD_PRELOAD and the kernel's settings are
    # what every Python process started from this environment gets). What they cost is speed,
    # not correctness: performance notes, apart from the findings.
    report["memory"] = memory_env.describe()
    report["performance_notes"] = memory_env.findings(report["memory"])
    report["findings"] = findings
    return report


def format_report(report: dict) -> str:
    out = [f"python      {report['python']}", f"platform    {report['platform']}"]
    torch_info = report["torch"]
    if "version" in torch_info:
        line = f"torch       {torch_info['version']}"
        line += f" (CUDA {torch_info['cuda']})" if torch_info.get("cuda") else ""
        line += f" (HIP {torch_info['hip']})" if torch_info.get("hip") else ""
        line += f", accelerator: {torch_info.get('accelerator')}"
        line += f", stack: {torch_info['stack']}" if torch_info.get("stack") else ""
        if torch_info.get("imports_with"):
            line += f"  [imports only with {torch_info['imports_with']}]"
        out.append(line)
    else:
        out.append(f"torch       IMPORT FAILS: {torch_info.get('import_error')}")
    out.append("torch autoloaded bridges: " + (", ".join(report["torch_autoload_bridges"]) or "none"))
    if report["glm5_hal_env"]:
        out.append("settings    " + " ".join(f"{k}={v}" for k, v in report["glm5_hal_env"].items()))
    native = report["native_extension"]
    out.append("native      " + (f"glm5_hal._C ok (OpenMP {'on' if native.get('openmp') else 'off'}, "
                                  f"tensors read through the {native.get('tensor_reading') or 'nothing'})"
                                 if "error" not in native else f"glm5_hal._C missing: {native['error']}"))
    if "memory" in report:
        out.append("memory      " + memory_env.summary(report["memory"]))
    out.append("")
    out.append(f"{'vendor':<10} {'bridge':<22} {'toolchain':<28} {'device tool':<22} {'dist':<6} visible devices")
    for name, v in report["vendors"].items():
        bridge = v["bridge"] or "(torch build)"
        bridge += " installed" if v["bridge"] and v["bridge_installed"] else (" missing" if v["bridge"] else "")
        out.append(f"{name:<10} {bridge:<22} {(v['toolchain_root'] or 'not found'):<28} "
                   f"{v['smi'] + (' found' if v['device_tool'] else ' not found'):<22} {v['dist_backend']:<6} "
                   + " ".join(f"{k}={'(unset)' if val is None else val}" for k, val in v["visible_devices"].items()))
    tc = report["toolchains"]
    out.append(f"{'cuda':<10} {'(torch build)':<22} {(tc['cuda'] or ('nvcc on PATH' if tc['nvcc'] else 'not found')):<28}")
    out.append("")
    backends = report.get("backends")
    if isinstance(backends, list):
        out.append("backends:")
        for row in backends:
            state = "available" if row["available"] else ("QUARANTINED" if row["error"] else "unavailable")
            out.append(f"  {row['name']:<12} {row['device_type']:<6} {state:<12} {row['error'] or row['reason']}")
    elif isinstance(backends, dict):
        out.append(f"backends: could not be listed: {backends['error']}")
    out.append("")
    if report.get("performance_notes"):
        out.append("performance notes (large CPU tensors):")
        out.extend(f"  - {n}" for n in report["performance_notes"])
        out.append("")
    if report["findings"]:
        out.append("findings:")
        out.extend(f"  - {f}" for f in report["findings"])
    else:
        out.append("findings: none, the environment looks healthy")
    return "\n".join(out)
