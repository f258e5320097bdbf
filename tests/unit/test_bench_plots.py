"""The committed bench plots (docs/img/*.svg) are drawn from the result files bench/plots.py would choose today.

bench/plots.py records in docs/img/plots.json which result file each image was drawn from, with the sha256 of that
file, of the script and of the image. Recomputing those here needs no matplotlib: a result file edited or added
(a newer run the script would pick), a changed script or an image edited by hand makes this fail, with the
command that redraws them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import pytest

from tests.conftest import REPO

REDRAW = "redraw with: pip install -e '.[bench]' && python bench/plots.py (then commit docs/img/)"


def load_plots():
    spec = importlib.util.spec_from_file_location("gpufleet_bench_plots", REPO / "bench" / "plots.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((REPO / "docs" / "img" / "plots.json").read_text())


def test_the_script_reads_without_matplotlib():
    plots = load_plots()
    assert set(plots.inputs()) == {plots.NOOP_SVG, plots.ROUTER_SVG, plots.ROLLOUT_SVG}


def test_each_image_comes_from_the_result_file_the_script_chooses_now(manifest):
    chosen = {name: path.relative_to(REPO).as_posix() for name, path in load_plots().inputs().items()}
    recorded = {name: image["source"] for name, image in manifest["images"].items()}
    assert recorded == chosen, REDRAW


def test_no_result_file_changed_since_the_images_were_drawn(manifest):
    for name, image in manifest["images"].items():
        assert sha256(REPO / image["source"]) == image["source_sha256"], f"{name}: {image['source']} changed; {REDRAW}"


def test_the_script_did_not_change_since(manifest):
    assert sha256(REPO / manifest["generator"]) == manifest["generator_sha256"], f"bench/plots.py changed; {REDRAW}"


def test_the_images_are_the_ones_drawn(manifest):
    for name, image in manifest["images"].items():
        path = REPO / "docs" / "img" / name
        assert path.is_file(), f"{name} missing; {REDRAW}"
        assert sha256(path) == image["sha256"], f"{name} is not what bench/plots.py drew; {REDRAW}"


def test_the_docs_show_every_image(manifest):
    bench_page = (REPO / "docs" / "bench.md").read_text()
    for name in manifest["images"]:
        assert f"img/{name}" in bench_page, f"docs/bench.md does not show {name}"
