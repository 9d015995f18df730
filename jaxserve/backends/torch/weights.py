"""Weight loading for the torch backend: the torch model of a config built on the meta
device, then filled from the checkpoint one parameter at a time (checkpoint.py, as the JAX
backend's weights.py), or with random weights (load_format="dummy").
"""

from __future__ import annotations

import logging

import ml_dtypes
import numpy as np
import torch

from jaxserve.backends.checkpoint import HOST_DTYPES, parameter_values
from jaxserve.config.engine_config import EngineConfig
from jaxserve.models import model_family
from jaxserve.models.llama_arch import with_max_model_len
from jaxserve.models.torch.quantized import component_names, fill_dummy_component

logger = logging.getLogger(__name__)


def model_dtypes(name: str) -> tuple[torch.dtype, type]:
    """(torch dtype, host dtype) of a model dtype name (ModelConfig.dtype): torch names its
    dtypes as the config does."""
    return getattr(torch, name), HOST_DTYPES[name]


_BIT_VIEWS = {np.dtype(ml_dtypes.bfloat16): (np.int16, torch.bfloat16),
              np.dtype(ml_dtypes.float8_e4m3fn): (np.uint8, torch.float8_e4m3fn)}


def _to_torch(value: np.ndarray) -> torch.Tensor:
    """A host array as a torch tensor (bfloat16 and float8 e4m3 through their bits: numpy
    has neither)."""
    value = np.ascontiguousarray(value).reshape(value.shape)  # 0-d stays 0-d
    if value.dtype in _BIT_VIEWS:
        bits, dtype = _BIT_VIEWS[value.dtype]
        return torch.from_numpy(value.view(bits)).view(dtype)
    return torch.from_numpy(value)


def _path(name: str) -> tuple:
    """A torch parameter name as the checkpoint loader's path ("layers.3.attn.wq" ->
    ("layers", 3, "attn", "wq"))."""
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))


def build_model(config: EngineConfig, device: torch.device) -> torch.nn.Module:
    """The torch model of config with its weights on `device`: read from the checkpoint one
    parameter at a time (checkpoint.parameter_values, as the JAX runner), or random
    (load_format="dummy": uniform in [-1e-3, 1e-3], as vLLM's dummy weights). A checkpoint
    published quantized (config.model.weights_scheme, a LinearQuant) builds the kernels it
    covers as their stored components (models/torch/quantized.py), loaded as stored."""
    hf = config.model.hf_config
    family = model_family(hf)
    arch = with_max_model_len(family.arch_from_hf(hf), config.model.max_model_len)
    dtype, np_dtype = model_dtypes(config.model.dtype)
    model_cls = family.torch_cls  # (EngineConfig refused a family without a torch twin)
    scheme = config.model.weights_scheme  # None or the checkpoint's LinearQuant on torch
    with torch.device("meta"):
        model = model_cls(arch, dtype, quantization=scheme)
    model = model.to_empty(device=device)
    params = dict(model.named_parameters())
    model.init_rope(device)
    if config.model.load_format == "dummy":
        generator = torch.Generator(device=device).manual_seed(config.model.seed)
        components = component_names(model)
        for name, param in params.items():
            if name in components:
                fill_dummy_component(param, name.rpartition(".")[2], generator)
            else:
                param.uniform_(-1e-3, 1e-3, generator=generator)
        return model.eval()
    # Every parameter's path, a quantized kernel's components under the kernel's path.
    shapes = {_path(name): tuple(p.shape) for name, p in params.items()}
    by_path = {_path(name): p for name, p in params.items()}
    path_of = lambda name: family.param_path(name, arch)
    for path, value in parameter_values(config.model.model, path_of, shapes, np_dtype,
                                        scheme):
        by_path[path].copy_(_to_torch(value))
    return model.eval()


def log_weights(config: EngineConfig, model: torch.nn.Module) -> None:
    """The weight bytes the device holds, and the checkpoint's scheme when quantized."""
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    label = config.model.weights_label
    logger.info("Weights: %.2f MiB%s.", held / 2**20, f" ({label})" if label else "")
