"""Screenshot an MLflow run in headless Chromium: its overview page and its metric charts.

Either point it at a running MLflow server (``--url``, e.g. the one ``make ui`` serves) or let it
start its own on a free loopback port against a sqlite database (``--db``) and an artifact root
(``--artifact-root``); that server is stopped before the script exits. The run is the newest
top-level training run (tag ``diloco.run_id``) of ``--experiment`` (default ``diloco-async``) unless
``--run-id`` names one.

For each page (``overview``: ``#/experiments/<exp>/runs/<run>``; ``model-metrics``: the charts of
every logged metric, ``.../model-metrics``; ``system-metrics``: CPU, memory, network, disk (and GPU)
charts, ``.../system-metrics``; ``artifacts``: ``.../artifacts``; ``learners``: the experiment's
chart view of the run's nested learner runs only, ``train_loss`` of every learner on one chart; ``runs``:
the experiment's runs table in the saved view with eval loss, goodput and tokens as columns) it saves
``<out>/<run_id>-<page>.png`` and, with ``--dump-dom``, the rendered DOM next to it (``.html``);
``--expect NAME`` (repeatable) fails the script unless the overview DOM names the run and every
NAME (a metric, say). Needs Debian's ``chromium`` (``apt-get install chromium``); nothing else
beyond the project's venv.

    .venv/bin/python scripts/mlflow_screenshot.py --db .local/mlflow.db --out .local/screenshots
    .venv/bin/python scripts/mlflow_screenshot.py --url http://127.0.0.1:5000 --run-id <id>

MLflow 3 opens its Assistant side panel on first load when the page's host is ``localhost`` or
``127.0.0.1``; a server this script starts also accepts the host name ``mlflow-ui`` (Chromium maps
it to 127.0.0.1), so its screenshots show the run without that panel. A ``--url`` server that
refuses that host name is loaded under its own address.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

EXPERIMENT = "diloco-async"
ALIAS = "mlflow-ui"  # a host name the MLflow UI does not treat as "local" (no Assistant panel)
PAGES = {"overview": "", "model-metrics": "/model-metrics", "system-metrics": "/system-metrics",
         "artifacts": "/artifacts", "learners": None, "runs": None}
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--hide-scrollbars",
    # draw real frames under virtual time: without it the charts' viewport observers often never
    # fire within the budget and the metric charts stay spinners
    "--run-all-compositor-stages-before-draw",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, host: str | None = None, timeout: float = 10.0) -> bytes:
    req = urllib.request.Request(url, headers={"Host": host} if host else {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return resp.read()


def _api(base: str, path: str, body: dict | None = None) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{base}/api/2.0/mlflow/{path}", data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return json.loads(resp.read() or b"{}")


def _as_uri(location: str) -> str:
    return location if "://" in location else Path(location).resolve().as_uri()


@contextlib.contextmanager
def mlflow_server(db: str, artifact_root: str, port: int = 0, startup_timeout_s: float = 90.0,
                  log_path: Path | None = None, proxy_artifacts: bool = False) -> Iterator[str]:
    """An ``mlflow server`` on 127.0.0.1 (one worker, job execution off) for the sqlite file
    ``db``; yields its base URL and stops the whole process group afterwards. ``artifact_root`` is
    where it keeps artifacts; new experiments get it as their location, or with
    ``proxy_artifacts`` the server's proxy ``mlflow-artifacts:/`` (clients upload through it)."""
    port = port or free_port()
    backend = db if "://" in db else "sqlite:///" + str(Path(db).resolve())
    root = _as_uri(artifact_root)
    if root.startswith("file://"):
        Path(urllib.parse.urlparse(root).path).mkdir(parents=True, exist_ok=True)
    exe = Path(sys.executable).with_name("mlflow")
    default_root = "mlflow-artifacts:/" if proxy_artifacts else root
    cmd = [str(exe) if exe.exists() else "mlflow", "server", "--backend-store-uri", backend,
           "--default-artifact-root", default_root, "--artifacts-destination", root,
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
           "--allowed-hosts", f"{ALIAS}:{port},127.0.0.1:{port},localhost:{port}",
           "--cors-allowed-origins", f"http://{ALIAS}:{port},http://127.0.0.1:{port},http://localhost:{port}"]
    env = dict(os.environ, MLFLOW_SERVER_ENABLE_JOB_EXECUTION="false", MLFLOW_DISABLE_TELEMETRY="true",
               DO_NOT_TRACK="1")
    log = open(log_path, "w+b") if log_path else tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                log.seek(0)
                tail = log.read()[-3000:]
                raise RuntimeError(f"mlflow server exited with {proc.returncode}:\n{tail.decode(errors='replace')}")
            with contextlib.suppress(OSError):
                if _get(f"{base}/health", timeout=2) == b"OK":
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"mlflow server on {base} not healthy after {startup_timeout_s:.0f} s")
            time.sleep(0.3)
        yield base
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        with contextlib.suppress(ProcessLookupError):  # a worker that outlived its parent
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def find_run(base: str, experiment: str, run_id: str | None) -> dict:
    """``{run_id, run_name, experiment_id}`` of ``run_id``, else of the newest top-level run that is a
    training run (tag ``diloco.run_id``), else of the newest top-level run."""
    if run_id:
        info = _api(base, f"runs/get?run_id={urllib.parse.quote(run_id)}")["run"]["info"]
    else:
        exp = _api(base, "experiments/get-by-name?experiment_name=" + urllib.parse.quote(experiment))
        exp_id = exp["experiment"]["experiment_id"]
        runs = _api(base, "runs/search", {"experiment_ids": [exp_id], "max_results": 200,
                                          "order_by": ["attributes.start_time DESC"]}).get("runs", [])
        tags = [{t["key"] for t in r["data"].get("tags", [])} for r in runs]
        top = [r for r, keys in zip(runs, tags, strict=True) if "mlflow.parentRunId" not in keys]
        if not top:
            raise LookupError(f"experiment {experiment!r} has no top-level run")
        # a training run (tagged with its diloco run id) before any other top-level run
        trained = [r for r in top if any(t["key"] == "diloco.run_id" for t in r["data"].get("tags", []))]
        info = (trained or top)[0]["info"]
    return {"run_id": info["run_id"], "run_name": info.get("run_name", ""), "experiment_id": info["experiment_id"]}


def find_chromium(explicit: str | None = None) -> str:
    for name in ([explicit] if explicit else ["chromium", "chromium-browser", "google-chrome"]):
        path = shutil.which(name) if name else None
        if path:
            return path
    raise FileNotFoundError("chromium not found (Debian: apt-get install -y --no-install-recommends chromium)")


def chromium(binary: str, url: str, mode: list[str], window: str, budget_ms: int, resolver: str | None,
             timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """One headless Chromium run with a fresh profile; ``mode`` holds ``--screenshot=PATH`` and/or
    ``--dump-dom`` (the DOM comes back on stdout)."""
    with tempfile.TemporaryDirectory(prefix="chromium-") as profile:
        cmd = [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={window}",
               f"--virtual-time-budget={budget_ms}", *mode]
        if resolver:
            cmd.append(f"--host-resolver-rules={resolver}")
        return subprocess.run([*cmd, url], capture_output=True, timeout=timeout_s,
                              env=dict(os.environ, HOME=profile), start_new_session=True)


def page_base(base: str) -> tuple[str, str | None]:
    """The base URL Chromium loads and its host-resolver rule: ``http://mlflow-ui:<port>`` when the
    server is on this machine's loopback and accepts that host name and origin (a server this
    script starts does), else ``base`` itself."""
    parsed = urllib.parse.urlparse(base)
    if parsed.hostname in ("127.0.0.1", "localhost") and parsed.port:
        alias = f"{ALIAS}:{parsed.port}"
        req = urllib.request.Request(
            f"{base}/ajax-api/2.0/mlflow/experiments/search", data=b'{"max_results": 1}', method="POST",
            headers={"Host": alias, "Origin": f"{parsed.scheme}://{alias}", "Content-Type": "application/json"})
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(req, timeout=10) as resp:
                if resp.status == 200:
                    return f"{parsed.scheme}://{alias}{parsed.path.rstrip('/')}", f"MAP {ALIAS} 127.0.0.1"
    return base.rstrip("/"), None


def page_url(ui: str, run: dict, page: str) -> str:
    """The UI address of ``page`` (a key of :data:`PAGES`) for ``run``; ``learners`` and ``runs`` are
    the paths the MLflow sink links from the run's description (``diloco_async.flows.tracking.learners_chart_path``,
    ``diloco_async.flows.mlflow_views.runs_table_path``: the experiment's runs table with the training columns)."""
    if page == "learners":
        from diloco_async.flows.tracking import learners_chart_path

        return ui + learners_chart_path(run["experiment_id"], run["run_id"])
    if page == "runs":
        from diloco_async.flows.mlflow_views import runs_table_path

        return ui + runs_table_path(run["experiment_id"])
    return f"{ui}/#/experiments/{run['experiment_id']}/runs/{run['run_id']}{PAGES[page]}"


def _rendered(page: str, run: dict, html: str) -> bool:
    """Whether the DOM shows the page drawn: the run's name (the learners' page names its learner
    runs instead), and on the chart pages plotted data."""
    if page != "learners" and run["run_name"] and run["run_name"] not in html:
        return False
    if page == "runs":  # the table drawn with the view's columns
        return 'col-id="metrics.`' in html and 'role="gridcell"' in html
    return page not in ("model-metrics", "system-metrics", "learners") or "scatterlayer" in html


class Browser(NamedTuple):
    """How Chromium renders a page: the window size (``"width,height"``, pixels), the virtual-time
    budget of the first try (ms; a retry gets a multiple of it), how many tries a page gets
    (``attempts``), whether every page's DOM is kept (``dump_dom``), and the binary (None: found)."""

    window: str = "1600,1200"
    budget_ms: int = 20000
    attempts: int = 3
    dump_dom: bool = False
    chromium_path: str | None = None


def screenshot_run(base: str, out: Path, *, experiment: str = EXPERIMENT, run_id: str | None = None,
                   pages: tuple[str, ...] = ("overview", "model-metrics"), expect: tuple[str, ...] = (),
                   browser: Browser | None = None) -> dict:
    """Screenshot (and optionally dump) the pages of one run; returns what was written. A page whose
    DOM shows it still loading is loaded again (fresh profile, longer budget), ``attempts`` at most."""
    browser = browser or Browser()
    window, budget_ms, attempts, dump_dom = browser.window, browser.budget_ms, browser.attempts, browser.dump_dom
    binary = find_chromium(browser.chromium_path)
    run = find_run(base, experiment, run_id)
    ui, resolver = page_base(base)
    out.mkdir(parents=True, exist_ok=True)
    result = {**run, "server": base, "loaded_as": ui, "screenshots": {}, "dom": {}, "urls": {}, "attempts": {}}
    for page in pages:
        url = page_url(ui, run, page)
        result["urls"][page] = url
        png = out / f"{run['run_id']}-{page}.png"
        for attempt in range(1, attempts + 1):
            png.unlink(missing_ok=True)
            # one Chromium run renders the page once and writes both the screenshot and the DOM
            proc = chromium(binary, url, [f"--screenshot={png}", "--dump-dom"], window, budget_ms * attempt, resolver)
            if proc.returncode != 0 or not png.exists() or png.stat().st_size == 0:
                raise RuntimeError(f"chromium wrote no screenshot of {url} (exit {proc.returncode}):\n"
                                   + proc.stderr.decode(errors="replace")[-3000:])
            if _rendered(page, run, proc.stdout.decode(errors="replace")):
                break
        result["attempts"][page] = attempt
        result["screenshots"][page] = str(png)
        if dump_dom or (expect and page == "overview"):
            html = out / f"{run['run_id']}-{page}.html"
            html.write_bytes(proc.stdout)
            result["dom"][page] = str(html)
    if expect:
        if "overview" not in result["dom"]:
            raise ValueError("--expect needs the overview page")
        text = Path(result["dom"]["overview"]).read_text(errors="replace")
        missing = [name for name in (run["run_name"], *expect) if name not in text]
        result["missing"] = missing
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--url", help="a running MLflow server, e.g. http://127.0.0.1:5000 (make ui)")
    src.add_argument("--db", default=".local/mlflow.db",
                     help="sqlite file (or backend store URI) for a server this script starts (default %(default)s)")
    ap.add_argument("--artifact-root", default=".local/store/mlartifacts",
                    help="artifact root of that server's new experiments (default %(default)s); runs "
                    "keep the artifact location they recorded")
    ap.add_argument("--experiment", default=EXPERIMENT)
    ap.add_argument("--run-id", help="default: the newest top-level training run of the experiment")
    ap.add_argument("--out", default=".local/screenshots", help="output folder (default %(default)s)")
    ap.add_argument("--pages", default="overview,model-metrics",
                    help=f"comma-separated, of {', '.join(PAGES)} (default %(default)s)")
    ap.add_argument("--window-size", default="1600,1200")
    ap.add_argument("--budget-ms", type=int, default=20000, help="Chromium --virtual-time-budget")
    ap.add_argument("--dump-dom", action="store_true", help="also save each page's rendered DOM")
    ap.add_argument("--expect", action="append", default=[],
                    help="fail unless the overview page shows this text (repeatable), e.g. eval/loss")
    ap.add_argument("--chromium", help="browser binary (default: chromium on PATH)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    pages = tuple(p.strip() for p in args.pages.split(",") if p.strip())
    unknown = [p for p in pages if p not in PAGES]
    if unknown:
        ap.error(f"unknown page(s) {unknown}; allowed: {', '.join(PAGES)}")
    if args.expect and "overview" not in pages:
        pages = ("overview", *pages)

    def shoot(base: str) -> dict:
        return screenshot_run(base, Path(args.out), experiment=args.experiment, run_id=args.run_id, pages=pages,
                              expect=tuple(args.expect), browser=Browser(args.window_size, args.budget_ms,
                                                                         dump_dom=args.dump_dom,
                                                                         chromium_path=args.chromium))

    try:
        if args.url:
            result = shoot(args.url.rstrip("/"))
        else:
            if "://" not in args.db and not Path(args.db).exists():
                ap.error(f"no MLflow database at {args.db} (run `make run` first, or pass --url)")
            with mlflow_server(args.db, args.artifact_root) as base:
                result = shoot(base)
    except (OSError, RuntimeError, LookupError, ValueError, subprocess.TimeoutExpired) as err:
        print(f"mlflow_screenshot: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"run {result['run_name']} ({result['run_id']}), experiment {result['experiment_id']}, "
              f"server {result['server']}")
        for page, path in result["screenshots"].items():
            print(f"  {page:14s} {path}   <- {result['urls'][page]}")
        for page, path in result["dom"].items():
            print(f"  {page + ' DOM':14s} {path}")
    if result.get("missing"):
        print(f"mlflow_screenshot: not on the run page: {result['missing']}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
