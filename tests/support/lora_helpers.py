"""LoRA adapters for the tests, built by the real PEFT library on a tiny checkpoint, with
random nonzero A and B (PEFT starts B at zero), so that an adapter visibly changes the
model's output; and PEFT's own per-module deltas, the reference the engine's layout is
compared with."""

from __future__ import annotations

import pathlib

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
A_GAIN, B_GAIN = 1.0, 0.3  # A ~ N(0, 1/in), B ~ N(0, B_GAIN^2 / r): a delta of ~0.3 * scaling


def base_model(base_folder):
    """The tiny checkpoint as a float32 transformers model."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    return transformers.AutoModelForCausalLM.from_pretrained(str(base_folder),
                                                             dtype=torch.float32)


def make_adapter(base_folder, out_folder, seed: int, rank: int = 8,
                 target_modules=ALL_MODULES, use_rslora: bool = False, lora_alpha: float = 16,
                 **extra) -> pathlib.Path:
    """A PEFT LoRA adapter of the checkpoint in base_folder, saved as safetensors in
    out_folder (returned); extra: more LoraConfig fields (rank_pattern, alpha_pattern,
    use_dora, bias, ...)."""
    import peft
    import torch

    config = peft.LoraConfig(r=rank, lora_alpha=lora_alpha, use_rslora=use_rslora,
                             target_modules=list(target_modules) if not isinstance(
                                 target_modules, str) else target_modules,
                             lora_dropout=0.0, init_lora_weights=False, **extra)
    model = peft.get_peft_model(base_model(base_folder), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if ".lora_A." in name:  # [r, in]
                t.copy_(torch.randn(t.shape, generator=gen) * A_GAIN / t.shape[1] ** 0.5)
            elif ".lora_B." in name:  # [out, r]
                t.copy_(torch.randn(t.shape, generator=gen) * B_GAIN / t.shape[1] ** 0.5)
    out = pathlib.Path(out_folder)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def peft_deltas(base_folder, adapter_folder, inputs: dict) -> dict:
    """{module name: f32[T, out]}: each LoRA module's output minus its base layer's on
    inputs[module name] (f32[T, in]), through PeftModel.from_pretrained of the saved
    adapter (its scaling and patterns as PEFT reads them)."""
    import peft
    import torch

    model = peft.PeftModel.from_pretrained(base_model(base_folder), str(adapter_folder))
    modules = dict(model.base_model.model.named_modules())
    deltas = {}
    with torch.no_grad():
        for name, x in inputs.items():
            module = modules[name]
            x = torch.from_numpy(x)
            deltas[name] = (module(x) - module.base_layer(x)).numpy()
    return deltas


def lora_module_names(adapter_folder) -> dict:
    """{module name: (in, out)} of every LoRA module in the adapter's safetensors."""
    from safetensors.numpy import load_file

    tensors = load_file(str(pathlib.Path(adapter_folder) / "adapter_model.safetensors"))
    found = {}
    for name, value in tensors.items():
        module = name.removeprefix("base_model.model.").rsplit(".", 2)[0]
        in_out = found.setdefault(module, [0, 0])
        if ".lora_A." in name:
            in_out[0] = value.shape[1]
        else:
            in_out[1] = value.shape[0]
    return {k: tuple(v) for k, v in found.items()}


def make_phi3(folder) -> pathlib.Path:
    """A random float32 Phi-3 (fused qkv_proj and gate_up_proj): 4 query and 2 kv heads of
    16, hidden 64, intermediate 128, 2 layers, the test tokenizer."""
    import torch
    import transformers

    from jaxserve.benchmarks import checkpoints

    config = transformers.Phi3Config(
        vocab_size=checkpoints.VOCAB_SIZE, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=2048, original_max_position_embeddings=2048,
        partial_rotary_factor=0.5, rope_theta=10000.0, tie_word_embeddings=False,
        dtype="float32", **checkpoints.SPECIAL_IDS)
    torch.manual_seed(0)
    model = transformers.Phi3ForCausalLM(config)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.dim() == 2:
                t.copy_(torch.randn(t.shape) / t.shape[-1] ** 0.5)
    folder = pathlib.Path(folder)
    checkpoints._save_model(model, folder, eos_token_id=[checkpoints.EOS_ID])
    for name, data in checkpoints._tokenizer_files():
        (folder / name).write_bytes(data)
    return folder


def peft_models(base, adapters) -> list:
    """The base model, then it with each adapter (transformers + PEFT, float32)."""
    import peft

    return [base_model(base)] + [peft.PeftModel.from_pretrained(base_model(base), str(a))
                                 for a in adapters]


def greedy(model, prompt: list[int], count: int) -> tuple[list[int], list]:
    """transformers' greedy tokens (EOS ignored, as the engine's ignore_eos) and the
    log-softmax at each generated position."""
    import torch

    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(count):
            logits = model(torch.tensor([ids])).logits[0, -1].double()
            logprobs.append(torch.log_softmax(logits, -1).numpy())
            ids.append(int(logits.argmax()))
    return ids[len(prompt):], logprobs


def poison_adapter(adapter_folder, out_folder, value: float, whole: bool = False,
                   module: str = "layers.0.self_attn.q_proj") -> tuple[pathlib.Path, str]:
    """A copy of an adapter whose lora_A of `module` holds `value`: at one element, or every
    element (whole); returns (the copy's folder, the tensor's name)."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    out = pathlib.Path(out_folder)
    shutil.copytree(adapter_folder, out)
    tensors = load_file(str(out / "adapter_model.safetensors"))
    name = next(n for n in tensors if f"{module}.lora_A." in n)
    array = tensors[name].copy()
    if whole:
        array[...] = value
    else:
        array[0, 1] = value
    tensors[name] = array.astype(np.float32)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    return out, name
