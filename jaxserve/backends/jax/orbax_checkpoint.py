"""Orbax checkpoints of the engine's parameter tree: `jaxserve convert` writes one, and the JAX
runner restores every array straight into its sharding.

A converted folder holds the model's config.json (its dtype set to the saved one), the
tokenizer files, generation and chat-template files, and `orbax/`: an Orbax checkpoint of
the parameters as the engine lays them out on one device (the 1x1 sharding plan: kv heads
not replicated), one nested dict of arrays keyed by the parameter's path. A marker file,
jaxserve_orbax.json, names the format and the saved dtype.

Restoring gives each array the sharding the mesh plan gives it, so every process reads only
the slices its devices hold (Orbax with tensorstore) and no device or host ever holds the
whole model; the mesh may differ from the one at conversion. Where tensor parallelism
replicates the kv heads (more model shards than kv heads), the small k/v projections are
read whole and repeated on the devices. The saved shapes are checked against the config
before anything is read; the first mismatch is named.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxserve.backends.checkpoint import parameter_values
from jaxserve.config.engine_config import ORBAX_MARKER, SUPPORTED_DTYPES, read_hf_config
from jaxserve.config.progress import progress

logger = logging.getLogger(__name__)

MARKER = ORBAX_MARKER
FORMAT = "jaxserve-orbax"
PARAMS_DIR = "orbax"
# Beside the parameters: what the engine and the tokenizer read from a model folder.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
              "tokenizer.model", "chat_template.json", "chat_template.jinja",
              "added_tokens.json", "preprocessor_config.json")
KV_PARAMS = ("wk", "wv", "bk", "bv")  # [.., K', H]: K' = K * kv_replicas
_KV_AXIS = {"wk": 1, "wv": 1, "bk": 0, "bv": 0}


def is_orbax_folder(folder: str | Path) -> bool:
    """Whether `folder` is a `jaxserve convert` output."""
    return (Path(folder) / MARKER).is_file()


def _orbax():
    """orbax.checkpoint's v1 API, imported on first use (about a second), with its absl
    logging kept to warnings."""
    logging.getLogger("absl").setLevel(logging.WARNING)
    from orbax.checkpoint import v1 as ocp

    return ocp


# ---- convert -------------------------------------------------------------------------------
def convert(model: str | Path, out: str | Path, dtype: str | None = None, *,
            overwrite: bool = False) -> Path:
    """Write `model` (a Hugging Face folder) as an Orbax folder at `out`, the parameters in
    `dtype` (default: the checkpoint's own). The parameters pass through host memory once."""
    from jaxserve.models import model_family
    from jaxserve.models.quant_config import checkpoint_quant

    source, out = Path(model), Path(out).absolute()
    hf = read_hf_config(source)
    quant = checkpoint_quant(hf)
    if quant is not None:
        raise ValueError(f"{source} is a quantized checkpoint ({quant.label}); jaxserve "
                         "convert writes float checkpoints. Serve the Hugging Face folder as "
                         "it is: its weights load quantized.")
    saved = hf.get("dtype") or hf.get("torch_dtype") or "float32"
    dtype = dtype or (saved if saved in SUPPORTED_DTYPES[1:] else "float32")
    if dtype not in SUPPORTED_DTYPES[1:]:
        raise ValueError(f"dtype must be one of {', '.join(SUPPORTED_DTYPES[1:])}, got "
                         f"{dtype!r}.")
    if out.exists():
        if not overwrite:
            raise ValueError(f"{out} already exists; choose another --out or remove it.")
        if not is_orbax_folder(out):
            raise ValueError(f"{out} exists and is not a jaxserve Orbax folder: not "
                             "overwriting it.")
        shutil.rmtree(out)
    family = model_family(hf)
    arch = family.arch_from_hf(hf)
    np_dtype = np.dtype(jnp.dtype(dtype))
    abstract = nnx.eval_shape(lambda: family.model_cls(arch, jnp.dtype(dtype)))
    shapes = {tuple(path): var.get_value().shape
              for path, var in nnx.to_flat_state(nnx.state(abstract))}
    tree: dict = {}
    for path, value in parameter_values(source, lambda name: family.param_path(name, arch),
                                        shapes, np_dtype):
        _nest(tree, path, np.ascontiguousarray(value))
    out.mkdir(parents=True)
    _write(out / PARAMS_DIR, tree)
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    config = json.loads((source / "config.json").read_text())
    config["torch_dtype"] = dtype
    config.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / MARKER).write_text(json.dumps({"format": FORMAT, "version": 1, "dtype": dtype,
                                          "source": str(source)}, indent=2))
    return out


def _write(path: Path, tree: dict) -> None:
    """Save with a progress bar of the bytes written (Orbax compresses as it goes)."""
    ocp = _orbax()
    total = sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree))
    logger.info("Writing %d tensors (%.1f MiB) to %s", len(jax.tree_util.tree_leaves(tree)),
                total / 2**20, path)
    done = threading.Event()
    error: list[BaseException] = []

    def save() -> None:
        try:
            ocp.save(path, tree)
        except BaseException as err:  # noqa: BLE001 - raised on the caller's thread
            error.append(err)
        finally:
            done.set()

    worker = threading.Thread(target=save, name="orbax-save")
    worker.start()
    with progress(desc="Writing Orbax checkpoint", unit="B", unit_scale=True) as bar:
        while not done.wait(0.2):
            bar.n = _bytes_under(path.parent)
            bar.refresh()
        bar.n = _bytes_under(path)
        bar.refresh()
    worker.join()
    if error:
        raise error[0]


def _bytes_under(folder: Path) -> int:
    try:
        return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    except OSError:  # a file renamed while counting
        return 0


def _nest(tree: dict, path: tuple, value) -> None:
    node = tree
    for key in path[:-1]:
        node = node.setdefault(str(key), {})
    node[str(path[-1])] = value


def _lookup(tree: dict, path: tuple):
    for key in path:
        tree = tree[str(key)]
    return tree


# ---- restore -------------------------------------------------------------------------------
def restore_params(abstract_model: nnx.Module, folder: str | Path, dtype, mesh: Mesh,
                   spec_of=lambda path: PartitionSpec(), kv_replicas: int = 1) -> nnx.Module:
    """Fill an abstract model from an Orbax folder, each array restored into its sharding on
    `mesh` (spec_of(path) -> PartitionSpec), cast to `dtype`. kv_replicas: how often the
    model repeats each checkpoint kv head (the mesh plan's)."""
    ocp = _orbax()
    path = Path(folder).absolute() / PARAMS_DIR
    graphdef, state = nnx.split(abstract_model)
    flat = [(tuple(p), var) for p, var in nnx.to_flat_state(state)]
    target: dict = {}
    for p, var in flat:
        shape, spec = var.get_value().shape, spec_of(p)
        if kv_replicas > 1 and str(p[-1]) in KV_PARAMS:  # read whole, repeated below
            axis = _KV_AXIS[str(p[-1])]
            shape = shape[:axis] + (shape[axis] // kv_replicas,) + shape[axis + 1:]
            spec = PartitionSpec()
        _nest(target, p, jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec)))
    _check(ocp.metadata(path).metadata, target, folder)
    started = time.perf_counter()
    restored = ocp.load(path, target)
    logger.info("Restored %d tensors from %s in %.1f s", len(flat), path,
                time.perf_counter() - started)
    values = []
    for p, var in flat:
        value = _lookup(restored, p)
        if kv_replicas > 1 and str(p[-1]) in KV_PARAMS:
            value = _repeat_heads(value, kv_replicas, _KV_AXIS[str(p[-1])],
                                  NamedSharding(mesh, spec_of(p)))
        values.append((p, var.replace(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(values))


def _repeat_heads(value: jax.Array, repeats: int, axis: int, sharding) -> jax.Array:
    return jax.jit(lambda v: jnp.repeat(v, repeats, axis=axis), out_shardings=sharding)(value)


def _check(saved, target: dict, folder) -> None:
    """ValueError naming the first parameter whose saved shape differs from the model's (or
    that one side lacks)."""
    def flat(tree) -> dict:
        return {jax.tree_util.keystr(k, simple=True, separator="."): leaf
                for k, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}

    have, want = flat(saved), flat(target)
    for name, expected in want.items():
        if name not in have:
            raise ValueError(f"{folder}: the Orbax checkpoint has no parameter {name!r}, which "
                             "this model's config.json needs; was it converted from another "
                             "model?")
        if tuple(have[name].shape) != tuple(expected.shape):
            raise ValueError(f"{folder}: parameter {name!r} is saved with shape "
                             f"{tuple(have[name].shape)}, but config.json makes it "
                             f"{tuple(expected.shape)}; was it converted from another model?")
    extra = sorted(set(have) - set(want))
    if extra:
        raise ValueError(f"{folder}: the Orbax checkpoint has parameter {extra[0]!r}, which "
                         "this model's config.json does not use; was it converted from another "
                         "model?")
