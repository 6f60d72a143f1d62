"""Per-learner credentials (issue 14, item 2): who may act as whom on the synchronizer's API.

The operator (the flow) holds the run's secret; the synchronizer gets it too. Every learner gets
only its own token, derived from the secret::

    learner_token(secret, run_id, learner_id) = hex HMAC-SHA256(secret, "diloco-learner\\n{run_id}\\n{learner_id}")

A request carries one credential as ``Authorization: Bearer <credential>``. A learner's token
lets it act as that learner only (join, heartbeat, announce, its push channel); the run secret
may act as any learner (it can derive every token anyway) and is the only credential of the
admin routes (checkpoint, metrics). :class:`Credentials` decides, in constant time per
comparison, and answers a reason: ``unauthenticated`` (the credential matches nothing) or
``forbidden`` (a learner's token used for another learner, or for an admin route). Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict
from typing import NamedTuple

__all__ = ["MIN_SECRET_CHARS", "MIN_SECRET_DISTINCT_CHARS", "check_run_secret", "learner_token", "bearer_credential",
            "Verdict", "Credentials", "ADMIN", "UNAUTHENTICATED", "FORBIDDEN"]

ADMIN = "admin"
"""The role of the run secret."""
UNAUTHENTICATED = "unauthenticated"
"""Reason: the credential is missing, malformed or matches nothing."""
FORBIDDEN = "forbidden"
"""Reason: a valid learner token used for another learner or for an admin route."""

_DOMAIN = "diloco-learner"
_KNOWN_CAP = 65_536  # learner tokens remembered to tell ``forbidden`` from ``unauthenticated``


MIN_SECRET_CHARS = 32
"""The shortest run secret accepted: 32 hex characters are 128 bits (``secrets.token_hex(16)``)."""
MIN_SECRET_DISTINCT_CHARS = 8
"""A run secret must use at least this many different characters (refuses ``aaaa...``, ``1212...``)."""


def check_run_secret(secret: str, name: str = "DILOCO_RUN_TOKEN") -> str:
    """Refuse a run secret that an offline guess could find, and return it unchanged.

    Every learner holds HMAC-SHA256(secret, a message it knows): with it, a learner that is not
    trusted (docs/threat-model.md) can test guesses of the secret offline, as fast as it hashes,
    and a secret it finds makes it the operator. So the secret must be long and random: at least
    :data:`MIN_SECRET_CHARS` characters with at least :data:`MIN_SECRET_DISTINCT_CHARS` different
    ones, e.g. ``python3 -c "import secrets; print(secrets.token_hex(32))"`` (64 characters). The
    length rule only bounds what a careless choice can be; it cannot tell a random string from a
    long pass phrase.

    Args:
        secret: the run secret.
        name: where it came from, for the message (the environment variable).

    Raises:
        ValueError: too short or too few distinct characters; the message names ``name`` and the rule,
            never the secret.
    """
    hint = 'make one with: python3 -c "import secrets; print(secrets.token_hex(32))"'
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(f"{name} is too weak: {len(secret)} characters, at least {MIN_SECRET_CHARS} needed "
                         f"(a learner could guess it offline from its own token); {hint}")
    if len(set(secret)) < MIN_SECRET_DISTINCT_CHARS:
        raise ValueError(f"{name} is too weak: only {len(set(secret))} different characters, at least "
                         f"{MIN_SECRET_DISTINCT_CHARS} needed; {hint}")
    return secret


def learner_token(run_secret: str, run_id: str, learner_id: str) -> str:
    """The token of ``learner_id`` in run ``run_id``: hex HMAC-SHA256 (64 characters) of the run
    secret over ``"diloco-learner\\n{run_id}\\n{learner_id}"``.

    Raises:
        ValueError: an empty ``run_secret``, ``run_id`` or ``learner_id``.
    """
    for name, value in (("run_secret", run_secret), ("run_id", run_id), ("learner_id", learner_id)):
        if not value:
            raise ValueError(f"{name} must be a non-empty string, got {value!r}")
    msg = f"{_DOMAIN}\n{run_id}\n{learner_id}".encode()
    return hmac.new(run_secret.encode(), msg, hashlib.sha256).hexdigest()


def bearer_credential(header: str | None) -> str | None:
    """The credential of an ``Authorization: Bearer <credential>`` header; None when the header is
    missing, not ASCII, not a bearer header or empty."""
    if not header:
        return None
    try:
        header.encode("ascii")
    except UnicodeEncodeError:
        return None
    scheme, _, credential = header.partition(" ")
    credential = credential.strip()
    return credential if scheme.lower() == "bearer" and credential else None


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


class Verdict(NamedTuple):
    """What a credential may do here: ``ok``; ``role`` (``"admin"``, the learner id it authenticated
    as, or None); ``reason`` (``""`` when ok, else ``unauthenticated`` or ``forbidden``)."""

    ok: bool
    role: str | None
    reason: str


class Credentials:
    """Checks credentials of one run against its secret.

    Remembers (a digest of) the learner tokens that authenticated, up to a bound, so that a token
    valid for learner A and presented as learner B is ``forbidden`` rather than
    ``unauthenticated`` once A has been seen.

    Args:
        run_secret: the run's secret (admin credential).
        run_id: the run's id.

    Raises:
        ValueError: an empty ``run_secret`` or ``run_id``.
    """

    def __init__(self, run_secret: str, run_id: str) -> None:
        if not run_secret or not run_id:
            raise ValueError("Credentials need a non-empty run secret and run id")
        self._secret, self.run_id = run_secret, run_id
        self._known: OrderedDict[bytes, str] = OrderedDict()  # sha256(token) -> learner id
        # learner id -> (its token, sha256 of it), for the learners in _known (the same bound and
        # order): a known learner's next request costs a comparison, not an HMAC and a hash (issue 17)
        self._tokens: OrderedDict[str, tuple[str, bytes]] = OrderedDict()

    def token_of(self, learner_id: str) -> str:
        """:func:`learner_token` of ``learner_id`` in this run."""
        return learner_token(self._secret, self.run_id, learner_id)

    def is_admin(self, credential: str | None) -> bool:
        return credential is not None and _same(credential, self._secret)

    def _owner(self, credential: str) -> str | None:
        return self._known.get(hashlib.sha256(credential.encode()).digest())

    def _remember(self, credential: str, learner_id: str, digest: bytes | None = None) -> None:
        digest = digest or hashlib.sha256(credential.encode()).digest()
        self._known[digest] = learner_id
        self._known.move_to_end(digest)
        self._tokens[learner_id] = (credential, digest)
        self._tokens.move_to_end(learner_id)
        while len(self._known) > _KNOWN_CAP:
            self._known.popitem(last=False)
        while len(self._tokens) > _KNOWN_CAP:
            self._tokens.popitem(last=False)

    def as_learner(self, credential: str | None, learner_id: str) -> Verdict:
        """May ``credential`` act as ``learner_id``? The run secret may act as anyone."""
        if credential is None:
            return Verdict(False, None, UNAUTHENTICATED)
        if self.is_admin(credential):
            return Verdict(True, ADMIN, "")
        cached = self._tokens.get(learner_id)
        if cached is not None and _same(credential, cached[0]):  # its token, derived when first seen
            self._remember(credential, learner_id, cached[1])
            return Verdict(True, learner_id, "")
        if learner_id and _same(credential, self.token_of(learner_id)):
            self._remember(credential, learner_id)
            return Verdict(True, learner_id, "")
        owner = self._owner(credential)
        return Verdict(False, owner, FORBIDDEN if owner is not None else UNAUTHENTICATED)

    def as_admin(self, credential: str | None) -> Verdict:
        """May ``credential`` use an admin route? Only the run secret may."""
        if self.is_admin(credential):
            return Verdict(True, ADMIN, "")
        owner = self._owner(credential) if credential is not None else None
        return Verdict(False, owner, FORBIDDEN if owner is not None else UNAUTHENTICATED)

    def as_anyone(self, credential: str | None) -> Verdict:
        """Is ``credential`` the run secret or a learner token seen before? (For a request whose
        learner cannot be read, e.g. a body that is not JSON: it decides between 400 and 401.)"""
        if self.is_admin(credential):
            return Verdict(True, ADMIN, "")
        owner = self._owner(credential) if credential is not None else None
        return Verdict(owner is not None, owner, "" if owner is not None else UNAUTHENTICATED)
