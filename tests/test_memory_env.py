"""glm5_hal.memory_env (the process's allocator and the THP mode) and the section of
`glm5-hal doctor` that reports them."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from glm5_hal import doctor, memory_env

TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
MAPS_LINE = "7f0000000000-7f0000100000 r-xp 00000000 08:01 1234 "


@pytest.mark.parametrize("library,name", [
    ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4.5.10", "tcmalloc"),
    ("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2", "jemalloc"),
    ("/opt/lib/libmimalloc.so.2.1", "mimalloc"),
])
def test_a_mapped_malloc_library_names_the_allocator(library, name):
    maps = MAPS_LINE + "/usr/lib/x86_64-linux-gnu/libc.so.6\n" + MAPS_LINE + library + "\n"
    assert memory_env.allocator(maps) == name


def test_without_a_malloc_library_the_c_librarys_malloc_is_named():
    maps = MAPS_LINE + "/usr/lib/x86_64-linux-gnu/libc.so.6\n" + MAPS_LINE + "/tmp/not-tcmalloc/libfoo.so\n"
    assert memory_env.allocator(maps) == (memory_env.platform.libc_ver()[0] or "unknown")


def test_thp_mode_reads_the_bracketed_choices(tmp_path):
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    (tmp_path / "defrag").write_text("always defer [defer+madvise] madvise never\n")
    assert memory_env.thp_mode(str(tmp_path)) == {"enabled": "madvise", "defrag": "defer+madvise"}
    assert memory_env.thp_mode(str(tmp_path / "missing")) == {"enabled": None, "defrag": None}


def _info(allocator="glibc", enabled="madvise", defrag="madvise"):
    return {"allocator": allocator, "ld_preload": None, "malloc_env": {}, "thp_enabled": enabled,
            "thp_defrag": defrag}


def test_findings_say_what_costs_speed_and_what_to_do():
    assert any("LD_PRELOAD=libtcmalloc_minimal.so.4" in f for f in memory_env.findings(_info("glibc")))
    assert any("jemalloc" in f for f in memory_env.findings(_info("jemalloc")))
    stall = memory_env.findings(_info("tcmalloc", "always", "always"))
    assert len(stall) == 1 and "defer+madvise" in stall[0]
    assert "enabled=never" in memory_env.findings(_info("tcmalloc", "never", "madvise"))[0]
    assert memory_env.findings(_info("tcmalloc", "madvise", "madvise")) == []


def test_summary_and_describe_name_the_settings():
    info = memory_env.describe(maps=MAPS_LINE + TCMALLOC + "\n", environ={"LD_PRELOAD": TCMALLOC,
                                                                       "GLIBC_TUNABLES": "glibc.malloc.x=1"})
    assert info["allocator"] == "tcmalloc" and info["ld_preload"] == TCMALLOC
    assert info["malloc_env"] == {"GLIBC_TUNABLES": "glibc.malloc.x=1"}
    line = memory_env.summary(info)
    assert line.startswith("allocator tcmalloc (LD_PRELOAD=") and "THP enabled=" in line


def test_this_process_has_an_allocator_and_doctor_reports_it():
    report = doctor.diagnose()
    assert report["memory"]["allocator"] == memory_env.allocator()
    assert report["performance_notes"] == memory_env.findings(report["memory"])
    text = doctor.format_report(report)
    assert "memory      allocator " in text
    if report["performance_notes"]:
        assert "performance notes" in text


@pytest.mark.skipif(not os.path.exists(TCMALLOC), reason="libtcmalloc-minimal4 not installed")
def test_a_preloaded_tcmalloc_is_detected_in_the_process():
    proc = subprocess.run([sys.executable, "-c", "from glm5_hal import memory_env; print(memory_env.allocator())"],
                          capture_output=True, text=True, env=dict(os.environ, LD_PRELOAD=TCMALLOC), timeout=60)
    assert proc.stdout.strip() == "tcmalloc", proc.stderr
