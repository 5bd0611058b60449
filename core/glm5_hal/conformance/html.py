"""The merged matrix as one self-contained HTML file (`glm5-hal conformance merge --html`).

Inline CSS and JavaScript, no network, no dependency: the matrix data sits in the page as
JSON and a small script draws the columns' facts, the colour-coded matrix (op x dtype rows,
backend @ chip columns), the stated differences, filters by op, column and status, each
failing case as an expandable entry (inputs, worst element, every checked output, reason)
and the fallbacks and skips grouped by reason. A failing cell links to its cases.

tests/test_conformance_html.py renders it in headless Chromium and checks the DOM against
the JSON.
"""
from __future__ import annotations

import json
from pathlib import Path

from .record import MEANING, json_safe
from .report import write_text


def to_html(matrix: dict) -> str:
    view = {k: v for k, v in matrix.items() if k != "records"}   # the page needs no per-case list
    view["meaning"] = MEANING
    data = json.dumps(json_safe(view), allow_nan=False, separators=(",", ":"))
    data = embeddable(data)
    title = f"glm5_hal conformance: {len(matrix['columns'])} columns"
    return (_PAGE.replace("{{TITLE}}", title).replace("{{CSS}}", _CSS).replace("{{JS}}", _JS)
            .replace("{{DATA}}", data))


def embeddable(data: str) -> str:
    """JSON text that the HTML parser reads as plain text inside <script>: every `<`, `>` and
    `&` becomes its JSON escape (the same string to JSON.parse). Escaping "</" alone is not
    enough: "<!--" followed by "<script" puts the parser in the script's double-escaped state,
    where the element's own closing tag no longer ends it and the page's script is swallowed."""
    return data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def write_html(path: str | Path, matrix: dict) -> None:
    write_text(path, to_html(matrix))


_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{{TITLE}}</title>
<style>{{CSS}}</style>
</head>
<body>
<header>
<h1>glm5_hal conformance matrix</h1>
<p id="summary"></p>
<noscript><p class="warn">This report draws itself with JavaScript; without it, read the
Markdown matrix written next to this file.</p></noscript>
</header>
<section id="differences-section" hidden><h2>Differences between the reports</h2><ul id="differences"></ul></section>
<section>
<h2>Matrix</h2>
<form id="filters" onsubmit="return false">
<label>op <select id="filter-op"><option value="">all</option></select></label>
<label>column <select id="filter-column"><option value="">all</option></select></label>
<span id="filter-status"></span>
<span id="shown"></span>
</form>
<div class="scroll"><table id="matrix"></table></div>
<p class="legend" id="legend"></p>
</section>
<section><h2>Failing cases</h2><div id="problems"></div></section>
<section><h2>Columns</h2><div class="scroll"><table id="columns"></table></div></section>
<section><h2>Fallbacks and skips</h2><div class="scroll"><table id="declines"></table></div></section>
<script type="application/json" id="matrix-data">{{DATA}}</script>
<script>{{JS}}</script>
</body>
</html>
"""

_CSS = """
:root { --pass: #d9f2dd; --fail: #f8d0d0; --error: #f3c0e8; --fallback: #fbe7b5; --skip: #e4e4e4; --contract: #dde8f5; }
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #1d1d1d; }
h1 { font-size: 1.5em; margin: 0 0 .3em; } h2 { font-size: 1.2em; margin: 1.4em 0 .5em; }
table { border-collapse: collapse; } th, td { border: 1px solid #c8c8c8; padding: .25em .5em; vertical-align: top; }
th { background: #f2f2f2; text-align: left; position: sticky; top: 0; }
.scroll { overflow-x: auto; max-width: 100%; }
#matrix td.cell { white-space: nowrap; text-align: center; font-size: .9em; }
#matrix th.col { writing-mode: vertical-rl; transform: rotate(180deg); white-space: nowrap; }
td.pass { background: var(--pass); } td.fail { background: var(--fail); } td.error { background: var(--error); }
td.fallback { background: var(--fallback); } td.skip { background: var(--skip); } td.none { color: #999; }
td.contract { background: var(--contract); }
td.cell a { color: inherit; font-weight: 600; } .margin { display: block; font-size: .8em; color: #444; }
.warn { background: #fff4d6; border-left: 4px solid #e0a800; padding: .3em .6em; }
#filters { margin: .5em 0; display: flex; gap: 1em; flex-wrap: wrap; align-items: center; }
details.case { border: 1px solid #d0d0d0; border-left: 4px solid #c0392b; margin: .3em 0; padding: .2em .6em; }
details.case.error { border-left-color: #a0308a; } details.case summary { cursor: pointer; }
details.case dl { display: grid; grid-template-columns: max-content 1fr; gap: .1em 1em; margin: .4em 0; }
details.case dt { font-weight: 600; } details.case dd { margin: 0; font-family: ui-monospace, monospace; white-space: pre-wrap; word-break: break-word; }
.group { margin: 1em 0 .3em; font-weight: 600; } .group:target { background: #fff4d6; }
code, .mono { font-family: ui-monospace, monospace; font-size: .92em; }
.legend span { display: inline-block; padding: 0 .5em; margin-right: .4em; }
"""

_JS = r"""
"use strict";
const DATA = JSON.parse(document.getElementById("matrix-data").textContent);
const STATUSES = Object.keys(DATA.meaning);   // glm5_hal.conformance.record.STATUSES, in order
const $ = (id) => document.getElementById(id);
function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v; else if (k.startsWith("data-")) node.setAttribute(k, v); else node[k] = v;
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}
function anchor(column, op, dtype) {   // matrix.anchor() in Python: the same ids
  return ("cases-" + column + "-" + op + "-" + dtype).replace(/[^A-Za-z0-9_-]/g, "-").toLowerCase();
}
function countLines(cell) {   // one status per line keeps the columns narrow
  const lines = STATUSES.filter((s) => cell.counts[s]).map((s) => cell.counts[s] + " " + s);
  return lines.flatMap((line, i) => (i ? [el("br", {}), line] : [line]));
}
function fmt(v) { return typeof v === "number" ? Number(v.toPrecision(4)).toString() : String(v); }
function describeWorst(w) {
  if (!w) return "";
  let where = (w.target || "") + ("index" in w ? " at [" + w.index + "]" : "");
  const rest = Object.entries(w).filter(([k]) => k !== "target" && k !== "index").map(([k, v]) => k + " " + fmt(v));
  return (where ? where + ": " : "") + rest.join(", ");
}
function describeMachine(m) {
  if (!m || !m.cpu) return "?";
  const parts = [m.cpu + " (" + m.cores + " cores" + (m.memory_gib ? ", " + m.memory_gib + " GiB)" : ")")];
  for (const a of m.accelerators || []) parts.push(a.count + " x " + a.type + (a.name ? " " + a.name : ""));
  if (m.nvidia_driver) parts.push(m.nvidia_driver);
  for (const [k, v] of Object.entries(m.vendor_toolkits || {})) parts.push(k + " toolkit " + v);
  for (const [k, v] of Object.entries(m.vendor_bridges || {})) parts.push(k + " " + v);
  return parts.join("; ");
}

function drawHeader() {
  const sources = new Set(DATA.columns.map((c) => c.source));
  const versions = [...new Set(DATA.columns.map((c) => c.glm5_hal))].join(", ");
  $("summary").textContent = DATA.columns.length + " columns (backend @ chip) from " + sources.size +
    " reports · glm5_hal " + versions + " · merged " + DATA.generated;
  if (DATA.differences.length) {
    $("differences-section").hidden = false;
    for (const d of DATA.differences) $("differences").append(el("li", {class: "warn"}, d));
  }
  const head = ["column", "glm5_hal", "versions", "machine", "reference", "presets", "cases", "command", "run at"];
  $("columns").append(el("tr", {}, ...head.map((h) => el("th", {}, h))));
  for (const c of DATA.columns) {
    const versions = Object.entries(c.versions || {}).map(([k, v]) => k + " " + v).join(", ");
    const ref = (c.reference.mode || "?") + " (" + (c.reference.dtype || "?") + ")";
    $("columns").append(el("tr", {"data-column": c.key},
      el("td", {}, el("code", {}, c.key)), el("td", {}, c.glm5_hal), el("td", {}, versions),
      el("td", {}, describeMachine(c.machine)), el("td", {}, ref), el("td", {}, c.presets.join(", ")),
      el("td", {}, c.cases), el("td", {class: "mono"}, c.command), el("td", {}, c.timestamp)));
  }
}

function drawMatrix() {
  const table = $("matrix");
  table.append(el("tr", {}, el("th", {}, "op"), el("th", {}, "dtype"),
    ...DATA.columns.map((c) => el("th", {class: "col", "data-column": c.key}, c.key))));
  for (const row of DATA.rows) {
    const tr = el("tr", {class: "row", "data-op": row.op, "data-dtype": row.dtype},
      el("th", {}, el("code", {}, row.op)), el("td", {}, row.dtype));
    for (const c of DATA.columns) {
      const cell = row.cells[c.key];
      if (!cell) { tr.append(el("td", {class: "cell none", "data-column": c.key, "data-status": ""}, "–")); continue; }
      const td = el("td", {class: "cell " + cell.status, "data-column": c.key, "data-status": cell.status,
                           "data-counts": JSON.stringify(cell.counts)});
      if (cell.status === "fail" || cell.status === "error") {
        td.append(el("a", {href: "#" + anchor(c.key, row.op, row.dtype)}, ...countLines(cell)));
        if (cell.margin !== null) {
          td.append(el("span", {class: "margin"}, "worst margin " + fmt(cell.margin)));
          td.title = "worst: " + cell.worst;
        }
      } else {
        td.append(...countLines(cell));
        td.title = cell.margin === null ? "" : "largest margin " + fmt(cell.margin) + " (" + cell.worst + ")";
      }
      tr.append(td);
    }
    table.append(tr);
  }
  $("legend").append(...STATUSES.map((s) => el("span", {class: s, title: DATA.meaning[s]}, s)));
  for (const s of $("legend").children) s.style.background = "var(--" + s.className + ")";
}

function drawProblems() {
  const groups = new Map();
  for (const p of DATA.problems) {
    const key = anchor(p.column, p.op, p.dtype);
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(p);
  }
  if (!groups.size) $("problems").append(el("p", {}, "None: no case failed or errored."));
  for (const [key, cases] of groups) {
    const first = cases[0];
    const wrap = el("div", {class: "cases", "data-column": first.column, "data-op": first.op},
      el("div", {class: "group", id: key}, first.column + " · " + first.op + " · " + first.dtype + " (" + cases.length + ")"));
    for (const p of cases) {
      const facts = [["status", p.status], ["margin", p.margin === null ? "" : fmt(p.margin)], ["worst element", describeWorst(p.worst)],
        ["inputs", p.inputs], ["about", p.note], ["implementation", p.impl], ["device", p.device],
        ["max |err|, max rel", fmt(p.max_abs) + ", " + fmt(p.max_rel)], ["atol, rtol", fmt(p.atol) + ", " + fmt(p.rtol)],
        ["reason", p.reason]];
      for (const o of p.outputs || []) facts.push(["output " + o.target, (o.ok ? "ok" : "FAILED") +
        (o.margin === null ? "" : ", margin " + fmt(o.margin)) + " · " + o.tolerance]);
      const dl = el("dl", {});
      for (const [k, v] of facts) if (v !== "" && v !== null && v !== undefined && v !== "null, null") dl.append(el("dt", {}, k), el("dd", {}, v));
      wrap.append(el("details", {class: "case " + p.status, "data-case": p.case, "data-status": p.status},
        el("summary", {}, p.status.toUpperCase() + " ", el("code", {}, p.case),
          (p.margin === null ? "" : " margin " + fmt(p.margin)) + (p.worst ? " · " + describeWorst(p.worst) : "") +
          (p.status === "error" ? " · " + p.reason.slice(0, 160) : "")), dl));
    }
    $("problems").append(wrap);
  }
}

function drawDeclines() {
  const table = $("declines");
  table.append(el("tr", {}, ...["column", "op", "status", "cases", "dtypes", "reason"].map((h) => el("th", {}, h))));
  for (const d of DATA.declines) {
    table.append(el("tr", {class: "decline", "data-column": d.column, "data-op": d.op, "data-status": d.status},
      el("td", {}, el("code", {}, d.column)), el("td", {}, el("code", {}, d.op)), el("td", {class: d.status}, d.status),
      el("td", {}, d.count), el("td", {}, d.dtypes.join(", ")), el("td", {}, d.reason)));
  }
}

function drawFilters() {
  for (const op of [...new Set(DATA.rows.map((r) => r.op))]) $("filter-op").append(el("option", {value: op}, op));
  for (const c of DATA.columns) $("filter-column").append(el("option", {value: c.key}, c.key));
  for (const s of STATUSES) {
    $("filter-status").append(el("label", {}, el("input", {type: "checkbox", value: s, checked: true}), " " + s + " "));
  }
  $("filters").addEventListener("change", applyFilters);
}

// A row shows when its op is chosen and one of its shown cells has a chosen status.
function applyFilters() {
  const op = $("filter-op").value, column = $("filter-column").value;
  const statuses = new Set([...$("filter-status").querySelectorAll("input:checked")].map((i) => i.value));
  const columnShown = (key) => !column || key === column;
  for (const node of document.querySelectorAll("#matrix [data-column]")) node.hidden = !columnShown(node.dataset.column);
  let rows = 0;
  for (const tr of document.querySelectorAll("#matrix tr.row")) {
    const cells = [...tr.querySelectorAll("td.cell")].filter((td) => !td.hidden);
    const hit = cells.some((td) => Object.keys(JSON.parse(td.dataset.counts || "{}")).some((s) => statuses.has(s)));
    tr.hidden = (op && tr.dataset.op !== op) || !hit;
    if (!tr.hidden) rows++;
  }
  for (const node of document.querySelectorAll(".cases, tr.decline")) {
    node.hidden = (op && node.dataset.op !== op) || !columnShown(node.dataset.column);
  }
  for (const d of document.querySelectorAll("details.case")) d.hidden = !statuses.has(d.dataset.status);
  for (const tr of document.querySelectorAll("tr.decline")) tr.hidden = tr.hidden || !statuses.has(tr.dataset.status);
  $("shown").textContent = rows + " of " + DATA.rows.length + " rows shown";
}

// Following a failing cell's link opens its cases.
function openTarget() {
  const id = decodeURIComponent(location.hash.slice(1));
  const group = id && document.getElementById(id);
  if (group) for (const d of group.parentElement.querySelectorAll("details")) d.open = true;
}

drawHeader(); drawMatrix(); drawProblems(); drawDeclines(); drawFilters(); applyFilters();
window.addEventListener("hashchange", openTarget); openTarget();
document.body.dataset.ready = "1";
"""
