"""Published config.json files of real models, abridged to what the engine reads: for
`jaxserve plan` and `jaxserve compile` at full size (scripts/compile_published.py, the
slow TPU-compile tests) and the tests that check the families and the plan against them.
"""

from __future__ import annotations

# Llama-3.1-8B's config.json (the fields the engine reads)
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}

# Qwen3-8B's config.json
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "hidden_act": "silu", "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
    "rope_theta": 1000000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "attention_bias": False, "bos_token_id": 151643, "eos_token_id": 151645}
# Mixtral-8x7B-v0.1's config.json
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 32000,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
    "eos_token_id": 2}
FP8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
       "weight_block_size": [128, 128]}
# DeepSeek-V3's published config.json (the fields the engine reads)
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "hidden_act": "silu",
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "tie_word_embeddings": False,
    "vocab_size": 129280, "num_nextn_predict_layers": 1, "moe_layer_freq": 1,
    "torch_dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1,
    "quantization_config": FP8}


def gpt_oss(layers: int, experts: int) -> dict:
    """openai/gpt-oss-20b's (24 layers, 32 experts) or -120b's (36, 128) config.json,
    abridged to what the architecture reads."""
    return dict(
        architectures=["GptOssForCausalLM"], attention_bias=True, head_dim=64,
        hidden_size=2880, intermediate_size=2880, max_position_embeddings=131072,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                     for i in range(layers)],
        num_attention_heads=64, num_experts_per_tok=4, num_hidden_layers=layers,
        num_key_value_heads=8, num_local_experts=experts, rms_norm_eps=1e-5,
        quantization_config={"quant_method": "mxfp4",
                             "modules_to_not_convert": ["model.layers.*.self_attn",
                                                        "model.layers.*.mlp.router",
                                                        "model.embed_tokens", "lm_head"]},
        rope_scaling={"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                      "original_max_position_embeddings": 4096, "rope_type": "yarn",
                      "truncate": False},
        rope_theta=150000, sliding_window=128, swiglu_limit=7.0, tie_word_embeddings=False,
        vocab_size=201088, eos_token_id=200002, pad_token_id=199999)

# Published config.json files (abridged to what the architecture reads), written before
# transformers had layer_types and per-layer-type rope_parameters.
GEMMA2_9B = dict(architectures=["Gemma2ForCausalLM"], vocab_size=256000, hidden_size=3584,
                 intermediate_size=14336, num_hidden_layers=42, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                 query_pre_attn_scalar=256, sliding_window=4096,
                 attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                 hidden_activation="gelu_pytorch_tanh", attention_bias=False)
GEMMA3_27B_TEXT = dict(architectures=["Gemma3ForCausalLM"], vocab_size=262208,
                       hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                       num_attention_heads=32, num_key_value_heads=16, head_dim=128,
                       rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                       rope_scaling={"factor": 8.0, "rope_type": "linear"},
                       query_pre_attn_scalar=168, sliding_window=1024,
                       sliding_window_pattern=6, final_logit_softcapping=None,
                       attn_logit_softcapping=None, hidden_activation="gelu_pytorch_tanh")
