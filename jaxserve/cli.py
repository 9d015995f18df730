"""The `jaxserve` command line: `generate` (offline), `serve` (the OpenAI-compatible HTTP and
gRPC servers), `plan` (memory and buckets, without loading weights) and `convert` (an Orbax
checkpoint); engine flags come from EngineArgs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from jaxserve.config.engine_args import EngineArgs
from jaxserve.config.engine_config import SUPPORTED_DTYPES
from jaxserve.hosts_cli import add_distributed_args, join_hosts, multi_host
from jaxserve.parsers.tools import PARSERS

LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by every subcommand that loads a model: one per EngineArgs field
    (vLLM's names, jaxserve's older ones as aliases), and --log-level."""
    EngineArgs.add_cli_args(parser)
    # Also after the subcommand (`jaxserve serve --log-level DEBUG`); SUPPRESS keeps the
    # main parser's value when it is not given here.
    parser.add_argument("--log-level", default=argparse.SUPPRESS, choices=LOG_LEVELS,
                        help="logging level (default: INFO)")


def engine_config(args: argparse.Namespace, model: str, precompile: bool | str = True,
                  on_accelerator: bool | None = None):
    """The EngineConfig of the parsed flags for a resolved model folder; precompile: the
    command's default (generate: on first use, serve: background)."""
    engine_args = EngineArgs.from_cli(args)
    if on_accelerator is None:
        from jaxserve.backends.selection import on_accelerator as accelerated

        on_accelerator = accelerated(engine_args.backend)
    return engine_args.engine_config(model, on_accelerator=on_accelerator,
                                                   default_precompile=precompile)


def _names_a_model(text: str) -> bool:
    """A local model folder (one with a config.json) or an org/name Hub id."""
    import pathlib
    import re

    if (pathlib.Path(text).expanduser() / "config.json").is_file():
        return True
    return re.fullmatch(r"[\w.-]+/[\w.-]+", text) is not None and ".." not in text


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts (offline)",
                       description="Generate completions offline and print them.")
    add_engine_args(p)
    add_distributed_args(p)
    p.add_argument("prompts", nargs="*", metavar="[MODEL] PROMPT",
                   help="prompt strings; with two or more, a first one that is a model folder "
                   "or a Hub id (org/name) is the model, as `jaxserve generate MODEL PROMPT`")
    p.add_argument("--prompts-file", help="a file with one prompt per line ('-' for stdin)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat turn")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from jaxserve import LLM, SamplingParams

    prompts = list(args.prompts)
    if args.model is None and prompts and (len(prompts) > 1 or args.prompts_file) and \
            _names_a_model(prompts[0]):
        args.model = prompts.pop(0)
    if args.prompts_file:
        stream = sys.stdin if args.prompts_file == "-" else open(args.prompts_file)
        with stream:
            prompts += [line.rstrip("\n") for line in stream if line.strip()]
    if not prompts:
        raise ValueError("give at least one prompt (as arguments or with --prompts-file).")
    params = SamplingParams(
        n=args.n, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty, seed=args.sample_seed, stop=args.stop,
        ignore_eos=args.ignore_eos, logprobs=args.logprobs)
    join_hosts(args, args.model, False, engine_config)  # (other hosts end here)
    llm = LLM.from_engine_args(EngineArgs.from_cli(args))  # model None: the built-in model
    try:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outputs = llm.generate(prompts, params)
    finally:
        llm.engine.close()  # multi-host: release the worker hosts
    for prompt, output in zip(prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "outputs": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}
                for c in output.outputs]}))
            continue
        for completion in output.outputs:
            print(f"{prompt}{completion.text}")
            print(f"--- finish_reason={completion.finish_reason} "
                  f"tokens={len(completion.token_ids)}")
    return 0


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API",
                       description="Serve /v1/completions, /v1/chat/completions and friends.")
    _add_model_positional(p)
    add_engine_args(p)
    add_distributed_args(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the model name(s) clients send; the first is the main one, in "
                   "metrics and logs (default: the model argument)")
    p.add_argument("--api-key", nargs="+", action="extend", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every API route; several keys "
                   "are each accepted (default: $JAXSERVE_API_KEY, else $VLLM_API_KEY)")
    p.add_argument("--metrics-require-auth", action="store_true",
                   help="with --api-key, protect /metrics too")
    p.add_argument("--allowed-origins", default="",
                   help="CORS origins, comma-separated or as a JSON list ('[\"*\"]', vLLM's "
                   "form) (default: no CORS headers)")
    p.add_argument("--chat-template", default=None,
                   help="chat template (a file, or the template itself) instead of the "
                   "tokenizer's")
    p.add_argument("--default-chat-template-kwargs", type=_json_object, default=None,
                   metavar="JSON", help="variables every chat template render gets, as a JSON "
                   "object (e.g. '{\"enable_thinking\": false}'); a request's "
                   "chat_template_kwargs win")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="accept a chat_template sent with a request (refused by default)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='serve tool_choice "auto": the model writes calls in its own format, '
                   "read out by --tool-call-parser")
    p.add_argument("--tool-call-parser", default=None,
                   choices=tuple(PARSERS),
                   help="how calls look in the model's text: hermes (Qwen2.5/Qwen3 and many "
                   "fine-tunes), llama3_json (Llama 3.1+), mistral, pythonic (Gemma 3), "
                   "phi4_mini_json")
    p.add_argument("--reasoning-parser", default=None, choices=("qwen3", "deepseek_r1"),
                   help="put the model's thinking (<think>...</think>) in reasoning_content "
                   "and reasoning, and apply structured outputs after it")
    p.add_argument("--max-body-bytes", type=int, default=4 * 1024 * 1024)
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="admission cap: beyond it new requests get 429")
    p.add_argument("--max-n", type=int, default=None,
                   help="largest n a request may ask for (default 16; the request limit "
                   "max_n, also settable in --request-limits)")
    p.add_argument("--max-prompts-per-request", type=int, default=None,
                   help="most prompts one batched completion request may carry (default 256; "
                   "the request limit max_prompts)")
    p.add_argument("--limit-concurrency", type=int, default=None,
                   help="connections and requests at once (uvicorn's; beyond it, 503), and "
                   "gRPC calls at once (default: what the process's open-file limit allows, "
                   "at most 4096)")
    p.add_argument("--max-preparing-requests", type=int, default=256,
                   help="requests being parsed, tokenized and compiled at once; beyond it "
                   "a request gets 503 with Retry-After")
    p.add_argument("--stream-write-timeout", type=float, default=60.0,
                   help="seconds a client may leave its response unread (the connection's "
                   "send buffer full) before the connection is cut and its request aborted")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may take to finish after SIGTERM")
    p.add_argument("--request-read-timeout", type=float, default=30.0,
                   help="seconds a client has to send a request's headers, then its body "
                   "(a body not received in time gets 408 and the connection closes)")
    p.add_argument("--keep-alive-timeout", type=float, default=5.0,
                   help="seconds an idle keep-alive connection stays open")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=None,
                   help="step the engine in a process of its own (as vLLM's engine core), so "
                   "that HTTP work never delays the device's next step; --no-engine-process "
                   "steps it on a thread of the server's process (multi-host runs always "
                   "do). Default: a process when this one may use 4 or more CPUs (the core "
                   "then has one to itself; on fewer it competes with the HTTP side)")
    p.add_argument("--grpc-port", type=int, default=None,
                   help="also serve vLLM's gRPC engine service (vllm.grpc.engine.VllmEngine, "
                   "for routers such as the SMG gateway) on this port, beside HTTP")
    p.add_argument("--grpc-host", default=None,
                   help="gRPC bind address (default: --host)")
    p.add_argument("--grpc-ssl-certfile", default=None, help="gRPC TLS: the certificate chain")
    p.add_argument("--grpc-ssl-keyfile", default=None, help="gRPC TLS: the private key")
    p.set_defaults(func=_run_serve)


def _add_model_positional(parser: argparse.ArgumentParser) -> None:
    """`jaxserve serve MODEL` as `vllm serve MODEL` (the same as --model)."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="model folder or Hugging Face Hub id (the same as --model)")


def _model_of(args: argparse.Namespace) -> str | None:
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        raise ValueError(f"the model is given twice, as {tag!r} and --model {args.model!r}; "
                         "give one of them.")
    args.model = tag if tag is not None else args.model
    return args.model


def _run_serve(args: argparse.Namespace) -> int:
    from jaxserve.config.model_path import resolve_model
    from jaxserve.config.request_limits import RequestLimits
    from jaxserve.server.app import ServerConfig
    from jaxserve.server.launch import serve
    from jaxserve.server.openai_serving import ChatSettings

    model = resolve_model(_model_of(args), logging.getLogger("jaxserve.serve"))
    names = tuple(args.served_model_name or [args.model or "jaxserve-default"])
    server_config = ServerConfig(
        host=args.host, port=args.port, served_model_name=names,
        api_key=_api_keys(args.api_key), metrics_require_auth=args.metrics_require_auth,
        allowed_origins=_origins(args.allowed_origins),
        chat=ChatSettings(template=_chat_template(args.chat_template),
                          default_kwargs=args.default_chat_template_kwargs or {},
                          trust_request_template=args.trust_request_chat_template,
                          tool_call_parser=_tool_call_parser(args),
                          reasoning_parser=args.reasoning_parser),
        max_body_bytes=args.max_body_bytes, max_waiting_requests=args.max_waiting_requests,
        shutdown_timeout=args.shutdown_timeout, request_read_timeout=args.request_read_timeout,
        keep_alive_timeout=args.keep_alive_timeout,
        stream_write_timeout=args.stream_write_timeout,
        limit_concurrency=args.limit_concurrency or _default_concurrency(),
        max_preparing_requests=args.max_preparing_requests)
    # --max-n and --max-prompts-per-request are request limits, as --request-limits holds.
    limits = RequestLimits.parse(args.request_limits).replace(
        max_n=args.max_n, max_prompts=args.max_prompts_per_request)
    args.request_limits = dataclasses.asdict(limits)
    grpc_config = _grpc_config(args, server_config)
    join_hosts(args, args.model, "background", engine_config)  # (other hosts end here)
    from jaxserve.engine.core_client import EngineCoreClient, engine_process_by_default

    if not multi_host(args) and (args.engine_process if args.engine_process is not None
                                  else engine_process_by_default()):
        from jaxserve.engine.data_parallel import engine_from_args

        engine = EngineCoreClient(engine_from_args, (EngineArgs.from_cli(args), model,
                                                     "background"), log_level=args.log_level)
    else:
        from jaxserve.engine.data_parallel import create_engine

        engine = create_engine(engine_config(args, model, "background"))
    return serve(engine, server_config, args.log_level, grpc_config)


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
    from jaxserve.server.grpc_server import GrpcConfig

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


def _origins(text: str) -> tuple[str, ...]:
    """CORS origins: a JSON list (vLLM's form, '["*"]') or comma-separated."""
    text = text.strip()
    if text.startswith("["):
        try:
            value = json.loads(text)
        except ValueError:
            value = None
        if not isinstance(value, list) or not all(isinstance(o, str) for o in value):
            raise ValueError(f"--allowed-origins: {text[:80]!r} is not a JSON list of strings.")
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


def _plan_parser(sub) -> None:
    from jaxserve.config.accelerators import PRESETS, preset  # host-side: no jax
    from jaxserve.config.plan import parse_bytes

    p = sub.add_parser(
        "plan", help="per-device memory, KV blocks and compile buckets, without loading weights",
        description="Print what the engine would place on each device for a model folder "
        "(only its config.json is read), a mesh and a device (a preset such as v5e-8, or a "
        "per-device memory size): weight and KV bytes, KV blocks, concurrency at "
        "max_model_len, compile buckets; the meshes a multi-device preset can take; what "
        "would fit when the configuration does not. Runs on the CPU; no accelerator is "
        "touched. Defaults are the engine's on an accelerator.")
    _add_model_positional(p)
    add_engine_args(p)
    device = p.add_mutually_exclusive_group(required=True)
    device.add_argument("--device", type=_arg_type(preset), metavar="NAME",
                        help=f"what you rent: {', '.join(d.name for d in PRESETS)}")
    device.add_argument("--device-memory", type=_arg_type(parse_bytes), metavar="SIZE",
                        help="memory of one device: 16GiB or 16G (binary), 80GB (decimal), "
                        "16e9 (bytes)")
    p.add_argument("--json", action="store_true", help="print the plan as one JSON object")
    p.set_defaults(func=_run_plan)


def _arg_type(parse):
    """parse as an argparse type: its ValueError's message becomes argparse's error."""
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    return convert


def _run_plan(args: argparse.Namespace) -> int:
    # The plan is arithmetic on config.json (the families' numpy parameter tables): it never
    # imports jax, so it cannot claim an accelerator that a running server may be using.
    from jaxserve.config.model_path import resolve_model
    from jaxserve.config.plan_advice import format_report, plan_report, report_dict

    model = resolve_model(_model_of(args), logging.getLogger("jaxserve.plan"))
    config = engine_config(args, model, on_accelerator=True)
    memory = args.device.memory_bytes if args.device else args.device_memory
    mesh_given = (args.mesh is not None or args.tensor_parallel_size != 1
                  or args.data_parallel_size != 1)
    report = plan_report(config, memory, args.device, mesh_given=mesh_given)
    if report.plan is None:
        print(f"error: {report.error}", file=sys.stderr, flush=True)
    print(json.dumps(report_dict(report), indent=2) if args.json else format_report(report))
    return 0 if report.plan is not None else 2


def _convert_parser(sub) -> None:
    p = sub.add_parser(
        "convert", help="write a model as an Orbax checkpoint, restored straight into a mesh",
        description="Write a Hugging Face model folder (or Hub id) as an Orbax checkpoint of "
        "the engine's parameters, with its config, tokenizer and generation config beside "
        "it. `jaxserve serve DIR` and LLM(model=DIR) restore each array directly into its "
        "sharding, every host reading only its slices, on any mesh. Runs on the CPU; the "
        "parameters pass through host memory once.")
    _add_model_positional(p)
    p.add_argument("--model", default=None, help="model folder or Hub id (or positional)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write")
    p.add_argument("--dtype", default=None, choices=SUPPORTED_DTYPES[1:],
                   help="the saved parameters' dtype (default: the checkpoint's own)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DIR if it holds an earlier conversion")
    p.set_defaults(func=_run_convert)


def _run_convert(args: argparse.Namespace) -> int:
    import jax

    jax.config.update("jax_platforms", "cpu")  # abstract shapes and host arrays only

    from jaxserve.backends.jax.orbax_checkpoint import convert
    from jaxserve.config.model_path import resolve_model

    model = resolve_model(_model_of(args), logging.getLogger("jaxserve.convert"))
    out = convert(model, args.out, args.dtype, overwrite=args.overwrite)
    print(f"Wrote {out}: serve it with `jaxserve serve {out}`")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxserve", description="LLM inference and serving on JAX.")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS,
                        help="logging level (also accepted after the subcommand)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    _plan_parser(sub)
    _convert_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `generate MODEL --flag ... PROMPT...`: argparse fills a positional list once, so
    # prompts after the flags come back as extras.
    if extra and args.command == "generate" and not any(e.startswith("-") for e in extra):
        args.prompts += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("jax").setLevel(max(logging.WARNING, logging.getLogger().level))
    logging.getLogger("jaxserve").setLevel(args.log_level)
    try:
        return args.func(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
