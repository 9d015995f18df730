"""The tiny test checkpoints load in transformers and have what parity tests rely on."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("tiny_checkpoint", ["llama", "mistral", "qwen2", "qwen3"], indirect=True)
def test_loads_with_random_biases_and_norms(tiny_checkpoint):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    assert model.config.vocab_size == 1024 and model.dtype == torch.float32
    params = dict(model.named_parameters())
    for name, p in params.items():
        assert p.std() > 0, f"{name} is constant"
    norms = [n for n in params if n.endswith("norm.weight")]
    assert norms and all(not torch.allclose(params[n], torch.ones_like(params[n])) for n in norms)
    biases = [n for n in params if n.endswith(".bias")]
    assert all(params[n].abs().min() > 0 for n in biases)
    if model.config.model_type == "qwen2":
        assert {n.split(".")[-2] for n in biases} == {"q_proj", "k_proj", "v_proj"}
    else:
        assert not biases
    with torch.no_grad():
        logits = model(torch.tensor([[0, 17, 300, 999]])).logits
    assert logits.shape == (1, 4, 1024) and torch.isfinite(logits).all()


def test_arch_specific_configs(tiny_checkpoints):
    cfg = {a: json.loads((p / "config.json").read_text()) for a, p in tiny_checkpoints.items()}
    assert cfg["llama"]["rope_parameters"]["rope_type"] == "llama3"
    assert cfg["llama"]["rope_parameters"]["factor"] == 8.0
    assert cfg["llama"]["tie_word_embeddings"] is False
    assert cfg["mistral"]["sliding_window"] == 96
    assert cfg["qwen2"]["tie_word_embeddings"] is True
    assert cfg["qwen3"]["head_dim"] == 32 and cfg["qwen3"]["tie_word_embeddings"] is False

    llama = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints["llama"])
    assert llama.model.rotary_emb.rope_type == "llama3"
    qwen2 = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints["qwen2"])
    assert qwen2.lm_head.weight.data_ptr() == qwen2.model.embed_tokens.weight.data_ptr()
    qwen3 = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoints["qwen3"])
    assert qwen3.model.layers[0].self_attn.q_proj.out_features == 4 * 32


def test_tokenizer_round_trip_and_chat_template(tiny_checkpoints):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_checkpoints["qwen3"])
    assert len(tok) == 1024
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 4)
    text = "naïve café — 日本語 🙂\n\tdef f(x): return x"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == text
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    rendered = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>assistant\n"
    )
    # transformers 5 returns a BatchEncoding here, 4.x a list
    chat_ids = tok.apply_chat_template(chat, add_generation_prompt=True)
    chat_ids = chat_ids if isinstance(chat_ids, list) else chat_ids["input_ids"]
    assert chat_ids[:2] == [0, tok.convert_tokens_to_ids("<|im_start|>")]
    assert chat_ids.count(0) == 1  # bos comes from the template only


def test_greedy_margins_on_check_prompts(tiny_checkpoints):
    """Parity tests may compare greedy tokens on check_prompts(): no near-ties there."""
    from jaxserve.benchmarks.checkpoint_checks import check_prompts, greedy_margins
    from jaxserve.benchmarks.checkpoints import MIN_REL_GAP, torch_threads

    with torch_threads(1):
        for arch, ckpt in tiny_checkpoints.items():
            results = greedy_margins(ckpt, check_prompts())
            assert min(r["rel_gap"] for r in results) > MIN_REL_GAP.get(arch, 1.5e-3), arch
            assert min(len(set(r["tokens"])) for r in results) >= 20, arch
