"""Error responses: every error body is {"error": {"message", "type", "param", "code"}}.

Messages name the field at fault and never carry more than a short excerpt of the input,
a traceback, or a file path.
"""

from __future__ import annotations

import re

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.responses import JSONResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error",
          429: "rate_limit_error", 500: "internal_server_error", 503: "service_unavailable"}
_FIELD = re.compile(r"^(?:SamplingParams\.)?([a-z_]+)\b")
_PROMPT_FIELDS = {"prompt", "prompt_token_ids"}
_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|function-\w+|\w+\[.*\])$")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # sent with the response (Retry-After)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code or str(self.status)}}

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def from_validation_error(err: RequestValidationError | ValidationError) -> APIError:
    """Pydantic's errors as one 400: the first problem, with its field path as param."""
    problems = err.errors()
    first = problems[0] if problems else {"loc": (), "msg": "invalid request"}
    # Drop "body" and the union-member tags pydantic adds (e.g. prompt.str, prompt.list[int]).
    loc = [str(p) for p in first.get("loc", ())
           if p != "body" and not _TYPE_TAG.match(str(p))]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind in ("json_invalid", "json_type") or (not loc and "dict" in kind):
        return APIError(400, "The request body must be a JSON object.", code="invalid_json")
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg")
    return APIError(400, short(message), param=param, code="invalid_value")


def from_value_error(err: ValueError, prompt_param: str = "prompt") -> APIError:
    """An engine/SamplingParams ValueError as a 400 whose param names the field."""
    message = str(err)
    param = getattr(err, "param", None)
    if param is None:
        match = _FIELD.match(message)
        if match:
            param = prompt_param if match.group(1) in _PROMPT_FIELDS else match.group(1)
    return APIError(400, short(message), param=param, code="invalid_value")


def short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
