"""Builds the CUDA-dialect kernels (backends/_cuda_dialect/src) for the host with g++, on the
thread-per-GPU-thread runtime of glm5_hal_sim_runtime.h, into a library with the same C ABI
(target "sim"). Tests then drive the real launchers and the real kernel code on CPU tensors.

The only source rewriting is what the preprocessor cannot do: a triple-chevron launch
`kernel<<<grid, block, shared, stream>>>(args);` becomes
`glm5_hal_sim::launch(grid, block, shared, stream, [&] { kernel(args); });`, and
`extern __shared__ T name[];` becomes a pointer to the launch's dynamic shared buffer.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
LIBRARY_NAME = "libglm5_hal_sim_kernels.so"

_LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;]*>)?)<<<(.*?)>>>\((.*?)\);", re.S)
_DYNAMIC_SHARED = re.compile(r"extern __shared__ (\w+) (\w+)\[\];")


def simify(source: str) -> str:
    """The two rewrites; everything else compiles as it is."""
    source = _DYNAMIC_SHARED.sub(r"\1* \2 = glm5_hal_sim::dynamic_shared<\1>();", source)
    return _LAUNCH.sub(r"glm5_hal_sim::launch(\2, [&] { \1(\3); });", source)


def build(kernel_dir: Path, out_dir: Path, compiler: str | None = None) -> Path:
    """Compiles every kernel_dir/src/*.cu for the simulator into out_dir; returns the library."""
    from glm5_hal.kernel_library import INCLUDE_DIR
    compiler = compiler or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise FileNotFoundError("no host C++ compiler (g++ / c++) to build the simulated kernels")
    sources = []
    for path in sorted((kernel_dir / "src").glob("*.cu")):
        text = simify(path.read_text())
        if "<<<" in text:
            raise ValueError(f"{path.name}: a launch the rewrite did not recognise")
        target = out_dir / f"{path.stem}.cpp"
        target.write_text(text)
        sources.append(str(target))
    library = out_dir / LIBRARY_NAME
    subprocess.run([compiler, "-std=c++17", "-O1", "-pthread", "-shared", "-fPIC", "-DGLM5_HAL_GPU_SIM",
                    "-Wall", "-Wextra", "-Wno-unused-parameter",
                    "-I", str(kernel_dir / "include"), "-I", str(INCLUDE_DIR), "-I", str(kernel_dir / "src"),
                    "-I", str(HERE),
                    "-o", str(library), *sources], check=True, capture_output=True, text=True, timeout=300)
    return library
