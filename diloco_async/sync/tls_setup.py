"""The run's TLS files, checked before anything starts, and the synchronizer's ``ssl.SSLContext``
(``network`` section, :mod:`diloco_async.config.network`; docs/network-modes.md).

:func:`check_network` is called by whoever starts a run (:class:`diloco_async.run.RunProcesses`)
and by the synchronizer's command line, before either starts a process or takes the lease.
"""

from __future__ import annotations

import datetime as dt
import os
import ssl
from collections.abc import Callable, Mapping
from pathlib import Path

from diloco_async.config.schema import Config
from diloco_async.protocol.tls import (
    CA_ENV,
    CERT_ENV,
    KEY_ENV,
    SERVER_CERT_ENV,
    SERVER_KEY_ENV,
    check_client_files,
    check_issued,
    check_key_pair,
    check_validity,
    count_handshake_refusals,
    read_certificates,
    server_context,
)

__all__ = ["server_files", "check_network", "edge_context", "client_files", "learner_tls_env", "operator_tls_env"]


def server_files(cfg: Config, env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
    """The synchronizer's (certificate, key) files: ``DILOCO_TLS_SERVER_CERT`` / ``_KEY`` when set,
    else ``network.server_cert`` / ``server_key``; None when the run serves plain HTTP.

    Raises:
        ValueError: the run has ``tls`` learners but no certificate or no key is named.
    """
    env = os.environ if env is None else env
    if not cfg.network.serves_tls(cfg.learners.count):
        return None
    cert = env.get(SERVER_CERT_ENV) or cfg.network.server_cert
    key = env.get(SERVER_KEY_ENV) or cfg.network.server_key
    if not cert or not key:
        raise ValueError(f"network.mode 'tls' needs the synchronizer's certificate and key: set network.server_cert "
                         f"and network.server_key (or {SERVER_CERT_ENV} and {SERVER_KEY_ENV}); got certificate "
                         f"{cert!r}, key {key!r}")
    return cert, key


def client_files(cfg: Config, name: str) -> tuple[str, str]:
    """(certificate, key) of client ``name`` (a learner id, or ``operator``) in ``network.client_certs``.

    Raises:
        ValueError: mutual TLS without ``network.client_certs``.
    """
    folder = cfg.network.client_certs
    if folder is None:
        raise ValueError("network.client_ca asks for mutual TLS: set network.client_certs to the folder of the "
                         "clients' certificates (<learner_id>.crt/.key, operator.crt/.key; `diloco-async certs`)")
    return str(Path(folder) / f"{name}.crt"), str(Path(folder) / f"{name}.key")


def check_network(cfg: Config, env: Mapping[str, str] | None = None, now: dt.datetime | None = None,
                  learners: bool = True) -> None:
    """Refuse bad TLS files before anything starts: the synchronizer's certificate and key (present,
    a pair, valid at ``now``), the learners' CA bundle against that certificate, the client CA and
    (``learners``) each learner's and the operator's certificate in ``network.client_certs``.

    Raises:
        ValueError: the first problem, naming its file (and the expiry or mismatch).
    """
    now = now or dt.datetime.now(dt.UTC)
    files = server_files(cfg, env)
    if files is None:
        return
    cert, key = files
    check_validity(cert, now)
    check_key_pair(cert, key)
    if cfg.network.ca is not None:
        check_issued(cert, cfg.network.ca, now, cfg.synchronizer.host)
    if cfg.network.client_ca is not None:
        read_certificates(cfg.network.client_ca, "network.client_ca bundle")
        if learners:
            for i in range(cfg.learners.count):
                if cfg.network.mode_of(i) == "tls":
                    check_client_files(*client_files(cfg, f"learner-{i}"), now, f"learner-{i}")
            check_client_files(*client_files(cfg, "operator"), now)


def edge_context(cfg: Config, note: Callable[[str, str], None],
                 env: Mapping[str, str] | None = None) -> ssl.SSLContext | None:
    """The synchronizer's ``ssl.SSLContext`` (None: plain HTTP); each refused handshake is handed to
    ``note(reason, detail)``.

    Raises:
        ValueError: as :func:`check_network`.
    """
    files = server_files(cfg, env)
    if files is None:
        return None
    check_network(cfg, env, learners=False)
    ctx = server_context(*files, client_ca=cfg.network.client_ca)
    count_handshake_refusals(ctx, note)
    return ctx


def learner_tls_env(cfg: Config, index: int) -> dict[str, str]:
    """The TLS part of learner ``index``'s environment: the CA bundle it verifies the synchronizer
    with, and with mutual TLS its own certificate and key; {} for a ``direct`` learner."""
    if cfg.network.mode_of(index) != "tls":
        return {}
    return _client_env(cfg, f"learner-{index}")


def operator_tls_env(cfg: Config) -> dict[str, str]:
    """The TLS environment of the operator's requests (metrics, checkpoints); {} over plain HTTP."""
    return _client_env(cfg, "operator") if cfg.network.serves_tls(cfg.learners.count) else {}


def _client_env(cfg: Config, name: str) -> dict[str, str]:
    env = {CA_ENV: str(Path(cfg.network.ca).resolve())} if cfg.network.ca else {}
    if cfg.network.client_ca is not None:
        cert, key = client_files(cfg, name)
        env.update({CERT_ENV: str(Path(cert).resolve()), KEY_ENV: str(Path(key).resolve())})
    return env
