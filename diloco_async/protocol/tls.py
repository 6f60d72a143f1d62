"""TLS and mutual TLS between learners and the synchronizer (issue 43): identities, the checks of
certificate files before anything starts, and the ``ssl.SSLContext`` of each side.

Identity: a learner's client certificate names it by one subjectAltName URI,
``diloco://learner/<learner_id>`` (:func:`learner_uri`); the operator's (flows, ``checkpoint``)
``diloco://operator``. The common name is informative only. With mutual TLS the synchronizer's
HTTP edge compares the identity of the connection's verified certificate with the learner id a
request acts as, beside the learner's HMAC token (:mod:`diloco_async.protocol.auth`): both must hold.

Environment: the synchronizer's certificate and key may come from ``DILOCO_TLS_SERVER_CERT`` /
``DILOCO_TLS_SERVER_KEY`` (instead of ``network.server_cert`` / ``server_key``); a client (learner,
operator) reads the CA bundle it verifies the synchronizer with from ``DILOCO_TLS_CA`` and its own
certificate and key from ``DILOCO_TLS_CERT`` / ``DILOCO_TLS_KEY``. Files are PEM.

Errors: every check raises ``ValueError`` naming the file (and the expiry, the mismatch or the
name it found).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
from collections.abc import Callable, Mapping
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

__all__ = ["SERVER_CERT_ENV", "SERVER_KEY_ENV", "CA_ENV", "CERT_ENV", "KEY_ENV", "LEARNER_URI_PREFIX",
           "OPERATOR_URI", "TLS_REASONS", "learner_uri", "peer_identity", "read_certificates", "check_key_pair",
           "check_validity", "check_issued", "check_client_files", "server_context", "client_context",
           "client_context_from_env", "handshake_reason", "count_handshake_refusals"]

SERVER_CERT_ENV = "DILOCO_TLS_SERVER_CERT"
SERVER_KEY_ENV = "DILOCO_TLS_SERVER_KEY"
CA_ENV = "DILOCO_TLS_CA"
CERT_ENV = "DILOCO_TLS_CERT"
KEY_ENV = "DILOCO_TLS_KEY"
LEARNER_URI_PREFIX = "diloco://learner/"
OPERATOR_URI = "diloco://operator"
TLS_REASONS = ("not_tls", "certificate_expired", "unknown_ca", "bad_certificate", "handshake_failed")
"""Why the synchronizer refused a TLS handshake (counted as ``tls_<reason>``)."""

_WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


def learner_uri(learner_id: str) -> str:
    """The subjectAltName URI that names ``learner_id`` in its client certificate."""
    return f"{LEARNER_URI_PREFIX}{learner_id}"


def peer_identity(peercert: Mapping | None) -> str | None:
    """The ``diloco://`` URI of a verified peer certificate (``ssl.SSLSocket.getpeercert()``'s dict);
    None when there is no certificate, none such URI, or more than one (ambiguous: no identity)."""
    if not peercert:
        return None
    uris = [v for k, v in peercert.get("subjectAltName", ()) if k == "URI" and v.startswith("diloco://")]
    return uris[0] if len(uris) == 1 else None


def read_certificates(path: str | os.PathLike, what: str) -> list[x509.Certificate]:
    """The PEM certificates in ``path`` (at least one).

    Raises:
        ValueError: no such file, or no PEM certificate in it; names ``what`` and the file.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as err:
        raise ValueError(f"{what} {path}: cannot read it ({err.strerror or err})") from None
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError as err:
        raise ValueError(f"{what} {path} holds no PEM certificate ({err})") from None
    return certs


def _read_key(path: str | os.PathLike, what: str):
    try:
        return serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    except OSError as err:
        raise ValueError(f"{what} {path}: cannot read it ({err.strerror or err})") from None
    except (ValueError, TypeError) as err:
        raise ValueError(f"{what} {path} is not an unencrypted PEM private key ({err})") from None


def check_key_pair(cert_path: str | os.PathLike, key_path: str | os.PathLike) -> None:
    """Raise ValueError (naming both files) unless the key of ``key_path`` is the private key of
    the first certificate of ``cert_path``."""
    cert = read_certificates(cert_path, "certificate")[0]
    key = _read_key(key_path, "private key")
    raw = serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(serialization.Encoding.DER, raw) != \
            cert.public_key().public_bytes(serialization.Encoding.DER, raw):
        raise ValueError(f"private key {key_path} does not match certificate {cert_path} (another key pair)")


def check_validity(cert_path: str | os.PathLike, now: dt.datetime) -> x509.Certificate:
    """The first certificate of ``cert_path``, if it is valid at ``now`` (aware, UTC).

    Raises:
        ValueError: it expired (the message names the expiry: ``expired at <not after>``), or is
            not valid yet.
    """
    cert = read_certificates(cert_path, "certificate")[0]
    if now > cert.not_valid_after_utc:
        raise ValueError(f"certificate {cert_path} expired at {cert.not_valid_after_utc.isoformat()} "
                         f"(not valid after that; now {now.isoformat(timespec='seconds')})")
    if now < cert.not_valid_before_utc:
        raise ValueError(f"certificate {cert_path} is not valid before {cert.not_valid_before_utc.isoformat()} "
                         f"(now {now.isoformat(timespec='seconds')})")
    return cert


def _subject_of(cert: x509.Certificate, host: str | None):
    """The name verified for: ``host`` when given, else the certificate's first DNS or IP name."""
    if host is not None:
        try:
            return x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            return x509.DNSName(host)
    try:
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    names = [x509.IPAddress(a) for a in sans.get_values_for_type(x509.IPAddress)]
    return (names or [x509.DNSName(n) for n in sans.get_values_for_type(x509.DNSName)] or [None])[0]


def check_issued(cert_path: str | os.PathLike, ca_path: str | os.PathLike, now: dt.datetime,
                 host: str | None = None) -> None:
    """Raise ValueError unless the CA bundle ``ca_path`` verifies the server certificate of
    ``cert_path`` (its chain after it) at ``now`` for ``host`` (None or a wildcard address: for the
    first name the certificate gives), as a learner's TLS client would."""
    chain = read_certificates(cert_path, "certificate")
    cas = read_certificates(ca_path, "CA bundle")
    host = None if host in _WILDCARD_HOSTS else host
    subject = _subject_of(chain[0], host)
    if subject is None:
        raise ValueError(f"certificate {cert_path} names no DNS name or IP address (subjectAltName): no TLS client "
                         "can verify it")
    verifier = PolicyBuilder().store(Store(cas)).time(now).build_server_verifier(subject)
    try:
        verifier.verify(chain[0], chain[1:])
    except VerificationError as err:
        raise ValueError(f"CA bundle {ca_path} does not verify certificate {cert_path}"
                         f"{f' for {host}' if host else ''}: {err}") from None


def check_client_files(cert_path: str | os.PathLike, key_path: str | os.PathLike, now: dt.datetime,
                       learner_id: str | None = None) -> None:
    """Check a client's certificate before it connects: readable, its key, valid at ``now``, and
    (with ``learner_id``) naming that learner.

    Raises:
        ValueError: named file, expiry, mismatch or the identity it names instead.
    """
    cert = check_validity(cert_path, now)
    check_key_pair(cert_path, key_path)
    if learner_id is not None:
        try:
            sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
        except x509.ExtensionNotFound:
            uris = []
        named = [u for u in uris if u.startswith("diloco://")]  # exactly one, as peer_identity reads it
        if named != [learner_uri(learner_id)]:
            raise ValueError(f"certificate {cert_path} names {named!r} instead of only {learner_uri(learner_id)!r} "
                             "(SAN URI): the synchronizer would refuse it")


def server_context(cert_path: str, key_path: str, client_ca: str | None = None) -> ssl.SSLContext:
    """The synchronizer's context: its certificate and key; with ``client_ca``, client certificates
    of that authority are verified (``CERT_OPTIONAL``: a certificate presented must verify, or the
    handshake fails; which routes need one is the HTTP edge's rule, so ``/status`` stays open)."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_path, key_path)
    if client_ca is not None:
        ctx.verify_mode = ssl.CERT_OPTIONAL
        ctx.load_verify_locations(cafile=client_ca)
    return ctx


def client_context(ca_path: str | None = None, cert_path: str | None = None,
                   key_path: str | None = None) -> ssl.SSLContext:
    """A client's context: verifies the synchronizer against ``ca_path`` (None: the system's trust
    store) and its host name; presents ``cert_path`` / ``key_path`` when given."""
    ctx = ssl.create_default_context(cafile=ca_path)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert_path is not None:
        ctx.load_cert_chain(cert_path, key_path)
    return ctx


def client_context_from_env(env: Mapping[str, str] | None = None) -> ssl.SSLContext:
    """:func:`client_context` of ``DILOCO_TLS_CA``, ``DILOCO_TLS_CERT`` and ``DILOCO_TLS_KEY``."""
    env = os.environ if env is None else env
    return client_context(env.get(CA_ENV) or None, env.get(CERT_ENV) or None, env.get(KEY_ENV) or None)


def handshake_reason(err: ssl.SSLError) -> str:
    """The reason (one of :data:`TLS_REASONS`) a server-side handshake failed with ``err``."""
    if getattr(err, "reason", None) == "HTTP_REQUEST":
        return "not_tls"
    if isinstance(err, ssl.SSLCertVerificationError):
        code = getattr(err, "verify_code", None)
        if code == 10:  # X509_V_ERR_CERT_HAS_EXPIRED
            return "certificate_expired"
        if code in (2, 18, 19, 20, 21):  # issuer unknown, self-signed: not of the client CA
            return "unknown_ca"
        return "bad_certificate"
    return "handshake_failed"


def count_handshake_refusals(ctx: ssl.SSLContext, note: Callable[[str, str], None]) -> None:
    """Call ``note(reason, detail)`` for every handshake of ``ctx`` that fails (asyncio drops them
    silently): ``ctx.sslobject_class`` becomes a subclass whose handshake reports its failure."""

    class _Reported(ssl.SSLObject):
        def do_handshake(self) -> None:
            try:
                super().do_handshake()
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                raise
            except ssl.SSLError as err:
                note(handshake_reason(err), getattr(err, "verify_message", None) or str(err))
                raise

    ctx.sslobject_class = _Reported
