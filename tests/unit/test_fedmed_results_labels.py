"""The kept results files name every run by a cell of its experiment's grid, and FedMed's runs by the
weighting they were made with: nothing made with a variant (fedmed-relative, fedmed-standardised) is called
FedMed. The grid keeps the variants' cells, run only where --only names them."""

from __future__ import annotations

import pytest

from fedmq.benchmarks import results_file
from fedmq.benchmarks.experiments import grids, nmt_grid
from fedmq.benchmarks.experiments.spec import RunSpec

KEPT = sorted(results_file.KEPT.glob("*.json"))


def _cells(name: str, scale: str) -> dict[str, RunSpec]:
    if name == "nmt-domains":
        return {s.name: s for s in nmt_grid.nmt_specs(scale)}
    return {s.name: s for s in grids.grid(name, scale)}


@pytest.mark.parametrize("path", KEPT, ids=[p.name for p in KEPT])
def test_every_archived_run_is_a_cell_of_its_grid_and_labelled_as_it(path):
    doc = results_file.read(path)
    cells = _cells(doc["experiment"], doc["scale"])
    for row in doc["runs"]:
        assert row["run"] in cells, f"{path.name}: {row['run']} is no cell of {doc['experiment']}"
        cell = cells[row["run"]]
        if "strategy" in row and not cell.central:
            assert row["strategy"] == cell.job["strategy"], (path.name, row["run"])
        rounds = row.get("strategy_rounds", {})
        assert set(rounds) <= {cell.job.get("strategy"), "fedavg"}, (path.name, row["run"], rounds)
        # a row made with a --set fedmed_js=... override is that variant's
        js = {**doc["overrides"], **row.get("overrides", {})}.get("fedmed_js")
        if js is not None and cell.job.get("strategy", "").startswith("fedmed"):
            assert cell.job["strategy"] == f"fedmed-{js}", (path.name, row["run"])
    # what the file's command named a renamed run is the FedMed cell of the same place in the grid
    for old, new in doc.get("renamed", {}).items():
        assert new in {r["run"] for r in doc["runs"]} and old in cells, (path.name, old)
        variant = cells[new].job["strategy"]
        assert variant in grids.FEDMED_VARIANTS and new == old.replace("fedmed", variant, 1)
        assert cells[old].job["strategy"] == "fedmed"


def test_no_archived_fedmed_run_was_made_with_the_papers_weights_and_so_none_is_called_fedmed():
    """Every FedMed run kept was made with relative or standardised JS weights (the default until the
    strategy named ``fedmed`` became the paper's formula)."""
    strategies = {row.get("strategy") for p in KEPT for row in results_file.read(p)["runs"]}
    assert "fedmed" not in strategies
    assert {"fedmed-relative", "fedmed-standardised"} <= strategies


def test_a_variants_cells_run_only_where_only_names_the_variant():
    cells = grids.grid("table2", "cpu")
    default = [s.name for s in grids.EXPERIMENTS["table2"]("cpu")]
    assert [s.name for s in cells[: len(default)]] == default
    assert {s.name for s in cells[len(default) :]} == {
        f"ptb-{v}-c{c}" for v in grids.FEDMED_VARIANTS for c in (0.1, 0.5)
    }
    names = {s.name for s in cells}

    def picked(only: str) -> list[str]:
        wanted = [w for w in only.split(",") if w]
        return [
            s.name
            for s in cells
            if any(grids._picks(w, s, names) for w in wanted) or (not wanted and grids._default_cell(s))
        ]

    assert picked("fedmed") == ["ptb-fedmed-c0.1", "ptb-fedmed-c0.5"]
    assert "ptb-fedmed-relative-c0.1" not in picked("c0.1")
    assert picked("fedmed-relative") == ["ptb-fedmed-relative-c0.1", "ptb-fedmed-relative-c0.5"]
    assert picked("ptb-fedmed-standardised-c0.5,ptb-fedavg-c0.5") == [
        "ptb-fedavg-c0.5",
        "ptb-fedmed-standardised-c0.5",
    ]
    assert picked("") == default


def _draw_results():
    """scripts/draw_results.py (it draws docs/results/'s method plots from the kept results files)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "draw_results.py"
    spec = importlib.util.spec_from_file_location("draw_results", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_plots_name_a_method_by_the_strategy_its_rows_record():
    draw = _draw_results()
    strategies = {row.get("strategy") for p in KEPT for row in results_file.read(p)["runs"]} - {None}
    for s in strategies & set(grids.FEDMED_VARIANTS):
        assert draw.label(s) == s
    assert draw.label("fedmed") == "FedMed"
    # every FedMed row kept was made with a variant (above): none is drawn as FedMed
    assert {s for s in strategies if s.startswith("fedmed")} <= set(draw.LABELS)
    assert all("FedMed" not in draw.label(s) for s in strategies & set(draw.LABELS))


@pytest.mark.parametrize("name", ["table2", "fraction", "rounds-to-target", "topk"])
def test_no_plot_of_the_results_pages_calls_a_fedmed_variants_run_fedmed(name):
    fig = _draw_results().FIGURES[name]()
    fig.canvas.draw()
    texts = [t.get_text() for t in fig.findobj(lambda o: hasattr(o, "get_text"))]
    assert not [t for t in texts if "FedMed" in t], name
    # the variant's own name instead (table2 breaks it over two lines at its hyphen)
    assert any("fedmed-" in t and "relative" in t for t in texts), name
