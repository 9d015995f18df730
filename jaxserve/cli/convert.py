"""`jaxserve convert`: a model folder written as an Orbax checkpoint of the engine's
parameters."""

from __future__ import annotations

import argparse
import logging

from jaxserve.cli.common import add_model_positional, model_of
from jaxserve.config.engine_config import SUPPORTED_DTYPES


def add_convert_parser(sub) -> None:
    p = sub.add_parser(
        "convert", help="write a model as an Orbax checkpoint, restored straight into a mesh",
        description="Write a Hugging Face model folder (or Hub id) as an Orbax checkpoint of "
        "the engine's parameters, with its config, tokenizer and generation config beside "
        "it. `jaxserve serve DIR` and LLM(model=DIR) restore each array directly into its "
        "sharding, every host reading only its slices, on any mesh. Runs on the CPU; the "
        "parameters pass through host memory once.")
    add_model_positional(p)
    p.add_argument("--model", default=None, help="model folder or Hub id (or positional)")
    p.add_argument("--out", required=True, metavar="DIR", help="the folder to write")
    p.add_argument("--dtype", default=None, choices=SUPPORTED_DTYPES[1:],
                   help="the saved parameters' dtype (default: the checkpoint's own)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace DIR if it holds an earlier conversion")
    p.set_defaults(func=run_convert)


def run_convert(args: argparse.Namespace) -> int:
    import jax

    jax.config.update("jax_platforms", "cpu")  # abstract shapes and host arrays only

    from jaxserve.backends.jax.orbax_checkpoint import convert
    from jaxserve.config.model_path import resolve_model

    model = resolve_model(model_of(args), logging.getLogger("jaxserve.convert"))
    out = convert(model, args.out, args.dtype, overwrite=args.overwrite)
    print(f"Wrote {out}: serve it with `jaxserve serve {out}`")
    return 0
