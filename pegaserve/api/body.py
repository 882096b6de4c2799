"""Reading a request body: JSON, then text that can be encoded, then the pydantic model. Every
failure is a 400 naming the parameter (never a 422 or a 500)."""

from __future__ import annotations

import functools
import json
import logging
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from pegaserve.api.errors import ApiError, invalid

log = logging.getLogger(__name__)
Model = TypeVar("Model", bound=BaseModel)


def parse_body(raw: bytes, model: type[Model], refuse_unknown: bool = True) -> Model:
    """The body as `model`. A top-level field `model` does not know is a 400 naming it (OpenAI's
    "Unrecognized request argument"), or with `refuse_unknown` off, logged and left out (vLLM's way,
    for clients that send vendor extras)."""
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(f"malformed JSON: {exc}", param=None) from exc
    except RecursionError:
        raise ApiError("malformed JSON: nested too deeply", param=None) from None
    except ValueError:  # an integer literal past Python's limit on digits (4300)
        raise ApiError("malformed JSON: a number has too many digits", param=None) from None
    if not isinstance(data, dict):
        raise ApiError("the request body must be a JSON object", param=None)
    try:
        for key, value in data.items() if _may_hold_surrogates(raw) else ():
            if not _encodable(key) or not _encodable(value):
                raise invalid(key if _encodable(key) else "body",
                              "holds text that is not valid Unicode (a lone surrogate)")
    except RecursionError:  # json.loads took a nesting the walk's deeper stack cannot
        raise ApiError("the request body is nested too deeply", param=None) from None
    if unknown := [key for key in data if key not in known_fields(model)]:
        if refuse_unknown:
            raise ApiError(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])
        log.warning("fields left out of a request, as unknown: %s", ", ".join(map(repr, unknown[:16])))
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise complaint(exc) from None


@functools.cache
def known_fields(model: type[BaseModel]) -> frozenset[str]:
    """The names a body may use at the top level: each field's, and its alias."""
    names = set(model.model_fields)
    names.update(f.alias for f in model.model_fields.values() if f.alias)
    return frozenset(names)


def _may_hold_surrogates(raw: bytes) -> bool:
    """A lone surrogate reaches the parsed body only as a `\\u` escape or as raw UTF-8-style bytes
    (0xED 0xA0-0xBF, which `json.loads` lets through): a body with neither needs no walk."""
    return b"\\u" in raw or b"\xed" in raw


def _encodable(value: object) -> bool:
    """Whether every string in `value` (keys included) encodes to UTF-8: JSON's `\\ud800` is a
    valid escape, but a lone surrogate is no character, and the tokenizer cannot take it."""
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            return False
        return True
    if isinstance(value, list):
        return all(_encodable(v) for v in value)
    if isinstance(value, dict):
        return all(_encodable(k) and _encodable(v) for k, v in value.items())
    return True


def complaint(exc: ValidationError) -> ApiError:
    """pydantic's first complaint, naming the top-level parameter it is about."""
    first = exc.errors(include_url=False, include_input=False)[0]
    loc = [str(p) for p in first.get("loc", ())]
    where = ".".join(loc) or "body"
    return ApiError(f"{where}: {first.get('msg')}", param=loc[0] if loc else None)
