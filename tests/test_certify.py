"""`glm5-hal conformance --certify`: a backend that declares ops but declines them all cannot be
certified; expected errors the ops' own checks decided are reported as `contract`."""
from __future__ import annotations

import json
import types

import torch

import glm5_hal as hal
from glm5_hal import cli


def plugin(name, supports=None, dtypes=(torch.float32,)):
    class B(hal.Backend):
        device_type, priority = "cpu", 50

    B.name = name
    backend = B()
    backend.impl("rms_norm", dtypes=dtypes, supports=supports)(hal.reference.rms_norm)
    module = types.ModuleType(name)
    module.glm5_hal_register_backends = hal.hookimpl(lambda register: register(backend))
    return module


def certify(name, tmp_path):
    out = tmp_path / f"{name}.json"
    code = cli.main(["conformance", "--backend", name, "--op", "rms_norm", "--preset", "tiny", "--certify",
                     "--json", str(out)])
    return code, json.loads(out.read_text())


def test_a_backend_serving_what_it_declares_is_certified(hal_state, tmp_path, capsys):
    hal_state(plugin("honest"), "honest")
    code, report = certify("honest", tmp_path)
    assert code == 0 and report["meta"]["certification"]["honest"]["certified"]
    statuses = {r["status"] for r in report["records"]}
    assert "contract" in statuses and "pass" in statuses
    contract = [r for r in report["records"] if r["status"] == "contract"]
    assert all(r["reason"].startswith("rejected by the op's own checks before any backend ran") for r in contract)
    assert "certified: honest" in capsys.readouterr().out


def test_a_backend_that_declares_an_op_but_declines_every_call_is_not_certified(hal_state, tmp_path, capsys):
    hal_state(plugin("hollow", supports=lambda x, weight, eps: "never"), "hollow")
    code, report = certify("hollow", tmp_path)
    verdict = report["meta"]["certification"]["hollow"]
    assert code == 1 and not verdict["certified"]
    assert any(p.startswith("rms_norm [float32]: declared, but every case fell back") for p in verdict["problems"])
    assert "NOT certified: hollow" in capsys.readouterr().out
    # without --certify the same run is green: every case is a declared fallback
    assert cli.main(["conformance", "--backend", "hollow", "--op", "rms_norm", "--preset", "tiny"]) == 0
