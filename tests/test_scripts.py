"""The benchmark scripts' own logic: method parsing, defaults, the memory check, and the
report/plots rebuilt from a committed run's results.json (no engine is started)."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import benchmark as bm  # noqa: E402


def test_parse_methods_adds_plain_and_checks_keys():
    methods = bm.parse_methods("ngram:3,ptd:max_verify_nodes=6:max_draft_nodes=4,pctree:mode=chain")
    assert [m.label for m in methods][0] == "none"
    ngram = methods[1]
    assert ngram.spec["num_speculative_tokens"] == 3 and ngram.spec["prompt_lookup_max"] == 5
    assert methods[2].spec == {"method": "ptd", "max_verify_nodes": 6, "max_draft_nodes": 4}
    with pytest.raises(ValueError, match="given twice"):
        bm.parse_methods("ptd,ptd")
    with pytest.raises(ValueError, match="max_verfy_nodes"):
        bm.parse_methods("ptd:max_verfy_nodes=3")
    with pytest.raises(ValueError, match="unknown method"):
        bm.parse_methods("eagle")


def test_dtype_auto_and_fp32_alias():
    a = argparse.Namespace(dtype="auto", kv_cache_gib=None, model="m")
    bm.resolve_common_args(a)
    assert a.dtype == ("bfloat16" if bm.fast_bf16() else "float32")
    assert a.kv_cache_gib == (1.0 if a.dtype == "float32" else 0.5)
    b = argparse.Namespace(dtype="fp32", kv_cache_gib=0.25, model="m")
    bm.resolve_common_args(b)
    assert (b.dtype, b.kv_cache_gib) == ("float32", 0.25)


def test_memory_check_refuses_too_many_engines(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    opts = {"dtype": "float32", "kv_cache_gib": 0.5}
    bm._check_memory(4, opts, avail_gib=20.0)  # 4 x 3 GiB fits
    with pytest.raises(SystemExit, match="9 engines need about 27 GiB"):
        bm._check_memory(9, opts, avail_gib=20.0)


def test_replot_rebuilds_report_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    src = REPO / "docs" / "results" / "batch1" / "results.json"
    shutil.copy(src, tmp_path / "results.json")
    bm.replot(tmp_path / "results.json", str(REPO / "docs" / "results" / "rowcost" / "row_cost.json"))
    md = (tmp_path / "results.md").read_text()
    data = json.loads(src.read_text())
    for label in data["meta"]["methods"]:
        assert f"| {label} |" in md
    for png in ("speedup.png", "de_vs_rows.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
