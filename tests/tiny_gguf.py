"""Random GGUF weights: blocks of each format the engine keeps quantized, and a tiny Qwen2 model folder whose
weights are one GGUF file (config and byte tokenizer beside it), its linears in several formats."""
import json
from pathlib import Path

import numpy as np

from smartspec.runtime.gguf_blocks import FORMATS

F16_FIELDS = {"Q8_0": (0,), "Q5_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}  # byte offsets in a block


def random_tensor(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGUF bytes of one type, its f16 scales drawn finite (random bits could make them NaN or Inf)."""
    size, per_block, _, _ = FORMATS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // per_block * size), dtype=np.uint8)
    blocks = raw.reshape(-1, size)
    for at in F16_FIELDS[kind]:
        scale = rng.uniform(0.002, 0.03, size=len(blocks)) * rng.choice([-1, 1], size=len(blocks))
        blocks[:, at:at + 2] = scale.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw


HIDDEN, INTERMEDIATE, HEADS, KV_HEADS, LAYERS = 512, 768, 8, 2, 2
HEAD_DIM = HIDDEN // HEADS
# per layer: (GGUF part, rows, row length, format or F16 / F32); layer 1 also has a dense F16 linear
LAYER_FORMATS = [
    {"attn_q": "Q4_K", "attn_k": "Q8_0", "attn_v": "Q5_0", "attn_output": "Q4_K", "ffn_gate": "Q4_K",
     "ffn_up": "Q5_0", "ffn_down": "Q6_K"},
    {"attn_q": "Q6_K", "attn_k": "Q4_1", "attn_v": "F16", "attn_output": "Q4_1", "ffn_gate": "Q8_0",
     "ffn_up": "Q4_K", "ffn_down": "Q8_0"},
]
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * HEAD_DIM, HIDDEN), "attn_v": (KV_HEADS * HEAD_DIM, HIDDEN),
          "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (INTERMEDIATE, HIDDEN), "ffn_up": (INTERMEDIATE, HIDDEN),
          "ffn_down": (HIDDEN, INTERMEDIATE)}


def build_tiny_gguf(path: Path, tokenizer, seed: int = 0) -> str:
    """A Qwen2 folder of 2 layers, 8 heads of 64 and 2 KV heads, 768 intermediate features, random blocks.
    Down weights in 256-weight superblocks make 768 features split 256 / 512 over two ranks."""
    from gguf import GGMLQuantizationType, GGUFWriter
    from transformers import Qwen2Config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    vocab = len(tokenizer)
    config = Qwen2Config(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=512, eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": tokenizer.eos_token_id}))
    writer = GGUFWriter(str(path / "tiny.gguf"), "qwen2")

    def add(name: str, kind: str, n: int, k: int) -> None:
        if kind in ("F16", "F32"):
            values = rng.normal(0, 0.05, size=(n, k)).astype(np.float16 if kind == "F16" else np.float32)
            writer.add_tensor(name, values if n > 1 else values[0])
        else:
            writer.add_tensor(name, random_tensor(kind, n, k, seed=int(rng.integers(1 << 30))),
                              raw_dtype=getattr(GGMLQuantizationType, kind))

    add("token_embd.weight", "Q8_0", vocab, HIDDEN)
    for layer, formats in enumerate(LAYER_FORMATS):
        for part, kind in formats.items():
            add(f"blk.{layer}.{part}.weight", kind, *SHAPES[part])
        for part in ("attn_q", "attn_k", "attn_v"):
            add(f"blk.{layer}.{part}.bias", "F32", 1, SHAPES[part][0])
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", (1 + rng.normal(0, 0.1, HIDDEN)).astype(np.float32))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    add("output.weight", "Q6_K", vocab, HIDDEN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
