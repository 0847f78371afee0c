"""Streamlit UI on the real engine and model: AppTest in-process, then a real headless Chromium.

The AppTest runs share the session's BlendEngine (tests/conftest.py), handed to the app's
st.cache_resource before the first script run, so this module starts no engine in-process. The
browser test starts `streamlit run ui/app.py` on a loopback port (that server starts its own
engine, reading chunk KV from the same disk tier) and drives Chromium over the DevTools protocol:
it types one question into the chat input, waits for the answer, reads the page text and saves a
screenshot.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest

from ragcache_testing.services import free_port
from tests.conftest import REPO

pytestmark = pytest.mark.integration

APP = str(REPO / "ui" / "app.py")
INDEX = "zorbia"
RUN_TIMEOUT = 300  # seconds per AppTest script run (generous: 2 shared CPU cores)

DOCS = {
    "capital.txt": "The capital of Zorbia is Velmora, a city on the river Aster known for its glass bridges. "
                   "Velmora has about two hundred thousand inhabitants.",
    "founding.txt": "Velmora was founded in 1432 by the navigator Idris Kell after a storm wrecked his fleet "
                    "on the sandbanks of the Aster delta.",
    "food.txt": "The national dish of Zorbia is kelmet, a stew of lentils, smoked fish and saffron that is "
                "served on the first day of spring.",
    "parliament.txt": "The Zorbian parliament meets in the Amber Hall, which has 212 seats and a copper roof "
                      "that turned green in the great rain of 1870.",
}
QUESTION = "What is the capital of Zorbia?"


# ------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def ui_env(tmp_path_factory, engine_settings, engine):
    """An index ``zorbia`` in a temporary index_dir, the RAGCACHE_* environment the app reads, and
    the session's engine handed to the app (``ui.state.shared_engine``).

    Streamlit's script runner installs a module of its own as ``sys.modules["__main__"]`` for each
    AppTest run and leaves it there; the real one is put back afterwards, else a process started
    later by spawn (vLLM's AsyncLLM engine core, in tests/test_server.py) re-runs the app script as
    its ``__main__`` and dies (NameError: name '__args' is not defined)."""
    from ragcache.config import Settings
    from ragcache.pipeline import RAGPipeline
    from ui import state

    root = tmp_path_factory.mktemp("ui")
    docs = root / "docs"
    docs.mkdir()
    for name, text in DOCS.items():
        (docs / name).write_text(text, encoding="utf-8")
    env = {
        "RAGCACHE_INGEST__INDEX_DIR": str(root / "indexes"),
        "RAGCACHE_STORE__SSD_CACHE_DIR": str(engine_settings.store.ssd_cache_dir),
        "RAGCACHE_STORE__REMOTE_URL": "",
        "RAGCACHE_STORE__CPU_KV_POOL_GB": str(engine_settings.store.cpu_kv_pool_gb),
        "RAGCACHE_ENGINE__KV_CACHE_MEMORY_BYTES": str(engine_settings.engine.kv_cache_memory_bytes),
        "RAGCACHE_ENGINE__MAX_TOKENS": str(engine_settings.engine.max_tokens),
        "RAGCACHE_BLEND__MIN_RECOMPUTE_TOKENS": str(engine_settings.blend.min_recompute_tokens),
        # blend by default: these tests check the blend's metrics (auto would answer the ~40-token passages by
        # full prefill); the mode list offers auto first-hand
        "RAGCACHE_ENGINE__MODE": "blend",
    }
    mp = pytest.MonkeyPatch()
    for key, value in env.items():
        mp.setenv(key, value)
    settings = Settings.load()
    report = RAGPipeline(settings, root / "indexes" / INDEX, engine).ingest([docs])
    assert report.total_chunks == len(DOCS), report.summary()
    state.shared_engine(settings, engine)  # the app's st.cache_resource now holds this engine
    main_module = sys.modules["__main__"]
    yield {"root": root, "env": env, "settings": settings}
    sys.modules["__main__"] = main_module
    state.shared_engine.clear()
    mp.undo()


def new_app():
    from streamlit.testing.v1 import AppTest

    return AppTest.from_file(APP, default_timeout=RUN_TIMEOUT)


def metrics_of(at) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def number(text: str) -> float:
    return float(re.sub(r"[^\d.]", "", text))


# ------------------------------------------------------------------------------------ AppTest


def test_chat_streams_an_answer_and_shows_its_metrics_and_sources(ui_env):
    at = new_app().run()
    assert not at.exception
    assert at.selectbox(key="index").value == INDEX
    assert at.selectbox(key="mode").value == "blend" and "auto" in at.selectbox(key="mode").options

    at.chat_input[0].set_value(QUESTION).run()
    assert not at.exception
    assert not at.error, [e.value for e in at.error]
    record = at.session_state["messages"][-1]
    answer = record.answer
    assert record.role == "assistant" and record.index == INDEX and not record.error and answer.text.strip()
    asked = at.session_state["messages"][-2]
    assert (asked.role, asked.question) == ("user", QUESTION)
    shown = " ".join(md.value for md in at.chat_message[-1].markdown)
    assert answer.text.strip() in shown

    m = metrics_of(at)
    assert m["Mode"] == "blend"
    assert m["TTFT"].endswith(" s") and number(m["TTFT"]) > 0
    assert number(m["Reused tokens"]) > 0
    assert number(m["Recomputed tokens"]) > 0
    assert m["Tier hits"] != "-"
    assert answer.metrics.reused_tokens == int(number(m["Reused tokens"]))

    sources = [e for e in at.expander if e.label.startswith("Sources")]
    assert sources and sources[-1].label == f"Sources ({len(answer.sources)})"
    assert any("Velmora" in s.text for s in answer.sources)
    assert all(s.tier for s in answer.sources)

    assert at.session_state["ttft_log"] == [{"query": 1, "mode": "blend", "ttft_s": answer.metrics.ttft_s}]
    cache = at.dataframe[0].value
    assert {"cpu", "disk"} <= set(cache["tier"]) and cache["hit rate"].max() > 0


def test_compare_with_full_prefill_shows_the_speedup_and_a_series_per_mode(ui_env):
    at = new_app().run()
    at.toggle(key="compare").set_value(True).run()
    at.chat_input[0].set_value("Who founded Velmora?").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    record = at.session_state["messages"][-1]
    blend, full = record.answer, record.full
    assert full.metrics.mode == "full" and full.metrics.reused_tokens == 0
    m = metrics_of(at)
    assert m["Speedup vs full"] == f"{full.metrics.ttft_s / blend.metrics.ttft_s:.1f}×"
    assert {r["mode"] for r in at.session_state["ttft_log"]} == {"blend", "full"}
    assert any(e.label.startswith("Full prefill answer") for e in at.expander)

    # the history is re-rendered on the next run, with the same metrics
    at.run()
    assert metrics_of(at)["Speedup vs full"] == m["Speedup vs full"]
    assert len(at.chat_message) == 2
    [clear] = [b for b in at.sidebar.button if b.label == "Clear conversation"]
    clear.click().run()
    assert not at.chat_message and at.session_state["ttft_log"] == []


def test_query_settings_survive_a_visit_to_the_ingest_page(ui_env):
    at = new_app().run()
    at.selectbox(key="mode").set_value("reuse").run()
    at.number_input(key="top_k").set_value(2).run()
    assert at.slider(key="recompute_ratio").disabled
    at.switch_page("ingest_page.py").run()
    assert not at.exception and at.title[0].value == "Ingest documents"
    at.switch_page("chat_page.py").run()
    assert at.selectbox(key="mode").value == "reuse" and at.number_input(key="top_k").value == 2


def test_empty_and_too_long_questions_show_an_error_with_the_fix(ui_env):
    at = new_app().run()
    at.chat_input[0].set_value("   ").run()
    assert not at.exception
    assert "question is empty" in at.error[-1].value
    failed = at.session_state["messages"][-1]
    assert failed.answer is None and "question is empty" in failed.error

    at.chat_input[0].set_value("Zorbia " * 9000).run()
    assert not at.exception
    message = at.error[-1].value
    assert "too long" in message and "top_k" in message
    assert "Traceback" not in message


def test_without_an_index_the_chat_points_to_the_ingest_page(ui_env, tmp_path, monkeypatch):
    monkeypatch.setenv("RAGCACHE_INGEST__INDEX_DIR", str(tmp_path / "empty"))
    at = new_app().run()
    assert not at.exception
    assert "ragcache ingest" in at.info[0].value and "Ingest page" in at.info[0].value
    assert at.chat_input[0].disabled


def test_ingest_page_uploads_files_into_a_new_index_and_reports_skipped_ones(ui_env, tmp_path, monkeypatch):
    monkeypatch.setenv("RAGCACHE_INGEST__INDEX_DIR", str(tmp_path / "indexes"))
    at = new_app().run()
    at.switch_page("ingest_page.py").run()
    assert at.selectbox(key="ingest_target").value == "New index…"
    at.text_input(key="ingest_new_name").set_value("uploaded").run()
    at.get("file_uploader")[0].set_value([
        ("harps.md", b"# Harps\n\nZorbian children learn the seven-string harp at five.", "text/markdown"),
        ("empty.txt", b"   \n", "text/plain"),
    ]).run()
    at.button[0].click().run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    assert "1 files ingested" in at.success[0].value and "1 skipped" in at.success[0].value
    skipped = at.table[0].value
    assert list(skipped["file"]) == ["empty.txt"] and "empty" in skipped["reason"].iloc[0]
    assert (tmp_path / "indexes" / "uploaded-uploads" / "harps.md").is_file()
    assert at.selectbox(key="index").value == "uploaded"  # the sidebar switched to the new index

    at.switch_page("chat_page.py").run()
    at.chat_input[0].set_value("When do Zorbian children learn the harp?").run()
    assert not at.exception and not at.error, [e.value for e in at.error]
    answer = at.session_state["messages"][-1].answer
    assert answer.sources[0].title == "harps" and answer.metrics.reused_tokens > 0


# ------------------------------------------------------------------------------------ browser


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def wait_for(check: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except Exception:  # not up yet
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


def http_get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


class DevTools:
    """A minimal Chrome DevTools Protocol client over one page's websocket (no events enabled)."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self._id = 0

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        self._id += 1
        self.ws.send(json.dumps({"id": self._id, "method": method, "params": params}))
        while True:
            reply = json.loads(self.ws.recv(timeout=60))
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def eval(self, expression: str) -> Any:
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def stop(proc: subprocess.Popen, group: bool) -> None:
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


APP_STATE = "document.querySelector('[data-testid=\"stApp\"]')?.getAttribute('data-test-script-state')"
CHAT_BOX = "document.querySelector('[data-testid=\"stChatInputTextArea\"]')"
ERRORS = "document.querySelectorAll('[data-testid=\"stAlertContentError\"], [data-testid=\"stException\"]').length"
WIDTH, HEIGHT = 1440, 1100


def ask_in_browser(chromium: str, url: str, question: str, profile: Path, server_log: Path) -> tuple[str, int, bytes]:
    """Open ``url`` in headless Chromium, type ``question`` into the chat input, press Enter and
    wait for the answer's metrics strip. Returns the page text, the number of error boxes and a
    PNG screenshot."""
    from websockets.sync.client import connect

    def fail(exc: Exception) -> AssertionError:
        return AssertionError(f"{exc}\nserver log:\n{server_log.read_text(errors='replace')[-4000:]}")

    devtools_port = free_port()
    browser = subprocess.Popen(
        [chromium, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--no-first-run", "--hide-scrollbars", f"--user-data-dir={profile}",
         "--remote-debugging-address=127.0.0.1", f"--remote-debugging-port={devtools_port}",
         f"--window-size={WIDTH},{HEIGHT}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        targets = wait_for(lambda: [t for t in json.loads(http_get(f"http://127.0.0.1:{devtools_port}/json/list"))
                                    if t.get("type") == "page"], 60, "Chromium's DevTools endpoint")
        with connect(targets[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=30) as ws:
            page = DevTools(ws)
            page.call("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT, deviceScaleFactor=1,
                      mobile=False)
            page.call("Page.navigate", url=url)
            # The first page load starts the server's engine (vLLM start-up) under a spinner.
            try:
                wait_for(lambda: page.eval(APP_STATE) == "notRunning"
                         and page.eval(f"!!{CHAT_BOX} && !{CHAT_BOX}.disabled"), 400,
                         "the chat page with a ready engine", interval=1)
            except TimeoutError as exc:
                raise fail(exc) from None
            page.eval(f"{CHAT_BOX}.focus()")
            page.call("Input.insertText", text=question)
            assert page.eval(f"{CHAT_BOX}.value") == question
            page.call("Input.dispatchKeyEvent", type="keyDown", key="Enter", code="Enter",
                      windowsVirtualKeyCode=13, nativeVirtualKeyCode=13, text="\r")
            page.call("Input.dispatchKeyEvent", type="keyUp", key="Enter", code="Enter",
                      windowsVirtualKeyCode=13, nativeVirtualKeyCode=13)
            try:
                wait_for(lambda: page.eval(APP_STATE) == "notRunning"
                         and ("Reused tokens" in page.eval("document.body.innerText") or page.eval(ERRORS)),
                         300, "the answer", interval=1)
            except TimeoutError as exc:
                raise fail(exc) from None
            time.sleep(1.0)  # let the chart and the table finish drawing
            text = page.eval("document.body.innerText")
            errors = page.eval(ERRORS)
            png = base64.b64decode(page.call("Page.captureScreenshot", format="png")["data"])
        return text, errors, png
    finally:
        stop(browser, group=True)


def test_browser_asks_one_question_and_shows_the_metrics_strip(ui_env, tmp_path):
    chromium = find_chromium()
    if chromium is None:
        pytest.skip("no Chromium binary found: install the Debian packages chromium and chromium-driver")
    port = free_port()
    server_log = tmp_path / "streamlit.log"
    server = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", APP, "--server.port", str(port),
         "--server.address", "127.0.0.1", "--server.headless", "true",
         "--browser.gatherUsageStats", "false", "--server.fileWatcherType", "none"],
        cwd=REPO, env={**os.environ, **ui_env["env"], "PYTHONUNBUFFERED": "1"},
        stdout=server_log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        wait_for(lambda: http_get(f"http://127.0.0.1:{port}/_stcore/health") == "ok", 120, "the streamlit server")
        text, errors, png = ask_in_browser(chromium, f"http://127.0.0.1:{port}/", QUESTION, tmp_path / "chromium",
                                           server_log)
    finally:
        stop(server, group=True)  # the server and its vLLM engine processes (one process group)

    screenshot = tmp_path / "ui_chat.png"
    screenshot.write_bytes(png)
    if os.environ.get("RAGCACHE_UI_SCREENSHOT"):  # keep a copy outside pytest's temp folders
        shutil.copyfile(screenshot, os.environ["RAGCACHE_UI_SCREENSHOT"])
    assert screenshot.is_file() and png_size(png) == (WIDTH, HEIGHT) and len(png) > 30_000, len(png)
    assert errors == 0, text
    assert QUESTION in text
    assert re.search(r"TTFT\s+\d+\.\d{3} s", text), text
    assert re.search(r"Mode\s+blend", text), text
    reused = re.search(r"Reused tokens\s+([\d,]+)", text)
    assert reused and int(reused.group(1).replace(",", "")) > 0, text
    assert re.search(r"Recomputed tokens\s+[\d,]+", text) and "Tier hits" in text, text
    assert "Deploy" not in text, text  # Streamlit's own toolbar is minimal (.streamlit/config.toml)
    assert server.returncode is not None


def test_streamlit_reads_the_apps_config_with_a_minimal_toolbar():
    """`make ui` starts Streamlit in the repository root, where .streamlit/config.toml sets the
    toolbar to minimal: no Deploy button, no developer menu."""
    out = subprocess.run([sys.executable, "-m", "streamlit", "config", "show"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert re.search(r'^toolbarMode = "minimal"$', out.stdout, re.M), out.stdout[:2000]


def test_the_tier_table_shows_a_100_percent_hit_rate_when_every_lookup_hit():
    """The cache panel renders the store's typed stats: five lookups, all served by cpu, read
    "5/5" and a miss row of "0/5" (the self-check's own lookups are never in the stats:
    tests/test_kvstore_accounting.py)."""
    from streamlit.testing.v1 import AppTest

    def page() -> None:
        from ragcache.engine.messages import StoreStats
        from ui import components

        components.cache_table(StoreStats.from_dict({
            "cpu": {"hits": 5, "misses": 0, "lookups": 5, "hit_rate": 1.0, "entries": 3, "occupancy_bytes": 10**6,
                    "capacity_bytes": 4 * 10**9},
            "disk": {"hits": 0, "misses": 5, "lookups": 5, "hit_rate": 0.0, "entries": 3, "occupancy_bytes": 10**6,
                     "capacity_bytes": 20 * 10**9}}))

    at = AppTest.from_function(page, default_timeout=60).run()
    assert not at.exception
    table = at.dataframe[0].value
    assert list(table["tier"]) == ["cpu", "disk", "miss"] and list(table["hits"]) == ["5/5", "0/5", "0/5"]
    assert list(table["hit rate"]) == [1.0, 0.0, 0.0]
