"""The ``[network]`` section of the config: how each learner reaches the synchronizer (issue 43).

``direct`` is plain HTTP and a WebSocket, as before this section existed (the default). ``tls`` is
HTTPS and WSS: the synchronizer serves with ``server_cert`` / ``server_key`` (or the files named by
``DILOCO_TLS_SERVER_CERT`` / ``DILOCO_TLS_SERVER_KEY``), learners verify it against ``ca``; with
``client_ca`` set every learner must also present a certificate of that CA naming its learner id
(mutual TLS, :mod:`diloco_async.protocol.tls`). The synchronizer listens on one scheme per port, so
``direct`` and ``tls`` learners cannot share a run (a plain port beside the TLS one would carry the
tokens in clear and let a learner skip its certificate). docs/network-modes.md is the user's page.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["NetworkConfig", "NETWORK_MODES", "CONNECTED_MODES"]

NETWORK_MODES = ("direct", "tls")
"""Every value of ``network.mode``."""
CONNECTED_MODES = ("direct", "tls")
"""The modes whose learners connect to the synchronizer's port (one scheme per port: at most one per run)."""

Mode = Literal["direct", "tls"]


class NetworkConfig(BaseModel):
    """How learners reach the synchronizer; every field is operational (the config hash ignores it)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Mode = Field(
        "direct", description="Network mode of every learner not named in learner_modes: 'direct' (plain HTTP and "
        "WebSocket) or 'tls' (HTTPS and WSS, the synchronizer's certificate verified against network.ca).")
    learner_modes: list[Mode] = Field(
        default_factory=list, max_length=4096, description="Network mode of learner i (learner-i) for i below its "
        "length; the others take network.mode. Learners that connect to the synchronizer share one scheme: "
        "'direct' and 'tls' do not mix in one run.")
    server_cert: str | None = Field(
        None, min_length=1, description="PEM file of the synchronizer's certificate (its chain after it) in tls "
        "mode; the environment variable DILOCO_TLS_SERVER_CERT, when set, names the file instead.")
    server_key: str | None = Field(
        None, min_length=1, description="PEM file of the private key of network.server_cert; the environment "
        "variable DILOCO_TLS_SERVER_KEY, when set, names the file instead.")
    ca: str | None = Field(
        None, min_length=1, description="PEM bundle of the certificate authorities learners verify the "
        "synchronizer's certificate with (None: the system's trust store).")
    client_ca: str | None = Field(
        None, min_length=1, description="PEM bundle of the authority of the learners' certificates: set, the "
        "synchronizer requires mutual TLS (a learner's certificate names it as the SAN URI "
        "diloco://learner/<learner_id>, and it may act only as that learner; the operator's names "
        "diloco://operator). Needs mode 'tls'.")
    client_certs: str | None = Field(
        None, min_length=1, description="Folder of the learners' certificates and keys with client_ca: "
        "<learner_id>.crt and <learner_id>.key for each learner, operator.crt and operator.key for the flow "
        "(the layout `diloco-async certs` writes under clients/).")

    def mode_of(self, index: int) -> str:
        """The network mode of learner ``index`` (``learner-{index}``)."""
        return self.learner_modes[index] if index < len(self.learner_modes) else self.mode

    def modes(self, count: int) -> list[str]:
        """The network mode of each of ``count`` learners, in index order."""
        return [self.mode_of(i) for i in range(count)]

    def serves_tls(self, count: int) -> bool:
        """Does the synchronizer of a run of ``count`` learners serve HTTPS (some learner is ``tls``)?"""
        return "tls" in self.modes(count)

    def check_learners(self, count: int) -> None:
        """Refuse a run whose connected learners need two schemes on one port.

        Raises:
            ValueError: some of the ``count`` learners are ``direct`` and some ``tls`` (both named);
                ``learner_modes`` is longer than ``count``.
        """
        if len(self.learner_modes) > count:
            raise ValueError(f"network.learner_modes lists {len(self.learner_modes)} modes but learners.count is "
                             f"{count}")
        by_mode: dict[str, list[str]] = {}
        for i, mode in enumerate(self.modes(count)):
            by_mode.setdefault(mode, []).append(f"learner-{i}")
        connected = [m for m in CONNECTED_MODES if m in by_mode]
        if len(connected) > 1:
            raise ValueError(f"network: {', '.join(by_mode['direct'])} would be 'direct' and "
                             f"{', '.join(by_mode['tls'])} 'tls', but the synchronizer listens on one scheme per "
                             "port: make them all 'tls' (a plain port would carry their tokens in clear)")

    @model_validator(mode="after")
    def _client_ca_needs_tls(self) -> NetworkConfig:
        if self.client_ca is not None and "tls" not in (self.mode, *self.learner_modes):
            raise ValueError(f"network.client_ca={self.client_ca!r} asks for mutual TLS, but no learner is in mode "
                             "'tls' (set network.mode = 'tls')")
        if (self.server_cert is None) != (self.server_key is None):
            raise ValueError("network.server_cert and network.server_key go together: set both or neither "
                             f"(server_cert={self.server_cert!r}, server_key={self.server_key!r})")
        return self
