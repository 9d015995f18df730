"""Request bodies: JSON bytes -> a validated pydantic model, or a 400. Nothing else escapes.

Bounded: a body nested deeper than MAX_JSON_DEPTH is refused before it is parsed
(bounded_json.py: Python's parser and pydantic both recurse, and a deep enough body would
exhaust the stack); NaN and Infinity literals and lone surrogates are refused. Runs off the
event loop (the caller's worker thread), so a large body never stalls other clients.
"""

from __future__ import annotations

import json
import logging

from pydantic import BaseModel, ValidationError

from jaxserve.inputs.bounded_json import DEFAULT_MAX_DEPTH as MAX_JSON_DEPTH
from jaxserve.inputs.bounded_json import reject_constant, too_deep
from jaxserve.server.errors import APIError, from_validation_error

logger = logging.getLogger(__name__)


def parse_body(raw: bytes, model: type[BaseModel]) -> BaseModel:
    """The body as `model`; APIError(400) for anything else."""
    if too_deep(raw):
        raise APIError(400, f"The request body nests arrays/objects deeper than "
                       f"{MAX_JSON_DEPTH} levels.", code="invalid_json")
    try:
        data = json.loads(raw, parse_constant=reject_constant)
        json.dumps(data, ensure_ascii=False).encode("utf-8")  # no lone surrogates
    except (ValueError, UnicodeError, RecursionError):
        raise APIError(400, "The request body is not valid JSON (UTF-8, no NaN or Infinity).",
                       code="invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise from_validation_error(err) from None
    except Exception as err:  # noqa: BLE001 - a validator that raised something else
        logger.debug("Request body refused: %s", err, exc_info=err)
        raise APIError(400, "The request body does not match the expected schema.",
                       code="invalid_value") from None
