"""Network mode ``tls`` with mutual TLS, and proxies, on the real processes (issue 43): a
synchronizer serving HTTPS/WSS and learners that train through it; every impostor refused and
counted; a learner that reaches the synchronizer only through a local forwarding proxy trains;
bad TLS files refused before anything starts (unit checks: tests/unit/test_network_modes.py)."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import signal
from pathlib import Path

import aiohttp
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from forward_proxy import ForwardProxy
from resolved_config import resolved_args
from tiny_recipe import tiny_recipe_text

from diloco_async.flows.certs import issue, make_run_certificates
from diloco_async.protocol.auth import learner_token
from diloco_async.protocol.client import LEARNER_TOKEN_ENV, TOKEN_ENV, ProtocolError, SyncClient, call_blocking
from diloco_async.protocol.tls import CA_ENV, CERT_ENV, KEY_ENV, client_context, learner_uri
from diloco_async.runtime.procs import LocalProcessLauncher, wait_for_ready_file

from polling import wait_until

pytestmark = pytest.mark.timeout(420)

SECRET = "tls-processes-run-secret-0123456789abcdef"


def run_certs(folder: Path) -> dict:
    """The run's certificates, another CA's, and an expired certificate of learner-0 from the run CA."""
    paths = make_run_certificates(folder, ["127.0.0.1"], ["learner-0", "learner-1"], days=1)
    paths["other"] = make_run_certificates(folder / "other", ["127.0.0.1"], ["learner-0"], days=1)
    ca = x509.load_pem_x509_certificate(paths["ca"].read_bytes())
    ca_key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), None)
    now = dt.datetime.now(dt.UTC)
    cert, key = issue(ca, ca_key, "learner-0", [learner_uri("learner-0")], now - dt.timedelta(days=3),
                      now - dt.timedelta(days=1), "client")
    (folder / "expired.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (folder / "expired.key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return paths


def network_lines(paths: dict, mutual: bool = True, **change: str) -> str:
    fields = {"mode": "tls", "server_cert": paths["server_cert"], "server_key": paths["server_key"], "ca": paths["ca"],
              **({"client_ca": paths["ca"], "client_certs": paths["client_certs"]} if mutual else {}), **change}
    return "[network]\n" + "".join(f'{k} = "{v}"\n' for k, v in fields.items())


def start_synchronizer(tmp_path: Path, learners: int, network: str, run_id: str, wall_s: float = 600):
    text = tiny_recipe_text(learners, run=f'store = "file://{tmp_path}/store"', budget=f"wall_s = {wall_s}")
    recipe = tmp_path / "tls.toml"
    recipe.write_text(text + network)
    launcher = LocalProcessLauncher(tmp_path / "logs")
    ready = tmp_path / "ready.json"
    sync = launcher.start("synchronizer", ["-m", "diloco_async.server", *resolved_args(recipe, [], tmp_path),
                                           "--run-id", run_id, "--ready-file", str(ready)], {TOKEN_ENV: SECRET})
    return launcher, sync, ready


def start_learner(launcher, tmp_path: Path, run_id: str, i: int, url: str, tls_env: dict[str, str],
                  name: str | None = None):
    lid = f"learner-{i}"
    env = {LEARNER_TOKEN_ENV: learner_token(SECRET, run_id, lid), **tls_env}
    return launcher.start(name or lid, ["-m", "diloco_async.learner", "--learner-id", lid, "--index", str(i),
                                        "--sync-url", url, "--store", f"file://{tmp_path}/store"], env)


def learner_tls(paths: dict, i: int) -> dict[str, str]:
    crt = paths["client_certs"] / f"learner-{i}.crt"
    return {CA_ENV: str(paths["ca"]), CERT_ENV: str(crt), KEY_ENV: str(crt.with_suffix(".key"))}


async def probe_impostors(url: str, paths: dict, run_id: str) -> dict[str, str]:
    """Every way in that must be refused; returns what each got (all must be refusals)."""
    ca, clients, other = str(paths["ca"]), paths["client_certs"], paths["other"]
    tok = {i: learner_token(SECRET, run_id, f"learner-{i}") for i in (0, 1)}
    join1 = {"learner_id": "learner-1", "incarnation": 9}
    seen: dict[str, str] = {}

    async def refused(name: str, ctx, token: str, body: dict, status: int | None = None, reason: str = "") -> None:
        async with SyncClient(url, token, ssl_context=ctx, request_timeout_s=20) as client:
            try:
                answer = await client.join(body)
            except ProtocolError as err:
                assert status is not None and f"HTTP {status}" in str(err) and reason in str(err), (name, err)
                seen[name] = str(err)
                return
            except aiohttp.ClientError as err:  # the TLS layer refused it
                assert status is None, (name, err)
                seen[name] = f"{type(err).__name__}: {err}"
                return
            raise AssertionError(f"{name} was let in: {answer}")

    # 1. plain HTTP against the HTTPS port
    with pytest.raises(aiohttp.ClientError):
        async with aiohttp.ClientSession() as s, s.get(url.replace("https://", "http://") + "/status") as r:
            await r.read()
    # 2. a learner certificate of another CA (learner-0's name, learner-0's token)
    await refused("other_ca", client_context(ca, str(other["client_certs"] / "learner-0.crt"),
                                             str(other["client_certs"] / "learner-0.key")), tok[0],
                  {"learner_id": "learner-0"})
    # 3. learner-0's certificate speaking as learner-1 with learner-1's own token
    ctx0 = client_context(ca, str(clients / "learner-0.crt"), str(clients / "learner-0.key"))
    await refused("a_as_b", ctx0, tok[1], join1, 403, "certificate_identity")
    async with SyncClient(url, tok[1], ssl_context=ctx0) as client:
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            async with client.push("learner-1"):
                pass
        assert err.value.status == 403
    # 4. an expired certificate of the run's own CA
    await refused("expired", client_context(ca, str(paths["expired_crt"]), str(paths["expired_key"])), tok[0],
                  {"learner_id": "learner-0"})
    # 5. no certificate at all (the token alone is not enough), and the operator's routes need its certificate
    await refused("no_certificate", client_context(ca), tok[1], join1, 401, "no_client_certificate")
    with pytest.raises(ProtocolError, match="certificate_identity"):
        async with SyncClient(url, SECRET, ssl_context=ctx0) as client:
            await client.metrics(0)
    # /status stays open over TLS without a certificate
    async with SyncClient(url, None, ssl_context=client_context(ca)) as client:
        assert (await client.health())["ok"]
    return seen


def test_an_mtls_run_trains_and_refuses_every_impostor(tmp_path):
    paths = run_certs(tmp_path / "certs")
    paths["expired_crt"], paths["expired_key"] = tmp_path / "certs" / "expired.crt", tmp_path / "certs" / "expired.key"
    launcher, sync, ready = start_synchronizer(tmp_path, 2, network_lines(paths), "mtls")
    learners = []
    operator = client_context(str(paths["ca"]), str(paths["client_certs"] / "operator.crt"),
                              str(paths["client_certs"] / "operator.key"))
    try:
        url = wait_for_ready_file(ready, sync, timeout_s=90)["url"]
        assert url.startswith("https://127.0.0.1:")
        learners = [start_learner(launcher, tmp_path, "mtls", i, url, learner_tls(paths, i)) for i in (0, 1)]
        seen = asyncio.run(probe_impostors(url, paths, "mtls"))
        assert set(seen) == {"other_ca", "a_as_b", "expired", "no_certificate"}, seen

        def status() -> dict:
            return call_blocking(url, None, "status", ssl_context=operator)

        def merged_with_both() -> dict | None:
            st = status()
            live = [st["learners"].get(f"learner-{i}", {}).get("live") for i in (0, 1)]
            return st if st["merges"] >= 8 and all(live) else None

        st = wait_until(merged_with_both, 240, "eight merges with both mTLS learners live", interval_s=0.5)
        assert {st["learners"][f"learner-{i}"]["network_mode"] for i in (0, 1)} == {"tls"}
        edge = st["rejected_by_reason"]
        for reason in ("tls_not_tls", "tls_unknown_ca", "tls_certificate_expired", "no_client_certificate"):
            assert edge.get(reason, 0) >= 1, (reason, edge)
        assert edge.get("certificate_identity", 0) >= 3, edge  # join and push as learner-1; metrics as operator
        assert "learner-1" not in [lid for lid, i in st["learners"].items() if i["incarnation"] == 9]
        assert st["refused_by_mode"]["tls"] >= sum(edge.get(r, 0) for r in (
            "tls_not_tls", "tls_unknown_ca", "tls_certificate_expired", "no_client_certificate"))
        def losses() -> list[list[float]]:
            points, since = [], 0
            while True:  # every page of the metric stream, over HTTPS with the operator's certificate
                page = call_blocking(url, SECRET, "metrics", since, ssl_context=operator)
                points += page["metrics"]
                since = page["next"]
                if since >= page["total"]:
                    return [[p["value"] for p in points if p["key"] == f"learner/learner-{i}/train_loss"]
                            for i in (0, 1)]

        # each learner's loss falls (ln 256 = 5.5 at first), however late the second one joined
        wait_until(lambda: all(len(ls) >= 3 and ls[-1] < ls[0] - 0.5 for ls in losses()), 240,
                   "three train_loss points per learner, falling by 0.5", interval_s=0.5)
        # a learner started with the expired certificate stops before it starts, naming the expiry
        expired = start_learner(launcher, tmp_path, "mtls", 0, url, {
            CA_ENV: str(paths["ca"]), CERT_ENV: str(paths["expired_crt"]), KEY_ENV: str(paths["expired_key"])},
            name="expired-learner")
        assert expired.proc.wait(timeout=120) == 2
        why = (tmp_path / "logs" / "expired-learner.log").read_text()
        assert f"certificate {paths['expired_crt']} expired at" in why, why
        os.kill(sync.pid, signal.SIGTERM)
        assert sync.proc.wait(timeout=120) == 0
        for handle in learners:
            assert handle.proc.wait(timeout=60) == 0
    finally:
        for handle in [*learners, sync]:
            handle.terminate(grace_s=5)
    log = (tmp_path / "logs" / "synchronizer.log").read_text()
    assert "certificate has expired" in log  # the refused handshake, logged with OpenSSL's reason


@pytest.mark.parametrize("mode", ["tls", "direct"])
def test_a_learner_behind_a_forwarding_proxy_trains(tmp_path, mode):
    """HTTPS_PROXY (a CONNECT tunnel) for tls, HTTP_PROXY (absolute-form requests and the WebSocket
    upgrade forwarded) for direct: the learner's only way to the synchronizer is the proxy, so
    when the proxy goes the synchronizer loses the learner."""
    paths = run_certs(tmp_path / "certs")
    network = network_lines(paths, mutual=False) if mode == "tls" else ""
    launcher, sync, ready = start_synchronizer(tmp_path, 1, network, f"proxy-{mode}")
    learner = None
    proxy = ForwardProxy().__enter__()
    try:
        url = wait_for_ready_file(ready, sync, timeout_s=90)["url"]
        port = int(url.rsplit(":", 1)[1])
        env = {"HTTPS_PROXY": proxy.url, "HTTP_PROXY": proxy.url, "NO_PROXY": "", "no_proxy": ""}
        tls_env = {CA_ENV: str(paths["ca"])} if mode == "tls" else {}
        learner = start_learner(launcher, tmp_path, f"proxy-{mode}", 0, url, {**env, **tls_env})
        operator = client_context(str(paths["ca"])) if mode == "tls" else None

        def status() -> dict:
            return call_blocking(url, None, "status", ssl_context=operator)

        st = wait_until(lambda: (s := status())["merges"] >= 4 and s, 240, "four merges through the proxy",
                        interval_s=0.5)
        assert st["learners"]["learner-0"]["network_mode"] == mode
        assert proxy.connections[f"127.0.0.1:{port}"] >= 1, proxy.connections
        assert proxy.kinds == {("CONNECT" if mode == "tls" else "forward"): sum(proxy.kinds.values())}
        proxy.__exit__()  # the proxy goes: the learner has no other way in
        wait_until(lambda: not status()["learners"]["learner-0"]["live"], 120, "the learner lost without its proxy",
                   interval_s=0.5)
    finally:
        proxy.__exit__()
        for handle in [h for h in (learner, sync) if h is not None]:
            handle.terminate(grace_s=5)


@pytest.mark.parametrize("case", ["no_certificate", "key_mismatch", "ca_does_not_verify"])
def test_bad_tls_files_are_refused_before_anything_starts(tmp_path, case):
    paths = run_certs(tmp_path / "certs")
    network = {
        "no_certificate": '[network]\nmode = "tls"\n',
        "key_mismatch": network_lines(paths, server_key=paths["client_certs"] / "learner-0.key"),
        "ca_does_not_verify": network_lines(paths, ca=paths["other"]["ca"]),
    }[case]
    want = {
        "no_certificate": "needs the synchronizer's certificate and key: set network.server_cert",
        "key_mismatch": f"private key {paths['client_certs'] / 'learner-0.key'} does not match certificate "
                        f"{paths['server_cert']}",
        "ca_does_not_verify": f"CA bundle {paths['other']['ca']} does not verify certificate {paths['server_cert']}",
    }[case]
    _, sync, ready = start_synchronizer(tmp_path, 2, network, "bad")
    assert sync.proc.wait(timeout=120) == 2
    assert want in (tmp_path / "logs" / "synchronizer.log").read_text()
    assert not ready.exists() and not (tmp_path / "store" / "bad").exists()  # no lease, nothing published
    from diloco_async.config.schema import load_config
    from diloco_async.run import RunProcesses

    cfg = load_config(tmp_path / "tls.toml", [f"run.workdir='{tmp_path}/runs'"])
    with pytest.raises(ValueError, match="network|certificate"):
        RunProcesses(cfg, run_id="bad2")
    assert not (tmp_path / "runs").exists()  # nothing started, not even the run's folder
