"""The Grafana dashboard (docs/grafana/tritonkv.json) loads and graphs only metrics that exist:
the connector's, as ``connector.vllm_connector.stats`` exports them, and vLLM's own."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest
from support.vllm_fixtures import requires_vllm

from connector.vllm_connector import stats

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "tritonkv.json"
_METRIC = re.compile(r"\bvllm:[a-z_:]+")


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _exprs() -> list[str]:
    return [t["expr"] for p in _dashboard()["panels"] for t in p["targets"]]


def _ours() -> set[str]:
    """Every series name the connector exports."""
    names = {f"vllm:tritonkv_{k}_total" for k in [*stats.PROM_COUNTERS, *stats.PROM_OUTCOMES]}
    names |= {f"vllm:tritonkv_{k}" for k in stats.PROM_GAUGES}
    for key in stats.PROM_HISTOGRAMS:
        names |= {f"vllm:tritonkv_{key}_seconds_{part}" for part in ("bucket", "sum", "count")}
    return names


def test_the_dashboard_is_grafana_json_with_a_sane_grid():
    dash = _dashboard()
    assert dash["uid"] and dash["title"] and dash["panels"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(set(ids)) == len(ids)
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = set(
            itertools.product(range(g["x"], g["x"] + g["w"]), range(g["y"], g["y"] + g["h"]))
        )
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
        assert p["targets"] and all(t["expr"] and t["refId"] for t in p["targets"])


def test_it_graphs_every_kind_of_the_connectors_metrics_and_no_other_of_ours():
    used = {m for e in _exprs() for m in _METRIC.findall(e)}
    ours = {m for m in used if m.startswith("vllm:tritonkv_")}
    assert ours <= _ours(), ours - _ours()
    for key in [*stats.PROM_OUTCOMES, *stats.PROM_GAUGES]:
        assert any(m.startswith(f"vllm:tritonkv_{key}") for m in ours), key
    for key in stats.PROM_HISTOGRAMS:
        assert f"vllm:tritonkv_{key}_seconds_bucket" in ours, key


@requires_vllm
def test_the_vllm_metrics_it_graphs_are_vllms():
    import vllm.v1.metrics.loggers as loggers

    source = Path(loggers.__file__).read_text()
    theirs = {m for e in _exprs() for m in _METRIC.findall(e) if not m.startswith("vllm:tritonkv_")}
    assert theirs
    for metric in theirs:
        base = re.sub(r"_(bucket|sum|count|total)$", "", metric)
        assert f'name="{base}"' in source, f"{metric} is not one of vLLM's metrics"


@pytest.mark.parametrize("expr", _exprs())
def test_each_query_is_balanced(expr):
    depth = 0
    for ch in expr:
        depth += {"(": 1, ")": -1, "{": 1, "}": -1, "[": 1, "]": -1}.get(ch, 0)
        assert depth >= 0, expr
    assert depth == 0, expr


def test_readme_metrics_table_is_stats_py():
    import metrics_table

    got = metrics_table.readme_table(
        (Path(__file__).resolve().parents[2] / "README.md").read_text()
    )
    assert got == metrics_table.table(), (
        "README.md's metrics table differs from connector/vllm_connector/stats.py: run "
        "`python tests/project/metrics_table.py --write`"
    )
