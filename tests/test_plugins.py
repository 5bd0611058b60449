"""Entry-point discovery, exercised the way users meet it: plugin distributions on
sys.path, a fresh interpreter per scenario."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, run_python, write_dist

TOY = '''
import torch
import glm5_hal as hal

class ToyBackend(hal.Backend):
    name = "toyvendor"
    device_type = "cpu"
    priority = 50
    def probe(self):
        return hal.Availability(True, "always available")

toy = ToyBackend()
calls = []

@toy.impl("rms_norm", dtypes=(torch.float32,), supports=None)
def rms_norm(x, weight, eps):
    calls.append(x.dtype)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

@hal.hookimpl
def glm5_hal_register_backends(register):
    register(toy)
'''

SCENARIO = '''
import json, sys, torch, warnings
import glm5_hal as hal
x, w = torch.randn(4, 16), torch.randn(16)
result = {"backends": {r.name: [r.available, r.reason, r.error] for r in hal.backends()},
          "fp32": hal.explain("rms_norm", x, w, 1e-5).chosen,
          "bf16": hal.explain("rms_norm", x.bfloat16(), w, 1e-5).chosen,
          "bf16_rejected": [list(r) for r in hal.explain("rms_norm", x.bfloat16(), w, 1e-5).rejected],
          "toy_imported": "toy_plugin" in sys.modules}
if result["toy_imported"]:
    hal.ops.rms_norm(x, w, 1e-5); hal.ops.rms_norm(x.bfloat16(), w, 1e-5)
    result["toy_calls"] = [str(d) for d in sys.modules["toy_plugin"].calls]
print(json.dumps(result))
'''


def scenario(tmp_path, env=None, extra_dists=()):
    write_dist(tmp_path / "site", "toy-plugin", "toy_plugin", TOY, {"toyvendor": "toy_plugin"})
    for dist, module, source in extra_dists:
        write_dist(tmp_path / "site", dist, module, source, {module: module})
    proc = run_python(SCENARIO, path=[tmp_path / "site"], env=env)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_out_of_tree_plugin_is_discovered_and_chosen_for_fp32_only(tmp_path):
    r = scenario(tmp_path)
    assert r["backends"]["toyvendor"] == [True, "always available", None]
    assert r["fp32"] == "toyvendor.rms_norm"
    assert r["bf16"] == "cpu.rms_norm"
    assert ["toyvendor.rms_norm", "implements rms_norm for {float32}, not bfloat16"] in r["bf16_rejected"]
    assert r["toy_calls"] == ["torch.float32"]


def test_disable_excludes_the_plugin_without_importing_it(tmp_path):
    r = scenario(tmp_path, env={"GLM5_HAL_DISABLE": "toyvendor"})
    assert "toyvendor" not in r["backends"] and not r["toy_imported"]
    assert r["fp32"] == "cpu.rms_norm"


def test_allowlist_loads_only_the_named_plugins(tmp_path):
    r = scenario(tmp_path, env={"GLM5_HAL_PLUGINS": "toyvendor"})
    assert set(r["backends"]) == {"reference", "toyvendor"}
    assert r["bf16"] == "reference.rms_norm"


BROKEN_IMPORT = "import not_a_real_module_xyz\n"
BROKEN_HOOK = '''
import glm5_hal as hal
@hal.hookimpl
def glm5_hal_register_backends(register):
    raise RuntimeError("vendor runtime said no")
'''
MISSPELLED_HOOK = '''
import glm5_hal as hal
@hal.hookimpl
def glm5_hal_register_backend(register):
    pass
'''
EXITS = "import sys\nsys.exit('plugin called sys.exit at import')\n"


def test_broken_plugins_do_not_break_the_hal(tmp_path):
    r = scenario(tmp_path, extra_dists=[
        ("broken-import", "broken_import", BROKEN_IMPORT),
        ("broken-hook", "broken_hook", BROKEN_HOOK),
        ("misspelled", "misspelled", MISSPELLED_HOOK),
        ("exits", "exits", EXITS)])
    b = r["backends"]
    assert "ModuleNotFoundError" in b["broken_import"][2]
    assert "vendor runtime said no" in b["broken_hook"][2]
    assert "unknown hook 'glm5_hal_register_backend'" in b["misspelled"][2]
    assert "SystemExit" in b["exits"][2]
    assert r["fp32"] == "toyvendor.rms_norm" and r["toy_calls"] == ["torch.float32"]


def test_strict_mode_makes_a_broken_plugin_fatal(tmp_path):
    write_dist(tmp_path / "site", "broken-hook", "broken_hook", BROKEN_HOOK, {"broken_hook": "broken_hook"})
    proc = run_python("import glm5_hal as hal; hal.backends()", path=[tmp_path / "site"],
                      env={"GLM5_HAL_STRICT": "1"})
    assert proc.returncode != 0
    assert "PluginError: GLM5_HAL_STRICT=1 and plugins failed to load: broken_hook" in proc.stderr


def test_import_glm5_hal_is_lazy_and_does_not_load_plugins(tmp_path):
    write_dist(tmp_path / "site", "broken-import", "broken_import", BROKEN_IMPORT,
               {"broken_import": "broken_import"})
    proc = run_python("import sys, glm5_hal; import glm5_hal.cli; print('torch' in sys.modules)",
                      path=[tmp_path / "site"])
    assert proc.returncode == 0 and proc.stdout.strip() == "False"


@pytest.mark.slow
def test_example_package_installs_and_registers(tmp_path):
    """examples/toy_plugin is a real package (own pyproject, entry point) built by pip."""
    target, source = tmp_path / "target", tmp_path / "toy_plugin"
    shutil.copytree(REPO / "examples" / "toy_plugin", source)  # builds leave files behind
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                          "--no-build-isolation", "--target", str(target), str(source)],
                         capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr
    proc = run_python(SCENARIO, path=[target])
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["fp32"] == "toyvendor.rms_norm" and r["toy_calls"] == ["(4, 16)"]
    assert r["bf16"] == "cpu.rms_norm"
