"""The merged HTML report in a real headless Chromium (Debian's `chromium`; .ci/run installs
it): it draws itself without errors or network requests, its DOM holds exactly the JSON's
cells and failing cases, the filters and links work, and a screenshot is saved.

Without Chromium these tests skip, unless GLM5_CI_REQUIRE_CHROMIUM=1 (set by .ci/run), which
turns the skip into a failure. GLM5_CI_MATRIX=reports/matrix.json (also .ci/run) adds
the check of CI's own merged report (matrix.html next to it; the screenshot goes there too).
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

import glm5_hal as hal
from chromium import Page, find
from conformance_reports import run_report, write, wrong_vendor_plugin
from glm5_hal.conformance import html, matrix

if find() is None:
    if os.environ.get("GLM5_CI_REQUIRE_CHROMIUM") == "1":
        raise RuntimeError("GLM5_CI_REQUIRE_CHROMIUM=1 but no chromium on PATH (apt-get install chromium)")
    pytest.skip("no Chromium on PATH (Debian: apt-get install chromium)", allow_module_level=True)

READY = "document.body.dataset.ready === '1'"

# What the page shows, read back from the DOM.
CELLS = """[...document.querySelectorAll('#matrix tr.row')].flatMap((tr) =>
  [...tr.querySelectorAll('td.cell')].filter((td) => td.dataset.status).map((td) => ({
    op: tr.dataset.op, dtype: tr.dataset.dtype, column: td.dataset.column, status: td.dataset.status,
    counts: Object.fromEntries(td.innerText.split('\\n').filter((l) => /^\\d+ /.test(l))
      .map((l) => [l.split(' ')[1], Number(l.split(' ')[0])])),
    link: (td.querySelector('a') || {}).hash || null})))"""
VISIBLE_ROWS = "[...document.querySelectorAll('#matrix tr.row')].filter((tr) => !tr.hidden).length"
VISIBLE_CELLS = "[...document.querySelectorAll('#matrix td.cell')].filter((td) => !td.hidden).length"
CASES = "[...document.querySelectorAll('details.case')].map((d) => d.dataset.case)"


def expected_cells(m: dict) -> list[dict]:
    return [{"op": row["op"], "dtype": row["dtype"], "column": c["key"], "status": cell["status"],
             "counts": cell["counts"],
             "link": "#" + matrix.anchor(c["key"], row["op"], row["dtype"]) if cell["status"] in ("fail", "error") else None}
            for row in m["rows"] for c in m["columns"] if (cell := row["cells"].get(c["key"]))]


def check_page(page: Page, html_path: Path, m: dict, screenshot: Path) -> None:
    """The checks every rendered matrix must pass: the DOM equals the JSON, nothing broke,
    nothing was fetched, a screenshot exists."""
    page.open(html_path.as_uri(), READY)
    assert page.errors() == []
    assert page.requests() == [html_path.as_uri()]
    cells = page.evaluate(CELLS)
    assert cells == expected_cells(m)
    assert page.evaluate(VISIBLE_CELLS) == len(m["rows"]) * len(m["columns"])
    assert page.evaluate("document.querySelectorAll('#columns tr[data-column]').length") == len(m["columns"])
    assert sorted(page.evaluate(CASES)) == sorted(p["case"] for p in m["problems"])
    assert page.evaluate("document.querySelectorAll('#declines tr.decline').length") == len(m["declines"])
    differences = page.evaluate("[...document.querySelectorAll('#differences li')].map((li) => li.textContent)")
    assert differences == m["differences"]
    png = page.screenshot(screenshot)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width >= 1000 and height >= 400


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> tuple[Path, dict]:
    """A matrix with every status, from two labs (cpu; a wrong backend and an offline one)."""
    folder = tmp_path_factory.mktemp("html")
    hal.load_plugin(wrong_vendor_plugin(), "wronglab_html")
    try:
        runs = [write(folder / "cpu.json", run_report(["cpu"])),
                write(folder / "wrong.json", run_report(["wrongvendor", "offvendor"]))]
    finally:
        hal.unload_plugin("wronglab_html")
        hal.reload()
    m = matrix.merge([matrix.load_run(p) for p in runs])
    m = json.loads(json.dumps(m))   # as a reader of the JSON sees it
    html.write_html(folder / "matrix.html", m)
    return folder / "matrix.html", m


@pytest.fixture(scope="module")
def page():
    with Page() as p:
        yield p


def test_the_page_shows_exactly_the_matrix(page, merged, tmp_path):
    path, m = merged
    assert {c["status"] for row in m["rows"] for c in row["cells"].values()} == {"pass", "fail", "error", "fallback", "skip"}
    check_page(page, path, m, tmp_path / "matrix.png")
    assert (tmp_path / "matrix.png").stat().st_size > 10_000


def test_filters_by_op_column_and_status(page, merged):
    path, m = merged
    page.open(path.as_uri(), READY)
    rows = len(m["rows"])
    assert page.evaluate("document.getElementById('shown').textContent") == f"{rows} of {rows} rows shown"

    def choose(script: str) -> None:
        page.evaluate(script + "; document.getElementById('filters').dispatchEvent(new Event('change'))")

    # status: only "error" -> the rows with an erroring shown cell; other statuses' cases hidden
    choose("for (const box of document.querySelectorAll('#filter-status input')) box.checked = box.value === 'error'")
    with_error = [r for r in m["rows"] if any("error" in c["counts"] for c in r["cells"].values())]
    assert page.evaluate(VISIBLE_ROWS) == len(with_error) == 1
    shown_cases = "[...document.querySelectorAll('details.case')].filter((d) => !d.hidden).map((d) => d.dataset.status)"
    assert set(page.evaluate(shown_cases)) == {"error"}
    # column: the cpu column alone has no error -> no row; with every status, all rows
    cpu = m["columns"][0]["key"]
    choose(f"document.getElementById('filter-column').value = {json.dumps(cpu)}")
    assert page.evaluate(VISIBLE_ROWS) == 0
    choose("for (const box of document.querySelectorAll('#filter-status input')) box.checked = true")
    assert page.evaluate(VISIBLE_ROWS) == len([r for r in m["rows"] if cpu in r["cells"]])
    assert page.evaluate(VISIBLE_CELLS) == len([r for r in m["rows"]])   # one column shown
    assert page.evaluate("[...document.querySelectorAll('#matrix th.col')].filter((th) => !th.hidden).length") == 1
    # op: a name that no row has hides them all
    choose("document.getElementById('filter-column').value = ''; "
           "document.getElementById('filter-op').append(new Option('x', 'other_op')); "
           "document.getElementById('filter-op').value = 'other_op'")
    assert page.evaluate(VISIBLE_ROWS) == 0
    choose("document.getElementById('filter-op').value = 'rms_norm'")
    assert page.evaluate(VISIBLE_ROWS) == rows


def test_a_failing_cell_links_to_its_cases_which_expand(page, merged):
    path, m = merged
    page.open(path.as_uri(), READY)
    failing = next(c for c in expected_cells(m) if c["status"] == "fail")
    opened = "[...document.querySelectorAll('details.case')].filter((d) => d.open).map((d) => d.dataset.case)"
    assert page.evaluate(opened) == []
    page.evaluate(f"document.querySelector('#matrix a[href={json.dumps(failing['link'])}]').click()")
    page.open(path.as_uri() + failing["link"], f"location.hash === {json.dumps(failing['link'])}")
    expected = sorted(p["case"] for p in m["problems"] if p["column"] == failing["column"]
                      and p["op"] == failing["op"] and p["dtype"] == failing["dtype"])
    assert sorted(page.evaluate(opened)) == expected and len(expected) == 10
    text = page.evaluate(f"document.querySelector('details.case[data-case={json.dumps(expected[0])}]').innerText")
    problem = next(p for p in m["problems"] if p["case"] == expected[0] and p["column"] == failing["column"])
    assert "inputs" in text and problem["inputs"] in text and "worst element" in text
    assert "elements outside |out - ref| <= atol + rtol*|ref|" in text


BREAKAGES = {
    "a row left out": ("for (const row of DATA.rows)", "for (const row of DATA.rows.slice(1))"),
    "a counted status dropped": ("const STATUSES = Object.keys(DATA.meaning);",
                                 'const STATUSES = Object.keys(DATA.meaning).filter((s) => s !== "skip");'),
    "a fetch": ("</body>", '<img src="http://127.0.0.1:9/logo.png"></body>'),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_the_page_check_fails_on_a_broken_page(page, merged, tmp_path, breakage):
    path, m = merged
    old, new = BREAKAGES[breakage]
    text = path.read_text()
    assert old in text
    broken = tmp_path / "broken.html"
    broken.write_text(text.replace(old, new, 1))
    with pytest.raises(AssertionError):
        check_page(page, broken, m, tmp_path / "broken.png")


HOSTILE = ("<!--<script>", "</script><script>document.body.dataset.pwned = '1'</script>",
           "<!-- x --> & &amp; \u2028 <b>bold</b>")


def test_report_strings_cannot_break_the_page(merged, tmp_path):
    """Strings from reports (reasons, notes, commands, differences) are data: none of them can
    end the data script early or swallow the page's own script. (A page of its own: check_page
    reads every request and error the page has seen.)"""
    _, m = merged
    m = json.loads(json.dumps(m))
    hostile = " ".join(HOSTILE)
    m["problems"][0]["reason"] = hostile
    m["problems"][0]["inputs"] = HOSTILE[0]
    m["columns"][0]["command"] = hostile
    m["differences"] = m["differences"] + [hostile]
    m["declines"][0]["reason"] = HOSTILE[1]
    path = tmp_path / "hostile.html"
    html.write_html(path, m)
    with Page() as page:
        check_page(page, path, m, tmp_path / "hostile.png")
        _check_hostile_strings_shown(page, m)


def _check_hostile_strings_shown(page: Page, m: dict) -> None:
    hostile = " ".join(HOSTILE)
    assert page.evaluate("document.body.dataset.pwned || ''") == ""
    assert page.evaluate("document.querySelectorAll('script').length") == 2
    problem = m["problems"][0]
    text = page.evaluate(f"document.querySelector('details.case[data-case={json.dumps(problem['case'])}] dl').textContent")
    assert hostile in text and HOSTILE[0] in text
    assert page.evaluate("document.querySelector('#columns td.mono').textContent") == hostile
    assert page.evaluate("[...document.querySelectorAll('#declines tr.decline td')].map((td) => td.textContent)"
                         ).count(HOSTILE[1]) == 1


@pytest.mark.skipif(not os.environ.get("GLM5_CI_MATRIX"),
                    reason="set by .ci/run to its merged report (reports/matrix.json)")
def test_ci_merged_report_renders(page):
    path = Path(os.environ["GLM5_CI_MATRIX"]).resolve()
    m = json.loads(path.read_text())
    check_page(page, path.with_suffix(".html"), m, path.with_suffix(".png"))
