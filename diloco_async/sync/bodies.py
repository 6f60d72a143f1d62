"""Decoding and validating a learner's JSON message, shared by the HTTP routes and the WebSocket
request channel (:mod:`~diloco_async.sync.http`, :mod:`~diloco_async.sync.ws_requests`).

A message that does not validate raises :class:`BadRequest` with a ``reason`` from a bounded
set (``not_utf8``, ``json_too_deep``, ``invalid_json``, ``number_too_long``, ``not_an_object``,
``field:<name>``, ``unexpected_field``, and the WebSocket frame's own ``bad_frame``) and a
detail of at most :data:`DETAIL_CHARS` characters naming what is wrong.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ValidationError

__all__ = ["DETAIL_CHARS", "BadRequest", "decode", "validate", "field_errors"]

DETAIL_CHARS = 300  # longest reason echoed to the client and logged


class BadRequest(Exception):
    """A request that does not validate: ``reason`` (a counter name from a bounded set) and a detail."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail[:DETAIL_CHARS]


def field_errors(err: ValidationError, model: type[BaseModel]) -> BadRequest:
    """The fields that failed, named in the detail; the reason is ``field:<name>`` for a field of
    ``model`` (``unexpected_field`` for any other name, which the sender chose)."""
    errors = err.errors(include_input=False, include_url=False)
    top = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else ""
    reason = f"field:{top}" if top in model.model_fields else "unexpected_field"
    detail = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in errors[:4])
    return BadRequest(reason, detail)


def validate(doc: Any, model: type[BaseModel]) -> BaseModel:
    """``doc`` (a decoded JSON document) as a ``model``.

    Raises:
        BadRequest: not an object (``not_an_object``), or a field out of its bounds.
    """
    if not isinstance(doc, dict):
        raise BadRequest("not_an_object", f"the body must be a JSON object, not {type(doc).__name__}")
    try:
        return model.model_validate(doc)
    except ValidationError as err:
        raise field_errors(err, model) from None


def decode(raw: bytes | str) -> Any:
    """The JSON document in ``raw`` (UTF-8 bytes, or text); hostile input raises
    :class:`BadRequest`, nothing else."""
    try:
        return json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
    except UnicodeDecodeError:
        raise BadRequest("not_utf8", "the body is not UTF-8") from None
    except RecursionError:
        raise BadRequest("json_too_deep", "the JSON document is nested too deep") from None
    except json.JSONDecodeError as err:
        raise BadRequest("invalid_json", f"not JSON: {err}") from None
    except ValueError as err:  # e.g. an integer of more than 4300 digits
        raise BadRequest("number_too_long", str(err)) from None
