"""bench/plots.py draws from the JSON the benchmarks write: a small file made by the
benchmarks' own writers, drawn without running any benchmark."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.support.host import REPO

sys.path.insert(0, os.path.join(REPO, "bench"))

import apply_curve  # noqa: E402
import compare  # noqa: E402
import plots  # noqa: E402

image = pytest.importorskip("matplotlib.image", reason="matplotlib: the bench extra")


def ours(n: int, per_alloc: float) -> dict[str, float]:
    return {"apply": n * per_alloc, "apply_probed": n * per_alloc * 2, "teardown": n * 0.004,
            "plan": 0.2 + n * 0.001, "agent_plan": 0.04, "dump": 0.01, "agent_dump": 0.008}


def test_compare_json_draws_the_scaling_and_noop_plan_figures(tmp_path):
    results = {50: {"ours": ours(50, 0.007), "cni": {"setup": 5.0, "teardown": 10.0},
                    "runs": 1, "cni_runs": 1},
               500: {"ours": ours(500, 0.009), "cni": None, "runs": 1, "cni_runs": 1}}
    path = str(tmp_path / "c.json")
    compare.write_json(path, {50: {"ours": [], "cni": []}}, results, None)
    doc = plots.read(path)
    assert doc["kind"] == "compare" and set(doc["meta"]) == {"when", "code", "load"}
    # a size where the chain did not run is left out of its line, not drawn as zero
    assert plots._series(doc, "cni", "setup", per_alloc=True) == ([50], [100.0])
    xs, ys = plots._series(doc, "ours", "apply", per_alloc=True)
    assert xs == [50, 500] and ys == pytest.approx([7.0, 9.0])
    written = plots.draw([path], str(tmp_path / "fig"))
    assert [os.path.basename(p) for p in written] == [plots.SCALING, plots.NOOP_PLAN]
    for p in written:
        with open(p, "rb") as fh:
            assert fh.read(8) == b"\x89PNG\r\n\x1a\n"
        pixels = image.imread(p)
        assert pixels.shape[0] > 300 and pixels.shape[1] > 500
        assert pixels.min() < 0.5 < pixels.max()  # something drawn on white


def test_apply_curve_json_draws_its_curve(tmp_path):
    rows = [apply_curve.Run(n, n * 0.003, 0, 0, 0, 0, "1.0", "1.1") for n in (250, 1000)]
    path = str(tmp_path / "a.json")
    apply_curve.write_json(path, rows, 0.2, runs=1)
    (written,) = plots.draw([path], str(tmp_path))
    assert os.path.basename(written) == plots.APPLY_CURVE
    assert image.imread(written).shape[1] > 500


def test_a_file_that_is_no_benchmark_is_one_error_line(tmp_path, capsys):
    bad = tmp_path / "x.json"
    bad.write_text(json.dumps({"something": 1}))
    assert plots.main([str(bad), "--out-dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err == \
        f"error: {bad}: neither compare.py's nor apply_curve.py's JSON\n"
    empty = tmp_path / "e.json"
    empty.write_text(json.dumps({"kind": "compare", "medians": {}}))
    assert plots.main([str(empty), "--out-dir", str(tmp_path)]) == 1
    assert "no set-up figures to draw" in capsys.readouterr().err


def test_several_compare_runs_make_one_pair_of_figures(tmp_path):
    paths = []
    for i, per in enumerate((0.007, 0.011)):
        path = str(tmp_path / f"c{i}.json")
        compare.write_json(path, {}, {100: {"ours": ours(100, per), "cni": {"setup": 20.0,
                                                                            "teardown": 25.0},
                                            "runs": 1, "cni_runs": 1}}, None)
        paths.append(path)
    written = plots.draw(paths, str(tmp_path / "fig"))
    assert [os.path.basename(p) for p in written] == [plots.SCALING, plots.NOOP_PLAN]
