"""Network modes (issue 43): the ``[network]`` config, certificate identities, the checks of TLS
files before anything starts, and ``diloco-async certs`` (the processes are
tests/system/test_tls_processes.py's)."""

from __future__ import annotations

import datetime as dt
import os
import ssl
import stat

import pytest
from cryptography.hazmat.primitives import serialization

from diloco_async.config.schema import config_hash, load_config
from diloco_async.flows.certs import issue, make_run_certificates
from diloco_async.flows.cli import main as cli_main
from diloco_async.learner.main import check_tls_env
from diloco_async.protocol.tls import (
    CA_ENV,
    CERT_ENV,
    KEY_ENV,
    check_client_files,
    check_issued,
    check_key_pair,
    check_validity,
    handshake_reason,
    learner_uri,
    peer_identity,
)
from diloco_async.sync import check_network, learner_tls_env

NOW = dt.datetime(2026, 12, 6, 12, 0, tzinfo=dt.UTC)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("certs")
    paths = make_run_certificates(folder, ["127.0.0.1", "localhost"], ["learner-0", "learner-1"], days=30, now=NOW)
    other = make_run_certificates(folder / "other", ["127.0.0.1"], ["learner-0"], days=30, now=NOW)
    return paths, other


def tls_config(paths, **extra):
    sets = {"network.mode": "tls", "network.server_cert": str(paths["server_cert"]),
            "network.server_key": str(paths["server_key"]), "network.ca": str(paths["ca"]),
            "network.client_ca": str(paths["ca"]), "network.client_certs": str(paths["client_certs"]),
            "learners.count": 2, **extra}
    return load_config(None, [f"{k}={v!r}" if isinstance(v, str) else f"{k}={v}" for k, v in sets.items()])


# -- config ---------------------------------------------------------------------------------------


def test_direct_is_the_default_and_the_network_section_is_operational(certs):
    assert load_config(None, []).network.modes(4) == ["direct"] * 4
    assert config_hash(tls_config(certs[0])) == config_hash(load_config(None, ["learners.count=2"]))


def test_direct_and_tls_learners_cannot_share_the_synchronizers_port():
    with pytest.raises(ValueError, match=r"learner-1 would be 'direct' and learner-0 'tls'.*one scheme per port"):
        load_config(None, ["learners.count=2", "network.learner_modes=['tls']"])
    cfg = load_config(None, ["learners.count=2", "network.learner_modes=['tls', 'tls']"])
    assert cfg.network.serves_tls(2)
    with pytest.raises(ValueError, match="network.learner_modes lists 3 modes but learners.count is 2"):
        load_config(None, ["learners.count=2", "network.learner_modes=['tls', 'tls', 'tls']"])
    with pytest.raises(ValueError, match="client_ca.*no learner is in mode 'tls'"):
        load_config(None, ["network.client_ca='ca.crt'"])
    with pytest.raises(ValueError, match="server_cert and network.server_key go together"):
        load_config(None, ["network.mode='tls'", "network.server_cert='s.crt'"])


# -- files checked before anything starts -----------------------------------------------------------


def test_tls_without_a_certificate_is_refused_naming_the_fields():
    cfg = load_config(None, ["network.mode='tls'"])
    with pytest.raises(ValueError, match="needs the synchronizer's certificate and key: set network.server_cert"):
        check_network(cfg, env={}, now=NOW)
    check_network(load_config(None, []), env={}, now=NOW)  # direct: nothing to check


def test_a_key_of_another_pair_is_refused_naming_both_files(certs):
    paths, _ = certs
    wrong_key = paths["client_certs"] / "learner-0.key"
    with pytest.raises(ValueError, match=f"private key {wrong_key} does not match certificate {paths['server_cert']}"):
        check_key_pair(paths["server_cert"], wrong_key)
    cfg = tls_config(paths, **{"network.server_key": str(wrong_key)})
    with pytest.raises(ValueError, match="does not match"):
        check_network(cfg, env={}, now=NOW)
    # the environment names the files instead of the recipe
    env = {"DILOCO_TLS_SERVER_CERT": str(paths["server_cert"]), "DILOCO_TLS_SERVER_KEY": str(paths["server_key"])}
    check_network(cfg, env=env, now=NOW)


def test_a_ca_bundle_that_does_not_verify_the_server_is_refused_naming_it(certs):
    paths, other = certs
    with pytest.raises(ValueError, match=f"CA bundle {other['ca']} does not verify certificate {paths['server_cert']}"):
        check_network(tls_config(paths, **{"network.ca": str(other["ca"])}), env={}, now=NOW)
    with pytest.raises(ValueError, match="for 10.1.2.3"):  # a host the certificate does not name
        check_issued(paths["server_cert"], paths["ca"], NOW, "10.1.2.3")
    check_issued(paths["server_cert"], paths["ca"], NOW, "0.0.0.0")  # every interface: its own first name
    check_network(tls_config(paths), env={}, now=NOW)


def test_an_expired_certificate_is_refused_naming_the_expiry(certs):
    paths, _ = certs
    later = NOW + dt.timedelta(days=31)
    with pytest.raises(ValueError, match=r"certificate .*server.crt expired at 2027-01-05T12:00:00\+00:00"):
        check_validity(paths["server_cert"], later)
    with pytest.raises(ValueError, match="server.crt expired at"):
        check_network(tls_config(paths), env={}, now=later)
    with pytest.raises(ValueError, match="learner-0.crt expired at"):
        check_client_files(paths["client_certs"] / "learner-0.crt", paths["client_certs"] / "learner-0.key", later)
    with pytest.raises(ValueError, match="is not valid before"):
        check_validity(paths["server_cert"], NOW - dt.timedelta(days=1))


def test_a_learners_certificate_must_name_it(certs, tmp_path):
    paths, _ = certs
    crt, key = paths["client_certs"] / "learner-0.crt", paths["client_certs"] / "learner-0.key"
    check_client_files(crt, key, NOW, "learner-0")
    with pytest.raises(ValueError, match="names \\['diloco://learner/learner-0'\\] instead of only 'diloco://learner/learner-1'"):
        check_client_files(crt, key, NOW, "learner-1")
    env = {CA_ENV: str(paths["ca"]), CERT_ENV: str(crt), KEY_ENV: str(key)}
    check_tls_env("learner-0", "https://127.0.0.1:1", env, NOW)
    check_tls_env("learner-1", "http://127.0.0.1:1", env, NOW)  # plain HTTP: no TLS files read
    with pytest.raises(ValueError, match="DILOCO_TLS_CERT and DILOCO_TLS_KEY go together"):
        check_tls_env("learner-0", "https://h:1", {CERT_ENV: str(crt)}, NOW)
    missing = tmp_path / "nope.crt"
    with pytest.raises(ValueError, match=f"DILOCO_TLS_CA bundle {missing}: cannot read it"):
        check_tls_env("learner-0", "https://h:1", {CA_ENV: str(missing)}, NOW)


def test_a_learner_gets_its_own_certificate_in_its_environment(certs):
    paths, _ = certs
    env = learner_tls_env(tls_config(paths), 1)
    assert env[CERT_ENV].endswith("clients/learner-1.crt") and env[KEY_ENV].endswith("clients/learner-1.key")
    assert env[CA_ENV] == str(paths["ca"].resolve())
    assert learner_tls_env(load_config(None, []), 1) == {}


# -- identities -------------------------------------------------------------------------------------


def test_the_identity_is_the_one_diloco_uri_of_the_certificate():
    cert = {"subject": ((("commonName", "learner-1"),),),
            "subjectAltName": (("DNS", "x"), ("URI", learner_uri("learner-0")))}
    assert peer_identity(cert) == "diloco://learner/learner-0"  # the URI counts, never the common name
    assert peer_identity({"subjectAltName": (("URI", "diloco://learner/a"), ("URI", "diloco://learner/b"))}) is None
    assert peer_identity({}) is None and peer_identity(None) is None


def test_handshake_reasons():
    expired = ssl.SSLCertVerificationError(1, "certificate verify failed")
    expired.verify_code, expired.verify_message = 10, "certificate has expired"
    assert handshake_reason(expired) == "certificate_expired"
    unknown = ssl.SSLCertVerificationError(1, "x")
    unknown.verify_code = 20
    assert handshake_reason(unknown) == "unknown_ca"
    plain = ssl.SSLError(1, "[SSL: HTTP_REQUEST] http request")
    plain.reason = "HTTP_REQUEST"
    assert handshake_reason(plain) == "not_tls"
    assert handshake_reason(ssl.SSLError(1, "other")) == "handshake_failed"


# -- diloco-async certs -----------------------------------------------------------------------------


def test_the_certs_command_writes_a_run_ca_server_and_client_certificates(tmp_path, capsys):
    out = tmp_path / "run-certs"
    assert cli_main(["certs", "--out", str(out), "--host", "127.0.0.1", "--host", "sync.example.org",
                     "--learners", "2", "--learner-id", "spot-7"]) == 0
    assert "client_ca = " in capsys.readouterr().out
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert names == ["ca.crt", "ca.key", "clients/learner-0.crt", "clients/learner-0.key", "clients/learner-1.crt",
                     "clients/learner-1.key", "clients/operator.crt", "clients/operator.key", "clients/spot-7.crt",
                     "clients/spot-7.key", "server.crt", "server.key"]
    for key in out.rglob("*.key"):
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600, key
        serialization.load_pem_private_key(key.read_bytes(), None)
    now = dt.datetime.now(dt.UTC)
    check_issued(out / "server.crt", out / "ca.crt", now, "sync.example.org")
    check_client_files(out / "clients" / "spot-7.crt", out / "clients" / "spot-7.key", now, "spot-7")
    assert cli_main(["certs", "--out", str(out), "--host", "h", "--learner-id", "bad id!"]) == 2
    assert "'bad id!' is not 1-64 characters" in capsys.readouterr().err


def test_issue_refuses_unknown_roles():
    with pytest.raises(ValueError, match="role must be"):
        issue(None, None, "x", ["x"], NOW, NOW, "admin")


def test_validate_checks_the_tls_files_as_train_does(tmp_path, capsys):
    paths = make_run_certificates(tmp_path / "run", ["127.0.0.1"], [])  # valid now: validate reads the clock
    other = make_run_certificates(tmp_path / "other", ["127.0.0.1"], [])
    assert cli_main(["validate", "default", "--set", "network.mode='tls'"]) == 2
    out = capsys.readouterr().out
    assert "FAIL network" in out and "needs the synchronizer's certificate and key" in out, out
    files = {"server_cert": paths["server_cert"], "server_key": paths["server_key"], "ca": other["ca"]}
    sets = [arg for k, v in files.items() for arg in ("--set", f"network.{k}='{v}'")]
    assert cli_main(["validate", "default", "--set", "network.mode='tls'", *sets]) == 2
    assert f"CA bundle {other['ca']} does not verify" in capsys.readouterr().out
