"""Every error the server answers, in OpenAI's shape::

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

``ENGINE_ERRORS`` is the one table from weightlift's typed exceptions to HTTP statuses.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

import weightlift

INVALID = "invalid_request_error"
SERVER = "server_error"


class APIError(Exception):
    """An answer other than 200, raised anywhere a request is handled."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# (exception, status, type, code, the request field it is about: "prompt" and "grammar" stand
# for the field the request used, e.g. "messages" or "response_format"). First match wins.
ENGINE_ERRORS: tuple[tuple[type[BaseException], int, str, str, str | None], ...] = (
    (weightlift.ContextFullError, 400, INVALID, "context_length_exceeded", "prompt"),
    (weightlift.GrammarError, 400, INVALID, "invalid_grammar", "grammar"),
    (weightlift.UnsupportedError, 400, INVALID, "unsupported", None),
    (weightlift.ClosedError, 503, SERVER, "model_closed", None),
    (weightlift.OutOfMemoryError, 503, SERVER, "out_of_memory", None),
    # The argument checks of create_completion / create_chat_completion (PlanError included).
    (ValueError, 400, INVALID, "invalid_value", None),
    (TypeError, 400, INVALID, "invalid_value", None),
    # An int too large for the engine's argument (Python's own error for it).
    (OverflowError, 400, INVALID, "invalid_value", None),
    (weightlift.WeightliftError, 500, SERVER, "engine_error", None),
    (Exception, 500, SERVER, "internal_error", None),
)

# A message that starts with a field's name, or a path in it (`top_p:`, `logit_bias[5]:`,
# `response_format.json_schema.schema.minimum:`), after the sampler's word `sampling`.
_LEADING_FIELD = re.compile(r"^(?:sampling )?([a-z_]+)(?:\[[^\]]*\]|\.[\w$]+)*:")
# Messages that name no field but are about one the request used: its token ids and its
# messages' contents are the prompt's, a JSON schema's keywords the grammar's.
_ROLE_OF_MESSAGE = (
    (re.compile(r"^token ids?\b"), "prompt"),
    (re.compile(r"^message\b"), "prompt"),
    (re.compile(r"^json schema\b"), "grammar"),
)


def from_engine(e: Exception, fields: Collection[str], roles: dict[str, str]) -> APIError:
    """The answer to an exception of a generation; ``fields`` are the request's field names
    (a message that starts with one names it), ``roles`` map "prompt"/"grammar" to fields."""
    message = " ".join(str(e).split()) or type(e).__name__
    _, status, kind, code, role = next(row for row in ENGINE_ERRORS if isinstance(e, row[0]))
    role = next((r for pattern, r in _ROLE_OF_MESSAGE if pattern.match(message)), role)
    m = _LEADING_FIELD.match(message)
    param = m.group(1) if m and m.group(1) in fields else roles.get(role or "")
    return APIError(status, message, type=kind, param=param, code=code)


# A step of pydantic's error path that names a member of a union field (``stop``'s ``str`` and
# ``list[str]``), not a field or an index.
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|(list|dict)\[.*\])$")


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a bool"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "a list" if isinstance(value, list) else "an object"


def _union_complaint(at: int, paths: list[list[str]], errors: list[Any]) -> tuple[list[str], str]:
    """The path and words of a union field's complaint, the field ending before step ``at`` of
    ``paths[0]``: those of a member that took the value's kind and failed inside it, else the
    kinds the members take against the kind that came."""
    field = paths[0][:at]
    mine = [(p, e) for p, e in zip(paths, errors, strict=True) if p[:at] == field and len(p) > at]
    for p, e in mine:
        if len(p) > at + 1:
            return field + p[at + 1 :], str(e.get("msg"))
    kinds = list(dict.fromkeys(p[at] for p, _ in mine))
    taken = kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} or {kinds[-1]}"
    return field, f"expected {taken}, got {_json_kind(errors[0].get('input'))}"


def _validation(exc: RequestValidationError) -> APIError:
    """pydantic's first complaint, naming the field by its path (``messages.0.role``); a union
    field (``stop``, ``prompt``) by its own name (``_union_complaint``)."""
    errors = exc.errors()
    first = errors[0]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "not JSON")
        return APIError(400, f"malformed JSON in the request body: {reason}", code="invalid_json")
    paths = [[str(part) for part in e.get("loc", ()) if part != "body"] for e in errors]
    loc, message = paths[0], str(first.get("msg"))
    at = next((i for i, part in enumerate(loc) if _UNION_MEMBER.match(part)), None)
    if at is not None:
        loc, message = _union_complaint(at, paths, errors)
    param = ".".join(loc) or None
    what = f"{param}: " if param else "request body: "
    return APIError(400, what + message, param=param, code="invalid_value")


def install(app: FastAPI) -> None:
    """Answer every error of ``app`` in OpenAI's shape."""

    async def api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return _validation(exc).response()

    async def http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        kind = INVALID if exc.status_code < 500 else SERVER
        return APIError(exc.status_code, str(exc.detail), type=kind).response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(RequestValidationError, validation)
    app.add_exception_handler(HTTPException, http)
