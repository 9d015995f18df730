"""`jaxserve generate`: completions for prompts, offline, printed as text or JSON lines."""

from __future__ import annotations

import argparse
import json
import sys

from jaxserve.cli.common import add_engine_args, engine_config
from jaxserve.cli.hosts import add_distributed_args, join_hosts
from jaxserve.cli.serve import add_config_flag
from jaxserve.config.engine_args import EngineArgs


def names_a_model(text: str) -> bool:
    """A local model folder (one with a config.json) or an org/name Hub id."""
    import pathlib
    import re

    if (pathlib.Path(text).expanduser() / "config.json").is_file():
        return True
    return re.fullmatch(r"[\w.-]+/[\w.-]+", text) is not None and ".." not in text


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts (offline)",
                       description="Generate completions offline and print them.")
    add_config_flag(p)
    add_engine_args(p)
    add_distributed_args(p.add_argument_group("Multi-host", "one command on every host"))
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
    p.set_defaults(func=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from jaxserve import LLM, SamplingParams

    prompts = list(args.prompts)
    if args.model is None and prompts and (len(prompts) > 1 or args.prompts_file) and \
            names_a_model(prompts[0]):
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
    join_hosts(args, False, engine_config)  # (other hosts end here)
    llm = LLM.from_engine_args(EngineArgs.from_cli(args))  # model None: the built-in model
    try:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outputs = llm.generate(prompts, params)
    finally:
        llm.close()  # multi-host: release the worker hosts
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
