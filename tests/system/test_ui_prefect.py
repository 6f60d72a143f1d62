"""The Prefect UI and the MLflow UI of a training run, linked both ways and showing a stop (issue 46
items 3-4), in headless Chromium driven over the DevTools protocol (tests/browser.py): a real
``prefect server start`` serving its UI, a real ``mlflow server``, ``diloco-async train`` as a
command reporting to both. Every check reads the rendered DOM.

* A finished run: the MLflow run's tag ``prefect.flow_run_url`` opens the flow run's page; its
  Artifacts tab lists the run's markdown artifact; the artifact's page shows the summary table and
  the MLflow run's link; clicking that link opens the MLflow run's page (its name, id, metrics).
* A run stopped by Ctrl-C: the flow run's page shows the state ``Stopped``; the MLflow run's page
  shows the status Killed and the tag ``diloco.stopped``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
from browser import Chromium, Page, find_chromium
from test_stop import _interrupt_training

from benchmarks.ctrl_c import command_env, train_overrides
from diloco_async.flows.run_end import STOPPED_STATE_NAME

from polling import wait_until

pytestmark = [pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CHROMIUM = find_chromium()
#: the MLflow run page's field "Run ID" and its tags (each an element titled with its key)
RUN_ID_FIELD = '[data-testid="key-value-Run ID"]'
TAGS = '[data-component-type="tag"][title]'


class Servers(NamedTuple):
    """The UI servers of the module: Prefect's API (``prefect_api``, ends in ``/api``) and UI
    (``prefect_ui``), MLflow's tracking server and UI (``mlflow``), and a folder for their runs."""

    prefect_api: str
    prefect_ui: str
    mlflow: str
    home: Path


def _load_screenshot_script():
    spec = importlib.util.spec_from_file_location("mlflow_screenshot", ROOT / "scripts" / "mlflow_screenshot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def prefect_ui_server(home: Path, port: int) -> Iterator[str]:
    """``prefect server start`` with its UI on 127.0.0.1:``port``, database in ``home``; yields its
    base URL once the API is healthy and the UI's page is served, stops its process group after.

    ``PREFECT_SERVER_API_PORT`` is the port too: the UI asks the API at the address of the server's
    settings (``/ui-settings``), which ``--port`` alone leaves at the default 4200."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(home), PREFECT_SERVER_API_PORT=str(port), PREFECT_SERVER_UI_ENABLED="true",
               PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1")
    base = f"http://127.0.0.1:{port}"
    with open(home / "prefect-server.log", "wb") as log:
        proc = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=home,
                                start_new_session=True)
    try:
        def healthy() -> bool:
            assert proc.poll() is None, (home / "prefect-server.log").read_text()[-3000:]
            with contextlib.suppress(OSError):
                return urllib.request.urlopen(f"{base}/api/health", timeout=2).read().strip() == b"true"
            return False
        wait_until(healthy, 180, "the Prefect server's /api/health", interval_s=0.3)
        page = urllib.request.urlopen(base, timeout=10).read().decode()
        assert "<title>Prefect Server</title>" in page, f"the Prefect server does not serve its UI:\n{page[:500]}"
        settings = json.loads(urllib.request.urlopen(f"{base}/ui-settings", timeout=10).read())
        assert settings["api_url"] == f"{base}/api", settings
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="module")
def servers(tmp_path_factory) -> Iterator[Servers]:
    if CHROMIUM is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)")
    home = tmp_path_factory.mktemp("ui-servers")
    shot = _load_screenshot_script()
    with prefect_ui_server(home, shot.free_port()) as prefect_ui, \
            shot.mlflow_server(f"sqlite:///{home}/mlflow.db", str(home / "mlartifacts"),
                               log_path=home / "mlflow-server.log") as mlflow:
        yield Servers(f"{prefect_ui}/api", prefect_ui, mlflow, home)


def _mlflow_run(base: str, run_id: str) -> tuple[dict, dict[str, str]]:
    """(run info, tags) of MLflow run ``run_id`` from the tracking server's REST API."""
    run = json.loads(urllib.request.urlopen(f"{base}/api/2.0/mlflow/runs/get?run_id={run_id}", timeout=30).read())
    return run["run"]["info"], {t["key"]: t["value"] for t in run["run"]["data"].get("tags", [])}


def _js(value: str) -> str:
    return json.dumps(value)


async def _open_flow_run(browser: Chromium, url: str, state: str) -> Page:
    """The Prefect UI's page of a flow run, once its state badge shows ``state`` (the run's final one)."""
    page = await browser.open(url)
    shown = await page.wait_for("document.querySelector('.state-badge')?.innerText.trim()", "the flow run's state")
    if shown != state:  # the page polls the flow run every 5 s; a final state arrives in one poll
        await page.wait_for(f"document.querySelector('.state-badge')?.innerText.trim() === {_js(state)}",
                            f"the state {state!r} (the page showed {shown!r})")
    return page


async def _mlflow_run_page(page: Page, run_id: str) -> tuple[dict[str, str], dict[str, str]]:
    """What the MLflow UI's run page shows once it has drawn the run, read from the DOM: its ``About
    this run`` fields (``Status``, ``Run ID``, ...) and its tags (each drawn as ``key: value``)."""
    await page.wait_for(f"document.querySelector('{RUN_ID_FIELD}')?.innerText.includes({_js(run_id)})"
                        f" && document.querySelectorAll('{TAGS}').length > 0", f"the MLflow run page of {run_id}")
    fields = await page.evaluate("""Object.fromEntries([...document.querySelectorAll('[data-testid^="key-value-"]')]
        .map(el => [el.dataset.testid.slice('key-value-'.length),
                    el.innerText.split('\\n').slice(1).join(' ').trim()]))""")
    tags = await page.evaluate(f"""Object.fromEntries([...document.querySelectorAll('{TAGS}')]
        .filter(el => el.innerText.startsWith(el.title))
        .map(el => [el.title, el.innerText.slice(el.title.length).replace(/^\\s*:\\s*/, '').trim()]))""")
    return fields, tags


async def _artifact_table(page: Page, key: str) -> dict[str, str]:
    """From a flow run's page: its Artifacts tab, where the one artifact's card names ``key`` and
    the type markdown, then the artifact's page, where the markdown is drawn; returns its summary
    table (figure: value), read from the DOM, and leaves the page there."""
    card = "#artifacts-content a[href*='/artifacts/artifact/']"
    titles = await page.click_until("#artifacts", f"[...document.querySelectorAll({_js(card)})].map(a => a.innerText)",
                                    "the flow run's artifact cards")
    assert len(titles) == 1 and key in titles[0] and "markdown" in titles[0].lower(), titles
    rows = await page.click_until(card, """(() => { const rows = [...document.querySelectorAll(
        '.markdown-renderer__table tr')].map(tr => [...tr.children].map(c => c.innerText.trim()));
        return rows.length > 1 ? rows : null; })()""", "the artifact's summary table")
    assert rows[0] == ["figure", "value"] and all(len(row) == 2 for row in rows), rows
    return dict(rows[1:])


def _train(servers: Servers, tmp: Path) -> dict:
    """``diloco-async train`` of the small recipe to a budget of 60k tokens, reporting to the module's
    Prefect and MLflow servers; returns the summary line it prints last."""
    overrides = [*train_overrides(tmp), "--set", "budget.tokens=60000",
                 "--set", f"tracking.mlflow_uri={servers.mlflow}"]
    env = command_env(tmp / "prefect", servers.prefect_api)
    proc = subprocess.run([sys.executable, "-m", "diloco_async.flows.cli", "train", *overrides], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


async def test_the_flow_runs_artifact_in_the_prefect_ui_links_the_mlflow_run(servers, tmp_path):
    summary = await asyncio.to_thread(_train, servers, tmp_path)
    info, tags = _mlflow_run(servers.mlflow, summary["mlflow_run_id"])
    run_url = f"{servers.mlflow}/#/experiments/{info['experiment_id']}/runs/{info['run_id']}"
    # MLflow -> Prefect: the run's tag is the flow run's page on this server
    assert tags["prefect.flow_run_url"].startswith(servers.prefect_ui + "/")
    assert tags["prefect.flow_run_url"].endswith(tags["prefect.flow_run_id"])
    async with Chromium(CHROMIUM) as browser:
        page = await _open_flow_run(browser, tags["prefect.flow_run_url"], "Completed")
        table = await _artifact_table(page, f"diloco-run-{summary['run_id']}")
        assert table["merges"] == str(summary["merges"]) and table["MLflow run"] == info["run_id"], table
        assert table["stop reason"].startswith("token budget"), table
        assert table["eval loss, final (nats/token)"] == f"{summary['eval_loss_final']:.4f}", table
        links = await page.evaluate("[...document.querySelectorAll('.markdown-renderer a')]"
                                    ".map(a => [a.getAttribute('href'), a.innerText.trim()])")
        assert [run_url, run_url] in links, f"no link to {run_url} on the artifact's page: {links}"
        # follow it: a click opens the MLflow run's page in a tab of its own (target=_blank)
        await page.click(f".markdown-renderer a[href={_js(run_url)}]")
        mlflow_page = await browser.tab_opened(run_url)
        shown, shown_tags = await _mlflow_run_page(mlflow_page, info["run_id"])
        text = await mlflow_page.text()
    assert shown["Run ID"] == info["run_id"] and shown["Status"] == "Finished", shown
    assert shown_tags["prefect.flow_run_id"] == tags["prefect.flow_run_id"], shown_tags
    assert info["run_name"] in text and "eval/loss" in text and "goodput/compute" in text, text[:3000]


async def test_a_run_stopped_by_ctrl_c_shows_stopped_in_the_prefect_and_the_mlflow_ui(servers, tmp_path):
    env = command_env(tmp_path / "prefect", servers.prefect_api)
    text, _before, _seen, code = await asyncio.to_thread(
        _interrupt_training, tmp_path, env, (f"tracking.mlflow_uri={servers.mlflow}",))
    assert code == 130, text[-3000:]
    mlflow_run_id = json.loads([line for line in text.splitlines() if line.startswith("{")][-1])["mlflow_run_id"]
    info, tags = _mlflow_run(servers.mlflow, mlflow_run_id)
    async with Chromium(CHROMIUM) as browser:
        page = await _open_flow_run(browser, tags["prefect.flow_run_url"], STOPPED_STATE_NAME)
        badge = await page.evaluate("document.querySelector('.state-badge').className")
        table = await _artifact_table(page, f"diloco-run-{tags['diloco.run_id']}")  # the summary says so too
        await page.goto(f"{servers.mlflow}/#/experiments/{info['experiment_id']}/runs/{info['run_id']}")
        shown, shown_tags = await _mlflow_run_page(page, info["run_id"])
    assert "state--completed" in badge, badge  # a Completed state named Stopped (diloco_async/flows/run_end.py)
    assert table["stop reason"] == "signal SIGINT", table
    assert table["eval loss, final (nats/token)"] == "not evaluated (stopped by a signal)", table
    assert shown["Status"] == "Killed", shown
    assert shown_tags["diloco.stopped"] == "signal SIGINT", shown_tags
