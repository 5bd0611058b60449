# Quick start (README): `make conformance` and `make test`. Each sets up .venv on first use
# (CPU torch pinned in requirements/cpu.txt, editable install with the native extension).
VENV ?= .venv
PY := $(VENV)/bin/python
NATIVE := CMakeLists.txt pyproject.toml $(wildcard csrc/*.cpp csrc/*.h core/glm5_hal/include/* backends/_cuda_dialect/src/* backends/_cuda_dialect/include/* backends/*/csrc/*)
# The editable install maps the package's files when it is made: a new module needs a reinstall
# (seconds when no native source changed).
PYTHON_SOURCES := $(shell find core backends -name '*.py' -not -path '*/__pycache__/*')

.PHONY: setup conformance test clean

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

clean:
	rm -rf build $(VENV)
