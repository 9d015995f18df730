"""PEFT LoRA adapters read into the engine's layout, numpy only: an adapter folder's
adapter_config.json and adapter_model.safetensors checked against the base model
(inspect_adapter: the header alone, cheap enough for admission), then its weights
(load_adapter), one (A, B) pair per engine kernel; and vLLM's LoRARequest.

PEFT's delta for a module with lora_A [r, in] and lora_B [out, r] is `x @ A.T @ B.T *
scaling`. The engine keeps, per kernel path of the parameter table (("layers", i, "attn",
"wq"), ...), A [*in_shape, R] and B [R, *out_shape] in the kernel's own layout
(llama_arch.py: wq [D, N, H], wk/wv [D, K, H], wo [N, H, D], w_gate/w_up [D, F], w_down
[F, D]; in_shape is the contracted axes, quantization.CONTRACTED), zero-padded from the
adapter's rank r to max_lora_rank R, the scaling folded into B, and wk/wv's kv heads
repeated arch.kv_replicas times as the base kernel's are. For a token row x [*in_shape]
the delta is einsum(einsum(x, A) -> [R], B) -> [*out_shape]. Phi-3's fused qkv_proj and
gate_up_proj share one A among their kernels and split B by rows as the loader splits the
base weights.

The safetensors file is read here, with the checkpoint reader's header checks: this
folder sits below jaxserve/backends (docs/architecture.md, "Layout and packaging").
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np

from jaxserve.models import model_family
from jaxserve.models.quantization import CONTRACTED
from jaxserve.models.safetensors_format import DTYPES, read_header

# HF module name -> the engine kernels it feeds, as (block, kernel) under ("layers", i).
LORA_MODULES = {
    "q_proj": (("attn", "wq"),), "k_proj": (("attn", "wk"),), "v_proj": (("attn", "wv"),),
    "o_proj": (("attn", "wo"),), "gate_proj": (("mlp", "w_gate"),),
    "up_proj": (("mlp", "w_up"),), "down_proj": (("mlp", "w_down"),),
    "qkv_proj": (("attn", "wq"), ("attn", "wk"), ("attn", "wv")),  # Phi-3: q, k, v rows
    "gate_up_proj": (("mlp", "w_gate"), ("mlp", "w_up")),  # Phi-3: gate rows, then up rows
}
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
_BLOCKS = {"self_attn": "attn", "mlp": "mlp"}
# base_model.model. + the base's module name (model.layers.i..., Gemma 3 multimodal's
# model.language_model.layers.i...) + .lora_A|lora_B.weight
_TENSOR = re.compile(r"(?:base_model\.model\.)?((?:model\.)?(?:language_model\.)?(?:model\.)?"
                     r"layers\.(\d+)\.(self_attn|mlp)\.(\w+))\.lora_([AB])\.weight")
_FLOATS = ("F64", "F32", "F16", "BF16")
_EMBEDDINGS = ("lm_head", "embed_tokens")
_EMBEDDING_HINT = ("LoRA on the embeddings or the lm_head is not supported (only the decoder "
                   "layers' attention and MLP projections)")
_COVERED = (f"LoRA here covers {', '.join(LORA_MODULES)} of the decoder layers' self_attn and "
            "mlp (not MoE experts, routers, embeddings or the lm_head)")
# Fields of adapter_config.json whose features change the computation: refused when set.
_UNSUPPORTED = {
    "use_dora": "DoRA is not supported; merge it into the base model or train a plain LoRA",
    "modules_to_save": "trained copies of whole modules are not supported",
    "fan_in_fan_out": "GPT-2 style Conv1D weights are not supported",
    "lora_bias": "a bias on lora_B is not supported", "use_qalora": "QA-LoRA is not supported",
    "layer_replication": "layer replication is not supported",
    "target_parameters": "LoRA on parameters (e.g. MoE experts) is not supported",
    "trainable_token_indices": _EMBEDDING_HINT,
    "alora_invocation_tokens": "activated LoRA (aLoRA) is not supported",
}


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _pattern_value(patterns: tuple, module: str):
    """PEFT's get_pattern_key: the value of the first pattern matching a dotted suffix of the
    module's name (re.match of `(.*\\.)?(pattern)$`), else None."""
    for pattern, value in patterns:
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return None


def _compile(pattern, what: str) -> None:
    try:
        re.compile(pattern)
    except (re.error, TypeError) as e:
        raise ValueError(f"{what} {pattern!r:.80} is not a valid regex ({e}).") from None


@dataclasses.dataclass(frozen=True)
class AdapterConfig:
    """What adapter_config.json says about the computation. Module names are the base
    model's (`model.layers.0.self_attn.q_proj`); the patterns keep the file's order (the
    first match wins, as in PEFT)."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str | None = None  # a str: a regex, re.fullmatch
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    layers_to_transform: tuple[int, ...] | None = None

    @classmethod
    def from_dict(cls, raw: dict, where: str = CONFIG_FILE) -> AdapterConfig:
        """Checked values; a ValueError naming the field for anything unsupported."""
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must hold a JSON object.")
        if raw.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"{where}: peft_type {raw['peft_type']!r:.40} is not supported; "
                             "only LoRA adapters (peft_type 'LORA') are.")
        if raw.get("bias", "none") != "none":
            raise ValueError(f"{where}: bias {raw['bias']!r:.40} is not supported (it trains "
                             "the base model's biases); only bias 'none' is.")
        for field, why in _UNSUPPORTED.items():
            if raw.get(field):
                raise ValueError(f"{where}: {field}={raw[field]!r:.80}: {why}.")
        r, alpha = raw.get("r"), raw.get("lora_alpha")
        if not _is_int(r) or r < 1:
            raise ValueError(f"{where}: r must be a positive integer (the LoRA rank), got {r!r}.")
        if not _is_number(alpha):
            raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r:.80}.")
        if not isinstance(raw.get("use_rslora", False), bool):
            raise ValueError(f"{where}: use_rslora must be true or false.")
        patterns = {}
        for field, kind, check in (("rank_pattern", "positive integers",
                                    lambda v: _is_int(v) and v >= 1),
                                   ("alpha_pattern", "numbers", _is_number)):
            value = raw.get(field) or {}
            if not isinstance(value, dict) or not all(map(check, value.values())):
                raise ValueError(f"{where}: {field} must map module-name patterns to {kind}, "
                                 f"got {value!r:.120}.")
            for key in value:
                _compile(key, f"{where}: {field} key")
            patterns[field] = tuple(value.items())
        layers = raw.get("layers_to_transform")
        layers = [layers] if _is_int(layers) else layers
        if layers is not None and not (isinstance(layers, list) and all(map(_is_int, layers))):
            raise ValueError(f"{where}: layers_to_transform must be a layer index or a list of "
                             f"them, got {layers!r:.80}.")
        return cls(r=r, lora_alpha=alpha, use_rslora=raw.get("use_rslora", False),
                   target_modules=_target_modules(raw.get("target_modules"), where),
                   layers_to_transform=tuple(layers) if layers else None, **patterns)

    def rank_of(self, module: str) -> int:
        """r, or the first rank_pattern matching the module."""
        rank = _pattern_value(self.rank_pattern, module)
        return self.r if rank is None else rank

    def scaling(self, module: str) -> float:
        """lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA, each from its pattern."""
        alpha = _pattern_value(self.alpha_pattern, module)
        alpha = self.lora_alpha if alpha is None else alpha
        r = self.rank_of(module)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def targets(self, module: str, layer: int) -> bool:
        """Whether PEFT puts a LoRA on the module (its check_target_module_exists)."""
        if self.target_modules is None or self.target_modules == "all-linear":
            return True
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module) is not None
        found = module in self.target_modules or any(
            module.endswith(f".{t}") for t in self.target_modules)
        return found and (self.layers_to_transform is None or layer in self.layers_to_transform)


def _target_modules(value, where: str):
    """None, a regex str, or a tuple of module names each ending in a supported module."""
    if isinstance(value, str) and value != "all-linear":
        _compile(value, f"{where}: target_modules")
    if value is None or isinstance(value, str):
        return value
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: target_modules must be a list of module names or a regex "
                         f"string, got {value!r:.80}.")
    for name in value:
        last = name.rsplit(".", 1)[-1]
        if last in _EMBEDDINGS:
            raise ValueError(f"{where}: target_modules names {name!r}: {_EMBEDDING_HINT}.")
        if last not in LORA_MODULES:
            raise ValueError(f"{where}: unknown target module {name!r} in target_modules; "
                             f"{_COVERED}.")
    return tuple(value)


def read_config(folder: str | Path) -> AdapterConfig:
    """adapter_config.json of an adapter folder, read with a size cap and checked."""
    if not Path(folder).is_dir():
        raise ValueError(f"LoRA adapter folder {folder} does not exist; a LoRA path must be a "
                         f"local folder holding {CONFIG_FILE} and {WEIGHTS_FILE}.")
    path = Path(folder) / CONFIG_FILE
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as e:
        raise ValueError(f"LoRA adapter {folder}: cannot read {CONFIG_FILE} ({e.strerror}); "
                         "PEFT's save_pretrained writes one beside the weights.") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes; not an adapter config.")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path} is not valid JSON ({type(e).__name__}: {str(e)[:120]}).") \
            from None
    return AdapterConfig.from_dict(data, where=str(path))


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: its config, its rank (the largest of its modules'), the engine
    kernel paths it covers (sorted), and R, the rank its weights are padded to."""

    path: str
    config: AdapterConfig
    rank: int
    targets: tuple[tuple, ...]
    max_lora_rank: int
    shapes: dict = dataclasses.field(repr=False, compare=False)  # path: (in_shape, out_shape)

    def nbytes(self, dtype=np.float32) -> int:
        """Bytes of load_adapter's weights in dtype (A and B of every target, padded to R)."""
        size = np.dtype(dtype).itemsize * self.max_lora_rank
        return sum(size * (math.prod(i) + math.prod(o)) for i, o in self.shapes.values())


class LoraWeights(dict):
    """{engine kernel path: (A [*in_shape, R], B [R, *out_shape])}, and the spec."""

    def __init__(self, weights: dict, spec: AdapterSpec):
        super().__init__(weights)
        self.spec = spec

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.values())


@dataclasses.dataclass(frozen=True)
class _Module:
    key: str  # the base model's module name, model.layers.0.self_attn.q_proj
    a: str  # its tensors' names
    b: str
    rank: int
    paths: tuple  # the engine kernels it feeds, in LORA_MODULES order


def inspect_adapter(path: str | Path, hf_config: dict, max_lora_rank: int,
                    arch=None, values: bool = False) -> AdapterSpec:
    """Every check of an adapter folder against the base model (its config.json as a dict;
    `arch`: the runner's, kv heads replicated, else the family's), from adapter_config.json
    and the safetensors header only; with `values`, also that every value of every tensor is
    finite (one pass over the file's data, memory-mapped; admission's check of an adapter)."""
    spec, modules, header_len, header, _ = _check(Path(path), hf_config, max_lora_rank, arch)
    if values:
        data = _tensor_data(Path(path), header_len)
        for module in modules:
            for name in (module.a, module.b):
                _check_finite(name, _tensor(data, header, name))
    return spec


def _tensor_data(folder: Path, header_len: int) -> np.memmap:
    return np.memmap(folder / WEIGHTS_FILE, dtype=np.uint8, mode="r", offset=8 + header_len)


def _tensor(data: np.memmap, header: dict, name: str) -> np.ndarray:
    """A tensor of the file as stored (memory-mapped, not converted), [rows, cols]."""
    begin, end = header[name]["data_offsets"]
    return data[begin:end].view(DTYPES[header[name]["dtype"]]).reshape(header[name]["shape"])


_FINITE_ROWS = 1 << 14  # rows checked at once: bounded scratch memory for any tensor


def _check_finite(name: str, values: np.ndarray, note: str = "") -> None:
    """ValueError naming the tensor when any of its values is NaN or infinite: such a value
    gives NaN for every token of the adapter, so it is refused before it reaches a slot."""
    for start in range(0, max(len(values), 1), _FINITE_ROWS):
        part = np.asarray(values[start:start + _FINITE_ROWS])
        bad = np.flatnonzero(~np.isfinite(part))
        if bad.size:
            where = np.unravel_index(int(bad[0]), part.shape)
            index = (start + int(where[0]), *map(int, where[1:]))
            raise ValueError(f"{WEIGHTS_FILE}: tensor {name!r} holds {bad.size} non-finite "
                             f"value(s){note} (the first, {part[where]}, at {list(index)}); "
                             "a NaN or infinite weight spoils every token the adapter "
                             "computes, so the adapter is refused.")


def load_adapter(path: str | Path, hf_config: dict, max_lora_rank: int, arch=None,
                 dtype=np.float32) -> LoraWeights:
    """inspect_adapter's checks, then the weights in the engine's layout (module docstring)
    in dtype, computed in float32 (bf16/f16 files widened first)."""
    spec, modules, header_len, header, arch = _check(Path(path), hf_config, max_lora_rank, arch)
    data = _tensor_data(Path(path), header_len)

    def tensor(name: str) -> np.ndarray:  # f32[rows, cols]
        array = _tensor(data, header, name)
        _check_finite(name, array)
        return array.astype(np.float32)

    weights = {}
    for module in modules:
        r = module.rank
        a = tensor(module.a).T  # [in, r]
        b = tensor(module.b).T * np.float32(spec.config.scaling(module.key))  # [r, out]
        # The values as the slots hold them: scaled, in dtype (a large weight can overflow
        # float16 or the scaling can take it past any dtype's range).
        with np.errstate(over="ignore", invalid="ignore"):  # (what _check_finite reports)
            a_cast, b_cast = a.astype(dtype), b.astype(dtype)
        _check_finite(module.a, a_cast, f" in {np.dtype(dtype).name}")
        _check_finite(module.b, b_cast, f" once scaled, in {np.dtype(dtype).name}")
        start = 0
        for path in module.paths:
            in_shape, out_shape = spec.shapes[path]
            rep = _replicas(path, arch)
            rows = math.prod(out_shape) // rep
            part = b[:, start:start + rows].reshape(r, out_shape[0] // rep, *out_shape[1:])
            start += rows
            big_a = np.zeros((*in_shape, max_lora_rank), dtype)
            big_a[..., :r] = a.reshape(*in_shape, r)
            big_b = np.zeros((max_lora_rank, *out_shape), dtype)
            big_b[:r] = np.repeat(part, rep, axis=1)
            weights[path] = (big_a, big_b)
    return LoraWeights(weights, spec)


def _check(folder: Path, hf_config: dict, max_lora_rank: int, arch):
    """(spec, modules, header length, header, arch) after every check."""
    if not _is_int(max_lora_rank) or max_lora_rank < 1:
        raise ValueError(f"max_lora_rank must be a positive integer, got {max_lora_rank!r}.")
    config = read_config(folder)
    ranks = [("r", config.r), *((f"rank_pattern[{k!r}]", v) for k, v in config.rank_pattern)]
    for what, r in ranks:
        if r > max_lora_rank:
            raise ValueError(f"LoRA adapter {folder}: {CONFIG_FILE} gives {what} = {r}, over "
                             f"max_lora_rank {max_lora_rank}; raise --max-lora-rank to at "
                             f"least {max(r for _, r in ranks)}.")
    file = folder / WEIGHTS_FILE
    if not file.is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = (f" It has {', '.join(pickles)}: PyTorch pickles are never loaded (they can run "
                "code); convert the adapter to safetensors (PEFT: save_pretrained(..., "
                "safe_serialization=True))." if pickles else "")
        raise ValueError(f"LoRA adapter {folder} has no {WEIGHTS_FILE}.{hint}")
    header_len, header = _read_header(file)
    family = model_family(hf_config)
    arch = arch if arch is not None else family.arch_from_hf(hf_config)
    table = family.param_shapes(arch, None)
    found = {}  # module key -> {"layer": i, "name": m, "A": tensor name, "B": tensor name}
    for name in header:
        match = _TENSOR.fullmatch(name)
        if not match or LORA_MODULES.get(match[4], ((None,),))[0][0] != _BLOCKS[match[3]]:
            raise ValueError(f"{file.name}: {_unknown(name)}")
        entry = found.setdefault(match[1], {"layer": int(match[2]), "name": match[4]})
        entry[match[5]] = name
    if not found:
        raise ValueError(f"LoRA adapter {folder}: {WEIGHTS_FILE} holds no LoRA weights.")
    modules, shapes = [], {}
    for key, entry in found.items():
        modules.append(_module(file.name, key, entry, header, config, max_lora_rank, table,
                               arch))
        for path in modules[-1].paths:
            if path in shapes:
                raise ValueError(f"{file.name}: two modules of layer {path[1]} both feed "
                                 f"{path[2]}.{path[3]}; keep one of them.")
            shapes[path] = _in_out(table, path)
    spec = AdapterSpec(path=str(folder), config=config, rank=max(m.rank for m in modules),
                       targets=tuple(sorted(shapes)), max_lora_rank=max_lora_rank, shapes=shapes)
    return spec, modules, header_len, header, arch


def _in_out(table: dict, path: tuple) -> tuple[tuple, tuple]:
    """(in_shape, out_shape) of an engine kernel: its contracted axes lead."""
    shape, contracted = table[path][0], len(CONTRACTED[path[-1]])
    return shape[:contracted], shape[contracted:]


def _replicas(path: tuple, arch) -> int:
    """How often each of the checkpoint's output rows of the kernel repeats (kv heads)."""
    return arch.kv_replicas if path[-1] in ("wk", "wv") else 1


def _unknown(name: str) -> str:
    if "lora_embedding_" in name or any(f"{e}." in name for e in _EMBEDDINGS):
        return f"tensor {name!r}: {_EMBEDDING_HINT}."
    if "lora_magnitude_vector" in name:
        return f"tensor {name!r}: DoRA is not supported."
    return f"tensor {name!r} is not the lora_A/lora_B weight of a supported module; {_COVERED}."


def _module(where: str, key: str, entry: dict, header: dict, config: AdapterConfig,
            max_lora_rank: int, table: dict, arch) -> _Module:
    """One module's A and B checked against the config and the base model's kernels."""
    layer, name = entry["layer"], entry["name"]
    if "A" not in entry or "B" not in entry:
        missing = "lora_B" if "A" in entry else "lora_A"
        raise ValueError(f"{where}: {key} has no {missing} weight; the file is incomplete.")
    if not config.targets(key, layer):
        raise ValueError(f"{where}: {key} is not among {CONFIG_FILE}'s target_modules (or "
                         "layers_to_transform); the adapter's files do not belong together.")
    if layer >= arch.num_layers:
        raise ValueError(f"{where}: {key} is in layer {layer}, but the base model has "
                         f"{arch.num_layers} layers; an adapter for another model?")
    paths = tuple(("layers", layer, block, kernel) for block, kernel in LORA_MODULES[name])
    for path in paths:
        if path not in table:
            raise ValueError(f"{where}: {key} targets {path[2]}.{path[3]}, which layer {layer} "
                             "of the base model does not have (LoRA covers the attention and "
                             "dense MLP projections, not MoE experts).")
    size_in = math.prod(_in_out(table, paths[0])[0])  # a fused module's kernels share it
    size_out = sum(math.prod(_in_out(table, p)[1]) // _replicas(p, arch) for p in paths)
    a, b = header[entry["A"]]["shape"], header[entry["B"]]["shape"]
    if len(a) != 2 or len(b) != 2 or a[1] != size_in or b[0] != size_out or a[0] != b[1]:
        raise ValueError(f"{where}: {key}'s lora_A {a} and lora_B {b} do not fit the base "
                         f"model: expected lora_A [r, {size_in}] and lora_B [{size_out}, r] "
                         f"({name}: in {size_in}, out {size_out}); an adapter for another "
                         "model?")
    rank = a[0]
    if rank > max_lora_rank:
        raise ValueError(f"{where}: {key} has rank {rank}, over max_lora_rank "
                         f"{max_lora_rank}; raise --max-lora-rank to at least {rank}.")
    if rank != config.rank_of(key):
        raise ValueError(f"{where}: {key} has rank {rank} but {CONFIG_FILE} gives it "
                         f"{config.rank_of(key)} (r, rank_pattern): its scaling would be wrong.")
    return _Module(key=key, a=entry["A"], b=entry["B"], rank=rank, paths=paths)


def _read_header(path: Path) -> tuple[int, dict]:
    """(header length, {tensor name: info}) of a safetensors file, checked as every
    checkpoint's is (safetensors_format.read_header), whose tensors are floating point."""
    header_len, header = read_header(path)
    for name, info in header.items():
        if info["dtype"] not in _FLOATS:
            raise ValueError(f"{path.name}: tensor {name!r} has dtype {info['dtype']!r:.20}; "
                             f"LoRA weights must be floating point ({', '.join(_FLOATS)}).")
    return header_len, header


SLOT_KERNELS = {"attn": ("wq", "wk", "wv", "wo"), "mlp": ("w_gate", "w_up", "w_down")}


def lora_targets(shapes: dict) -> dict[str, tuple[tuple, tuple, tuple]]:
    """{"layers.3.attn.wq": (kernel path, in shape, out shape)} of every kernel an adapter
    may target, from a family's param_shapes (unquantized)."""
    targets = {}
    for path, (shape, _) in shapes.items():
        if len(path) == 4 and path[0] == "layers" and path[-1] in SLOT_KERNELS.get(
                path[-2], ()):
            contracted = CONTRACTED[path[-1]]
            inputs = tuple(n for i, n in enumerate(shape) if i in contracted)
            outputs = tuple(n for i, n in enumerate(shape) if i not in contracted)
            targets[".".join(map(str, path))] = (path, inputs, outputs)
    return targets


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """vLLM's vllm.lora.request.LoRARequest: the adapter a request runs with. lora_int_id
    (>= 1) names the adapter in the engine; lora_path is its local folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name must be a non-empty string, got {self.lora_name!r:.80}.")
        if not _is_int(self.lora_int_id) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1 (0 means no adapter), got "
                             f"{self.lora_int_id!r:.80}.")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"lora_path must be a string (the adapter's folder), got "
                             f"{type(self.lora_path).__name__}.")

    # vLLM's aliases
    adapter_id = property(lambda self: self.lora_int_id)
    name = property(lambda self: self.lora_name)
    path = property(lambda self: self.lora_path)
