"""Published config.json files of real models, abridged to what the architecture reads
(models/test_gemma.py; config/test_kv_groups.py plans Gemma 3 27B's KV groups)."""

from __future__ import annotations

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
