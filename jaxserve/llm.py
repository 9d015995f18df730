"""The offline API, as in vLLM: LLM(model=...).generate(prompts, sampling_params) and .chat();
for pooling models (runner="pooling") .embed(), .classify(), .score() and .encode()."""

from __future__ import annotations

import gc
import itertools
import logging
import sys
import time
from collections.abc import Sequence

from tqdm.auto import tqdm

from jaxserve.backends.selection import on_accelerator
from jaxserve.config.engine_args import EngineArgs
from jaxserve.core.pooling_params import PoolingParams
from jaxserve.core.sampling_params import SamplingParams
from jaxserve.engine.data_parallel import create_engine
from jaxserve.engine.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringRequestOutput,
)
from jaxserve.engine.scoring import plan_scores
from jaxserve.models.lora import LoRARequest

logger = logging.getLogger(__name__)


class LLM:
    """An engine for offline batched generation.

    With no model, loads the built-in default model (jaxserve.default_model_path()).
    Takes the engine arguments of EngineArgs (jaxserve/config/engine_args.py): vLLM's names
    (tokenizer, dtype, max_model_len, max_num_seqs, max_num_batched_tokens, block_size,
    num_gpu_blocks_override, gpu_memory_utilization, enable_expert_parallel, seed, ...) and
    jaxserve's own (mesh, attention_backend, compilation_cache_dir, precompile; aliases
    num_kv_blocks and expert_parallel). Another keyword raises TypeError.
    Shape buckets compile on first use (precompile=False, the default here: a few prompts
    compile only the buckets they use); precompile=True compiles every bucket up front, so
    that no later call compiles (benchmarks).
    close() (or leaving `with LLM(...) as llm:`) frees the devices for another model.
    """

    def __init__(self, model: str | None = None, **engine_args) -> None:
        self._start(EngineArgs.from_kwargs("LLM", model=model, **engine_args))

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        llm = cls.__new__(cls)
        llm._start(args)
        return llm

    def _start(self, args: EngineArgs) -> None:
        model = args.model_folder(logger)  # the built-in model, or a Hub id at its revision
        config = args.engine_config(model, on_accelerator=on_accelerator(args.backend),
                                    default_precompile=False)
        self._engine = create_engine(config)
        self._ids = itertools.count()

    @property
    def engine(self):
        """The engine (an LLMEngine, or a DataParallelEngine over its replicas)."""
        if self._engine is None:
            raise RuntimeError("this LLM was closed (LLM.close() or the end of its `with` "
                               "block): create a new LLM to generate again.")
        return self._engine

    def close(self) -> None:
        """Free what the model holds, so that another model can load in the same process (a
        notebook's kernel): stop the engine's background work (a background warm-up is
        waited for: a compile in progress cannot be interrupted), release the worker hosts
        and the grammar sandbox's processes, delete the weights and the KV cache from the
        devices, and drop every reference to them. generate() and chat() raise afterwards;
        closing again does nothing."""
        engine, self._engine = getattr(self, "_engine", None), None
        if engine is None:
            return
        runners = [replica.runner for replica in getattr(engine, "replicas", [engine])
                   if hasattr(replica, "runner")]  # (a remote replica's runner is elsewhere)
        # A JAX runner's warm-up (bucket_compiler.CompiledFunctions): its background thread
        # and compile threads end once the engine has closed it.
        warm_ups = [runner.compiled for runner in runners if hasattr(runner, "compiled")]
        try:
            engine.close()
        finally:
            for compiled in warm_ups:
                compiled.join()
            for runner in runners:
                _release(runner)
            del engine, runners, warm_ups
            gc.collect()
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_initialized():
                torch.cuda.empty_cache()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (as vLLM's LLM.reset_prefix_cache)."""
        self.engine.reset_prefix_cache()

    # ---- sleep mode and weight updates (engine/sleep_mode.py) ----------------------------
    def sleep(self, level: int = 1) -> None:
        """Free the device memory of the KV cache and the weights between generation phases
        (as vLLM's LLM.sleep; needs enable_sleep_mode=True): level 1 keeps the weights in
        host memory, level 2 drops them (wake_up reads the model's folder again). Requests
        must have finished. Sleeping again at the same or a lower level does nothing;
        generate() and chat() raise until wake_up()."""
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Bring back what tags name: "weights", "kv_cache" (None: both, weights first), as
        vLLM's LLM.wake_up. The KV cache comes back empty (so does the prefix cache) and
        nothing recompiles. Waking what is awake does nothing."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """Whether the weights or the KV cache are off the device."""
        return self.engine.is_sleeping()

    def update_weights(self, weights) -> int:
        """Replace weights without recompiling, awake or asleep: weights is a dict {Hugging
        Face tensor name: array} (numpy, torch or jax; a partial update changes only the
        parameters those tensors map to) or a folder of safetensors (every tensor in it).
        Each tensor must fit its parameter's shape; ValueError naming the first that does
        not (or an unknown name), before anything changes. The prefix cache is reset. Returns
        how many parameters changed."""
        return self.engine.update_weights(weights)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (temperature,
        top_p, top_k, min_p, repetition_penalty, max_new_tokens as max_tokens), unless the
        engine was started with generation_config="vllm": what generate() and chat() use
        when given no sampling_params, as vLLM does."""
        return SamplingParams(**self.engine.config.model.sampling_defaults)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] |
                 None = None, *, use_tqdm: bool = True, lora_request: LoRARequest |
                 Sequence[LoRARequest | None] | None = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, a list of token ids, a list of token-id
        lists, or {"prompt": ...} / {"prompt_token_ids": ...} dicts. Outputs come back in the
        order of the prompts. Every prompt is checked before any is scheduled.
        lora_request: the LoRA adapter (LoRARequest) of every prompt, or one per prompt
        (None: the base model), with enable_lora=True."""
        items = _normalise_prompts(prompts)
        params = self._checked_params(sampling_params, len(items))
        if priority is not None and len(priority) != len(items):
            raise ValueError(f"priority has {len(priority)} entries for {len(items)} prompts; "
                             "give one per prompt.")
        loras = _per_prompt_lora(lora_request, len(items))
        tokenized = [(text, ids if ids is not None else self._encode(text))
                     for text, ids in items]
        return self._run(self._admitted(tokenized, params, priority, loras), use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] |
             None = None, *, use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False, documents: list[dict] | None = None,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             ) -> list[RequestOutput]:
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of them.
        continue_final_message: the last (assistant) message is left open for the model to
        continue (then add_generation_prompt must be False); documents: passed to the
        template, as vLLM does."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message=True needs add_generation_prompt=False.")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        params = self._checked_params(sampling_params, len(conversations))
        loras = _per_prompt_lora(lora_request, len(conversations))
        kwargs = dict(chat_template_kwargs or {})
        if documents is not None:
            kwargs["documents"] = documents
        tokenized = []
        for conversation in conversations:
            ids = self.engine.processor.render_chat(
                list(conversation), add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template,
                **kwargs)
            tokenized.append((self.engine.tokenizer.decode(ids), ids))
        return self._run(self._admitted(tokenized, params, None, loras), use_tqdm)

    def _checked_params(self, sampling_params, count: int) -> list[SamplingParams]:
        """One SamplingParams per prompt, each through the request limits (admission.py)
        before any prompt is tokenized."""
        processor = self.engine.processor
        params = _per_prompt(sampling_params, count, self.get_default_sampling_params)
        checked: dict[int, SamplingParams] = {}  # the same object for many prompts: once
        for p in params:
            if id(p) not in checked:
                checked[id(p)] = processor.check_params(p)
        return [checked[id(p)] for p in params]

    def _admitted(self, tokenized, params, priority, loras) -> list:
        """Every prompt through the admission path (truncation, the model's checks, its
        grammar) before any is scheduled."""
        processor = self.engine.processor
        grammars: dict[int, object] = {}  # one compile per SamplingParams object
        out = []
        for i, ((text, ids), p) in enumerate(zip(tokenized, params)):
            request = processor.process(str(next(self._ids)), text, ids, p,
                                        priority[i] if priority else 0, compile_grammar=False,
                                        lora=loras[i])
            if p.structured_outputs is not None:
                if id(p) not in grammars:
                    grammars[id(p)] = processor.compile_grammar(p)
                request = request.with_grammar(grammars[id(p)])
            out.append(request)
        return out

    # ---- pooling models (runner="pooling") ----------------------------------------------
    def encode(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams] |
               None = None, *, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """The pooled output of each prompt (prompts as generate takes them): `outputs.data`,
        an embedding or the classifier's probabilities, as the engine's pooler makes them."""
        return self._pool(prompts, pooling_params, None, truncate_prompt_tokens, use_tqdm)

    def embed(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams] |
              None = None, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (`outputs.embedding`), from an embedding model:
        pooling_params.dimensions truncates it (Matryoshka models), normalize chooses
        L2-normalization (default: the model's pooler's, on)."""
        return [EmbeddingRequestOutput.from_base(o) for o in self._pool(
            prompts, pooling_params, "embed", truncate_prompt_tokens, use_tqdm)]

    def classify(self, prompts, pooling_params: PoolingParams | Sequence[PoolingParams] |
                 None = None, *, truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (`outputs.probs`, in id2label's order) from a
        *ForSequenceClassification model: softmax over the labels, a sigmoid for one label;
        pooling_params.use_activation=False gives the raw logits."""
        return [ClassificationRequestOutput.from_base(o) for o in self._pool(
            prompts, pooling_params, "classify", truncate_prompt_tokens, use_tqdm)]

    def score(self, data_1, data_2, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | None = None
              ) -> list[ScoringRequestOutput]:
        """The similarity of each pair (`outputs.score`): data_1[i] with data_2[i], or one
        data_1 with every data_2. An embedding model (bi-encoder) gives the cosine of the
        two embeddings; a classifier with one label (cross-encoder) reads each pair
        tokenized together (tokenizer(text_1, text_2)) and gives its sigmoid."""
        params = (pooling_params or PoolingParams()).clone(task="score")
        if truncate_prompt_tokens is not None:
            params = params.clone(truncate_prompt_tokens=truncate_prompt_tokens)
        # (the server's /score and /rerank pair, pool and score through the same plan)
        job = plan_scores(self.engine.processor, _normalise_prompts(data_1),
                          _normalise_prompts(data_2), params)
        return job.scores(self._pooled(job.prompts, [params] * len(job.prompts), use_tqdm))

    def _pool(self, prompts, pooling_params, task: str | None, truncate: int | None,
              use_tqdm: bool) -> list[PoolingRequestOutput]:
        """Each prompt through a pooling request of `task` (None: the engine's)."""
        items = _normalise_prompts(prompts)
        self.engine.processor.check_pooling_count(len(items), "prompts")
        params = _per_prompt(pooling_params, len(items), PoolingParams, PoolingParams)
        changes = {"task": task} if task is not None else {}
        if truncate is not None:
            changes["truncate_prompt_tokens"] = truncate
        params = [p.clone(**changes) if changes else p for p in params]
        tokenized = [(text, ids if ids is not None else self._encode(text))
                     for text, ids in items]
        return self._pooled(tokenized, params, use_tqdm)

    def _pooled(self, tokenized, params: list[PoolingParams],
                use_tqdm: bool) -> list[PoolingRequestOutput]:
        """Pooling requests through the admission path (every one before any runs), run;
        a request the engine failed raises."""
        processor = self.engine.processor
        requests = [processor.process_pooling(str(next(self._ids)), text, ids, p)
                    for (text, ids), p in zip(tokenized, params)]
        outputs = self._run(requests, use_tqdm)
        for output in outputs:
            if output.error is not None:
                raise RuntimeError(f"pooling request {output.request_id} failed: "
                                   f"{output.error}")
        return outputs

    def _encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(text)}.")
        if not text:
            raise ValueError("prompt must not be empty (got the empty string).")
        return self.engine.processor.encode(text)

    def _run(self, requests, use_tqdm) -> list[RequestOutput]:
        engine = self.engine
        order = [request.request_id for request in requests]
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm,
                   dynamic_ncols=True)
        start = time.perf_counter()
        prompt_tokens = output_tokens = 0
        try:
            for request in requests:
                engine.add_processed(request)
            while engine.has_unfinished_requests():
                for output in engine.step(final_only=True):
                    if output.finished:
                        results[output.request_id] = output
                        prompt_tokens += len(output.prompt_token_ids)
                        elapsed = time.perf_counter() - start
                        rates = f"input: {prompt_tokens / elapsed:.1f} toks/s"
                        if isinstance(output, RequestOutput):  # (pooling makes no tokens)
                            output_tokens += sum(len(c.token_ids) for c in output.outputs)
                            rates += f", output: {output_tokens / elapsed:.1f} toks/s"
                        bar.set_postfix_str(rates)
                        bar.update(1)
        finally:
            bar.close()
            for request_id in order:
                if request_id not in results:
                    engine.abort_request(request_id)
        return [results[r] for r in order]


def _release(runner) -> None:
    """Delete a closed runner's device arrays (weights, KV cache, sampler state) and drop
    its attributes: the memory is freed even where a stray reference to the runner lives on
    (a traceback's frames in a notebook); torch's tensors go with their last reference (and
    a torch runner's process never imports jax)."""
    jax = sys.modules.get("jax")
    for value in getattr(runner, "__dict__", {}).values() if jax is not None else ():
        for leaf in jax.tree_util.tree_leaves(value):
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                leaf.delete()
    getattr(runner, "__dict__", {}).clear()


def _normalise_prompts(prompts) -> list[tuple[str | None, list[int] | None]]:
    """Each prompt as (text or None, token ids or None)."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    elif isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int):
        prompts = [list(prompts)]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a string, a list of strings or token-id lists, and "
                         "not empty.")
    items = []
    for prompt in prompts:
        if isinstance(prompt, str):
            items.append((prompt, None))
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            items.append((prompt.get("prompt"), list(prompt["prompt_token_ids"])))
        elif isinstance(prompt, dict) and "prompt" in prompt:
            items.append((prompt["prompt"], None))
        elif isinstance(prompt, Sequence):
            items.append((None, list(prompt)))
        else:
            raise ValueError(f"Unsupported prompt {prompt!r:.80}: use a string, a list of token "
                             "ids, or a {'prompt': ...} / {'prompt_token_ids': ...} dict.")
    return items


def _per_prompt_lora(lora_request, count: int) -> list:
    """One adapter (or None) per prompt."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    if isinstance(lora_request, (str, bytes)) or not isinstance(lora_request, Sequence):
        raise ValueError("lora_request must be a LoRARequest, a list of them (None for the "
                         f"base model), one per prompt, or None; got {type(lora_request)}.")
    if len(lora_request) != count:
        raise ValueError(f"lora_request has {len(lora_request)} entries for {count} prompts; "
                         "give one LoRARequest or one per prompt.")
    return list(lora_request)


def _per_prompt(params, count: int, default, kind=SamplingParams) -> list:
    """One `kind` (SamplingParams or PoolingParams) per prompt."""
    if params is None:
        return [default()] * count
    if isinstance(params, kind):
        return [params] * count
    name = "sampling_params" if kind is SamplingParams else "pooling_params"
    try:
        params = list(params)
    except TypeError:
        params = None
    if params is None or not all(isinstance(p, kind) for p in params):
        raise ValueError(f"{name} must be a {kind.__name__} or a list of them, one per "
                         "prompt.")
    if len(params) != count:
        raise ValueError(f"{name} has {len(params)} entries for {count} prompts; give one "
                         f"{kind.__name__} or one per prompt.")
    return params


