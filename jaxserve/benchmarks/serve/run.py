"""`jaxserve bench serve`'s run (its flags: jaxserve/cli/bench.py), as `vllm bench serve`:
every flag checked before a request is sent (the dataset file read, matplotlib found when
--plot asks for it), the model and tokenizer, the dataset, one run per swept value (each
printed as vLLM's table), the result JSON under vLLM's keys and the sweep's plot.

scripts/bench_serving.py is this command with a `jaxserve serve` started for the run.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import ipaddress
import json
import os
import pathlib
import sys
from datetime import datetime
from urllib.parse import urlsplit

from tqdm import tqdm

from jaxserve.benchmarks.serve.client import (
    Endpoint,
    first_model,
    make_client,
    ready_check,
    run_benchmark,
)
from jaxserve.benchmarks.serve.datasets import (
    ServerTokenizer,
    get_samples,
    load_local_tokenizer,
    load_sharegpt,
)
from jaxserve.benchmarks.serve.report import (
    GOODPUT_METRICS,
    MATPLOTLIB_MISSING,
    METRICS,
    calculate_metrics,
    finite,
    plot_point,
    plot_sweep,
    print_result,
    result_dict,
    sweep_header,
    sweep_line,
)

SAMPLING = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
            "repetition_penalty")


@dataclasses.dataclass
class Plan:
    """The checked flags: where to send, what to report, one (concurrency, rate) per run."""

    base_url: str
    api_url: str
    headers: dict
    verify: bool
    trust_env: bool
    points: list[tuple[int | None, float]]
    axis: str | None  # the swept flag's name, None for one run
    selected: list[str]
    percentiles: list[float]
    goodput: dict[str, float]
    metadata: dict[str, str]
    extra_body: dict
    sharegpt: list[dict] | None = None  # the dataset file's conversations, read once


def check_args(args: argparse.Namespace) -> Plan:
    """ValueError for anything wrong that can be found before a request is sent."""
    if args.input_len is not None:  # vLLM's general lengths
        args.random_input_len = args.input_len
    if args.output_len is not None:
        args.random_output_len = args.sharegpt_output_len = args.output_len
    for flag in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.random_prefix_len < 0 or args.num_warmups < 0:
        raise ValueError("--random-prefix-len and --num-warmups must be >= 0")
    if args.sharegpt_output_len is not None and args.sharegpt_output_len < 1:
        raise ValueError("--sharegpt-output-len must be >= 1")
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1)")
    if not args.burstiness > 0:
        raise ValueError("--burstiness must be > 0")
    points, axis = sweep_points(args.max_concurrency, args.request_rate)
    selected = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    if unknown := [m for m in selected if m not in METRICS]:
        raise ValueError(f"--percentile-metrics: unknown {','.join(unknown)} (of "
                         f"{','.join(METRICS)})")
    percentiles = _numbers(args.metric_percentiles, "--metric-percentiles")
    if not all(0 < p <= 100 for p in percentiles):
        raise ValueError("--metric-percentiles must be in (0, 100]")
    goodput = {}
    for pair in args.goodput or []:
        key, _, value = pair.partition(":")
        try:
            goodput[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {pair!r}: expected KEY:MILLISECONDS") from None
        if key not in GOODPUT_METRICS or goodput[key] < 0:
            raise ValueError(f"--goodput {pair!r}: KEY is one of {', '.join(GOODPUT_METRICS)} "
                             "and the value >= 0 ms")
    base_url, api_url = urls(args)
    headers = _pairs(args.header, "--header")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if api_key:
        headers.setdefault("Authorization", f"Bearer {api_key}")
    if args.dataset_name == "random" and args.dataset_path is not None:
        raise ValueError(f"--dataset-path {args.dataset_path} is for a dataset file: pass "
                         "--dataset-name sharegpt (random makes its own prompts)")
    # the file's errors now, before any request
    sharegpt = load_sharegpt(args.dataset_path) if args.dataset_name == "sharegpt" else None
    if args.dataset_name == "random":
        args.ignore_eos = True  # as vLLM: random outputs run to their length
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError(MATPLOTLIB_MISSING) from None
    extra = {k: getattr(args, k) for k in SAMPLING if getattr(args, k) is not None}
    host = urlsplit(base_url).hostname or ""
    return Plan(base_url, api_url, headers, verify=not args.insecure,
                trust_env=not _loopback(host), points=points, axis=axis, selected=selected,
                percentiles=percentiles, goodput=goodput,
                metadata=_pairs(args.metadata, "--metadata"),
                extra_body={**extra, **(args.extra_body or {})}, sharegpt=sharegpt)


def sweep_points(concurrency: str | None, rate: str) -> tuple[list, str | None]:
    """[(max_concurrency, request_rate)] per run, and the swept flag (None: one run)."""
    levels = [None] if concurrency is None else [
        int(v) for v in _numbers(concurrency, "--max-concurrency")]
    if not all(level is None or level >= 1 for level in levels):
        raise ValueError("--max-concurrency must be >= 1")
    rates = _numbers(rate, "--request-rate")
    if not all(r > 0 for r in rates):
        raise ValueError("--request-rate must be > 0 (inf: all at once)")
    if len(levels) > 1 and len(rates) > 1:
        raise ValueError("sweep one of --max-concurrency and --request-rate, not both")
    if len(levels) > 1:
        return [(level, rates[0]) for level in levels], "max concurrency"
    if len(rates) > 1:
        return [(levels[0], r) for r in rates], "request rate (req/s)"
    return [(levels[0], rates[0])], None


def _numbers(text: str, flag: str) -> list[float]:
    try:
        values = [float(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes numbers separated by commas, got {text!r}") from None
    if not values:
        raise ValueError(f"{flag}: no value")
    if flag == "--max-concurrency" and not all(v.is_integer() for v in values):
        raise ValueError(f"{flag} takes whole numbers, got {text!r}")
    return values


def _pairs(items: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
        out[key.strip()] = value.strip()
    return out


def urls(args: argparse.Namespace) -> tuple[str, str]:
    """(server root, request URL) from --base-url or --host/--port, and --endpoint."""
    chat = args.backend == "openai-chat"
    endpoint = args.endpoint or ("/v1/chat/completions" if chat else "/v1/completions")
    path = endpoint.rstrip("/")
    if chat != path.endswith("chat/completions") or not path.endswith("completions"):
        kind, usual = (("chat completions", "/v1/chat/completions") if chat
                       else ("completions", "/v1/completions"))
        raise ValueError(f"--backend {args.backend} sends {kind}: --endpoint {endpoint} is "
                         f"not a {kind} path (as {usual})")
    if args.base_url:
        base = args.base_url.rstrip("/")
        if base.endswith("/v1") and endpoint.startswith("/v1/"):
            base = base[:-3]  # http://host:8000/v1, as the openai client takes it
    else:
        host = f"[{args.host}]" if ":" in args.host else args.host
        base = f"http://{host}:{args.port}"
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--base-url must look like http://HOST:PORT, got {base!r}")
    return base, base + ("" if endpoint.startswith("/") else "/") + endpoint


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def get_tokenizer(args, model_id: str, model_name: str, plan: Plan):
    """--tokenizer (downloaded if it is a Hub id not in the cache); else the model's
    tokenizer if it is on this machine; else the server's /tokenize."""
    if args.tokenizer:
        tokenizer = load_local_tokenizer(args.tokenizer, True, args.trust_remote_code)
        if tokenizer is None:
            raise ValueError(f"--tokenizer {args.tokenizer}: no such folder, and not a Hub "
                             "id that can be loaded")
        return tokenizer
    tokenizer = load_local_tokenizer(model_id, False, args.trust_remote_code)
    if tokenizer is None:
        print(f"no tokenizer for {model_id} on this machine: counting tokens with the "
              f"server's /tokenize (pass --tokenizer to use a local one)", file=sys.stderr)
        tokenizer = ServerTokenizer(plan.base_url, model_name, plan.headers, plan.verify)
    return tokenizer


async def one_run(args, plan: Plan, endpoint: Endpoint, requests: list, concurrency,
                  rate: float):
    """The test request, the warm-ups and the timed run of one (concurrency, rate)."""
    async with make_client(plan.headers, concurrency or len(requests), plan.verify,
                           plan.trust_env) as client:
        test = await ready_check(client, endpoint, requests[0], args.ready_check_timeout_sec)
        if not test.success:
            raise ValueError("the initial test request failed - check the flags (--base-url, "
                             f"--endpoint, --model): {test.error}")
        if args.num_warmups:
            gate = asyncio.Semaphore(concurrency or args.num_warmups)

            async def warm(request):
                async with gate:
                    await ready_check(client, endpoint, request, 0)
            await asyncio.gather(*(warm(requests[i % len(requests)])
                                   for i in range(args.num_warmups)))
        with tqdm(total=len(requests), disable=args.disable_tqdm, file=sys.stderr) as bar:
            return await run_benchmark(client, endpoint, requests, rate, args.burstiness,
                                       concurrency, args.seed, bar)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 when every request succeeded, 1 otherwise."""
    plan = check_args(args)
    if args.model is None:
        model_name, model_id = first_model(plan.base_url, plan.headers, plan.verify,
                                           plan.trust_env)
        print(f"model: {model_name} ({model_id}), the server's first")
    else:
        model_id, model_name = args.model, args.served_model_name or args.model
    tokenizer = get_tokenizer(args, model_id, model_name, plan)
    requests = get_samples(args, tokenizer, plan.sharegpt)
    endpoint = Endpoint(plan.api_url, args.backend == "openai-chat", model_name,
                        plan.extra_body, args.ignore_eos, args.logprobs)
    date = datetime.now().strftime("%Y%m%d-%H%M%S")
    label = args.label or args.backend
    header = {"date": date, "endpoint_type": args.backend, "backend": args.backend,
              "label": label, "model_id": model_id, "tokenizer_id": tokenizer.name,
              "num_prompts": args.num_prompts, "base_url": plan.base_url,
              "dataset_name": args.dataset_name, **plan.metadata}
    top = max(plan.percentiles)
    results, points = [], []
    for concurrency, rate in plan.points:
        print(f"{len(requests)} requests to {plan.api_url}: request rate {rate:g}, burstiness "
              f"{args.burstiness:g}, max concurrency {concurrency}", file=sys.stderr)
        outputs, duration = asyncio.run(one_run(args, plan, endpoint, requests, concurrency,
                                                rate))
        metrics = calculate_metrics(outputs, duration, tokenizer, plan.goodput)
        result = {**header, "request_rate": finite(rate), "burstiness": args.burstiness,
                  "max_concurrency": concurrency,
                  **result_dict(metrics, outputs, duration, plan.selected, plan.percentiles,
                                bool(plan.goodput), args.save_detailed)}
        print_result(result, plan.selected, plan.percentiles,
                     [o.error for o in outputs if not o.success])
        results.append(result)
        points.append(plot_point(metrics, f"{rate:g}" if plan.axis and "rate" in plan.axis
                                 else str(concurrency), top))
    if plan.axis:
        print(sweep_header(plan.axis, top))
        for point in points:
            print(sweep_line(point))
    if args.save_result or args.append_result:
        path = result_path(args, model_id, label, date, plan)
        text = json.dumps(results if plan.axis else results[0], indent=None if
                          args.append_result else 2)
        last = path.read_bytes()[-1:] if args.append_result and path.is_file() else b""
        with open(path, "a" if args.append_result else "w", encoding="utf-8") as f:
            f.write(("\n" if last not in (b"", b"\n") else "") + text + "\n")
        print(f"{'appended to' if args.append_result else 'wrote'} {path}")
    if args.plot:
        data = (f"random prompts of {args.random_input_len} tokens, outputs of "
                f"{args.random_output_len}" if args.dataset_name == "random" else
                f"ShareGPT {pathlib.Path(args.dataset_path).name}")
        title = (f"jaxserve bench serve: {model_name}, {urlsplit(plan.api_url).path}, {data}"
                 f", {len(requests)} requests per point")
        plot_sweep(points, args.plot, plan.axis or "max concurrency", title, top)
        print(f"wrote {args.plot}")
    return 0 if all(r["failed"] == 0 for r in results) else 1


def result_path(args, model_id: str, label: str, date: str, plan: Plan) -> pathlib.Path:
    """--result-dir/--result-filename, or vLLM's LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json
    (a sweep names its values joined by '-')."""
    rates = "-".join(dict.fromkeys(f"{r:g}" for _, r in plan.points))
    levels = "-".join(dict.fromkeys(str(c) for c, _ in plan.points if c is not None))
    name = args.result_filename or (f"{label}-{rates}qps"
                                    f"{f'-concurrency{levels}' if levels else ''}-"
                                    f"{model_id.rstrip('/').split('/')[-1]}-{date}.json")
    folder = pathlib.Path(args.result_dir or ".")
    folder.mkdir(parents=True, exist_ok=True)
    return folder / name

