"""What scripts/bench_serving.py reports (the numbers and names of `vllm bench serve`): the
summary of one run's requests (TTFT, TPOT, ITL and E2E latency percentiles, request and
token throughput), its table, the one-line-per-rate view of a --sweep and its plot of
latency against output token throughput (matplotlib, imported only to draw it).
"""

from __future__ import annotations

import math
import statistics
import sys

MATPLOTLIB_MISSING = ("--sweep writes a PNG plot with matplotlib, which is not installed: "
                      "pip install matplotlib")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(args, model: str, results: list, elapsed: float) -> dict:
    """The run's numbers (the --json report): results are bench_serving's Result per request
    sent, elapsed the seconds from the first send to the last answer."""
    ok = [r for r in results if r.ok]
    qs = [float(q) for q in args.percentiles.split(",")]
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "itl": [gap for r in ok for gap in r.itl],
        "e2e": [r.e2e for r in ok],
    }
    out = {
        "base_url": args.base_url, "model": model, "endpoint": args.endpoint,
        "max_concurrency": args.max_concurrency,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "input_len": args.input_len, "output_len": args.output_len,
        "range_ratio": args.range_ratio, "num_prompts": args.num_prompts,
        "sent": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": elapsed, "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / elapsed if elapsed else 0.0,
        "output_throughput": output_tokens / elapsed if elapsed else 0.0,
        "total_token_throughput": (prompt_tokens + output_tokens) / elapsed if elapsed else 0.0,
        "short_outputs": sum(r.output_tokens < 1 for r in ok),
        "errors": sorted({r.error for r in results if not r.ok})[:10],
    }
    for name, values in series.items():
        out[f"mean_{name}_ms"] = 1000 * statistics.fmean(values) if values else float("nan")
        for q in qs:
            out[f"p{q:g}_{name}_ms"] = 1000 * percentile(values, q)
    return out


def print_table(out: dict, qs: list[float]) -> None:
    rows = [
        ("Model / endpoint", f"{out['model']} / {out['endpoint']}"),
        ("Max concurrency", out["max_concurrency"] or "none"),
        ("Request rate (req/s)", out["request_rate"] or "inf"),
        ("Successful requests", out["completed"]),
        ("Failed requests", out["failed"]),
        ("Benchmark duration (s)", f"{out['duration_s']:.2f}"),
        ("Total input tokens", out["total_input_tokens"]),
        ("Total generated tokens", out["total_output_tokens"]),
        ("Request throughput (req/s)", f"{out['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{out['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{out['total_token_throughput']:.2f}"),
    ]
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st)",
              "itl": "Inter-token Latency", "e2e": "End-to-end Latency"}
    print("{:=^60}".format(" Serving Benchmark Result "))
    for label, value in rows:
        print(f"{label:<44}{value!s:>16}")
    for key, title in titles.items():
        print("{:-^60}".format(f" {title} "))
        print(f"{'Mean ' + key.upper() + ' (ms)':<44}{out[f'mean_{key}_ms']:>16.2f}")
        for q in qs:
            label = f"P{q:g} {key.upper()} (ms)"
            print(f"{label:<44}{out[f'p{q:g}_{key}_ms']:>16.2f}")
    print("=" * 60)
    for error in out["errors"]:
        print(f"error: {error}", file=sys.stderr)


def sweep_header(top: float) -> str:
    p = f"p{top:g}"
    return (f"{'rate':>6} {'ok/sent':>9} {'req/s':>7} {'out tok/s':>10} | "
            f"{'TTFT mean':>9} {p:>7} | {'TPOT mean':>9} {p:>7} | {'ITL ' + p:>8} | "
            f"{'E2E mean':>9} {p:>8}   (latencies in ms)")


def sweep_line(out: dict, top: float) -> str:
    def ms(stat: str, key: str, width: int) -> str:
        return f"{out[f'{stat}_{key}_ms']:>{width}.1f}"
    p = f"p{top:g}"
    ok = f"{out['completed']}/{out['sent']}"
    return (f"{rate_label(out):>6} {ok:>9} {out['request_throughput']:>7.2f} "
            f"{out['output_throughput']:>10.1f} | {ms('mean', 'ttft', 9)} {ms(p, 'ttft', 7)} | "
            f"{ms('mean', 'tpot', 9)} {ms(p, 'tpot', 7)} | {ms(p, 'itl', 8)} | "
            f"{ms('mean', 'e2e', 9)} {ms(p, 'e2e', 8)}")


def rate_label(out: dict) -> str:
    rate = out["request_rate"]
    return "inf" if rate is None else f"{rate:g}"


def plot_sweep(results: list[dict], path: str, qs: list[float]) -> None:
    """Latency (ms) against achieved output token throughput, one point per rate."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(MATPLOTLIB_MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stats = ["mean"] + [f"p{q:g}" for q in sorted({50.0, max(qs)} & set(qs))]
    x = [r["output_throughput"] for r in results]
    panels = (("ttft", "Time to first token"), ("tpot", "Time per output token"),
              ("e2e", "End-to-end latency"))
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4.8))
    for ax, (key, title) in zip(axes, panels):
        for stat, style in zip(stats, ("o-", "s--", "^:")):
            ax.plot(x, [r[f"{stat}_{key}_ms"] for r in results], style, label=stat)
        for r, xi in zip(results, x):  # label the points of the top series by their rate
            ax.annotate(f"{rate_label(r)}/s", (xi, r[f"{stats[-1]}_{key}_ms"]),
                        textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set(title=title, xlabel="output token throughput (tok/s)", ylabel="ms")
        ax.grid(alpha=0.3)
        ax.legend()
    first = results[0]
    fig.suptitle(f"{first['model']} / {first['endpoint']}: input {first['input_len']}, "
                 f"output {first['output_len']}, max concurrency "
                 f"{first['max_concurrency'] or 'none'} (points labelled by request rate)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
