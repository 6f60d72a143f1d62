"""A seeded generator of valid, boundary and hostile requests for the synchronizer's HTTP API
(issue 14: no single message may crash, stall or poison a run).

:class:`RequestGenerator` draws one :class:`FuzzRequest` at a time, covering every route of
:mod:`diloco_async.sync.http` (``/join``, ``/heartbeat``, ``/announce``, ``/checkpoint``,
``/status``, ``/metrics``, ``/health``, the WebSocket ``/ws``), unknown paths and methods. A body
starts as a valid message of the fuzz's own learners and gets at most one mutation: a boundary or
out-of-range number, a wrong type, NaN/Infinity, an integer of thousands of digits, deep nesting,
a huge string, an unknown or missing key, another learner's id, a replayed or stale message, raw
bytes that are not JSON or not UTF-8. Headers are valid (built by the caller through
:class:`~diloco_async.protocol.client.SyncClient`) or hostile (none, wrong token, another learner's token,
non-ASCII). Pure: no I/O; the same seed gives the same requests.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from diloco_async.protocol.messages import COUNT_MAX, STEP_MAX

__all__ = ["FuzzRequest", "RequestGenerator", "HeadersFor"]

HeadersFor = Callable[[str | None], dict[str, str]]
"""``headers_for(learner_id)``: the valid auth headers of that learner (None: the run's admin token)."""

_SHA = "ab" * 32


@dataclass(frozen=True)
class FuzzRequest:
    """One request: ``method`` (an HTTP verb, or ``WS`` for a WebSocket handshake), ``path`` with
    its query, the raw ``body`` (None: no body), ``headers`` and ``kind`` (what was drawn, for the
    tallies, e.g. ``heartbeat/wrong_type``)."""

    method: str
    path: str
    body: bytes | None
    headers: dict[str, str]
    kind: str


def _huge_ints() -> list[int]:
    return [-1, -(2**63), STEP_MAX, STEP_MAX + 1, COUNT_MAX, COUNT_MAX + 1, 2**63, 2**64, 10**30, 10**400]


_FLOATS = [0.0, -0.0, -1.0, 1e-320, 1e308, -1e308, 1e9, 1e12, 3.5]
_WRONG_TYPES: list[Any] = ["x", "", [], {}, None, True, [1, 2], {"a": 1}, 1.5, "1"]
_RAW_BODIES = [b"", b"null", b"[]", b"[1,2]", b'"a"', b"1", b"true", b"learner_id=a&step=1", b"{", b"{}}",
               b'{"learner_id":"\xff\xfe"}', b"\x00" * 64, b'{"a":1,"a":2}', "{\"learner_id\":\"\u2603\"}".encode()]
_NON_FINITE = [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"-1e999"]
_BAD_AUTH = [None, "Bearer", "Bearer ", "Bearer wrong-token", "Basic dXNlcjpwYXNz", "bearer {tok}", "Bearer {tok}x",
             "Bearer t\u00e9st", "\u00ff" * 20, "Bearer " + "A" * 8000, "Bearer {tok} {tok}"]
_UNKNOWN_PATHS = ["/", "/admin", "/status/x", "/join/", "/../../etc/passwd", "/%00", "/ws/x", "/metrics/1",
                  "/" + "a" * 4000, "/health?x=" + "%ff" * 50, "/checkpoints", "/.env", "/heartbeat;x"]
_OTHER_METHODS = ["PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"]


@dataclass
class RequestGenerator:
    """Draws requests with ``random.Random(seed)``.

    Args:
        seed: the generator's seed.
        run_id: the run's id (object keys of announcements live under it).
        own_ids: learner ids that belong to the fuzz (it joins and heartbeats as them).
        victim_ids: the honest learners' ids (requests "as another learner" use them).
        headers_for: valid auth headers of a learner id (see :data:`HeadersFor`).
        fragments: number of fragments of the run.
        object_keys: keys of objects in the store the fuzz may announce (hostile contributions
            written by the caller), appended to while the fuzz runs.
        weights: relative weights of the routes (``join heartbeat announce status metrics health
            ws checkpoint unknown``).
    """

    seed: int
    run_id: str
    own_ids: list[str]
    victim_ids: list[str]
    headers_for: HeadersFor
    fragments: int = 2
    object_keys: list[tuple[str, int, str]] = field(default_factory=list)  # (key, nbytes, sha256)
    weights: dict[str, float] = field(default_factory=lambda: {
        "join": 10, "heartbeat": 30, "announce": 25, "status": 8, "metrics": 8, "health": 3, "ws": 4,
        "checkpoint": 0.3, "unknown": 6})

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.sent: list[tuple[str, bytes]] = []  # valid bodies sent, for replays
        self.token_owner: str | None = None  # whose token the last headers carry
        self._routes = list(self.weights)
        self._route_weights = [self.weights[r] for r in self._routes]

    # -- public --------------------------------------------------------------------------------

    def next(self) -> FuzzRequest:
        """The next request."""
        route = self.rng.choices(self._routes, self._route_weights)[0]
        return getattr(self, f"_{route}")()

    # -- helpers -------------------------------------------------------------------------------

    def _pick(self, seq):
        return seq[self.rng.randrange(len(seq))]

    def _lid(self) -> str:
        return self._pick(self.own_ids)

    def _headers(self, lid: str | None) -> tuple[dict[str, str], str]:
        """(headers, tag): usually ``lid``'s valid headers; sometimes hostile ones."""
        r = self.rng.random()
        self.token_owner = lid
        if r < 0.85:
            return dict(self.headers_for(lid)), ""
        if r < 0.90 and self.victim_ids:  # another learner's credentials
            self.token_owner = self._pick(self.victim_ids)
            return dict(self.headers_for(self.token_owner)), "/other_token"
        tok = self.headers_for(lid).get("Authorization", "Bearer x").split(" ", 1)[-1]
        bad = self._pick(_BAD_AUTH)
        return ({} if bad is None else {"Authorization": bad.format(tok=tok)}), "/bad_auth"

    def _valid(self, route: str, lid: str) -> dict[str, Any]:
        rng = self.rng
        if route == "join":
            return {"learner_id": lid, "incarnation": rng.randrange(3), "uptime_s": rng.random() * 100}
        if route == "heartbeat":
            body = {"learner_id": lid, "incarnation": rng.randrange(2), "step": rng.randrange(400),
                    "step_time_s": rng.random(), "tokens_total": rng.randrange(10**6),
                    "train_loss": 2 + rng.random(), "tokens_per_s": rng.random() * 1e4,
                    "bytes_down": rng.randrange(10**6), "bytes_up": rng.randrange(10**6), "uptime_s": 10.0}
            if rng.random() < 0.3:
                body["base_versions"] = {str(p): rng.randrange(20) for p in range(self.fragments)}
            return body
        fragment, round_n = rng.randrange(self.fragments), 1 + rng.randrange(60)
        if self.object_keys and rng.random() < 0.5:
            key, nbytes, sha = self._pick(self.object_keys)
        else:
            key, nbytes, sha = f"{self.run_id}/contributions/p{fragment}/r{round_n}/{lid}-x.safetensors", 100, _SHA
        return {"learner_id": lid, "fragment": fragment, "round_n": round_n, "base_version": max(0, round_n - 1),
                "c_steps": 4, "c_tokens": 256, "compute_s": 0.1, "key": key, "nbytes": nbytes, "sha256": sha,
                "codec": self._pick(["fp32", "fp32", "bf16", "int8", "int4", "int2"]),
                "update_id": f"u{rng.randrange(10**6)}"}

    def _mutate(self, body: dict[str, Any]) -> tuple[bytes, str]:
        """``body`` with at most one mutation, serialized; and the mutation's name."""
        rng = self.rng
        fields = list(body)
        m = rng.choices(["valid", "boundary", "wrong_type", "non_finite", "long_int", "deep", "huge_string",
                         "unknown_key", "missing_key", "other_learner", "replay", "raw"],
                        [20, 14, 10, 6, 4, 3, 4, 5, 5, 6, 5, 5])[0]
        name = self._pick(fields)
        if m == "valid":
            raw = json.dumps(body).encode()
            if len(self.sent) < 512:
                self.sent.append(("", raw))
            else:
                self.sent[rng.randrange(512)] = ("", raw)
            return raw, m
        if m == "boundary":
            body[name] = self._pick(_huge_ints() + _FLOATS)
        elif m == "wrong_type":
            body[name] = self._pick(_WRONG_TYPES)
        elif m == "non_finite":  # json.dumps cannot write these in standard JSON: splice the literal
            return json.dumps({**body, name: "@@"}).replace('"@@"', self._pick(_NON_FINITE).decode()).encode(), m
        elif m == "long_int":
            digits = "9" * self._pick([400, 4300, 4301, 20000])
            return json.dumps({**body, name: "@@"}).replace('"@@"', digits).encode(), m
        elif m == "deep":
            depth = self._pick([100, 1000, 10_000, 100_000])
            return json.dumps({**body, name: "@@"}).replace('"@@"', "[" * depth + "]" * depth).encode(), m
        elif m == "huge_string":
            body[name] = "x" * self._pick([65, 1025, 100_000, 900_000, 2_000_000])
        elif m == "unknown_key":
            body[self._pick(["extra", "is_admin", "__proto__", "x" * 300, ""])] = self._pick(_WRONG_TYPES)
        elif m == "missing_key":
            body.pop(name)
        elif m == "other_learner" and self.victim_ids:
            body["learner_id"] = self._pick(self.victim_ids)
        elif m == "replay" and self.sent:
            return self._pick(self.sent)[1], m
        elif m == "raw":
            return self._pick(_RAW_BODIES), m
        return json.dumps(body).encode(), m

    def _post(self, route: str) -> FuzzRequest:
        lid = self._lid()
        body = self._valid(route, lid)
        raw, m = self._mutate(body)
        headers, tag = self._headers(lid)
        if tag != "/bad_auth" and self.token_owner != body.get("learner_id", self.token_owner):
            tag += "/impersonation"  # the body names a learner other than the token's
        if self.rng.random() < 0.9:
            headers["Content-Type"] = "application/json"
        return FuzzRequest("POST", f"/{route}", raw, headers, f"{route}/{m}{tag}")

    # -- routes --------------------------------------------------------------------------------

    def _join(self) -> FuzzRequest:
        return self._post("join")

    def _heartbeat(self) -> FuzzRequest:
        return self._post("heartbeat")

    def _announce(self) -> FuzzRequest:
        return self._post("announce")

    def _checkpoint(self) -> FuzzRequest:
        headers, tag = self._headers(None)
        return FuzzRequest("POST", "/checkpoint", self._pick([b"{}", b"", b"[" * 1000]), headers, f"checkpoint{tag}")

    def _status(self) -> FuzzRequest:
        query = self._pick(["", "", "?x=1", "?since=-1", "?" + "a=b&" * 500])
        return FuzzRequest("GET", f"/status{query}", None, {}, "status")

    def _health(self) -> FuzzRequest:
        return FuzzRequest("GET", "/health", None, {}, "health")

    def _metrics(self) -> FuzzRequest:
        since = self._pick(["0", "1", "-1", "x", "1e3", "9" * 5000, str(2**80), str(STEP_MAX), "", "0&since=5",
                            "%ff", str(self.rng.randrange(10**6))])
        headers, tag = self._headers(None)
        return FuzzRequest("GET", f"/metrics?since={since}", None, headers, f"metrics{tag}")

    def _ws(self) -> FuzzRequest:
        lid = self._pick(self.own_ids + self.victim_ids + ["", "a b", "x" * 300, "%ff"])
        headers, tag = self._headers(lid if lid in self.own_ids + self.victim_ids else None)
        return FuzzRequest("WS", f"/ws?learner_id={lid}", self._pick([None, b"hello", b"\x00\xff", b"{}"]),
                           headers, f"ws{tag}")

    def _unknown(self) -> FuzzRequest:
        if self.rng.random() < 0.5:
            path = self._pick(_UNKNOWN_PATHS)
            return FuzzRequest(self._pick(["GET", "POST"]), path, b"{}", {}, "unknown/path")
        path = self._pick(["/join", "/heartbeat", "/announce", "/status", "/metrics", "/health", "/checkpoint", "/ws"])
        headers, _ = self._headers(None)
        return FuzzRequest(self._pick(_OTHER_METHODS), path, self._pick([None, b"{}"]), headers, "unknown/method")
