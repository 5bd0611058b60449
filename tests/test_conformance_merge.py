"""Conformance reports across machines: what every report records (margins, machine, command),
`glm5-hal conformance merge` (one matrix, differences stated) and `glm5-hal conformance diff`
(regressions, new fallbacks, lost coverage, margin drift; the exit status gates CI)."""
from __future__ import annotations

import copy
import json
import re

import pytest

import glm5_hal as hal
import glm5_hal.cli as cli
from conformance_reports import WRONG_CHIP, run_report, write, wrong_vendor_plugin
from glm5_hal.conformance import diff, matrix


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Two labs' reports: the cpu backend, and a wrong backend plus an offline one."""
    folder = tmp_path_factory.mktemp("reports")
    hal.load_plugin(wrong_vendor_plugin(), "wronglab")
    try:
        cpu = write(folder / "cpu.json", run_report(["cpu"]))
        wrong = write(folder / "wrong.json", run_report(["wrongvendor", "offvendor"]))
    finally:
        hal.unload_plugin("wronglab")
        hal.reload()
    return cpu, wrong


def load(path) -> dict:
    return json.loads(path.read_text())


# -- every report records margins, the machine and the command ---------------------------------
def test_cli_report_records_the_machine_the_command_and_each_case(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert cli.main(["conformance", "--backend", "cpu", "--op", "rms_norm", "--preset", "glm5",
                     "--json", str(out)]) == 0
    meta = load(out)["meta"]
    assert meta["schema"] == 2
    assert meta["command"] == f"glm5-hal conformance --backend cpu --op rms_norm --preset glm5 --ref cpu -n 1 --json {out}"
    machine = meta["machine"]
    assert machine["cpu"] and machine["cores"] >= 1 and "accelerators" in machine and machine["os"]
    records = load(out)["records"]
    assert all(isinstance(r["margin"], float) and 0 <= r["margin"] <= 1 for r in records)
    slice_ = next(r for r in records if r["case"] == "rms_norm/glm5/kv_lora512_of_576/bfloat16")
    assert slice_["inputs"] == "x=bfloat16[5, 512] strides (576, 1), weight=bfloat16[512], eps=1e-05"
    assert "c_kv slice" in slice_["note"]


def test_the_recorded_command_carries_the_plugin_settings_only(monkeypatch):
    monkeypatch.setenv("GLM5_HAL_DISABLE", "cpu")
    monkeypatch.setenv("GLM5_HAL_STRICT", "1")
    monkeypatch.setenv("GLM5_CI_MATRIX", "x.json")
    monkeypatch.delenv("GLM5_HAL_PLUGINS", raising=False)
    args = cli.build_parser().parse_args(["conformance", "--backend", "ascend_emu", "--preset", "tiny", "-n", "auto"])
    assert cli._conformance_command(args) == ("GLM5_HAL_DISABLE=cpu GLM5_HAL_STRICT=1 glm5-hal conformance "
                                              "--backend ascend_emu --preset tiny --ref cpu -n auto")


# -- merge -------------------------------------------------------------------------------------
def test_merge_counts_every_record_in_its_column_and_row(reports):
    cpu, wrong = reports
    runs = [matrix.load_run(cpu), matrix.load_run(wrong)]
    m = matrix.merge(runs)
    cpu_key = f"cpu @ {matrix.chip_of(runs[0].meta, 'cpu')}"
    keys = [c["key"] for c in m["columns"]]
    assert keys == [cpu_key, f"wrongvendor @ {WRONG_CHIP}", "offvendor @ ?"]
    assert [(r["op"], r["dtype"]) for r in m["rows"]] == [
        ("rms_norm", "float32"), ("rms_norm", "float16"), ("rms_norm", "bfloat16"), ("rms_norm", "*")]
    for run in runs:
        for backend in {r.backend for r in run.records}:
            key = next(c["key"] for c in m["columns"] if c["backend"] == backend and c["source"] == run.source)
            in_cells = sum(sum(row["cells"][key]["counts"].values()) for row in m["rows"] if key in row["cells"])
            assert in_cells == sum(r.backend == backend for r in run.records) == len(m["records"][key])
    cells = {row["dtype"]: row["cells"][f"wrongvendor @ {WRONG_CHIP}"] for row in m["rows"] if row["dtype"] != "*"}
    assert cells["float16"]["counts"] == {"pass": 5, "fail": 10, "fallback": 1} and cells["float16"]["status"] == "fail"
    assert cells["bfloat16"]["status"] == "error" and cells["float32"]["status"] == "fallback"
    # a failing cell names its worst case and margin: the largest of its records
    failing = [r for r in runs[1].records if r.dtype == "float16" and r.status == "fail"]
    worst = max(failing, key=lambda r: r.margin)
    assert cells["float16"]["worst"] == worst.case and cells["float16"]["margin"] == pytest.approx(worst.margin, rel=1e-2)
    assert m["rows"][3]["cells"] == {"offvendor @ ?": {"counts": {"skip": 1}, "margin": None, "worst": None,
                                                       "status": "skip"}}
    # every failing case in full; fallbacks and skips grouped by reason
    assert {p["case"] for p in m["problems"]} == {r.case for r in runs[1].records if r.status in ("fail", "error")}
    assert all(p["column"] == f"wrongvendor @ {WRONG_CHIP}" and p["inputs"] for p in m["problems"])
    declines = {(d["column"], d["status"], d["reason"]): (d["count"], d["dtypes"]) for d in m["declines"]}
    assert declines == {(f"wrongvendor @ {WRONG_CHIP}", "fallback", "2-d x only"): (3, ["float32", "float16", "bfloat16"]),
                        ("offvendor @ ?", "skip", "backend unavailable: no WrongChip device found"): (1, ["*"])}
    # margins are kept per case (3 significant digits) for diff
    r = next(r for r in runs[0].records if r.case == "rms_norm/tiny/rows17_dim129/float32")
    assert m["records"][cpu_key][r.case] == ["pass", float(f"{r.margin:.3g}")]
    assert m["columns"][1]["versions"] == {"wrong_sdk": "9.1"} and m["columns"][1]["machine"]["cpu"]


def test_merge_states_other_versions_case_sets_and_references(reports, tmp_path):
    cpu, wrong = reports
    older = load(cpu)
    older["meta"]["glm5_hal"] = "0.0.9"
    older["meta"]["reference"] = dict(older["meta"]["reference"], mode="cuda", dtype="float32")
    older["records"] = [r for r in older["records"] if not r["case"].endswith("/bfloat16")
                        and "noncontig" not in r["case"]]
    older["meta"]["machine"] = dict(older["meta"]["machine"], cpu="Other CPU 1")
    m = matrix.merge([matrix.load_run(cpu), matrix.load_run(wrong), matrix.load_run(write(tmp_path / "old.json", older))])
    keys = [c["key"] for c in m["columns"]]
    cpu_key = keys[0]
    # the same backend @ chip twice: told apart by the machine
    assert keys[0].endswith(")") and keys[-1] == re.sub(r"\(.*\)$", "(Other CPU 1)", keys[0])
    text = "\n".join(m["differences"])
    assert f"glm5_hal versions differ: 0.1.0 ({cpu_key}, wrongvendor @ {WRONG_CHIP}, offvendor @ ?); 0.0.9 ({keys[-1]})" in text
    assert f"references differ: cpu (float64) (" in text and f"cuda (float32) ({keys[-1]})" in text
    assert f"{keys[-1]} ran 26 of the 48 cases in these reports; missing: rms_norm (22 cases)" in text
    assert not any(d.startswith(f"wrongvendor @ {WRONG_CHIP} ran") for d in m["differences"])  # it ran all 48
    assert "offvendor @ ? ran 0 of the 48 cases" in text and "backend unavailable: no WrongChip device found" in text


def test_merge_refuses_what_is_not_a_run_report(tmp_path, reports):
    m = matrix.merge([matrix.load_run(reports[0])])
    matrix.write_json(tmp_path / "m.json", m)
    for path, message in ((tmp_path / "m.json", "is a merged matrix"), (tmp_path / "nope.json", "cannot read"),
                          (write(tmp_path / "x.json", {"a": 1}), "not a conformance report")):
        with pytest.raises(Exception, match=message):
            matrix.load_run(path)
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(Exception, match="is not JSON"):
        matrix.load_run(tmp_path / "bad.json")


def test_matrix_json_keeps_one_case_per_line_and_round_trips(reports, tmp_path):
    m = matrix.merge([matrix.load_run(p) for p in reports])
    matrix.write_json(tmp_path / "m.json", m)
    text = (tmp_path / "m.json").read_text()
    assert json.loads(text) == json.loads(json.dumps(m))
    lines = [line for line in text.splitlines() if line.startswith('   "rms_norm/tiny/')]
    assert len(lines) == sum(len(v) for v in m["records"].values()) - 1   # all but the whole-op skip


def test_markdown_matrix_links_failing_cells_to_their_cases(reports):
    m = matrix.merge([matrix.load_run(p) for p in reports])
    md = matrix.to_markdown(m)
    column = f"wrongvendor @ {WRONG_CHIP}"
    link = matrix.anchor(column, "rms_norm", "float16")
    assert re.search(rf"\| `rms_norm` \| float16 \| ✅ 16 pass \| \[❌ 5 pass, 10 fail, 1 fallback \(margin [\d.]+\)\]\(#{link}\) \| - \|", md)
    assert f'<a id="{link}"></a>' in md and f"**`{column}` · `rms_norm` · float16**" in md
    assert "| ⚠️ 15 pass, 1 fallback |" in md and "| ⏭️ 1 skip |" in md
    assert "`glm5-hal conformance --backend wrongvendor --backend offvendor`" in md and "wrong_sdk 9.1" in md
    assert f"| `{column}` | `rms_norm` | fallback | 3 | float32, float16, bfloat16 | 2-d x only |" in md


# -- diff --------------------------------------------------------------------------------------
def side(records: dict[str, list], name="s") -> diff.Side:
    return diff.Side(name, {col: {case: (s, m) for case, s, m in rows} for col, rows in records.items()},
                     {col: {"key": col} for col in records})


OLD = {"a @ X": [("op/tiny/1/float32", "pass", 0.1), ("op/tiny/2/float32", "pass", 0.2),
                 ("op/tiny/3/float32", "pass", 0.3), ("op/tiny/4/float32", "pass", 0.4),
                 ("op/tiny/5/float32", "pass", 0.5), ("op/tiny/6/float32", "fail", 3.0),
                 ("op/tiny/7/float32", "pass", 0.7), ("op/tiny/8/float32", "fallback", None)],
       "b @ Y": [("op/tiny/1/float32", "pass", 0.0)]}
NEW = {"a @ X": [("op/tiny/1/float32", "fail", 2.0), ("op/tiny/2/float32", "error", None),
                 ("op/tiny/3/float32", "fallback", None), ("op/tiny/4/float32", "skip", None),
                 ("op/tiny/5/float32", "pass", 0.9), ("op/tiny/6/float32", "pass", 0.2),
                 ("op/tiny/8/float32", "pass", 0.1), ("op/tiny/9/float32", "fail", 5.0),
                 ("op/tiny/10/float32", "pass", 0.1)],
       "c @ Z": [("op/tiny/1/float32", "pass", 0.0)]}


def test_diff_classifies_every_change():
    d = diff.compare(side(OLD), side(NEW), drift=0.25)
    cases = lambda changes: [(c.column, c.case.split("/")[2], c.old, c.new) for c in changes]
    assert cases(d.regressions) == [("a @ X", "1", "pass", "fail"), ("a @ X", "2", "pass", "error"),
                                    ("a @ X", "9", "missing", "fail")]   # a new case that fails
    assert cases(d.fallbacks) == [("a @ X", "3", "pass", "fallback")]
    assert cases(d.lost) == [("a @ X", "4", "pass", "skip"), ("a @ X", "7", "pass", "missing"),
                             ("b @ Y", "1", "pass", "missing")]
    assert cases(d.drift) == [("a @ X", "5", "pass", "pass")] and d.drift[0].new_margin == 0.9
    assert cases(d.fixed) == [("a @ X", "6", "fail", "pass")]
    assert d.new_cases == {"a @ X": {"fail": 1, "pass": 1}, "c @ Z": {"pass": 1}}
    assert d.lost_columns == ["b @ Y"] and d.new_columns == ["c @ Z"]
    assert d.failing(("regression",)) == ["regression"]
    assert d.failing(("fallback", "coverage", "drift")) == ["fallback", "coverage", "drift"]
    assert diff.compare(side(OLD), side(NEW), drift=0.5).drift == []
    same = diff.compare(side(OLD), side(OLD))
    assert not (same.regressions or same.fallbacks or same.lost or same.drift or same.fixed or same.new_cases)


def test_diff_cli_gates_on_regressions_and_reads_reports_or_matrices(reports, tmp_path, capsys):
    cpu, wrong = reports
    base = tmp_path / "base.json"
    matrix.write_json(base, matrix.merge([matrix.load_run(cpu)]))
    assert cli.main(["conformance", "diff", str(base), str(cpu)]) == 0
    assert "ok: none of regression, fallback, coverage" in capsys.readouterr().out
    # the cpu column regresses: one case fails, one falls back, one is gone, one drifts
    worse = load(cpu)
    by_case = {r["case"]: r for r in worse["records"]}
    by_case["rms_norm/tiny/rows3_dim17/float16"].update(status="fail", margin=4.0, reason="1 of 51 elements outside")
    by_case["rms_norm/tiny/rows3_dim17/bfloat16"].update(status="fallback", margin=None)
    by_case["rms_norm/tiny/rows17_dim129/float32"].update(margin=by_case["rms_norm/tiny/rows17_dim129/float32"]["margin"] + 0.5)
    worse["records"] = [r for r in worse["records"] if r["case"] != "rms_norm/tiny/rows1_dim1/float32"]
    worse_path = write(tmp_path / "worse.json", worse)
    assert cli.main(["conformance", "diff", str(base), str(worse_path)]) == 1
    out = capsys.readouterr().out
    assert "regressions (pass, fallback, skip or missing -> fail/error): 1" in out and "rms_norm/tiny/rows3_dim17/float16  pass -> fail (margin 4)" in out
    assert "new fallbacks (pass -> fallback): 1" in out and "lost coverage (pass -> skip, or gone): 1" in out
    assert "margin drift (> +0.25): 1" in out and "failing on: regression, fallback, coverage" in out
    assert cli.main(["conformance", "diff", "--json", "--fail-on", "drift", str(base), str(worse_path)]) == 1
    data = json.loads(capsys.readouterr().out)
    assert [c["case"] for c in data["drift"]] == ["rms_norm/tiny/rows17_dim129/float32"]
    assert data["failing"] == ["drift"] and len(data["regressions"]) == 1
    assert cli.main(["conformance", "diff", "--drift", "1", "--fail-on", "drift", str(base), str(worse_path)]) == 0
    assert cli.main(["conformance", "diff", str(base), str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_merge_cli_writes_markdown_html_and_json(reports, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["conformance", "merge", *map(str, reports), "--markdown", str(out / "m.md"),
            "--html", str(out / "m.html"), "--json", str(out / "m.json")]
    assert cli.main(args) == 0
    assert {p.name for p in out.iterdir()} == {"m.md", "m.html", "m.json"}
    assert load(out / "m.json")["kind"] == matrix.MATRIX_KIND
    html = (out / "m.html").read_text()
    assert "<script" in html and "http://" not in html and "https://" not in html
    capsys.readouterr()
    assert cli.main(["conformance", "merge", str(reports[0])]) == 0   # no output named: Markdown on stdout
    assert capsys.readouterr().out.startswith("## glm5_hal conformance matrix")
    assert cli.main(["conformance", "--backend", "cpu", "merge", str(reports[0])]) == 2
    assert "--backend belong to a conformance run" in capsys.readouterr().err


def test_diff_of_two_run_reports_uses_the_merge_columns(reports):
    cpu, _ = reports
    old = diff.load(cpu)
    assert list(old.records) == [f"cpu @ {matrix.chip_of(load(cpu)['meta'], 'cpu')}"]
    new = copy.deepcopy(old)
    new.columns[next(iter(new.columns))]["glm5_hal"] = "0.2.0"
    assert diff.compare(old, new).notes == [f"{next(iter(old.columns))}: glm5_hal 0.1.0 -> 0.2.0"]


# -- diff: every new failure fails the gate by default ------------------------------------------
def matrix_file(path, records: dict[str, list], schema=1):
    """A merged matrix as `merge --json` writes it, reduced to what diff reads."""
    data = {"kind": matrix.MATRIX_KIND, "schema": schema, "columns": [{"key": col} for col in records],
            "records": {col: {case: [status, margin] for case, status, margin in rows}
                        for col, rows in records.items()}}
    return write(path, data)


def case(n):
    return f"op/tiny/{n}/float32"


BASE = {"a @ X": [(case(1), "pass", 0.1), (case(2), "fallback", None), (case(3), "skip", None),
                  (case(4), "fail", 2.0)]}
# each: NEW as a change of BASE; the kind of finding it is
NEW_FAILURES = {
    "fallback -> fail": ({"a @ X": [(case(1), "pass", 0.1), (case(2), "fail", 3.0), (case(3), "skip", None),
                                    (case(4), "fail", 2.0)]}, "regression"),
    "skip -> error": ({"a @ X": [(case(1), "pass", 0.1), (case(2), "fallback", None), (case(3), "error", None),
                                 (case(4), "fail", 2.0)]}, "regression"),
    "a brand-new failing case": ({"a @ X": BASE["a @ X"] + [(case(5), "fail", 9.0)]}, "regression"),
    "a new column's failing case": ({**BASE, "b @ Y": [(case(1), "error", None)]}, "regression"),
    "pass -> fallback": ({"a @ X": [(case(1), "fallback", None)] + BASE["a @ X"][1:]}, "fallback"),
    "pass -> skip": ({"a @ X": [(case(1), "skip", None)] + BASE["a @ X"][1:]}, "coverage"),
    "a passing case gone": ({"a @ X": BASE["a @ X"][1:]}, "coverage"),
    "a lost column of declines only": ({"a @ X": BASE["a @ X"]}, "coverage"),
    "a failing case gone": ({"a @ X": BASE["a @ X"][:3]}, "coverage"),
    "a declined case gone": ({"a @ X": BASE["a @ X"][:1] + BASE["a @ X"][2:]}, "coverage"),
}
OLD_WITH_DECLINED_COLUMN = {**BASE, "z @ W": [(case(1), "skip", None), (case(2), "fallback", None)]}
NOT_FAILURES = {
    "the same": BASE,
    "a failure that was failing": {"a @ X": BASE["a @ X"][:3] + [(case(4), "error", None)]},
    "a decline that was declined": {"a @ X": [BASE["a @ X"][0], (case(2), "skip", None), (case(3), "fallback", None),
                                              BASE["a @ X"][3]]},
    "a new case that passes or declines": {"a @ X": BASE["a @ X"] + [(case(5), "pass", 0.1), (case(6), "fallback", None)]},
    "a fix": {"a @ X": BASE["a @ X"][:3] + [(case(4), "pass", 0.5)]},
}


@pytest.mark.parametrize("change", NEW_FAILURES)
def test_diff_fails_by_default_on_every_new_failure(change, tmp_path, capsys):
    new, kind = NEW_FAILURES[change]
    old = OLD_WITH_DECLINED_COLUMN if change == "a lost column of declines only" else BASE
    old_path, new_path = matrix_file(tmp_path / "old.json", old), matrix_file(tmp_path / "new.json", new)
    assert cli.main(["conformance", "diff", str(old_path), str(new_path)]) == 1
    assert f"failing on: {kind}" in capsys.readouterr().out
    # .ci/run's gate names the same kinds: the same verdict
    ci = ["--fail-on", "regression", "--fail-on", "fallback", "--fail-on", "coverage"]
    assert cli.main(["conformance", "diff", *ci, str(old_path), str(new_path)]) == 1
    # --fail-on narrows: naming only another kind passes it
    other = "drift" if kind != "drift" else "regression"
    assert cli.main(["conformance", "diff", "--fail-on", other, str(old_path), str(new_path)]) == 0
    assert cli.main(["conformance", "diff", "--fail-on", other, "--fail-on", kind, str(old_path), str(new_path)]) == 1


@pytest.mark.parametrize("change", NOT_FAILURES)
def test_diff_passes_what_is_no_new_failure(change, tmp_path, capsys):
    old_path = matrix_file(tmp_path / "old.json", BASE)
    new_path = matrix_file(tmp_path / "new.json", NOT_FAILURES[change])
    assert cli.main(["conformance", "diff", str(old_path), str(new_path)]) == 0
    assert "ok: none of regression, fallback, coverage" in capsys.readouterr().out


def test_diff_widens_to_drift_on_request(tmp_path):
    old_path = matrix_file(tmp_path / "old.json", BASE)
    new_path = matrix_file(tmp_path / "new.json", {"a @ X": [(case(1), "pass", 0.9)] + BASE["a @ X"][1:]})
    assert cli.main(["conformance", "diff", str(old_path), str(new_path)]) == 0
    assert cli.main(["conformance", "diff", "--fail-on", "drift", str(old_path), str(new_path)]) == 1


def test_an_empty_new_report_fails_the_diff_whatever_fail_on(reports, tmp_path, capsys):
    cpu, _ = reports
    empty = load(cpu)
    empty["records"] = []
    empty_path = write(tmp_path / "empty.json", empty)
    for fail_on in ([], ["--fail-on", "drift"]):
        assert cli.main(["conformance", "diff", *fail_on, str(cpu), str(empty_path)]) == 1
        out = capsys.readouterr().out
        assert "NEW holds no records" in out and "failing on: empty" in out
    empty_matrix = matrix_file(tmp_path / "empty-matrix.json", {})
    assert cli.main(["conformance", "diff", "--json", str(cpu), str(empty_matrix)]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["empty_new"] and data["failing"][0] == "empty"


# -- malformed or incompatible reports: one line naming the file, exit 2 ------------------------
def _record(report, **change):
    report["records"][3].update(change)
    return report


def _drop(report, field):
    del report["records"][3][field]
    return report


MALFORMED_RUNS = {
    "a top-level list": (lambda r: r["records"], "expected a JSON object"),
    "a record missing its status": (lambda r: _drop(r, "status"), "record 3 (rms_norm/tiny/"),
    "a record missing its case": (lambda r: _drop(r, "case"), "record 3: lacks 'case'"),
    "an unknown status": (lambda r: _record(r, status="flaky"), "status 'flaky' is not one of pass, fail"),
    "a status of the wrong type": (lambda r: _record(r, status=["pass"]), "status must be a string"),
    "a margin that is no number": (lambda r: _record(r, margin={"x": 1}), "margin must be a number, a string or null"),
    "a case id without its op": (lambda r: _record(r, case="x"), "case id must be '<op>/<preset>/...'"),
    "schema 99": (lambda r: dict(r, meta=dict(r["meta"], schema=99)), "report schema 99 is not one this glm5_hal reads (1, 2)"),
    "a schema that is no number": (lambda r: dict(r, meta=dict(r["meta"], schema="2")), "report schema '2' is not one"),
    "records that are no list": (lambda r: dict(r, records={"a": 1}), "records: expected a list, got an object"),
    "meta that is no object": (lambda r: dict(r, meta=[]), "meta: expected an object, got a list"),
    "backends facts of the wrong type": (lambda r: dict(r, meta=dict(r["meta"], backends={"cpu": "x"})),
                                         "meta.backends.cpu: expected an object"),
    "no records key": (lambda r: {"meta": r["meta"]}, "not a conformance report"),
}


@pytest.mark.parametrize("fault", MALFORMED_RUNS)
def test_a_malformed_run_report_is_refused_in_one_line(fault, reports, tmp_path, capsys):
    cpu, _ = reports
    change, message = MALFORMED_RUNS[fault]
    bad = write(tmp_path / "bad.json", change(load(cpu)))
    for args in (["merge", str(bad)], ["merge", str(cpu), str(bad)], ["diff", str(bad), str(cpu)],
                 ["diff", str(cpu), str(bad)]):
        capsys.readouterr()
        assert cli.main(["conformance", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"glm5-hal: error: conformance: {bad}: ") and message in err, err


def _short_record(m):
    key = next(iter(m["records"]))
    case = next(iter(m["records"][key]))
    m["records"][key][case] = m["records"][key][case][:1]
    return m


def _status(m, status):
    key = next(iter(m["records"]))
    case = next(iter(m["records"][key]))
    m["records"][key][case][0] = status
    return m


MALFORMED_MATRICES = {
    "a short record": (_short_record, "expected [status, margin], got ['pass']"),
    "an unknown status": (lambda m: _status(m, "flaky"), "status 'flaky' is not one of"),
    "schema 99": (lambda m: dict(m, schema=99), "matrix schema 99 is not one this glm5_hal reads (1)"),
    "no columns": (lambda m: {k: v for k, v in m.items() if k != "columns"}, "columns: expected a list, got null"),
    "a column without a key": (lambda m: dict(m, columns=[{}]), "columns[0]: expected an object with a string 'key'"),
    "records of an unknown column": (lambda m: dict(m, columns=[]), "is not among the matrix's columns"),
    "a column's machine that is no object": (lambda m: dict(m, columns=[dict(m["columns"][0], machine="x")]),
                                             "machine must be an object, got a string"),
}


@pytest.mark.parametrize("fault", MALFORMED_MATRICES)
def test_a_malformed_matrix_is_refused_in_one_line(fault, reports, tmp_path, capsys):
    cpu, _ = reports
    good = tmp_path / "m.json"
    matrix.write_json(good, matrix.merge([matrix.load_run(cpu)]))
    change, message = MALFORMED_MATRICES[fault]
    bad = write(tmp_path / "bad.json", change(load(good)))
    for args in (["diff", str(bad), str(cpu)], ["diff", str(good), str(bad)]):
        capsys.readouterr()
        assert cli.main(["conformance", *args]) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"glm5-hal: error: conformance: {bad}: ") and message in err, err


def test_merge_refuses_an_empty_report_and_files_that_are_no_text(reports, tmp_path, capsys):
    cpu, _ = reports
    empty = write(tmp_path / "empty.json", dict(load(cpu), records=[]))
    assert cli.main(["conformance", "merge", str(cpu), str(empty)]) == 2
    assert f"conformance: {empty}: the report has no records (the run tested nothing)" in capsys.readouterr().err
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00{")
    assert cli.main(["conformance", "merge", str(binary)]) == 2
    assert f"conformance: {binary} is not UTF-8 text" in capsys.readouterr().err


WRONG_VALUES = (None, True, 7, 1.5, "x", [], [1], {}, {"a": 1})


def test_no_field_of_the_wrong_type_crashes_merge_or_diff(reports, tmp_path, capsys):
    """Every field the readers use, set to every JSON type: merge (with all three outputs) and
    diff either work or refuse the file with exit 2, never a traceback."""
    cpu, _ = reports
    base = load(cpu)
    mutations = []
    for field in base["meta"]:
        mutations += [("meta", field, v) for v in WRONG_VALUES]
    for field in base["records"][0]:
        mutations += [("record", field, v) for v in WRONG_VALUES]
    for field in ("device_name", "versions", "reason", "available"):
        mutations += [("backend", field, v) for v in WRONG_VALUES]
    for field in ("cpu", "cores", "accelerators", "memory_gib"):
        mutations += [("machine", field, v) for v in WRONG_VALUES]
    refused = 0
    for where, field, value in mutations:
        report = copy.deepcopy(base)
        target = {"meta": report["meta"], "record": report["records"][0],
                  "backend": report["meta"]["backends"]["cpu"], "machine": report["meta"]["machine"]}[where]
        target[field] = value
        path = write(tmp_path / "mutated.json", report)
        out = tmp_path / "out"
        code = cli.main(["conformance", "merge", str(path), "--markdown", str(out / "m.md"),
                         "--html", str(out / "m.html"), "--json", str(out / "m.json")])
        assert code in (0, 2), (where, field, value)
        if code == 0:
            assert cli.main(["conformance", "diff", str(out / "m.json"), str(path)]) in (0, 1)
        else:
            refused += 1
            assert capsys.readouterr().err.count("\n") == 1, (where, field, value)
            assert cli.main(["conformance", "diff", str(cpu), str(path)]) == 2
        capsys.readouterr()
    assert 0 < refused < len(mutations)
