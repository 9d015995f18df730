"""What every request schema shares: field errors that name their field, and unknown fields
kept and logged once per name (as vLLM's OpenAIBaseModel keeps them)."""

from __future__ import annotations

import logging
import threading

from pydantic import BaseModel, ConfigDict, model_validator

logger = logging.getLogger(__name__)


class ParamError(ValueError):
    """A request field with an unacceptable value; `param` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# ---- unknown fields: logged once per name ------------------------------------------------
_logged_unknown: set[str] = set()
_logged_lock = threading.Lock()


def _log_unknown(where: str, names) -> None:
    for name in names:
        key = f"{where}.{name}"
        with _logged_lock:
            if key in _logged_unknown:
                continue
            _logged_unknown.add(key)
        logger.warning("Requests carry the field %r, which is not part of vLLM's %s schema: "
                       "it is ignored (logged once).", name[:64], where)


class Body(BaseModel):
    """Extra fields are kept (and logged once per name), as vLLM's OpenAIBaseModel does."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _note_unknown(self):
        extra = set(self.model_extra or ())
        if extra:
            _log_unknown(type(self).__name__, sorted(extra))
        return self
