"""PoolingParams: how one pooling request's output is made (vLLM's names), validated when it
is made; resolved against the engine's pooler (config/pooler.py) at admission.

A pooling request (an embedding, a classification, a score) runs its prompt through the
model like a generation request's prefill and ends there: no token is sampled for it. Its
settings only shape the pooled vector on the host:
- embed: `dimensions` keeps the first d values (Matryoshka; then renormalized), `normalize`
  L2-normalizes (default: the pooler's, True for embedding models);
- classify: `use_activation` applies softmax over the labels (sigmoid for one label, as
  sentence-transformers' cross-encoders) (default True); False: raw logits;
- `truncate_prompt_tokens`: keep the last k prompt tokens (-1: max_model_len).
"""

from __future__ import annotations

import dataclasses

# What a request may ask for (LLM.embed / classify / score / encode set it); "encode" is the
# engine's own task, whichever it is.
TASKS = ("embed", "classify", "score", "encode")
# The fields each engine task honours; setting another is refused, naming it.
_FIELDS = {"embed": ("dimensions", "normalize"), "classify": ("use_activation",)}


@dataclasses.dataclass
class PoolingParams:
    """Per-request pooling settings, named as vLLM's PoolingParams."""

    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None  # embed: Matryoshka truncation (models trained for it)
    normalize: bool | None = None  # embed: L2-normalize (None: the pooler's default)
    use_activation: bool | None = None  # classify: softmax / sigmoid (None: True)
    activation: bool | None = None  # vLLM's older name of use_activation
    task: str | None = None  # None: the engine's task

    def __post_init__(self) -> None:
        if self.activation is not None:
            if self.use_activation not in (None, self.activation):
                raise ValueError("activation (vLLM's older name) and use_activation disagree; "
                                 "give use_activation only.")
            self.use_activation, self.activation = self.activation, None
        for field in ("normalize", "use_activation"):
            value = getattr(self, field)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{field} must be true, false or null, got {value!r:.40}.")
        for field in ("truncate_prompt_tokens", "dimensions"):
            value = getattr(self, field)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{field} must be an integer or null, got {value!r:.40}.")
        k = self.truncate_prompt_tokens
        if k is not None and k < 1 and k != -1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1 (max_model_len), "
                             f"got {k}.")
        if self.dimensions is not None and self.dimensions < 1:
            raise ValueError(f"dimensions must be >= 1, got {self.dimensions}.")
        if self.task is not None and self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r:.40}.")

    def clone(self, **changes) -> PoolingParams:
        return dataclasses.replace(self, **changes)

    def resolve(self, pooler) -> PoolingParams:
        """These settings checked against the engine's pooler (a config.pooler.PoolerConfig,
        or None for a generating engine) with its defaults filled in: ValueError naming the
        field when the engine cannot honour it."""
        if pooler is None:
            raise ValueError("This model generates text: embeddings, classification and "
                             "scores need a pooling model (start the engine with "
                             "runner='pooling', --runner pooling).")
        task = self.task or "encode"
        if task in ("embed", "classify") and task != pooler.task:
            model = {"embed": "an embedding", "classify": "a classification"}[task]
            raise ValueError(f"task {task!r} needs {model} model; this engine's pooling task "
                             f"is {pooler.task!r} (runner='pooling', convert='{pooler.task}').")
        if task == "score" and pooler.task == "classify" and pooler.num_labels != 1:
            raise ValueError(f"score needs an embedding model or a classifier with one label "
                             f"(a cross-encoder); this classifier has {pooler.num_labels}.")
        params = self
        if pooler.task == "embed" and task != "score" and self.use_activation is not None:
            # vLLM's current name for an embedding's normalization (normalize: its older one)
            if self.normalize not in (None, self.use_activation):
                raise ValueError("use_activation and normalize disagree (on an embedding "
                                 "model both choose L2-normalization); give one of them.")
            params = dataclasses.replace(self, normalize=self.use_activation,
                                         use_activation=None)
        return params._resolved(pooler, task)

    def _resolved(self, pooler, task: str) -> PoolingParams:
        allowed = () if task == "score" and pooler.task == "embed" else _FIELDS[pooler.task]
        for field in ("dimensions", "normalize", "use_activation"):
            if getattr(self, field) is not None and field not in allowed:
                raise ValueError(f"{field} does not apply to {task} requests on this "
                                 f"{pooler.task} model (they take "
                                 f"{', '.join(allowed) or 'no pooling settings'}).")
        dimensions = self.dimensions if self.dimensions is not None else pooler.dimensions
        if dimensions is not None and task != "score":
            pooler.check_dimensions(dimensions)
        return dataclasses.replace(
            self, task=task, dimensions=dimensions if task != "score" else None,
            normalize=pooler.normalize if self.normalize is None else self.normalize,
            use_activation=pooler.use_activation if self.use_activation is None
            else self.use_activation)
