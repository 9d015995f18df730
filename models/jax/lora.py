"""LoRA adapters applied inside the compiled step (multi-LoRA serving).

The device holds S = max_loras adapter slots per target kernel (backends/jax/lora_weights.py):
A [S, *in, R] and B [S, R, *out] in the kernel's engine layout (models/lora.py), R =
max_lora_rank (a smaller adapter zero-padded), the adapter's scaling folded into B. Each
token carries its slot (-1: the base model). A projection's product then adds, for token t,

    delta[t] = (x[t] . A[slot t]) . B[slot t]

computed for every slot at once and masked, as two dense products: h = x . A over the
kernel's input axes ([T, S, R]), where only the token's own slot is kept (a select, not
a product with a one-hot: 0 x inf is NaN, so an adapter whose values overflow would
otherwise reach every token of the step), then h . B over (S, R). Every slot's B is finite (adapters
are checked at load, models/lora.py, and idle slots hold zeros or an adapter's checked
values), so the zeros of other slots' h add exactly nothing: no slot's values reach another
slot's tokens, or the base model's. Their cost is S*R columns beside the kernel's own (S*R = 64 for 4 slots of rank 16,
against thousands), with no gather of per-token weights, so any mix of adapters and the base
model runs in the one compiled step, and loading an adapter only writes a slot's values.
Sharded on the mesh as the kernel is (A split like its inputs, B like its outputs), the two
products need no collectives beyond the kernel's own. A step whose tokens all run the base
model skips them (lax.cond): on the CPU the products cost ~15% of a projection's time with 4
slots of rank 16 (scripts/bench_lora.py, docs/performance.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ATTRIBUTE = "lora_step"  # the LoraStep a module carries during one step


class LoraStep:
    """One module's adapters in one step: {kernel name: (A [S, *in, R], B [S, R, *out])},
    the step's token mask bool[T, S] (each token's own slot) and whether any token has an
    adapter (a step of base-model tokens only skips the products: lax.cond)."""

    def __init__(self, weights: dict, mask, active) -> None:
        self.weights, self.mask, self.active = weights, mask, active

    def delta(self, spec: str, x, name: str):
        """What the adapters add to einsum(spec, x, kernel `name`), or None when no slot
        holds weights for that kernel. spec: the projection's einsum, "td,dnh->tnh"."""
        pair = self.weights.get(name)
        if pair is None:
            return None
        a, b = pair
        inputs, out = spec.split("->")
        x_axes, w_axes = inputs.split(",")
        contracted = "".join(c for c in w_axes if c in x_axes)
        w_out = "".join(c for c in w_axes if c not in x_axes)
        lead = "".join(c for c in x_axes if c not in w_axes)  # the token axis

        def products(x):
            h = jnp.einsum(f"{x_axes},S{contracted}R->{lead}SR", x, a.astype(x.dtype))
            h = jnp.where(self.mask[:, :, None], h, jnp.zeros((), h.dtype))
            return jnp.einsum(f"{lead}SR,SR{w_out}->{out}", h, b.astype(x.dtype))

        shape = jax.eval_shape(products, x)
        return jax.lax.cond(self.active, products,
                            lambda x: jnp.zeros(shape.shape, shape.dtype), x)


def attach(model, weights: dict, token_slots) -> None:
    """Give each module of `model` with adapter slots its LoraStep for this step. weights:
    {"layers.3.attn.wq": (A, B)}; token_slots: i32[T], each token's slot (-1: none)."""
    num_slots = next(iter(weights.values()))[0].shape[0]
    mask = token_slots[:, None] == jnp.arange(num_slots)[None, :]  # bool[T, S]; -1: none
    active = jnp.any(token_slots >= 0)
    by_module: dict[tuple, dict] = {}
    for key, pair in weights.items():
        *path, name = key.split(".")
        by_module.setdefault(tuple(path), {})[name] = pair
    for path, pairs in by_module.items():
        module = model
        for part in path:
            module = module[int(part)] if part.isdigit() else getattr(module, part)
        setattr(module, ATTRIBUTE, LoraStep(pairs, mask, active))
