"""`jaxserve bench serve`: benchmark a running OpenAI-compatible server, with the flags of
`vllm bench serve` (their names and defaults) and two additions: a sweep (`--max-concurrency
1,4,16` or `--request-rate 1,2,inf`: one run per value against the same server) and `--plot
FILE.png` (throughput and latency against the swept value; needs matplotlib).

    jaxserve bench serve --base-url http://127.0.0.1:8000 --dataset-name random \\
        --random-input-len 128 --random-output-len 64 --num-prompts 200 \\
        --max-concurrency 1,4,16 --plot sweep.png --save-result --result-dir results

The flags are defined here (imported by `jaxserve --help`, so nothing heavy); the run is in
jaxserve/benchmarks/serve/run.py, imported only when the command runs.
"""

from __future__ import annotations

import argparse
import uuid

BACKENDS = ("openai", "vllm", "openai-chat")  # vLLM's names for /v1/completions and chat
DATASETS = ("random", "sharegpt")
METRICS = ("ttft", "tpot", "itl", "e2el")  # jaxserve/benchmarks/serve/report.py's METRICS' keys


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """`bench` (with its `serve` subcommand) on the `jaxserve` command's subparsers."""
    bench = subparsers.add_parser(
        "bench", help="benchmark a running server (as `vllm bench`)",
        description="Benchmarks, as `vllm bench`: `jaxserve bench serve --help`.")
    commands = bench.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND",
                                    required=True)
    serve = commands.add_parser(
        "serve", help="load an OpenAI-compatible server and report latency and throughput",
        description="\n\n".join(__doc__.split("\n\n")[:2]),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_args(serve)
    serve.set_defaults(func=run_bench_serve)
    return bench


def run_bench_serve(args: argparse.Namespace) -> int:
    try:
        from jaxserve.benchmarks.serve.run import main
    except ImportError as err:
        if err.name != "httpx":
            raise
        raise SystemExit("jaxserve bench serve needs httpx: pip install httpx") from None
    return main(args)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """`vllm bench serve`'s common flags (names, defaults), and the sweep and plot: one
    argument group each, in --help's order."""
    _add_server_args(p)
    _add_model_args(p)
    _add_dataset_args(p)
    _add_load_args(p)
    _add_sampling_args(p)
    _add_results_args(p)


def _add_server_args(p: argparse.ArgumentParser) -> None:
    """The "server" group: where the server is and how to reach it (URL, endpoint, headers,
    key, TLS, the ready check)."""
    g = p.add_argument_group("server")
    g.add_argument("--backend", default="openai", choices=BACKENDS,
                   help="openai or vllm: /v1/completions; openai-chat: /v1/chat/completions "
                   "(default: %(default)s)")
    g.add_argument("--base-url", default=None,
                   help="server root, e.g. http://10.0.0.5:8000 (instead of --host/--port; "
                   "https too)")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--endpoint", default=None,
                   help="API path (default: /v1/completions, or /v1/chat/completions for "
                   "openai-chat)")
    g.add_argument("--header", metavar="KEY=VALUE", nargs="*", default=None,
                   help="headers sent with each request, e.g. --header x-tenant=a")
    g.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)")
    g.add_argument("--insecure", action="store_true",
                   help="do not verify the server's TLS certificate")
    g.add_argument("--ready-check-timeout-sec", type=int, default=0,
                   help="retry the first (untimed) test request until it succeeds or this "
                   "many seconds pass (default 0: one try)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The "model" group: the model the requests name, the tokenizer that counts tokens."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help="model name (default: the first of the server's /v1/models)")
    g.add_argument("--served-model-name", default=None,
                   help="the name sent in requests, when it differs from --model")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or Hub id (default: the model's, if it is on this "
                   "machine; else the server's /tokenize)")
    g.add_argument("--tokenizer-mode", default="auto", choices=("auto", "hf"),
                   help="accepted for vLLM's command lines: the Hugging Face tokenizer either "
                   "way")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="let the tokenizer's folder or Hub repository run its own code")


def _add_dataset_args(p: argparse.ArgumentParser) -> None:
    """The "dataset" group: the prompts (random or ShareGPT), how many, their lengths."""
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", default="random", choices=DATASETS,
                   help="random: synthetic token sequences; sharegpt: a local ShareGPT-format "
                   "JSON file (--dataset-path)")
    g.add_argument("--dataset-path", default=None,
                   help="the ShareGPT-format JSON file (local; nothing is downloaded)")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--input-len", type=int, default=None,
                   help="sets --random-input-len")
    g.add_argument("--output-len", type=int, default=None,
                   help="sets --random-output-len and --sharegpt-output-len")
    g.add_argument("--random-input-len", type=int, default=1024)
    g.add_argument("--random-output-len", type=int, default=128)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)], r in [0, 1)")
    g.add_argument("--random-prefix-len", type=int, default=0,
                   help="a fixed random prefix of this many tokens before every prompt")
    g.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="output tokens per request (default: the dataset answer's length)")
    g.add_argument("--no-oversample", action="store_true",
                   help="do not repeat ShareGPT samples when fewer than --num-prompts fit")
    g.add_argument("--disable-shuffle", action="store_true",
                   help="take ShareGPT conversations in file order")


def _add_load_args(p: argparse.ArgumentParser) -> None:
    """The "load" group: how the requests are sent (rate, burstiness, concurrency, warm-ups)
    and what their bodies add."""
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", default="inf", metavar="RATE[,RATE...]",
                   help="requests per second (inf: all at once; default %(default)s); a comma "
                   "list sweeps over the rates")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 Poisson, < 1 burstier, > 1 "
                   "steadier")
    g.add_argument("--max-concurrency", default=None, metavar="N[,N...]",
                   help="most requests in flight at once (default: no cap); a comma list, "
                   "e.g. 1,4,16, sweeps over the values")
    g.add_argument("--num-warmups", type=int, default=0,
                   help="untimed requests sent before each run")
    g.add_argument("--request-id-prefix", default=f"bench-{uuid.uuid4().hex[:8]}-",
                   help="the x-request-id of request i is PREFIX + i")
    g.add_argument("--ignore-eos", action="store_true",
                   help="generate every output to its length (on by default for random)")
    g.add_argument("--logprobs", type=int, default=None,
                   help="logprobs per token (completions)")
    g.add_argument("--extra-body", type=_json_object, default=None,
                   help="JSON object merged into every request body")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    """The "sampling parameters" group: sent with every request (unset: the server's)."""
    g = p.add_argument_group("sampling parameters")
    g.add_argument("--temperature", type=float, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--frequency-penalty", type=float, default=None)
    g.add_argument("--presence-penalty", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)


def _add_results_args(p: argparse.ArgumentParser) -> None:
    """The "results" group: what is reported and saved (metrics, percentiles, goodput, the
    result files, the plot)."""
    g = p.add_argument_group("results")
    g.add_argument("--percentile-metrics", default=",".join(METRICS),
                   help="metrics whose statistics are reported, of "
                   f"{','.join(METRICS)} (default %(default)s)")
    g.add_argument("--metric-percentiles", default="99",
                   help="percentiles reported, e.g. 25,50,75 (default %(default)s)")
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS", default=None,
                   help="service level objectives, e.g. ttft:500 tpot:50: request goodput "
                   "counts the requests that meet all of them")
    g.add_argument("--label", default=None,
                   help="the result's label and file name prefix (default: --backend)")
    g.add_argument("--metadata", metavar="KEY=VALUE", nargs="*", default=None,
                   help="pairs saved in the result JSON")
    g.add_argument("--save-result", action="store_true",
                   help="save the result JSON (vLLM's keys; a sweep saves a list, one "
                   "object per run)")
    g.add_argument("--append-result", action="store_true",
                   help="append the result JSON to the file (one JSON value per line)")
    g.add_argument("--save-detailed", action="store_true",
                   help="also save each request's lengths, times, text and error")
    g.add_argument("--result-dir", default=None, help="folder of the result JSON")
    g.add_argument("--result-filename", default=None,
                   help="file name of the result JSON (default: "
                   "LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json)")
    g.add_argument("--plot", metavar="FILE.png", default=None,
                   help="draw throughput and TTFT/ITL/E2EL against the swept concurrency "
                   "or rate (needs matplotlib)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value
