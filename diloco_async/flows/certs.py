"""``diloco-async certs``: a run's certificate authority, the synchronizer's certificate and one
client certificate per learner (and the operator's), for ``network.mode = "tls"`` with mutual TLS
(docs/network-modes.md).

Layout written under ``--out`` (keys mode 0600, written with that mode from the start)::

    ca.crt  ca.key                  the run CA (network.ca and network.client_ca)
    server.crt  server.key          the synchronizer (network.server_cert / server_key): SANs = --host
    clients/learner-<i>.crt  .key   learner i: SAN URI diloco://learner/learner-<i> (network.client_certs)
    clients/operator.crt  .key      the flow's requests (metrics, checkpoints): SAN URI diloco://operator

Keys are ECDSA P-256; certificates are valid ``--days`` days from now (the CA a day longer).
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
import re
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from diloco_async.protocol.messages import LEARNER_ID_PATTERN
from diloco_async.protocol.tls import OPERATOR_URI, learner_uri

__all__ = ["make_run_certificates", "issue", "add_certs_parser"]


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "diloco-async"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """The key as unencrypted PEM, created with mode 0600 (never readable by others, even briefly)."""
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    os.chmod(path, 0o600)  # whatever the umask was


def _san(names: list[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for name in names:
        if name.startswith("diloco://"):
            out.append(x509.UniformResourceIdentifier(name))
            continue
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


def issue(ca_cert: x509.Certificate | None, ca_key: ec.EllipticCurvePrivateKey | None, common_name: str,
          names: list[str], not_before: dt.datetime, not_after: dt.datetime, role: str
          ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A new key and its certificate: ``role`` ``ca`` (self-signed when ``ca_cert`` is None),
    ``server`` (DNS/IP ``names``) or ``client`` (``diloco://`` URI ``names``), signed by the CA.

    Raises:
        ValueError: an unknown ``role``, or a server or client certificate without ``names``.
    """
    if role not in ("ca", "server", "client"):
        raise ValueError(f"role must be ca, server or client, got {role!r}")
    if role != "ca" and not names:
        raise ValueError(f"a {role} certificate needs at least one name")
    key = ec.generate_private_key(ec.SECP256R1())
    signer_key = ca_key if ca_key is not None else key
    issuer = ca_cert.subject if ca_cert is not None else _name(common_name)
    b = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(issuer)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(not_before).not_valid_after(not_after)
         .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
         .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(signer_key.public_key()), critical=False))
    if role == "ca":
        b = (b.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
             .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                          data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                          crl_sign=True, encipher_only=False, decipher_only=False), critical=True))
    else:
        usage = ExtendedKeyUsageOID.SERVER_AUTH if role == "server" else ExtendedKeyUsageOID.CLIENT_AUTH
        b = (b.add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
             .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                          data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                          crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
             .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
             .add_extension(x509.SubjectAlternativeName(_san(names)), critical=False))
    return b.sign(signer_key, hashes.SHA256()), key


def _save(folder: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    (folder / f"{stem}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(folder / f"{stem}.key", key)


def make_run_certificates(out: str | os.PathLike, hosts: list[str], learners: list[str], days: float = 30.0,
                          now: dt.datetime | None = None) -> dict[str, Path]:
    """Write the run CA, the server certificate for ``hosts`` and a client certificate for each
    learner id of ``learners`` and for the operator under ``out`` (the layout of the module's docstring).

    Returns the paths by name (``ca``, ``server_cert``, ``server_key``, ``client_certs``).

    Raises:
        ValueError: no host, ``days`` not positive, or a learner id that is not ``[A-Za-z0-9_.-]{1,64}``.
    """
    if not hosts:
        raise ValueError("give at least one --host the learners reach the synchronizer at (a DNS name or an IP)")
    if not days > 0:
        raise ValueError(f"--days must be > 0, got {days}")
    for lid in learners:
        if not re.match(LEARNER_ID_PATTERN, lid):
            raise ValueError(f"learner id {lid!r} is not 1-64 characters of A-Z a-z 0-9 _ . -")
    now = now or dt.datetime.now(dt.UTC)
    start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)
    root = Path(out)
    clients = root / "clients"
    clients.mkdir(parents=True, exist_ok=True)
    ca, ca_key = issue(None, None, "diloco-async run CA", [], start, end + dt.timedelta(days=1), "ca")
    _save(root, "ca", ca, ca_key)
    _save(root, "server", *issue(ca, ca_key, hosts[0], hosts, start, end, "server"))
    for lid in learners:
        _save(clients, lid, *issue(ca, ca_key, lid, [learner_uri(lid)], start, end, "client"))
    _save(clients, "operator", *issue(ca, ca_key, "operator", [OPERATOR_URI], start, end, "client"))
    return {"ca": root / "ca.crt", "server_cert": root / "server.crt", "server_key": root / "server.key",
            "client_certs": clients}


def _certs(args: argparse.Namespace) -> int:
    learners = [f"learner-{i}" for i in range(args.learners)] + list(args.learner_id or [])
    try:
        paths = make_run_certificates(args.out, args.host, learners, args.days)
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote the run CA, the server certificate ({', '.join(args.host)}) and {len(learners)} learner "
          f"certificates (+ operator) under {args.out}; in the recipe:\n"
          f"[network]\nmode = \"tls\"\nserver_cert = \"{paths['server_cert']}\"\n"
          f"server_key = \"{paths['server_key']}\"\n"
          f"ca = \"{paths['ca']}\"\nclient_ca = \"{paths['ca']}\"\nclient_certs = \"{paths['client_certs']}\"")
    return 0


def add_certs_parser(sub) -> None:
    """``diloco-async certs``: its parser on ``sub`` (argparse subparsers)."""
    p = sub.add_parser("certs", help="make a run CA, the synchronizer's certificate and one client certificate "
                       "per learner (network.mode = 'tls', mutual TLS)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write into (keys get mode 0600)")
    p.add_argument("--host", action="append", required=True, metavar="NAME_OR_IP",
                   help="a DNS name or IP address learners reach the synchronizer at (repeatable; the first is "
                        "also its common name), e.g. --host 127.0.0.1 --host sync.example.org")
    p.add_argument("--learners", type=int, default=4, metavar="M",
                   help="client certificates for learner-0 .. learner-(M-1) (default: %(default)s)")
    p.add_argument("--learner-id", action="append", metavar="ID", help="one more learner id (repeatable)")
    p.add_argument("--days", type=float, default=30.0, help="days the certificates are valid (default: %(default)s)")
    p.set_defaults(func=_certs)
