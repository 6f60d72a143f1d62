"""``diloco-async alerts``: a real Prefect server's automation notifies a real webhook when the real
`train` and `resume` flows fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from aiohttp import web
from test_client import serving

from polling import wait_until


def _receiver(seen: list[dict]) -> web.Application:
    async def hook(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.Response(text="ok")

    app = web.Application()
    app.add_routes([web.post("/hook", hook)])
    return app


def _alerts_command(api_url: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_HOME": os.environ.get("PREFECT_HOME", ".local/prefect")}
    return subprocess.run([sys.executable, "-m", "diloco_async.flows.cli", "alerts", *args], env=env,
                          capture_output=True, text=True, timeout=180)


def test_a_failed_train_or_resume_run_notifies_the_webhook(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.settings import get_current_settings

    from diloco_async.flows.alerts import DEFAULT_AUTOMATION_NAME
    from diloco_async.flows.train import resume, train

    api_url = get_current_settings().api.url
    seen: list[dict] = []
    try:
        found = _fail_runs_and_wait(api_url, seen, tmp_path, train, resume)
    finally:  # the server is the session's: leave no automation behind for the other tests
        with get_client(sync_client=True) as client:
            for automation in client.read_automations_by_name(DEFAULT_AUTOMATION_NAME):
                client.delete_automation(automation.id)
    for flow, text in found.items():
        assert f"of flow {flow} entered Failed" in text, text
        assert text.startswith(f"diloco-async: {flow} run "), text


def _fail_runs_and_wait(api_url: str, seen: list[dict], tmp_path, train, resume) -> dict[str, str]:
    from prefect.client.orchestration import get_client

    from diloco_async.flows.alerts import DEFAULT_AUTOMATION_NAME

    with serving(_receiver(seen)) as url:
        for verb in ("created", "updated"):  # the second call changes nothing but says so
            done = _alerts_command(api_url, "--webhook", f"{url}/hook")
            assert done.returncode == 0, done.stderr
            assert done.stdout.startswith(f"{verb} automation"), done.stdout
        with get_client(sync_client=True) as client:
            assert len(client.read_automations_by_name(DEFAULT_AUTOMATION_NAME)) == 1

        # the real flows, failing at their first step: a recipe value out of range, a store without the run
        failed_train = train(config="configs/default.toml", overrides=["learners.count=0"], return_state=True)
        failed_resume = resume(checkpoint_url=f"file://{tmp_path}/store/no-such-run", return_state=True)
        assert failed_train.is_failed() and failed_resume.is_failed()
        runs = {"train": str(failed_train.state_details.flow_run_id),
                "resume": str(failed_resume.state_details.flow_run_id)}

        def notified() -> dict[str, str] | None:
            texts = [m.get("text", "") for m in list(seen)]
            found = {flow: next((t for t in texts if run_id in t), None) for flow, run_id in runs.items()}
            return found if all(found.values()) else None

        # Prefect's event pipeline (client -> server -> triggers -> actions) is asynchronous
        return wait_until(notified, timeout_s=180, what=f"a notification for each of {runs}", interval_s=0.5)


def test_alerts_refuses_what_cannot_work(tmp_path):
    bad_url = _alerts_command("http://127.0.0.1:9/api", "--webhook", "ftp://example.invalid/hook")
    assert bad_url.returncode == 2 and "http:// or https://" in bad_url.stderr, bad_url.stderr
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    no_server = subprocess.run([sys.executable, "-m", "diloco_async.flows.cli", "alerts", "--webhook", "http://127.0.0.1:9/h"],
                               env={**env, "PREFECT_HOME": str(tmp_path / "prefect")}, capture_output=True,
                               text=True, timeout=180)
    assert no_server.returncode == 2 and "PREFECT_API_URL is not set" in no_server.stderr, no_server.stderr
    no_body = _alerts_command("http://127.0.0.1:9/api", "--webhook", "http://127.0.0.1:9/h",
                              "--payload", json.dumps({"text": "{{subject}}"}))
    assert no_body.returncode == 2 and "{{body}}" in no_body.stderr, no_body.stderr
