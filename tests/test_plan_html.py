"""`primebuild plan -o html`: one self-contained page, rendered by headless Chromium and looked at.

Chromium comes from the Debian package `chromium` (scripts/bootstrap --test installs it as root); under
CI=true a missing one fails. The checks read the page as the browser built it (`--dump-dom`: one map cell
per GPU) and its screenshot (every role's colour is on screen in about the area its GPUs take).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import MANIFESTS, run_cli

from primebuild.builders.plan_html import ROLE_COLOURS

pytestmark = pytest.mark.timeout(180)


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return name
    if os.environ.get("CI") == "true":
        pytest.fail("chromium is not installed (apt-get install chromium; scripts/bootstrap --test does it)")
    pytest.skip("chromium is not installed (apt-get install chromium)")


def headless(*args: str, tmp: Path) -> subprocess.CompletedProcess:
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
    argv = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
            f"--user-data-dir={tmp / 'profile'}", *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.fixture(scope="module")
def glm5_page(tmp_path_factory) -> Path:
    result = run_cli("plan", MANIFESTS / "glm5.yaml", "--design", "-o", "html")
    assert result.code == 0, result.text
    page = tmp_path_factory.mktemp("html") / "glm5.html"
    page.write_text(result.out)
    return page


def test_the_page_is_self_contained(glm5_page: Path):
    html = glm5_page.read_text()
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")
    assert "<script" not in html and "<link" not in html and not re.search(r"(src|href)=|url\(", html)
    assert "glm5-swe" in html and "design study" not in html  # glm5 plans as a run


def test_chromium_builds_one_map_cell_per_gpu(glm5_page: Path, tmp_path: Path):
    dom = headless("--dump-dom", glm5_page.as_uri(), tmp=tmp_path).stdout
    cells = re.findall(r'<div class="gpu" data-role="(\w+)"', dom)
    assert len(cells) == 28 * 8
    assert {role: cells.count(role) for role in set(cells)} == {"prefill": 32, "decode": 96, "trainer": 96}
    assert len(re.findall(r'<div class="mem" data-role=', dom)) == 4  # prefill, decode, trainer, orchestrator bars
    assert re.search(r'data-phase="rollout"', dom) and "~861 s" in dom


def test_the_screenshot_shows_the_map_and_the_bars(glm5_page: Path, tmp_path: Path):
    from PIL import Image

    shot = tmp_path / "glm5.png"
    headless("--window-size=1400,1500", f"--screenshot={shot}", glm5_page.as_uri(), tmp=tmp_path)
    image = Image.open(shot).convert("RGB")
    assert image.size == (1400, 1500)
    counts = {colour: n for n, colour in image.getcolors(maxcolors=image.size[0] * image.size[1])}
    total = image.size[0] * image.size[1]
    assert max(counts.values()) < 0.9 * total, "the page is (almost) one colour: blank"
    assert len(counts) > 50, "too few colours for a rendered page"

    def pixels(hex_colour: str) -> int:
        rgb = tuple(int(hex_colour[i:i + 2], 16) for i in (1, 3, 5))
        return counts.get(rgb, 0)

    # 96 decode and 96 trainer cells of ~60 x 17 px, 32 prefill cells, plus legend and bar segments
    assert pixels(ROLE_COLOURS["decode"]) > 96 * 400
    assert pixels(ROLE_COLOURS["trainer"]) > 96 * 400
    assert pixels(ROLE_COLOURS["prefill"]) > 32 * 400
    assert pixels(ROLE_COLOURS["orchestrator"]) > 200  # its chip on node 0


def test_the_headline_is_the_expected_asynchronous_step(glm5_page: Path):
    """The figure people compare with runs leads; the full-length worst case is the line under it."""
    from conftest import plan_json

    profile = plan_json("manifests/glm5.yaml")["estimates"]["profile"]
    html = glm5_page.read_text()
    assert f'class="big">~{profile["async_step_seconds"]:.0f} s' in html
    assert 'id="step-expected"' in html and f'~{profile["sync_step_seconds"]:.0f} s' in html
