"""What `jaxserve bench serve` reports, with vLLM's names: the metrics of one run (TTFT, TPOT,
ITL and end-to-end latency statistics, request and token throughput, goodput, peaks), its
summary table, its result JSON, the one-line-per-point view of a sweep and the sweep's plot
(matplotlib, imported only to draw it).
"""

from __future__ import annotations

import dataclasses
import math
import sys

import numpy as np

# key: (short name, table heading), in vLLM's order
METRICS = {"ttft": ("TTFT", "Time to First Token"),
           "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"),
           "e2el": ("E2EL", "End-to-end Latency")}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DETAILED = ("input_lens", "output_lens", "ttfts", "itls", "start_times", "generated_texts",
            "errors")
MATPLOTLIB_MISSING = ("--plot draws a PNG with matplotlib, which is not installed: "
                      "pip install matplotlib")
WIDTH = 50


@dataclasses.dataclass
class Metrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    series: dict[str, list[float]]  # per metric name: the values in seconds
    output_lens: list[int]  # per request (0 for a failed one)


def output_len(out, tokenizer) -> int:
    """The server's usage count, else the tokenizer's count of the text, else the chunks."""
    if out.output_tokens:
        return out.output_tokens
    if tokenizer is not None and out.generated_text:
        return len(tokenizer.encode(out.generated_text, add_special_tokens=False))
    return len(out.itl) + 1


def calculate_metrics(outputs: list, duration: float, tokenizer=None,
                      goodput: dict[str, float] | None = None) -> Metrics:
    """vLLM's calculate_metrics over bench_client's RequestOutputs."""
    ok = [o for o in outputs if o.success]
    lens = [output_len(o, tokenizer) if o.success else 0 for o in outputs]
    ok_lens = [n for o, n in zip(outputs, lens) if o.success]
    tpot = [(o.latency - o.ttft) / (n - 1) for o, n in zip(ok, ok_lens) if n > 1]
    series = {"ttft": [o.ttft for o in ok], "tpot": tpot,
              "itl": [gap for o in ok for gap in o.itl], "e2el": [o.latency for o in ok]}
    good = 0
    if goodput:  # a request is good when it meets every objective (ms)
        all_tpot = [(o.latency - o.ttft) / (n - 1) if n > 1 else 0.0 for o, n in zip(ok, ok_lens)]
        values = {"ttft": series["ttft"], "tpot": all_tpot, "e2el": series["e2el"]}
        good = sum(all(values[k][i] <= v / 1000 for k, v in goodput.items())
                   for i in range(len(ok)))
    total_input = sum(o.prompt_len for o in ok)
    total_output = sum(ok_lens)
    peak_tokens, peak_requests = peaks(ok)
    rate = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    return Metrics(completed=len(ok), failed=len(outputs) - len(ok), total_input=total_input,
                   total_output=total_output, request_throughput=rate(len(ok)),
                   request_goodput=rate(good), output_throughput=rate(total_output),
                   total_token_throughput=rate(total_input + total_output),
                   max_output_tokens_per_s=peak_tokens, max_concurrent_requests=peak_requests,
                   series=series, output_lens=lens)


def peaks(ok: list) -> tuple[float, int]:
    """(most streamed chunks in one wall-clock second, most requests in flight at once)."""
    if not ok:
        return 0.0, 0
    first = min(o.start_time for o in ok)
    per_second: dict[int, int] = {}
    for o in ok:
        t = o.start_time + o.ttft
        for gap in [0.0, *o.itl]:
            t += gap
            per_second[int(t - first)] = per_second.get(int(t - first), 0) + 1
    events = sorted([(o.start_time, 1) for o in ok] + [(o.start_time + o.latency, -1)
                                                      for o in ok])
    now = top = 0
    for _, step in events:
        now += step
        top = max(top, now)
    return float(max(per_second.values())), top


def stats(values: list[float], percentiles: list[float]) -> dict[str, float]:
    """mean, median, std and each pXX, in milliseconds (0 for no values, as vLLM)."""
    data = np.asarray(values or [0.0]) * 1000
    out = {"mean": float(np.mean(data)), "median": float(np.median(data)),
           "std": float(np.std(data))}
    for p in percentiles:
        out[f"p{p_word(p)}"] = float(np.percentile(data, p))
    return out


def p_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def result_dict(m: Metrics, outputs: list, duration: float, selected: list[str],
                percentiles: list[float], goodput: bool, detailed: bool) -> dict:
    """The run's part of the result JSON, under vLLM's keys."""
    out = {"duration": duration, "completed": m.completed, "failed": m.failed,
           "total_input_tokens": m.total_input, "total_output_tokens": m.total_output,
           "request_throughput": m.request_throughput,
           "request_goodput": m.request_goodput if goodput else None,
           "output_throughput": m.output_throughput,
           "total_token_throughput": m.total_token_throughput,
           "max_output_tokens_per_s": m.max_output_tokens_per_s,
           "max_concurrent_requests": m.max_concurrent_requests}
    if detailed:
        out.update(input_lens=[o.prompt_len for o in outputs], output_lens=m.output_lens,
                   ttfts=[o.ttft for o in outputs], itls=[o.itl for o in outputs],
                   start_times=[o.start_time for o in outputs],
                   generated_texts=[o.generated_text for o in outputs],
                   errors=[o.error for o in outputs])
    for name in METRICS:
        if name in selected:
            for stat, value in stats(m.series[name], percentiles).items():
                out[f"{stat}_{name}_ms"] = value
    return out


def print_result(result: dict, selected: list[str], percentiles: list[float],
                 errors: list[str], file=None) -> None:
    """vLLM's summary table (Successful requests ... P99 E2EL), then up to 10 errors."""
    file = file or sys.stdout
    if errors:
        print("Failed requests during benchmark run detected (capping to 10):", file=sys.stderr)
        for i, error in enumerate(errors[:10]):
            print(f"Error {i}: {error}", file=sys.stderr)

    def row(label, value, fmt=""):
        print(f"{label:<40} {value:<10{fmt}}", file=file)

    print("{:=^{}}".format(" Serving Benchmark Result ", WIDTH), file=file)
    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    if result.get("max_concurrency") is not None:
        row("Maximum request concurrency:", result["max_concurrency"])
    if result.get("request_rate", "inf") != "inf":
        row("Request rate configured (RPS):", result["request_rate"], ".2f")
    row("Benchmark duration (s):", result["duration"], ".2f")
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"], ".2f")
    if result.get("request_goodput") is not None:
        row("Request goodput (req/s):", result["request_goodput"], ".2f")
    row("Output token throughput (tok/s):", result["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", result["max_concurrent_requests"], ".2f")
    row("Total token throughput (tok/s):", result["total_token_throughput"], ".2f")
    for name, (short, heading) in METRICS.items():
        if name not in selected:
            continue
        print("{:-^{}}".format(heading, WIDTH), file=file)
        row(f"Mean {short} (ms):", result[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", result[f"median_{name}_ms"], ".2f")
        for p in percentiles:
            row(f"P{p_word(p)} {short} (ms):", result[f"p{p_word(p)}_{name}_ms"], ".2f")
    print("=" * WIDTH, file=file)


# ---- sweeps --------------------------------------------------------------------------------
def plot_point(m: Metrics, x: str, top: float) -> dict:
    """What a sweep's line and plot show of one run: throughput, and the mean, median and
    top percentile of TTFT, ITL and E2EL (ms), whatever --percentile-metrics selects."""
    point = {"x": x, "completed": m.completed, "sent": m.completed + m.failed,
             "request_throughput": m.request_throughput,
             "output_throughput": m.output_throughput,
             "total_token_throughput": m.total_token_throughput}
    for name in ("ttft", "itl", "e2el"):
        s = stats(m.series[name], [50.0, top])
        point[name] = {"mean": s["mean"], "median": s["median"], "top": s[f"p{p_word(top)}"]}
    return point


def sweep_header(axis: str, top: float) -> str:
    p = f"P{p_word(top)}"
    return (f"{axis:>12} {'ok/sent':>9} {'req/s':>7} {'out tok/s':>10} | "
            f"{'TTFT med':>9} {p:>8} | {'ITL med':>8} {p:>7} | {'E2EL med':>9} {p:>8}"
            "   (ms)")


def sweep_line(point: dict) -> str:
    ok = f"{point['completed']}/{point['sent']}"
    return (f"{point['x']:>12} {ok:>9} {point['request_throughput']:>7.2f} "
            f"{point['output_throughput']:>10.1f} | {point['ttft']['median']:>9.1f} "
            f"{point['ttft']['top']:>8.1f} | {point['itl']['median']:>8.1f} "
            f"{point['itl']['top']:>7.1f} | {point['e2el']['median']:>9.1f} "
            f"{point['e2el']['top']:>8.1f}")


def plot_sweep(points: list[dict], path: str, axis: str, title: str, top: float) -> None:
    """A 2x2 PNG against the swept value (concurrency or request rate): output and total
    token throughput, and the mean, median and top percentile of TTFT, ITL and E2EL."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError(MATPLOTLIB_MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(range(len(points)))
    labels = [p["x"] for p in points]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    ax = axes[0][0]
    ax.plot(xs, [p["output_throughput"] for p in points], "o-", label="output")
    ax.plot(xs, [p["total_token_throughput"] for p in points], "s--", label="total (in + out)")
    ax.set(title="Token throughput", ylabel="tokens/s")
    panels = (("ttft", "Time to first token (TTFT)"), ("itl", "Inter-token latency (ITL)"),
              ("e2el", "End-to-end latency (E2EL)"))
    for ax, (name, heading) in zip((axes[0][1], axes[1][0], axes[1][1]), panels):
        for stat, style, label in (("mean", "o-", "mean"), ("median", "s--", "median"),
                                   ("top", "^:", f"P{p_word(top)}")):
            ax.plot(xs, [p[name][stat] for p in points], style, label=label)
        ax.set(title=heading, ylabel="ms")
    for ax in axes.flat:
        ax.set_xticks(xs, labels)
        ax.set_xlabel(axis)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def finite(value: float) -> float | str:
    """A float for JSON; 'inf' for an infinite one (vLLM writes request_rate so)."""
    return "inf" if math.isinf(value) else value
