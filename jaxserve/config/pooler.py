"""The pooling runner's settings: vLLM's `runner`, `convert` and `pooler_config`, resolved
against the model folder into one frozen PoolerConfig (None: the engine generates).

A pooling engine serves embeddings (task "embed": a sequence's hidden states pooled into one
vector, L2-normalized by default) or classification (task "classify": a
*ForSequenceClassification head on the pooled hidden state; softmax over the labels, a
sigmoid for one label) from the same scheduler, batching and prefix cache as generation,
and keeps no KV after a request (docs/architecture.md, "Pooling").

Resolution, as vLLM's:
- runner "auto": "pooling" for a pooling architecture (*Model, *ForSequenceClassification),
  a folder with a sentence-transformers Pooling module (modules.json; Qwen3-Embedding ships
  as a *ForCausalLM), or convert "embed" / "classify"; else "generate";
- convert "auto": "classify" for a *ForSequenceClassification, else "embed"; "none" serves
  a pooling architecture as it is (a *ForCausalLM has nothing to pool with then); "classify"
  needs a classification head (score.weight);
- pooling type: pooler_config's, else the sentence-transformers Pooling module's
  (pooling_mode_lasttoken / mean_tokens / cls_token), else LAST; normalize: pooler_config's,
  else whether modules.json has a Normalize module, else True (embeddings).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from jaxserve.models import pooling_task, resolve_architecture
from jaxserve.models.llama_arch import num_labels

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
POOLING_TYPES = ("LAST", "MEAN", "CLS")
TASKS = ("embed", "classify")
# pooler_config keys honoured (activation and softmax: vLLM's older names of use_activation)
_KEYS = ("pooling_type", "normalize", "dimensions", "use_activation", "activation", "softmax",
         "enable_chunked_processing")
# sentence-transformers' Pooling modes -> the pooling type; the other modes are refused
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
             "pooling_mode_cls_token": "CLS"}
_ST_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                   "pooling_mode_weightedmean_tokens")
_ST_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclasses.dataclass(frozen=True)
class PoolerConfig:
    """How a pooling engine turns a prompt's final hidden states into its output."""

    task: str  # "embed" | "classify"
    pooling_type: str = "LAST"  # LAST: the last token; MEAN: every token's mean; CLS: the first
    normalize: bool = True  # embed: L2-normalize (a request's PoolingParams.normalize wins)
    use_activation: bool = True  # classify: softmax (sigmoid for one label); else raw logits
    dimensions: int | None = None  # embed: the default Matryoshka truncation of a request
    hidden_size: int = 0  # D: an embedding's size before truncation
    num_labels: int = 0  # L: the classification head's rows (0: none)
    labels: tuple[str, ...] = ()  # id2label, in label order
    # Matryoshka: None: the model was not trained for truncated embeddings (dimensions is
    # refused); (): any size up to D; else the sizes it was trained for.
    matryoshka_dimensions: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"pooler task must be one of {', '.join(TASKS)}, got {self.task!r}.")
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooler_config.pooling_type must be one of "
                             f"{', '.join(POOLING_TYPES)}, got {self.pooling_type!r}.")
        if self.task == "classify" and self.num_labels < 1:
            raise ValueError("classification needs a classification head (num_labels >= 1).")
        if self.dimensions is not None:
            self.check_dimensions(self.dimensions, "pooler_config.dimensions")

    @property
    def reads_all_tokens(self) -> bool:
        """MEAN and CLS need every prompt position's hidden state: such requests never read
        the prefix cache (LAST recomputes at least the last token, which is all it needs)."""
        return self.pooling_type != "LAST"

    @property
    def applies_head(self) -> bool:
        """Whether the device applies the classification head to the pooled state."""
        return self.task == "classify"

    @property
    def output_size(self) -> int:
        """What the device returns per pooled row: L logits, or D hidden values."""
        return self.num_labels if self.applies_head else self.hidden_size

    def check_dimensions(self, dimensions, field: str = "dimensions") -> int:
        """A Matryoshka truncation this model allows (ValueError naming field otherwise)."""
        if self.task != "embed":
            raise ValueError(f"{field} applies to embeddings; this engine classifies.")
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
            raise ValueError(f"{field} must be a positive integer, got {dimensions!r}.")
        if self.matryoshka_dimensions is None:
            raise ValueError(f"{field}: this model does not support Matryoshka embeddings "
                             "(its config.json sets neither is_matryoshka nor "
                             "matryoshka_dimensions), so truncated embeddings would be poor; "
                             "drop dimensions.")
        if dimensions > self.hidden_size:
            raise ValueError(f"{field} must be at most the model's hidden size "
                             f"{self.hidden_size}, got {dimensions}.")
        if self.matryoshka_dimensions and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"{field} must be one of the model's matryoshka_dimensions "
                             f"{list(self.matryoshka_dimensions)}, got {dimensions}.")
        return dimensions


def resolve_pooler(runner: str, convert: str, pooler_config, hf_config: dict,
                   model: str | Path) -> PoolerConfig | None:
    """The PoolerConfig of a model folder under vLLM's runner / convert / pooler_config
    (see the module docstring), or None for a generating engine. ValueError naming the
    argument that cannot apply."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}.")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)}, got {convert!r}.")
    name = resolve_architecture(hf_config)
    native = pooling_task(hf_config)
    st = sentence_transformers_pooling(model)
    if runner == "auto":
        runner = "pooling" if native or st or convert in TASKS else "generate"
    if runner == "generate":
        if native:
            what = "embeddings" if native == "embed" else "classification"
            raise ValueError(f"{name} is a pooling model ({what}) without a language-model "
                             "head: serve it with runner='pooling' (--runner pooling).")
        if convert in TASKS:
            raise ValueError(f"convert={convert!r} makes a pooling model: use it with "
                             "runner='pooling' (or leave runner at 'auto').")
        if _parse(pooler_config):
            raise ValueError("pooler_config applies to pooling models: give it with "
                             "runner='pooling'.")
        return None
    task = (native or "embed") if convert in ("auto", "none") else convert
    if convert == "none" and native is None:
        raise ValueError(f"{name} is a generative model: convert='none' leaves it nothing to "
                         "pool with; use convert='embed' (--convert embed) for embeddings.")
    if task == "classify" and native != "classify":
        raise ValueError(f"convert='classify' needs a *ForSequenceClassification checkpoint "
                         f"(a score head); {name} has none. Use convert='embed' for "
                         "embeddings.")
    return _pooler(task, _parse(pooler_config), st or {}, hf_config)


def _pooler(task: str, options: dict, st: dict, hf: dict) -> PoolerConfig:
    """The PoolerConfig of a task from pooler_config's options over the sentence-transformers
    defaults (st) over vLLM's."""
    if task == "classify":
        wrong = sorted({"normalize", "dimensions"} & set(options))
    else:
        wrong = sorted({"use_activation"} & set(options))
    if wrong:
        raise ValueError(f"pooler_config.{wrong[0]} does not apply to {task} models.")
    pooling_type = str(options.get("pooling_type") or st.get("pooling_type") or "LAST").upper()
    normalize = options.get("normalize", st.get("normalize", True))
    use_activation = options.get("use_activation", True)
    for field, value in (("normalize", normalize), ("use_activation", use_activation)):
        if not isinstance(value, bool):
            raise ValueError(f"pooler_config.{field} must be true or false, got {value!r}.")
    labels = hf.get("id2label") or {}
    matryoshka = hf.get("matryoshka_dimensions")
    if matryoshka is not None:
        matryoshka = tuple(int(d) for d in matryoshka)
    elif hf.get("is_matryoshka"):
        matryoshka = ()
    return PoolerConfig(
        task=task, pooling_type=pooling_type, normalize=normalize,
        use_activation=use_activation, dimensions=options.get("dimensions"),
        hidden_size=int(hf["hidden_size"]),
        num_labels=num_labels(hf) if task == "classify" else 0,
        labels=tuple(str(labels[k]) for k in sorted(labels, key=int)) if task == "classify"
        else (), matryoshka_dimensions=matryoshka)


def _parse(pooler_config) -> dict:
    """pooler_config (a dict, its JSON text or None) as checked options."""
    if pooler_config in (None, ""):
        return {}
    if isinstance(pooler_config, str):
        try:
            pooler_config = json.loads(pooler_config)
        except ValueError as err:
            raise ValueError(f"pooler_config is not valid JSON: {err}") from None
    if not isinstance(pooler_config, dict):
        raise ValueError("pooler_config must be a JSON object, e.g. {\"pooling_type\": "
                         f"\"MEAN\"}}; got {type(pooler_config).__name__}.")
    unknown = sorted(set(pooler_config) - set(_KEYS))
    if unknown:
        raise ValueError(f"pooler_config: {', '.join(unknown)} not supported; jaxserve "
                         f"honours {', '.join(_KEYS)}.")
    options = {k: v for k, v in pooler_config.items() if v is not None}
    if options.pop("enable_chunked_processing", False):
        raise ValueError("pooler_config.enable_chunked_processing: prompts longer than "
                         "max_model_len are refused, not pooled in chunks (long prompts are "
                         "still prefilled in chunks of max_num_batched_tokens).")
    for alias in ("activation", "softmax"):  # vLLM's older names
        if alias in options:
            value = options.pop(alias)
            if options.setdefault("use_activation", value) != value:
                raise ValueError(f"pooler_config: {alias} and use_activation disagree.")
    if "pooling_type" in options and not isinstance(options["pooling_type"], str):
        raise ValueError("pooler_config.pooling_type must be one of "
                         f"{', '.join(POOLING_TYPES)}, got {options['pooling_type']!r}.")
    return options


def sentence_transformers_pooling(model: str | Path) -> dict | None:
    """A sentence-transformers folder's pooling: {"pooling_type", "normalize"} from
    modules.json and its Pooling module's config.json, or None when the folder has no
    Pooling module. ValueError for what jaxserve cannot reproduce (max or weighted pooling,
    prompts left out, Dense or other modules)."""
    folder = Path(model)
    modules = _read_json(folder / "modules.json")
    if not isinstance(modules, list):
        return None
    kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules if isinstance(m, dict)]
    pooling = next((m for m in modules if isinstance(m, dict)
                    and str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None:
        return None
    other = [k for k in kinds if k not in _ST_MODULES]
    if other:
        raise ValueError(f"{folder / 'modules.json'}: sentence-transformers module "
                         f"{other[0]} is not supported (jaxserve pools with Pooling and "
                         "Normalize only).")
    path = folder / str(pooling.get("path") or "") / "config.json"
    settings = _read_json(path)
    if not isinstance(settings, dict):
        raise ValueError(f"{path} is missing or not a JSON object (the Pooling module's "
                         "settings).")
    mode = settings.get("pooling_mode")
    chosen = [t for key, t in _ST_MODES.items() if settings.get(key)]
    if isinstance(mode, str):
        chosen = [{"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}.get(mode, mode)]
    unsupported = [k for k in _ST_OTHER_MODES if settings.get(k)]
    if unsupported or len(chosen) != 1 or chosen[0] not in POOLING_TYPES:
        raise ValueError(f"{path}: jaxserve pools with exactly one of pooling_mode_lasttoken, "
                         f"pooling_mode_mean_tokens or pooling_mode_cls_token; got "
                         f"{unsupported or chosen or 'none'}.")
    if settings.get("include_prompt") is False:
        raise ValueError(f"{path}: include_prompt=false (instructions left out of the pooled "
                         "tokens) is not supported.")
    return {"pooling_type": chosen[0], "normalize": "Normalize" in kinds}


def _read_json(path: Path):
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
