"""The server's LoRA adapters by name (vLLM's OpenAIServingModels, its LoRA part).

Adapters come from `--lora-modules name=path` at start and, when runtime updates are on
(`--allow-runtime-lora-updating` or vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), from
`POST /v1/load_lora_adapter`; `POST /v1/unload_lora_adapter` forgets one. A request's
`model` naming an adapter runs with it (a LoRARequest through the admission path); /v1/models
lists each with its parent (not its folder: API clients do not see the server's paths). A
folder loaded at run time must lie inside one of `--allowed-lora-paths` (symbolic links
resolved first, the folder's files too), and is checked as every adapter is
(admission.check_lora: its config, tensor header and values against the model and
max_lora_rank) before it is registered: a bad adapter is refused and nothing is kept. Every
adapter keeps its resolved folder, the one that was checked: a link re-pointed afterwards
changes nothing. Names and folders are
bounded by the request limits max_lora_name_length, max_lora_path_length and
max_lora_adapters.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import threading

from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import PlainTextResponse

from jaxserve.config.request_limits import limit_error
from jaxserve.models.lora import CONFIG_FILE, WEIGHTS_FILE, LoRARequest
from jaxserve.server.errors import APIError, from_value_error
from jaxserve.server.request_body import parse_body
from jaxserve.server.schema_base import Body

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


@dataclasses.dataclass(frozen=True)
class LoraModule:
    name: str
    path: str
    base_model_name: str | None = None


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """--lora-modules, runtime updates, and where runtime-loaded adapters may live."""

    modules: tuple[LoraModule, ...] = ()
    runtime_updates: bool = False
    allowed_paths: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise ValueError("--lora-modules names an adapter twice; give each name once.")


def runtime_updates_from_env() -> bool:
    """vLLM's switch for the load/unload routes."""
    return os.environ.get(RUNTIME_ENV, "").strip().lower() in ("1", "true")


def parse_lora_modules(values: list[str] | None) -> tuple[LoraModule, ...]:
    """vLLM's --lora-modules forms: name=path, or JSON {"name", "path", "base_model_name"}."""
    modules = []
    for value in values or ():
        if value.lstrip().startswith("{"):
            try:
                raw = json.loads(value)
            except ValueError:
                raise ValueError(f"--lora-modules {value[:80]!r}: not valid JSON.") from None
            extra = set(raw) - {"name", "path", "base_model_name"} if isinstance(raw, dict) \
                else set()
            if not isinstance(raw, dict) or extra or not isinstance(raw.get("name"), str) or \
                    not isinstance(raw.get("path"), str):
                raise ValueError(f"--lora-modules {value[:80]!r}: expected "
                                 '{"name": ..., "path": ..., "base_model_name": ...}'
                                 + (f"; unknown field(s) {sorted(extra)}" if extra else "") + ".")
            modules.append(LoraModule(raw["name"], raw["path"], raw.get("base_model_name")))
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules {value[:80]!r}: expected name=path (or JSON).")
        modules.append(LoraModule(name, path))
    return tuple(modules)


class LoadLoRAAdapterRequest(Body):
    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(Body):
    lora_name: str
    lora_int_id: int | None = None


class LoraModels:
    """The adapters by name; thread-safe (prepare threads read, routes write)."""

    def __init__(self, processor, served_names: tuple[str, ...],
                 settings: LoraSettings) -> None:
        """processor: the admission path (its check_lora and limits); served_names: the base
        model's names (the first is the adapters' default parent)."""
        self.processor, self.settings = processor, settings
        self.served_names, self.base_name = tuple(served_names), served_names[0]
        self.enabled = processor.lora is not None
        if settings.modules and not self.enabled:
            raise ValueError("--lora-modules needs --enable-lora.")
        if settings.runtime_updates and not self.enabled:
            raise ValueError("Runtime LoRA updates (--allow-runtime-lora-updating or "
                             f"{RUNTIME_ENV}) need --enable-lora.")
        self._roots = tuple(os.path.realpath(p) for p in settings.allowed_paths)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._by_name: dict[str, tuple[LoRARequest, str]] = {}  # name -> (adapter, parent)
        for module in settings.modules:
            try:
                self._add(module.name, os.path.realpath(module.path) if module.path else "",
                          module.base_model_name)
            except APIError as err:
                raise ValueError(f"--lora-modules {module.name}={module.path}: "
                                 f"{err.message}") from None

    @property
    def runtime_updates(self) -> bool:
        return self.settings.runtime_updates

    def lookup(self, name: str) -> LoRARequest | None:
        entry = self._by_name.get(name)
        return None if entry is None else entry[0]

    def names(self) -> list[str]:
        return list(self._by_name)

    def cards(self, created: int, max_model_len: int) -> list[dict]:
        """/v1/models entries: one per adapter, with its parent (vLLM's, but its root is
        the adapter's name, not the server's folder)."""
        return [{"id": name, "object": "model", "created": created, "owned_by": "jaxserve",
                 "root": name, "parent": parent, "max_model_len": max_model_len}
                for name, (lora, parent) in list(self._by_name.items())]

    def _add(self, name: str, path: str, parent: str | None = None) -> LoRARequest:
        limits = self.processor.limits
        try:
            if len(name) > limits.max_lora_name_length:
                raise limit_error("lora_name", "an adapter's name", "max_lora_name_length",
                                  limits.max_lora_name_length, len(name))
            if len(path) > limits.max_lora_path_length:
                raise limit_error("lora_path", "an adapter's folder", "max_lora_path_length",
                                  limits.max_lora_path_length, len(path))
        except ValueError as err:
            raise from_value_error(err, "lora_name") from None
        if not name or not name.strip():
            raise APIError(400, "lora_name must not be empty.", param="lora_name")
        if not path:
            raise APIError(400, "lora_path must not be empty.", param="lora_path")
        if name in self.served_names:
            raise APIError(400, f"lora_name {name[:64]!r} is a name of the base model; give "
                           "the adapter another.", param="lora_name")
        with self._lock:
            if name in self._by_name:
                raise APIError(400, f"The lora adapter {name[:64]!r} has already been loaded.",
                               param="lora_name", code="lora_adapter_exists")
            if len(self._by_name) >= limits.max_lora_adapters:
                raise APIError(400, f"{len(self._by_name)} LoRA adapters are loaded, the most "
                               "this server keeps (request limit max_lora_adapters); unload "
                               "one first.", param="lora_name")
            lora = LoRARequest(name, next(self._ids), path)
        try:
            self.processor.check_lora(lora, field="lora_path")
        except ValueError as err:
            raise from_value_error(err, "lora_path") from None
        with self._lock:
            if name in self._by_name:  # (loaded meanwhile by another request)
                raise APIError(400, f"The lora adapter {name[:64]!r} has already been loaded.",
                               param="lora_name", code="lora_adapter_exists")
            self._by_name[name] = (lora, parent or self.base_name)
        return lora

    def load(self, raw: bytes) -> str:
        """POST /v1/load_lora_adapter: check, then register (on a prepare thread)."""
        body = parse_body(raw, LoadLoRAAdapterRequest)
        if body.load_inplace:
            raise APIError(400, "load_inplace is not supported: unload the adapter, then "
                           "load it again under its name.", param="load_inplace")
        self._add(body.lora_name, self._check_root(body.lora_path))
        return f"Success: LoRA adapter '{body.lora_name}' added successfully."

    def unload(self, raw: bytes) -> str:
        """POST /v1/unload_lora_adapter: new requests may no longer name it (those running
        finish with it; the engine drops its weights when it needs the room)."""
        body = parse_body(raw, UnloadLoRAAdapterRequest)
        with self._lock:
            entry = self._by_name.get(body.lora_name)
            if entry is None or (body.lora_int_id is not None
                                 and entry[0].lora_int_id != body.lora_int_id):
                raise APIError(404, f"The lora adapter {body.lora_name[:64]!r} cannot be "
                               "found.", param="lora_name", code="lora_adapter_not_found")
            del self._by_name[body.lora_name]
        return f"Success: LoRA adapter '{body.lora_name}' removed successfully."

    def _check_root(self, path: str) -> str:
        """The folder resolved (the path every later read uses), once it and the adapter's
        files in it are inside the allowed folders."""
        if not self._roots:
            raise APIError(400, "lora_path: this server loads no adapters at run time from "
                           "local folders until it is told where they may live: start it "
                           "with --allowed-lora-paths DIR.", param="lora_path")
        if "\0" in path:
            raise APIError(400, "lora_path must not contain a NUL character.",
                           param="lora_path")
        if len(path) > self.processor.limits.max_lora_path_length or not path:
            return path  # (_add refuses it with the limit)
        real = os.path.realpath(path)
        for where in (real, *(os.path.realpath(os.path.join(real, name))
                              for name in (CONFIG_FILE, WEIGHTS_FILE))):
            if not any(where == root or where.startswith(root + os.sep)
                       for root in self._roots):
                raise APIError(400, f"lora_path {path[:200]!r} is outside the folders adapters "
                               "may be loaded from (--allowed-lora-paths)"
                               f"{'' if where == real else ': a link among its files'}.",
                               param="lora_path", code="lora_path_not_allowed")
        return real


def lora_routes(state) -> APIRouter | None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter, when runtime updates are on
    (as vLLM registers them only then; None otherwise). state: the app's ServerState."""
    loras = state.serving.loras
    if loras is None or not loras.runtime_updates:
        return None
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        async with state.preparing():
            return PlainTextResponse(await state.off_loop(loras.load, await request.body()))

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        async with state.preparing():
            return PlainTextResponse(await state.off_loop(loras.unload,
                                                          await request.body()))

    return router
