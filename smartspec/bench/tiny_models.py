"""Small random models with a real byte-level tokenizer, saved as Hugging Face directories: what the tests run on,
and what the host-time benchmarks run an engine on when the forward's own time is beside the point."""
from __future__ import annotations

import torch


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    # a minimal chat template, so the serving tests can exercise /v1/chat/completions
    fast.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}[assistant] {% endif %}")
    return fast


def build_tiny_model(path, arch: str = "qwen2", seed: int = 0, tie: bool = False, positions: int = 512):
    """A small random model with a real byte-level tokenizer and a context of `positions`, saved as a Hugging Face
    directory."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    tokenizer = byte_tokenizer()
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                  eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=tie,
                  # a wide init makes logits decisive, so reference and engine rarely meet a near-tie
                  initializer_range=0.3)
    config = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def build_noisy_draft(path, target: str, noise: float = 0.25, seed: int = 7) -> str:
    """`target` with noise on every weight, saved at `path`: the same tokenizer, a draft that agrees with it often
    but not always."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std())
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(target).save_pretrained(path)
    return str(path)
