"""Compiled step executables on disk, so that a second start skips tracing and lowering.

JAX's persistent compilation cache (compile_stats.py) saves the XLA compile, but every start
still traces and lowers each bucket's step to look it up. This store keeps the compiled
executable itself (jax.experimental.serialize_executable): a warm start loads it in a
fraction of that time.

An entry is one file, <name>-<hlo key>.jxc: a JSON header line (format, jax and jaxlib
versions, the key) and then the pickled executable. Its key hashes the lowered HLO text with
what else changes an executable: jax / jaxlib versions, platform, device kinds, the exact
devices and XLA_FLAGS. Finding it needs tracing and lowering (a fraction of compiling); an
index file, <name>-<key>.idx, maps everything that shapes a function before tracing (model
config, dtypes, mesh, bucket, the shape-changing engine arguments, jaxserve's own source)
to its entry, so a start with unchanged code and configuration loads without tracing. Writes
go to a temporary file renamed into place, so concurrent starts never read half a file. An
entry or index that cannot be used (stale, foreign, truncated, corrupt) is reported in one
log line and recompiled; it never stops a start.

This store replaces JAX's persistent cache in the engine's process (compile_stats.py turns
JAX's on only where this one is off: several hosts). On XLA:CPU an executable that JAX
loaded from its own cache serializes without the code of its kernels ("Function ... not
found" when a later process runs it), and JAX decides once per process whether its cache
is used; so when a user has configured JAX's cache themselves, this store stays off.

Loading runs pickled code from the cache folder, as JAX's own cache does with executables:
the folder must be as trusted as the Python installation (it is the user's own ~/.cache).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import tempfile
from pathlib import Path

import jax
import jaxlib

logger = logging.getLogger(__name__)

FORMAT = 1
_SUFFIX = ".jxc"
_INDEX = ".idx"


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """A hash of the Python source of the packages a step is traced from (jaxserve and its
    subfolders, the models, the Pallas kernels): any code change gives new keys."""
    import jaxserve.kernels_pallas
    import jaxserve.models

    package_root = Path(__file__).resolve().parents[2]  # jaxserve/ (this is backends/jax/)
    roots = [package_root, *map(Path, jaxserve.models.__path__),
             *map(Path, jaxserve.kernels_pallas.__path__)]
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if path.relative_to(root).parts[0] == "benchmarks":
                continue  # the scripts' library: no step is traced from it
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def versions() -> dict:
    return {"jax": jax.__version__, "jaxlib": jaxlib.__version__}


class ExecutableCache:
    """Load and store compiled executables under `directory` for one engine configuration
    (`fingerprint`: a JSON-able description of everything that shapes its executables).

    Two files per function: the entry (<name>-<hlo key>.jxc, header and executable), keyed
    by the lowered HLO text, the versions and the devices; and an index (<name>-<key>.idx,
    one JSON line naming the entry), keyed by the fingerprint and jaxserve's source. A start
    with the same code and configuration finds the index and loads without tracing; after a
    code change that leaves a function's HLO as it was (most changes), tracing and lowering
    find the old entry by its HLO key and only the XLA compile is saved."""

    def __init__(self, directory: str | os.PathLike, fingerprint: dict, devices) -> None:
        self.directory = Path(directory)
        self.devices = list(devices)
        machine = {**versions(), "format": FORMAT, "platform": self.devices[0].platform,
                   "devices": [(d.id, d.device_kind, d.process_index) for d in self.devices],
                   "xla_flags": os.environ.get("XLA_FLAGS", "")}
        self._machine = json.dumps(machine, sort_keys=True, default=str)
        self._base = json.dumps({**fingerprint, **machine, "source": source_digest()},
                                sort_keys=True, default=str)
        self._bad: set[Path] = set()  # entries found unusable by this process (logged once)
        self.hits = 0
        self.misses = 0

    def index_path(self, name: str) -> Path:
        key = hashlib.sha256(f"{self._base}|{name}".encode()).hexdigest()[:24]
        return self.directory / f"{name}-{key}{_INDEX}"

    def entry_path(self, name: str, hlo: str) -> Path:
        digest = hashlib.sha256(f"{self._machine}|{name}|".encode())
        digest.update(hlo.encode())
        return self.directory / f"{name}-{digest.hexdigest()[:24]}{_SUFFIX}"

    def load(self, name: str):
        """The executable the index names for `name` (a jax.stages.Compiled), or None: no
        index (a first start, or another configuration or source), or an unusable entry."""
        index = self.index_path(name)
        try:
            header = json.loads(index.read_bytes())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            return self._unusable(index, f"unreadable index ({error})")
        if not isinstance(header, dict) or header.get("key") != index.stem or \
                not isinstance(header.get("entry"), str) or "/" in header["entry"]:
            return self._unusable(index, "unreadable index")
        return self._load_entry(self.directory / header["entry"])

    def load_lowered(self, name: str, hlo: str):
        """The executable stored for this HLO text (written by an earlier source or
        configuration), indexed for `name` from now on; or None (counted as a miss)."""
        path = self.entry_path(name, hlo)
        if path in self._bad or not path.is_file():
            self.misses += 1
            return None
        compiled = self._load_entry(path)
        if compiled is None:
            self.misses += 1
        else:
            self._write_index(name, path)
        return compiled

    def _load_entry(self, path: Path):
        if path in self._bad:
            return None
        try:
            with open(path, "rb") as f:
                header = json.loads(f.readline())
                payload = f.read()
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as error:
            return self._unusable(path, f"unreadable header ({error})")
        if not isinstance(header, dict):
            return self._unusable(path, "unreadable header")
        found = {k: header.get(k) for k in ("format", "jax", "jaxlib")}
        wanted = {"format": FORMAT, **versions()}
        if found != wanted:
            return self._unusable(path, f"written by {found}, this is {wanted}")
        if header.get("key") != path.stem:
            return self._unusable(path, "its key does not match its name")
        try:
            from jax.experimental.serialize_executable import deserialize_and_load

            serialized, in_tree, out_tree = pickle.loads(payload)
            compiled = deserialize_and_load(serialized, in_tree, out_tree,
                                            backend=self.devices[0].client,
                                            execution_devices=self.devices)
        except Exception as error:  # any corrupt or foreign entry means: compile again
            return self._unusable(path, f"cannot be loaded ({type(error).__name__}: "
                                        f"{str(error)[:120]})")
        self.hits += 1
        return compiled

    def _unusable(self, path: Path, why: str) -> None:
        logger.warning("Executable cache: ignoring %s: %s; compiling it again.", path.name, why)
        self._bad.add(path)
        return None

    def store(self, name: str, hlo: str, compiled) -> None:
        """Write `compiled` (lowered to `hlo`) for `name`, and its index; a failure to write
        is logged, never raised."""
        path = self.entry_path(name, hlo)
        try:
            from jax.experimental.serialize_executable import serialize

            payload = pickle.dumps(serialize(compiled))
            header = json.dumps({"format": FORMAT, **versions(), "key": path.stem})
            self._write(path, header.encode() + b"\n" + payload)
            self._bad.discard(path)
            self._write_index(name, path)
        except Exception as error:
            logger.warning("Executable cache: could not store %s (%s: %s).", path.name,
                           type(error).__name__, str(error)[:120])

    def _write_index(self, name: str, entry: Path) -> None:
        index = self.index_path(name)
        try:
            self._write(index, json.dumps({"key": index.stem, "entry": entry.name}).encode())
        except OSError as error:
            logger.warning("Executable cache: could not store %s (%s).", index.name, error)

    def _write(self, path: Path, content: bytes) -> None:
        """Atomically: readers see the whole file or none (temporary file, then rename)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(content)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def executable_cache_for(config, runner) -> ExecutableCache | None:
    """The executable cache of a ModelRunner's configuration (an EngineConfig), beside the
    XLA cache. None when compilation_cache_dir is None; on several hosts (each compiles; JAX's persistent cache
    serves them instead); and when JAX's own persistent cache was configured outside
    jaxserve (an executable loaded from it cannot be stored: executable_cache.py)."""
    if not config.compilation_cache_dir or jax.process_count() > 1:
        return None
    if jax.config.jax_compilation_cache_dir is not None:
        logger.info("JAX's persistent compilation cache is configured (%s): jaxserve's "
                    "executable cache is off.", jax.config.jax_compilation_cache_dir)
        return None
    model, cache, sched = config.model, config.cache, config.scheduler
    fingerprint = {
        "hf_config": model.hf_config, "dtype": model.dtype,
        "cache_dtype": str(runner.cache_dtype), "num_blocks": runner.num_blocks,
        "block_size": cache.block_size, "blocks_per_seq": runner.blocks_per_seq,
        "max_num_seqs": sched.max_num_seqs, "vocab": runner.arch.vocab_size,
        "attention": config.attention.backend, "mesh": str(config.parallel.mesh),
        "expert_parallel": config.parallel.expert_parallel, "arch": repr(runner.arch),
        "speculative_tokens": runner.num_speculative, "quantization": repr(model.weights_scheme),
        "kv_cache_dtype": cache.kv_cache_dtype, "pooler": repr(config.pooler),
        "lora": repr(config.lora),
    }
    directory = os.path.join(config.compilation_cache_dir, "executables")
    return ExecutableCache(directory, fingerprint, runner.mesh.devices.flat)
