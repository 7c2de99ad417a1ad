"""The report page a user opens: OUT/report/index.html rendered by a real headless Chromium
(Debian's package, driven by Playwright), with every plot decoded and the quarantine reasons
shown with examples."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mmpack_udfs.report import plots
from tests.conftest import PACKED_DEMO_SETTINGS, demo_run

pytestmark = [pytest.mark.spark, pytest.mark.slow]
CHROMIUM = "/usr/bin/chromium"  # `make test` installs Debian's chromium when it is missing
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-sync",
                 "--disable-component-update", "--no-first-run"]  # fmt: skip
PNGS = {plots.LENGTHS_PLOT, plots.TOKENS_PLOT, plots.SUPERVISED_PLOT, plots.ATTENTION_PLOT,
        plots.PATCHES_PLOT, plots.COST_PLOT}  # fmt: skip


@pytest.fixture(scope="module")
def report_dir(spark, demo, tokenized_demo, tmp_path_factory) -> Path:
    """A whole run's output (the stages' reports too), packed: its OUT/report."""
    from mmpack_udfs.pack import stage as pack

    out = tmp_path_factory.mktemp("report-html") / "out"
    shutil.copytree(tokenized_demo, out)
    pack.run(spark, demo_run(demo, out, *PACKED_DEMO_SETTINGS))
    return out / "report"


def test_the_page_renders_in_chromium_with_every_plot(report_dir):
    from playwright.sync_api import sync_playwright

    assert Path(CHROMIUM).exists(), "Chromium is missing: `make test` installs Debian's chromium"
    for name in PNGS:
        assert (report_dir / name).stat().st_size > 5000, name
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto((report_dir / "index.html").as_uri())
            page.wait_for_load_state("load")
            images = page.evaluate("[...document.images].map(i => [i.alt, i.complete, i.naturalWidth])")
            headings = page.locator("h2").all_inner_texts()
            reasons = page.locator("h3").all_inner_texts()
            examples = page.locator("td pre").count()
            links = page.evaluate("[...document.links].map(a => a.getAttribute('href'))")
        finally:
            browser.close()
    assert {alt for alt, _, _ in images} == PNGS
    assert all(done and width >= 600 for _, done, width in images), images  # decoded, drawn
    assert headings[:3] == ["Numbers", "Normalize", "Tokenize"] and "Quarantine" in headings
    assert any(h.startswith("normalize: ") for h in reasons) and examples >= 3
    for link in links:  # the JSON reports and PNGs beside the page, and the manifest
        assert (report_dir / link).resolve().exists(), link
