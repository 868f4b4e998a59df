"""End to end: the Gradio demo in a real headless Chromium, driven by Playwright.

Starts ``demo/app.py`` on 127.0.0.1 (a free port) in a subprocess with the embedded SmolLM2, then:
a model directory that does not load and an empty prompt each show a message (no stack trace) and the
app stays up; a real prompt streams in both panes until both finish, each with text and a numeric
tok/s; the page says which device ran it. Screenshots go to ``$HF_ACCEL_TEST_ARTIFACTS`` (default
``test-artifacts/``): ``demo.png`` (both panes at once) and ``demo-sequential.png``.

Needs Debian's ``chromium`` (``$HF_ACCEL_CHROMIUM``, default /usr/bin/chromium) and the ``playwright``
Python package (its own browser download is not used); skipped with the reason when either is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
APP = REPO / "demo" / "app.py"
CHROMIUM = os.environ.get("HF_ACCEL_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(os.environ.get("HF_ACCEL_TEST_ARTIFACTS", REPO / "test-artifacts"))
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]
START_TIMEOUT_S = 90  # server up (the model loads in the background)
RUN_TIMEOUT_S = 150  # first Generate includes waiting for the model (~20 s on CPU)
PROMPT = "Write a short poem about the sea."

try:
    from playwright.sync_api import sync_playwright
except ImportError:  # pragma: no cover - depends on the environment
    sync_playwright = None


def _chromium() -> str | None:
    path = shutil.which(CHROMIUM) if os.sep not in CHROMIUM else CHROMIUM
    return path if path and os.access(path, os.X_OK) else None


pytestmark = [
    pytest.mark.skipif(sync_playwright is None, reason="the playwright Python package is not installed "
                       "(pip install playwright; its browser download is not needed)"),
    pytest.mark.skipif(_chromium() is None, reason=f"Chromium not found at {CHROMIUM} "
                       "(apt-get install chromium, or set HF_ACCEL_CHROMIUM)"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app_url():
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the app runs as a user runs it, not under the test interpreter
    env["PYTHONUNBUFFERED"] = "1"
    log_path = ARTIFACTS / "demo-server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(APP), "--host", "127.0.0.1", "--port", str(port)],
                                cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"demo/app.py exited with {proc.returncode}; log:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"demo did not answer on {url} within {START_TIMEOUT_S} s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def page(app_url):
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), headless=True, args=CHROMIUM_ARGS)
        try:
            pg = browser.new_page(viewport={"width": 1400, "height": 1000})
            pg.goto(app_url, timeout=60_000)
            pg.wait_for_selector("#prompt textarea", timeout=60_000)
            yield pg
        finally:
            browser.close()


def _run_id(pg) -> int:
    return int(pg.locator("#status .status-msg").get_attribute("data-run") or 0)


def _generate(pg, timeout_s: float = RUN_TIMEOUT_S) -> tuple[str, str]:
    """Click Generate and wait for this run's final message; returns (kind, text)."""
    before = _run_id(pg)
    pg.click("#run-btn")
    pg.wait_for_function(
        """before => {
            const el = document.querySelector('#status .status-msg');
            return el && Number(el.dataset.run) > before && ['ok', 'error'].includes(el.dataset.kind);
        }""",
        arg=before, timeout=timeout_s * 1000,
    )
    status = pg.locator("#status .status-msg")
    return status.get_attribute("data-kind"), status.inner_text().strip()


def _pane(pg, key: str) -> dict:
    stats = pg.locator(f"#{key}-stats .pane-stats")
    return {
        "state": stats.get_attribute("data-state"),
        "text": pg.locator(f"#{key}-text textarea").input_value(),
        "tps": stats.locator(".tps").inner_text().strip(),
        "ttft": stats.locator(".ttft").inner_text().strip(),
        "ntok": stats.locator(".ntok").inner_text().strip(),
    }


def _assert_no_traceback(pg):
    body = pg.locator("body").inner_text()
    assert "Traceback" not in body and 'File "' not in body, body[-2000:]


def test_bad_model_directory_shows_message(page, tmp_path):
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    page.fill("#model-path textarea", str(not_a_model))
    page.fill("#prompt textarea", "Hello")
    kind, text = _generate(page)
    assert kind == "error"
    assert "Could not load the model" in text and "config.json" in text, text
    _assert_no_traceback(page)
    page.fill("#model-path textarea", "")


def test_empty_prompt_shows_message(page):
    page.fill("#prompt textarea", "   ")
    kind, text = _generate(page, timeout_s=30)
    assert kind == "error"
    assert "enter a prompt" in text, text
    _assert_no_traceback(page)


def _check_finished_run(page):
    for key in ("stock", "accel"):
        pane = _pane(page, key)
        assert pane["state"] == "done", pane
        assert pane["text"].strip(), f"{key} pane shows no text: {pane}"
        assert re.fullmatch(r"\d+(\.\d+)?", pane["tps"]) and float(pane["tps"]) > 0, pane
        assert re.fullmatch(r"\d+ ms", pane["ttft"]), pane
        assert int(pane["ntok"]) > 0, pane
    _assert_no_traceback(page)


def test_both_panes_stream_and_finish(page):
    page.fill("#prompt textarea", PROMPT)
    page.click('#run-mode label:has-text("Both at once")')
    started = time.monotonic()
    before = _run_id(page)
    page.click("#run-btn")
    # While generating, both panes are running at the same time (or one already finished on a fast device).
    page.wait_for_function(
        """before => {
            const el = document.querySelector('#status .status-msg');
            return el && Number(el.dataset.run) > before && el.textContent.startsWith('Generating');
        }""",
        arg=before, timeout=RUN_TIMEOUT_S * 1000,
    )
    page.wait_for_function(
        """before => {
            const el = document.querySelector('#status .status-msg');
            return el && Number(el.dataset.run) > before && ['ok', 'error'].includes(el.dataset.kind);
        }""",
        arg=before, timeout=RUN_TIMEOUT_S * 1000,
    )
    status = page.locator("#status .status-msg")
    assert status.get_attribute("data-kind") == "ok", status.inner_text()
    _check_finished_run(page)
    device = page.locator("#device-info").inner_text()
    assert re.search(r"Device: (CPU \(\d+ cores\) — PyTorch reference attention path|GPU \(.+\) — Triton kernels)",
                     device), device
    summary = page.locator("#summary").inner_text()
    assert "greedy tokens identical: yes" in summary, summary
    assert "at the same time" in summary, summary
    page.wait_for_selector("#kv-plot canvas, #kv-plot svg", timeout=10_000)
    assert "KV" in page.locator("#kv-caption").inner_text()
    legend = page.locator("#kv-plot").inner_text()
    assert "stock HF generate" in legend and "hf-accel" in legend, legend
    # both series are drawn (Vega renders SVG: one line path per series)
    page.wait_for_function(
        """() => Array.from(document.querySelectorAll('#kv-plot g.mark-line path'))
                 .filter(p => (p.getAttribute('d') || '').length > 10).length >= 2""",
        timeout=10_000,
    )
    page.wait_for_timeout(500)  # let the plot's last redraw land before the screenshot
    page.screenshot(path=str(ARTIFACTS / "demo.png"), full_page=True)
    print(f"concurrent run took {time.monotonic() - started:.1f} s; {summary}")


def test_sequential_mode(page):
    page.click('#run-mode label:has-text("One after the other")')
    kind, text = _generate(page)
    assert kind == "ok", text
    _check_finished_run(page)
    summary = page.locator("#summary").inner_text()
    assert "one after the other" in summary and "hf-accel / stock speed" in summary, summary
    page.screenshot(path=str(ARTIFACTS / "demo-sequential.png"), full_page=True)
    page.click('#run-mode label:has-text("Both at once")')
