"""`jaxserve serve`: its flags (vLLM's names, in vLLM's --help groups) and the start of the
HTTP (and gRPC) server. The flags vLLM has and jaxserve has no counterpart of are answered by
config/vllm_flags.py: accepted with a warning, or refused with the reason."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging

from jaxserve.cli.common import (
    add_engine_args,
    add_model_positional,
    engine_config,
    model_folder,
)
from jaxserve.cli.hosts import add_distributed_args, join_hosts, multi_host
from jaxserve.config.engine_args import EngineArgs, human_int
from jaxserve.config.logs import FORMATS
from jaxserve.config.vllm_flags import add_compat_args, check_compat
from jaxserve.parsers.tools import PARSERS

logger = logging.getLogger("jaxserve.serve")
UVICORN_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def add_serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve the OpenAI-compatible HTTP API",
        usage="jaxserve serve [MODEL] [options]",
        description="Serve /v1/completions, /v1/chat/completions and friends. --help=GROUP "
        "shows one group of flags (--help=listgroup names them), --help=WORD the flags "
        "whose names contain WORD.")
    add_model_positional(p)
    add_config_flag(p)
    add_engine_args(p)
    _frontend_args(p.add_argument_group("Frontend", "the HTTP server"))
    _chat_args(p.add_argument_group("Chat", "chat templates, tools and reasoning"))
    _limit_args(p.add_argument_group("Server limits", "what the server takes on at once"))
    _log_args(p.add_argument_group("Logging"))
    _grpc_args(p.add_argument_group("gRPC", "vLLM's gRPC engine service beside HTTP"))
    _lora_args(p.add_argument_group("LoRA adapters", "served by name (with --enable-lora)"))
    add_distributed_args(p.add_argument_group("Multi-host", "one command on every host"))
    add_compat_args(p)
    p.set_defaults(func=run_serve)


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """--config FILE.yaml (read by cli.main before parsing: config_file.py)."""
    parser.add_argument("--config", dest="config_file", default=None, metavar="FILE.yaml",
                        help="read flags from a YAML file of long flag names (without --) "
                        "and values, as vLLM's; flags on the command line win")


def add_log_format_args(parser, suppress: bool) -> None:
    """--log-format and --log-config-file (on the main parser, and after `serve`)."""
    default = argparse.SUPPRESS if suppress else None
    parser.add_argument("--log-format", default=default, choices=FORMATS,
                        help="text (default) or json: one JSON object per line, for log "
                        "pipelines; jaxserve's and uvicorn's lines alike")
    parser.add_argument("--log-config-file", default=default, metavar="FILE.json",
                        help="a logging dictConfig JSON file for jaxserve's and uvicorn's "
                        "loggers, instead of --log-format (vLLM's flag)")


def _frontend_args(g) -> None:
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) clients send; the first is the main one, in "
                   "metrics and logs (default: the model argument)")
    g.add_argument("--api-key", nargs="+", action="extend", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every API route; several keys "
                   "are each accepted (default: $JAXSERVE_API_KEY, else $VLLM_API_KEY)")
    g.add_argument("--metrics-require-auth", action="store_true",
                   help="with --api-key, protect /metrics too")
    g.add_argument("--root-path", default="", metavar="PREFIX",
                   help="behind a proxy that serves this server under a path prefix and "
                   "strips it (e.g. /llm): the prefix, for the URLs the server reports")
    g.add_argument("--ssl-keyfile", default=None, help="HTTPS: the private key file")
    g.add_argument("--ssl-certfile", default=None,
                   help="HTTPS: the certificate chain file (turns HTTPS on)")
    g.add_argument("--ssl-ca-certs", default=None,
                   help="HTTPS: the CA certificates that sign client certificates")
    g.add_argument("--ssl-cert-reqs", type=int, default=0, choices=(0, 1, 2),
                   help="client certificates: 0 none, 1 optional, 2 required (Python's "
                   "ssl.CERT_*; default 0)")
    g.add_argument("--allowed-origins", default="",
                   help="CORS origins, comma-separated or as a JSON list ('[\"*\"]', vLLM's "
                   "form) (default: no CORS headers)")
    g.add_argument("--allowed-methods", default='["*"]',
                   help="CORS: allowed methods, a JSON list or comma-separated (default all)")
    g.add_argument("--allowed-headers", default='["*"]',
                   help="CORS: allowed headers, a JSON list or comma-separated (default all)")
    g.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="do not serve the OpenAPI schema at /openapi.json")
    g.add_argument("--enable-request-id-headers", action="store_true",
                   help="put X-Request-Id on every response (the client's own, else the "
                   "server's id of the request)")
    g.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="the default of the request field: logprobs name tokens as "
                   "'token_id:N'")
    g.add_argument("--enable-force-include-usage", action="store_true",
                   help="every streamed response ends with a usage chunk, as if its "
                   "stream_options.include_usage were set")


def _chat_args(g) -> None:
    g.add_argument("--chat-template", default=None,
                   help="chat template (a file, or the template itself) instead of the "
                   "tokenizer's")
    g.add_argument("--default-chat-template-kwargs", type=_json_object, default=None,
                   metavar="JSON", help="variables every chat template render gets, as a JSON "
                   "object (e.g. '{\"enable_thinking\": false}'); a request's "
                   "chat_template_kwargs win")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template sent with a request (refused by default)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto": the model writes calls in its own format, '
                   "read out by --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=tuple(PARSERS),
                   help="how calls look in the model's text: hermes (Qwen2.5/Qwen3 and many "
                   "fine-tunes), llama3_json (Llama 3.1+), mistral, pythonic (Gemma 3), "
                   "phi4_mini_json, deepseek_v3 (DeepSeek-V3, R1), deepseek_v31, kimi_k2")
    g.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help='with tool_choice "none", leave the tools out of the prompt (by '
                   "default the chat template still sees them)")
    g.add_argument("--reasoning-parser", default=None, choices=("qwen3", "deepseek_r1"),
                   help="put the model's thinking (<think>...</think>) in reasoning_content "
                   "and reasoning, and apply structured outputs after it")


def _limit_args(g) -> None:
    g.add_argument("--max-body-bytes", type=human_int, default=4 * 1024 * 1024,
                   help="largest request body (4M = 4 MiB; default 4M)")
    g.add_argument("--max-waiting-requests", type=int, default=4096,
                   help="admission cap on waiting sequences: beyond it new requests get "
                   "429 (default 4096, above max_embedding_inputs' 2048 so an embedding "
                   "request of that many inputs is admitted)")
    g.add_argument("--max-n", type=int, default=None,
                   help="largest n a request may ask for (default 16; the request limit "
                   "max_n, also settable in --request-limits)")
    g.add_argument("--max-prompts-per-request", type=int, default=None,
                   help="most prompts one batched completion request may carry (default 256; "
                   "the request limit max_prompts)")
    g.add_argument("--limit-concurrency", type=int, default=None,
                   help="connections and requests at once (uvicorn's; beyond it, 503), and "
                   "gRPC calls at once (default: what the process's open-file limit allows, "
                   "at most 4096)")
    g.add_argument("--max-preparing-requests", type=int, default=256,
                   help="requests being parsed, tokenized and compiled at once; beyond it "
                   "a request gets 503 with Retry-After")
    g.add_argument("--max-stored-responses", type=int, default=1024,
                   help="/v1/responses answers kept in memory (store=true) for GET "
                   "/v1/responses/{id} and previous_response_id; past it the least recently "
                   "used is evicted (default 1024)")
    g.add_argument("--max-stored-response-bytes", type=human_int, default=256 * 2**20,
                   help="the stored /v1/responses answers' size at most (their text, "
                   "256M = 256 MiB; default 256M); past it the least recently used are "
                   "evicted")
    g.add_argument("--stream-write-timeout", type=float, default=60.0,
                   help="seconds a client may leave its response unread (the connection's "
                   "send buffer full) before the connection is cut and its request aborted")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    g.add_argument("--request-read-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's headers, then its body "
                   "(a body not received in time gets 408 and the connection closes)")
    g.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open")
    g.add_argument("--h11-max-incomplete-event-size", type=human_int, default=None,
                   help="most bytes of a request's headers (default: uvicorn's, 16K)")
    g.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="step the engine in a process of its own (as vLLM's engine core), so "
                   "that HTTP work never delays the device's next step; --no-engine-process "
                   "steps it on a thread of the server's process (multi-host runs always "
                   "do). Default: a process when this one may use 4 or more CPUs (the core "
                   "then has one to itself; on fewer it competes with the HTTP side)")


def _log_args(g) -> None:
    add_log_format_args(g, suppress=True)
    g.add_argument("--enable-log-requests", action="store_true",
                   help="log each request received (prompt, parameters) and finished "
                   "(tokens, TTFT, finish reason); off by default, as vLLM's")
    g.add_argument("--enable-log-outputs", action="store_true",
                   help="with --enable-log-requests, log each request's output text too")
    g.add_argument("--max-log-len", type=int, default=None,
                   help="at most this many prompt characters (or ids) and output characters "
                   "in those lines (default: all)")
    g.add_argument("--disable-log-stats", action="store_true",
                   help="no periodic throughput line")
    g.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LEVELS,
                   help="uvicorn's logging level (default info)")
    g.add_argument("--disable-uvicorn-access-log", action="store_true",
                   help="no line per HTTP request")
    g.add_argument("--disable-access-log-for-endpoints", default="", metavar="PATHS",
                   help="comma-separated paths without access-log lines (e.g. "
                   "/health,/metrics)")


def _grpc_args(g) -> None:
    g.add_argument("--grpc-port", type=int, default=None,
                   help="also serve vLLM's gRPC engine service (vllm.grpc.engine.VllmEngine, "
                   "for routers such as the SMG gateway) on this port, beside HTTP")
    g.add_argument("--grpc-host", default=None, help="gRPC bind address (default: --host)")
    g.add_argument("--grpc-ssl-certfile", default=None, help="gRPC TLS: the certificate chain")
    g.add_argument("--grpc-ssl-keyfile", default=None, help="gRPC TLS: the private key")


def _lora_args(g) -> None:
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served under their names: a request's "
                   "model picks one; name=path, or JSON {\"name\": ..., \"path\": ..., "
                   "\"base_model_name\": ...}")
    g.add_argument("--allow-runtime-lora-updating", action="store_true",
                   help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's "
                   "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, also honoured)")
    g.add_argument("--allowed-lora-paths", nargs="+", default=None, metavar="DIR",
                   help="folders adapters may be loaded from at run time (a lora_path "
                   "elsewhere is refused)")


def server_config(args: argparse.Namespace):
    """The ServerConfig of the parsed flags (checked: a bad value is a ValueError)."""
    from jaxserve.server.app import ServerConfig
    from jaxserve.server.lora_models import (
        LoraSettings,
        parse_lora_modules,
        runtime_updates_from_env,
    )
    from jaxserve.server.openai.options import ChatSettings, ResponseOptions

    if args.max_log_len is not None and args.max_log_len < 0:
        raise ValueError(f"--max-log-len must be >= 0, got {args.max_log_len}.")
    names = tuple(args.served_model_name or [args.model or "jaxserve-default"])
    return ServerConfig(
        host=args.host, port=args.port, served_model_name=names,
        api_key=_api_keys(args.api_key), metrics_require_auth=args.metrics_require_auth,
        allowed_origins=_origins(args.allowed_origins),
        cors_methods=_origins(args.allowed_methods, "--allowed-methods"),
        cors_headers=_origins(args.allowed_headers, "--allowed-headers"),
        cors_credentials=args.allow_credentials,
        chat=ChatSettings(template=_chat_template(args.chat_template),
                          default_kwargs=args.default_chat_template_kwargs or {},
                          trust_request_template=args.trust_request_chat_template,
                          tool_call_parser=_tool_call_parser(args),
                          reasoning_parser=args.reasoning_parser,
                          exclude_tools_when_none=args.exclude_tools_when_tool_choice_none),
        responses=ResponseOptions(return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                                  force_include_usage=args.enable_force_include_usage,
                                  log_requests=args.enable_log_requests,
                                  log_outputs=_log_outputs(args),
                                  max_log_len=args.max_log_len),
        max_body_bytes=args.max_body_bytes, max_waiting_requests=args.max_waiting_requests,
        shutdown_timeout=args.shutdown_timeout, request_read_timeout=args.request_read_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        stream_write_timeout=args.stream_write_timeout,
        limit_concurrency=args.limit_concurrency or _default_concurrency(),
        max_preparing_requests=args.max_preparing_requests,
        max_stored_responses=args.max_stored_responses,
        max_stored_response_bytes=args.max_stored_response_bytes, root_path=args.root_path,
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs,
        openapi=not args.disable_fastapi_docs,
        request_id_headers=args.enable_request_id_headers,
        uvicorn_log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        access_log_quiet_paths=tuple(p.strip() for p in
                                     args.disable_access_log_for_endpoints.split(",")
                                     if p.strip()),
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
        log_stats=not args.disable_log_stats,
        lora=LoraSettings(parse_lora_modules(args.lora_modules),
                          args.allow_runtime_lora_updating or runtime_updates_from_env(),
                          tuple(args.allowed_lora_paths or ())))


def _check_lora_flags(args: argparse.Namespace) -> None:
    """LoRA's flags mean nothing without --enable-lora: refused rather than ignored."""
    if args.enable_lora:
        return
    for flag, given in (("--lora-modules", args.lora_modules),
                        ("--max-loras", args.max_loras != 1),
                        ("--max-lora-rank", args.max_lora_rank != 16),
                        ("--max-cpu-loras", args.max_cpu_loras is not None),
                        ("--allow-runtime-lora-updating", args.allow_runtime_lora_updating),
                        ("--allowed-lora-paths", args.allowed_lora_paths)):
        if given:
            raise ValueError(f"{flag} configures LoRA adapters, which are off: add "
                             "--enable-lora (or drop the flag).")


def check_serve_args(args: argparse.Namespace):
    """Everything about the flags that can be checked before the model loads: vLLM's flags
    without a counterpart (a warning each, or a ValueError), the server's settings, the
    request limits. Returns (ServerConfig, GrpcConfig or None)."""
    from jaxserve.config.request_limits import RequestLimits

    check_compat(args, logger.warning)
    _check_lora_flags(args)
    config = server_config(args)
    # --max-n and --max-prompts-per-request are request limits, as --request-limits holds.
    limits = RequestLimits.parse(args.request_limits).replace(
        max_n=args.max_n, max_prompts=args.max_prompts_per_request)
    args.request_limits = dataclasses.asdict(limits)
    return config, _grpc_config(args, config)


def run_serve(args: argparse.Namespace) -> int:
    from jaxserve.config import progress
    from jaxserve.server.launch import serve

    config, grpc_config = check_serve_args(args)
    progress.use_log_lines()  # no progress bars in a server's log (here and in the core)
    model = model_folder(args, logger)
    join_hosts(args, "background", engine_config)  # (other hosts end here)
    from jaxserve.engine.core_client import EngineCoreClient, engine_process_by_default

    if not multi_host(args) and (args.engine_process if args.engine_process is not None
                                  else engine_process_by_default()):
        from jaxserve.engine.data_parallel import engine_from_args

        engine = EngineCoreClient(engine_from_args, (EngineArgs.from_cli(args), model,
                                                     "background"), log_level=args.log_level)
    else:
        from jaxserve.engine.data_parallel import create_engine

        engine = create_engine(engine_config(args, model, "background"))
    return serve(engine, config, grpc_config)


def _log_outputs(args: argparse.Namespace) -> bool:
    if args.enable_log_outputs and not args.enable_log_requests:
        raise ValueError("--enable-log-outputs adds the output text to the request log "
                         "lines: add --enable-log-requests.")
    return args.enable_log_outputs


def _grpc_config(args: argparse.Namespace, server_config):
    """The gRPC server's settings, or None without --grpc-port (the other --grpc-* flags
    then have nothing to configure, and are refused)."""
    if args.grpc_port is None:
        given = [f"--grpc-{name.replace('_', '-')}" for name in ("host", "ssl_certfile",
                                                                  "ssl_keyfile")
                 if getattr(args, f"grpc_{name}") is not None]
        if given:
            raise ValueError(f"{', '.join(given)} configure the gRPC server: add --grpc-port.")
        return None
    from jaxserve.server.grpc.server import GrpcConfig

    return GrpcConfig(port=args.grpc_port, host=args.grpc_host or server_config.host,
                      ssl_certfile=args.grpc_ssl_certfile, ssl_keyfile=args.grpc_ssl_keyfile,
                      max_receive_bytes=server_config.max_body_bytes,
                      max_concurrent_rpcs=server_config.limit_concurrency)


def _default_concurrency() -> int:
    """Connections and requests at once: what the open-file limit leaves room for (each
    connection is a file descriptor; the engine needs some of its own), at most 4096."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft - 128))


def _tool_call_parser(args: argparse.Namespace) -> str | None:
    """The parser for tool_choice "auto", as vLLM: both flags, or neither."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{', '.join(PARSERS)}).")
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text[:80]!r}")
    return value


def _api_keys(flags: list[str] | None) -> tuple[str, ...]:
    """--api-key values, else $JAXSERVE_API_KEY, else $VLLM_API_KEY (as vLLM)."""
    import os

    if flags:
        keys = tuple(flags)
    else:
        keys = tuple(k for k in (os.environ.get("JAXSERVE_API_KEY"),
                                 os.environ.get("VLLM_API_KEY")) if k)[:1]
    if any(not key.strip() for key in keys):
        raise ValueError("--api-key: an API key must not be empty.")
    return keys


def _origins(text: str, flag: str = "--allowed-origins") -> tuple[str, ...]:
    """CORS origins (methods, headers): a JSON list (vLLM's form, '["*"]') or
    comma-separated."""
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, list) or not all(isinstance(o, str) for o in value):
            raise ValueError(f"{flag}: {text[:80]!r} is not a JSON list of strings.")
        return tuple(o.strip() for o in value if o.strip())
    return tuple(o.strip() for o in text.split(",") if o.strip())


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file's contents, or the value itself when it is a template."""
    import pathlib

    if value is None:
        return None
    path = pathlib.Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" not in value:
        raise ValueError(f"--chat-template: {value[:80]!r} is neither a file nor a Jinja "
                         "template.")
    return value
