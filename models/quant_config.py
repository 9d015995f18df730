"""A checkpoint published quantized: its config.json's `quantization_config` read into one
LinearQuant (how every quantized linear kernel is stored and run), numpy-free.

Supported, by `quant_method` (and, for compressed-tensors, the config group's format):

* `fp8`: e4m3 weights with `weight_scale_inv` per `weight_block_size` block (DeepSeek-V3,
  Qwen3-*-FP8), or one `weight_scale` per tensor; activations quantized per token (and per
  128-column group with blocks) as `activation_scheme` says, or with a static `input_scale`;
* `compressed-tensors`: `float-quantized` (fp8 weights per tensor, channel or block; as
  `naive-quantized` without activation quantization), `int-quantized` / `naive-quantized`
  (int8 W8A8, per channel), `pack-quantized` (4- or
  8-bit integer weights packed in int32, per group or channel, symmetric or with zero
  points, with or without activation order), with the config group's input activations
  (none, dynamic per token, or static per tensor);
* `awq`: AutoAWQ's GEMM layout (`qweight`, `qzeros`, `scales`), 4-bit with zero points;
* `gptq`: `qweight`, `qzeros`, `scales`, `g_idx`, 4- or 8-bit, `desc_act` false or true,
  symmetric or not, checkpoint_format gptq (zeros stored minus one) or gptq_v2;
* `mxfp4`: GPT-OSS's experts (`*_blocks`, `*_scales`), the only kernels it quantizes.

Anything else (gguf, bitsandbytes, hqq, nvfp4, ...) is refused by name before a weight is
read. models/quant_tensors.py reads each format's tensors; models/jax/quantized.py runs them.
"""

from __future__ import annotations

import dataclasses
import re

KINDS = ("attention", "mlp", "experts")  # the kernel classes a checkpoint may quantize
# The attention's kernels: multi-head (wq .. wo) and latent (DeepSeek's MLA: wq_a .. wv_b).
ATTENTION_KERNELS = ("wq", "wk", "wv", "wo", "wq_a", "wq_b", "wkv_a", "wk_b", "wv_b")
# Activation quantization: none, dynamic per token, dynamic per token and column group,
# or one static scale per kernel (its `input_scale`).
ACTIVATIONS = ("none", "dynamic-token", "dynamic-group", "static")
SUPPORTED = ("fp8, compressed-tensors (float-quantized, int-quantized, pack-quantized), awq "
             "(GEMM), gptq and mxfp4 (GPT-OSS)")
_NAMES = {"gguf": "GGUF", "bitsandbytes": "bitsandbytes", "hqq": "HQQ", "aqlm": "AQLM",
          "eetq": "EETQ", "torchao": "torchao", "quark": "Quark", "modelopt": "ModelOpt",
          "fbgemm_fp8": "FBGEMM FP8", "bitnet": "BitNet", "vptq": "VPTQ", "higgs": "HIGGS",
          "spqr": "SpQR", "auto-round": "AutoRound", "fp_quant": "FP-Quant"}


@dataclasses.dataclass(frozen=True)
class LinearQuant:
    """How a checkpoint stores its quantized linear kernels, and how the step runs them.

    On the device each quantized kernel keeps its codes (`codes`: float8_e4m3fn and int8
    one byte each, uint8 one byte, uint4 and e2m1 two per byte) with a scale per group of
    `group_size` input rows (0: one group, i.e. per output channel) and output column;
    the step dequantizes w = (codes - zero) * scale in float32 and casts it to the
    activations' dtype (models/jax/quantized.py)."""

    method: str  # quant_method as published
    format: str  # the tensor reader (quant_tensors.py): fp8-block, fp8, ct-float, ct-int, ct-pack, awq, gptq, mxfp4
    codes: str  # float8_e4m3fn | int8 | uint4 | uint8 | e2m1
    group_size: int = 0  # input rows per scale; 0: all rows (per channel, or per tensor)
    block_rows: int = 0  # output rows per stored scale (block formats; expanded at load)
    zero_point: bool = False  # a stored zero per group and output column
    zero: int = 0  # the zero of symmetric unsigned codes (8 for uint4, 128 for uint8)
    act_order: bool = False  # a stored g_idx maps each input row to its group
    activations: str = "none"  # ACTIVATIONS
    activation_codes: str = ""  # float8_e4m3fn | int8 (activations != "none")
    activation_group: int = 0  # columns per dynamic activation scale ("dynamic-group")
    kinds: tuple = KINDS  # which kernel classes are quantized
    gptq_zero_offset: int = 0  # added to stored zeros (GPTQ v1 stores zero - 1)
    label: str = ""  # what the start-up log and `jaxserve plan` call it

    @property
    def packed(self) -> bool:
        """Two codes per byte (along the input rows)."""
        return self.codes in ("uint4", "e2m1")

    @property
    def scale_dtype(self) -> str:
        return "uint8" if self.codes == "e2m1" else "float32"  # MXFP4: e8m0 exponents

    @property
    def bits(self) -> int:
        return 4 if self.packed else 8

    def covers(self, name: str) -> bool:
        """Whether the kernel parameter `name` (wq, w_down, experts_up, ...) is quantized."""
        kind = ("experts" if name.startswith("experts_") else
                "attention" if name in ATTENTION_KERNELS else "mlp")
        return kind in self.kinds


def checkpoint_quant(hf_config: dict) -> LinearQuant | None:
    """The LinearQuant of a config.json's quantization_config, None without one; ValueError
    naming the method, format or field jaxserve does not support."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"config.json's quantization_config must be an object, got "
                         f"{type(qc).__name__}.")
    method = str(qc.get("quant_method", "")).lower().replace("_", "-")
    readers = {"fp8": _fp8, "compressed-tensors": _compressed_tensors, "awq": _awq,
               "gptq": _gptq, "mxfp4": _mxfp4}
    if method not in readers:
        shown = _NAMES.get(method, _NAMES.get(method.replace("-", "_"),
                                              repr(qc.get("quant_method"))))
        raise ValueError(f"{shown} checkpoints are not supported (quantization_config."
                         f"quant_method {qc.get('quant_method')!r}); jaxserve serves "
                         f"unquantized checkpoints and ones quantized with {SUPPORTED}. Use "
                         "an unquantized checkpoint (optionally with --quantization int8) or "
                         "one of those formats.")
    try:
        quant = readers[method](qc)
        kinds = tuple(k for k in quant.kinds if not _ignored(k, qc, hf_config, method))
    except (TypeError, AttributeError, KeyError, re.error) as e:  # a field of the wrong type
        raise ValueError(f"config.json's quantization_config ({method}) is malformed: "
                         f"{type(e).__name__}: {e}.") from None
    if not kinds:
        raise ValueError(f"quantization_config ({method}) leaves every linear layer "
                         "unquantized; remove quantization_config from config.json.")
    return dataclasses.replace(quant, kinds=kinds)


def _refuse(method: str, what: str, supported: str) -> ValueError:
    return ValueError(f"{method} checkpoints with {what} are not supported; jaxserve reads "
                      f"{supported}.")


def _fp8(qc: dict) -> LinearQuant:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse("fp8", f"fmt {fmt!r}", "e4m3 weights")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise _refuse("fp8", f"activation_scheme {scheme!r}", "dynamic or static activations")
    block = qc.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, list) and len(block) == 2
                and all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"quantization_config.weight_block_size must be two positive "
                             f"integers [rows, columns], got {block!r}.")
        if scheme != "dynamic":
            raise _refuse("fp8", "blocks and static activations", "blocks with dynamic "
                          "activations")
        return LinearQuant("fp8", "fp8-block", "float8_e4m3fn", group_size=block[1],
                           block_rows=block[0],
                           activations="dynamic-group", activation_codes="float8_e4m3fn",
                           activation_group=block[1],
                           label=f"FP8 e4m3 in {block[0]}x{block[1]} blocks")
    return LinearQuant("fp8", "fp8", "float8_e4m3fn",
                       activations="dynamic-token" if scheme == "dynamic" else "static",
                       activation_codes="float8_e4m3fn", label="FP8 e4m3 per tensor")


def _awq(qc: dict) -> LinearQuant:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("awq", f"version {qc.get('version')!r}", "the GEMM layout")
    if qc.get("bits", qc.get("w_bit", 4)) != 4:
        raise _refuse("awq", f"bits {qc.get('bits')!r}", "4-bit weights")
    if not qc.get("zero_point", True):
        raise _refuse("awq", "zero_point false", "weights with zero points")
    group = _group_size(qc.get("group_size", qc.get("q_group_size", 128)), "awq")
    return LinearQuant("awq", "awq", "uint4", group_size=group, zero_point=True,
                       label=f"AWQ int4{_group_text(group)}")


def _gptq(qc: dict) -> LinearQuant:
    bits = qc.get("bits", 4)
    if bits not in (4, 8):
        raise _refuse("gptq", f"bits {bits!r}", "4- and 8-bit weights")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise _refuse("gptq", f"checkpoint_format {fmt!r}", "the gptq and gptq_v2 formats")
    if qc.get("lm_head"):
        raise _refuse("gptq", "a quantized lm_head (lm_head: true)", "an unquantized lm_head")
    if qc.get("dynamic"):
        raise _refuse("gptq", "per-module `dynamic` overrides", "one scheme for every layer")
    group = _group_size(qc.get("group_size", 128), "gptq")
    act_order = bool(qc.get("desc_act", False))
    return LinearQuant("gptq", "gptq", "uint4" if bits == 4 else "uint8", group_size=group,
                       zero_point=True, act_order=act_order,
                       gptq_zero_offset=1 if fmt == "gptq" else 0,
                       label=f"GPTQ int{bits}{_group_text(group)}"
                             f"{', act order' if act_order else ''}")


def _mxfp4(qc: dict) -> LinearQuant:
    return LinearQuant("mxfp4", "mxfp4", "e2m1", group_size=32, kinds=("experts",),
                       label="MXFP4 experts")


def _group_size(value, method: str) -> int:
    if value in (-1, None):
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"quantization_config.group_size must be a positive integer or -1 "
                         f"({method}), got {value!r}.")
    return value


def _group_text(group: int) -> str:
    return f", groups of {group}" if group else ", per channel"


def _compressed_tensors(qc: dict) -> LinearQuant:
    group = _ct_scheme(qc)
    fmt = group.get("format") or qc.get("format")
    if group.get("output_activations"):
        raise _refuse("compressed-tensors", "output activation quantization",
                      "weight and input activation quantization")
    weights = group.get("weights") or {}
    bits, kind = weights.get("num_bits"), weights.get("type", "int")
    reader = _CT_READERS.get((fmt, kind, bits))
    if reader is None:
        raise _refuse("compressed-tensors", f"format {fmt!r} ({kind} weights of {bits} bits)",
                      "float-quantized 8-bit float, int-quantized 8-bit int and "
                      "pack-quantized 4- or 8-bit int weights")
    strategy, group_size, block_rows = _ct_weight_layout(weights)
    symmetric = weights.get("symmetric", True)
    if not symmetric and reader != "ct-pack":
        raise _refuse("compressed-tensors", f"asymmetric {fmt} weights",
                      "symmetric 8-bit weights")
    act_order = weights.get("actorder") in ("group", True)
    codes = {"ct-float": "float8_e4m3fn", "ct-int": "int8"}.get(
        reader, "uint4" if bits == 4 else "uint8")
    acts, act_codes, act_group = _ct_activations(group.get("input_activations"))
    if acts != "none" and reader == "ct-pack":
        raise _refuse("compressed-tensors", "quantized activations on packed weights",
                      "pack-quantized weights with 16-bit activations")
    words = {"ct-float": "FP8", "ct-int": "INT8", "ct-pack": f"INT{bits}"}[reader]
    label = (f"compressed-tensors {words} per {strategy}"
             f"{f' of {group_size}' if strategy == 'group' else ''}"
             f"{', asymmetric' if not symmetric else ''}{', act order' if act_order else ''}"
             f"{f', {acts} {act_codes} activations' if acts != 'none' else ''}")
    return LinearQuant("compressed-tensors", reader, codes, group_size=group_size,
                       block_rows=block_rows,
                       zero_point=not symmetric, zero=(1 << (bits - 1)) if reader == "ct-pack"
                       else 0, act_order=act_order, activations=acts,
                       activation_codes=act_codes, activation_group=act_group,
                       kinds=_ct_kinds(group.get("targets")), label=label)


# compressed-tensors (format, weight type, bits) -> the reader of its tensors
_CT_READERS = {("float-quantized", "float", 8): "ct-float",
               ("naive-quantized", "float", 8): "ct-float",  # fp8 weights, 16-bit activations
               ("int-quantized", "int", 8): "ct-int", ("naive-quantized", "int", 8): "ct-int",
               ("pack-quantized", "int", 4): "ct-pack", ("pack-quantized", "int", 8): "ct-pack"}


def _ct_scheme(qc: dict) -> dict:
    """The one config group of a compressed checkpoint (several groups may name the same
    scheme for different layers); what jaxserve does not read is refused."""
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise _refuse("compressed-tensors", f"quantization_status {status!r}",
                      "compressed checkpoints")
    if qc.get("kv_cache_scheme"):
        raise _refuse("compressed-tensors", "a kv_cache_scheme (calibrated KV-cache scales)",
                      "weight and activation schemes; jaxserve calibrates its own KV scales "
                      "(--kv-cache-dtype fp8)")
    if qc.get("sparsity_config"):
        raise _refuse("compressed-tensors", "a sparsity_config", "dense quantized weights")
    groups = qc.get("config_groups") or {}
    if not isinstance(groups, dict) or not groups:
        raise ValueError("compressed-tensors quantization_config has no config_groups.")
    schemes = {}
    for name, group in groups.items():
        if not isinstance(group, dict):
            raise ValueError(f"compressed-tensors config group {name!r} is not an object.")
        fmt = group.get("format") or qc.get("format")
        key = repr((fmt, group.get("weights"), group.get("input_activations")))
        schemes.setdefault(key, (name, group))
    if len(schemes) > 1:
        raise _refuse("compressed-tensors", f"{len(schemes)} different schemes "
                      f"({', '.join(n for n, _ in schemes.values())}) for different layers",
                      "one scheme for every quantized layer")
    return next(iter(schemes.values()))[1]


def _ct_weight_layout(weights: dict) -> tuple[str, int, int]:
    """(strategy, group size, block rows) of static weights: a group's columns, or a
    block's (rows, columns); 0 where the strategy has none."""
    if weights.get("dynamic"):
        raise _refuse("compressed-tensors", "dynamic weight quantization", "static weights")
    strategy = weights.get("strategy", "tensor")
    if strategy not in ("tensor", "channel", "group", "block"):
        raise _refuse("compressed-tensors", f"weight strategy {strategy!r}",
                      "tensor, channel, group and block weights")
    if strategy == "group":
        return strategy, _group_size(weights.get("group_size"), "compressed-tensors"), 0
    if strategy == "block":
        block = weights.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2
                and all(isinstance(b, int) and b > 0 for b in block)):
            raise ValueError(f"compressed-tensors block_structure must be two positive "
                             f"integers, got {block!r}.")
        return strategy, block[1], block[0]
    return strategy, 0, 0


def _ct_activations(args) -> tuple[str, str, int]:
    if not args:
        return "none", "", 0
    kind, bits = args.get("type", "int"), args.get("num_bits", 8)
    if bits != 8 or kind not in ("int", "float"):
        raise _refuse("compressed-tensors", f"{bits}-bit {kind} activations",
                      "8-bit int or float activations")
    if not args.get("symmetric", True):
        raise _refuse("compressed-tensors", "asymmetric activations", "symmetric activations")
    codes = "int8" if kind == "int" else "float8_e4m3fn"
    strategy, dynamic = args.get("strategy", "tensor"), args.get("dynamic", False)
    if dynamic in (True, "local") and strategy in ("token", "tensor"):
        return "dynamic-token", codes, 0
    if dynamic in (True, "local") and strategy == "group" and args.get("group_size"):
        return "dynamic-group", codes, int(args["group_size"])
    if not dynamic and strategy == "tensor":
        return "static", codes, 0
    raise _refuse("compressed-tensors", f"{'dynamic' if dynamic else 'static'} {strategy} "
                  "activations", "dynamic per-token or per-group and static per-tensor "
                  "activations")


def _ct_kinds(targets) -> tuple:
    """The kernel classes a config group's targets reach (Linear: all of them)."""
    if targets in (None, ["Linear"], "Linear"):
        return KINDS
    if isinstance(targets, list) and "Linear" in targets:
        return KINDS
    kinds = tuple(k for k in KINDS if any(_matches(t, n) for t in targets
                                          for n in _module_names(k, 0)))
    if not kinds:
        raise _refuse("compressed-tensors", f"targets {targets!r}", "targets that reach the "
                      "attention, MLP or expert projections (e.g. ['Linear'])")
    return kinds


def _module_names(kind: str, layer: int) -> list[str]:
    """Hugging Face module names of one layer's kernels of a class, as checkpoints name
    them (Llama, Mixtral and Qwen MoE layouts)."""
    prefix = f"model.layers.{layer}."
    if kind == "attention":
        return [prefix + f"self_attn.{p}_proj" for p in ("q", "k", "v", "o")]
    if kind == "mlp":
        return [prefix + f"mlp.{p}_proj" for p in ("gate", "up", "down")]
    return ([prefix + f"mlp.experts.0.{p}_proj" for p in ("gate", "up", "down")]
            + [prefix + f"block_sparse_moe.experts.0.w{i}" for i in (1, 2, 3)])


def _matches(entry, name: str) -> bool:
    """An ignore/target entry against a module name: `re:` a regular expression (as
    compressed-tensors), else a whole module-path component run (`lm_head`, `mlp.gate`,
    `model.layers.3.self_attn`)."""
    if not isinstance(entry, str):
        return False
    if entry.startswith("re:"):
        return re.match(entry[3:], name) is not None
    return f".{entry}." in f".{name}."


def _ignored(kind: str, qc: dict, hf_config: dict, method: str) -> bool:
    """Whether the config's ignore list leaves a kernel class unquantized in every layer;
    ValueError when it does so in some layers only (one scheme per class is supported)."""
    entries = []
    for key in ("ignore", "modules_to_not_convert", "ignored_layers"):
        value = qc.get(key) or []
        if not isinstance(value, list):
            raise ValueError(f"quantization_config.{key} must be a list of module names, got "
                             f"{value!r:.80}.")
        entries += value
    if not entries:
        return False
    layers = int(hf_config.get("num_hidden_layers") or 0)
    hit = [any(_matches(e, n) for e in entries for n in _module_names(kind, i))
           for i in range(layers)]
    if any(hit) and not all(hit):
        first = hit.index(True) if not hit[0] else hit.index(False)
        raise _refuse(method, f"{kind} projections left unquantized in some layers only "
                      f"(the ignore list treats layer {first} differently)",
                      "one scheme per class of projections (attention, MLP, experts) in "
                      "every layer")
    return all(hit) and bool(hit)
