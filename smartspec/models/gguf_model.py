"""A transformers model built from a GGUF file with its weights left quantized.

Linears become Q8Linear (int8 activations) or QuantLinear (exact, fp32 activations), computed from the blocks;
the token embedding a QuantEmbedding (rows dequantized as they are looked up), and the small tensors (norms, biases, any F32/F16 weight) are read as fp32. The model's
config and tokenizer come from the model's folder. Qwen2 and Llama architectures; a Llama GGUF stores its q and k
rows permuted for its rotary layout, and they are put back in transformers' order, as transformers' own GGUF
loader does."""
from __future__ import annotations

import logging
import re

import numpy as np
import torch
from torch import nn

from smartspec.models.gguf_blocks import FORMATS, QuantizedRows, unpack

logger = logging.getLogger(__name__)

LAYER_PARTS = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
ARCHITECTURES = ("qwen2", "llama")


def hf_name(gguf_name: str) -> str:
    """blk.3.attn_q.bias -> model.layers.3.self_attn.q_proj.bias; output.weight -> lm_head.weight."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m and m.group(2) in LAYER_PARTS:
        return f"model.layers.{m.group(1)}.{LAYER_PARTS[m.group(2)]}.{m.group(3)}"
    base, _, kind = gguf_name.rpartition(".")
    if base in TOP_LEVEL:
        return f"{TOP_LEVEL[base]}.{kind}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a Qwen2 / Llama model")


def _rotary_order(n: int, heads: int) -> np.ndarray:
    """Row order that undoes a Llama GGUF's q / k permutation (per head, the two rotary halves interleaved)."""
    return np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def _rows(tensor) -> tuple[str, np.ndarray, int, int]:
    """(type, bytes, rows n, row length k); a vector is one row."""
    k, n = (int(v) for v in tensor.shape[:2]) if len(tensor.shape) > 1 else (int(tensor.shape[0]), 1)
    return tensor.tensor_type.name, np.asarray(tensor.data), n, k


def _dense(kind: str, data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    if kind not in ("F32", "F16"):
        from gguf import GGMLQuantizationType, quants
        logger.warning("GGUF type %s is not kept quantized: dequantized to fp32 at load", kind)
        data = quants.dequantize(data, getattr(GGMLQuantizationType, kind))
    return torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))  # a copy: the reader maps the file


def load_gguf_model(model_dir: str, gguf_file: str, ext, int8_activations: bool = True) -> nn.Module:
    """The causal LM of model_dir's config with the weights of gguf_file; ext: the CPU kernels."""
    from accelerate import init_empty_weights
    from accelerate.utils import set_module_tensor_to_device
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM

    from smartspec.engine.quant_linear import Q8Linear, QuantEmbedding, QuantLinear

    linear = Q8Linear if int8_activations else QuantLinear

    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type not in ARCHITECTURES:
        raise ValueError(f"quantized GGUF loading supports {ARCHITECTURES}, not {config.model_type!r}")
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    heads = {"attn_q": config.num_attention_heads,
             "attn_k": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
    embedding_rows: QuantizedRows | None = None
    biases: dict[str, torch.Tensor] = {}
    for tensor in GGUFReader(gguf_file).tensors:
        name, part = hf_name(tensor.name), tensor.name.split(".")[-2]
        kind, data, n, k = _rows(tensor)
        order = _rotary_order(n, heads[part]) if config.model_type == "llama" and part in heads else None
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if attr == "bias":
            bias = _dense(kind, data, (n * k,))
            biases[module_name] = bias if order is None else bias[torch.from_numpy(order)]
        elif isinstance(module, (nn.Linear, nn.Embedding)) and kind in FORMATS:
            rows = unpack(kind, data, n, k)
            rows = rows if order is None else rows.take(order)
            if isinstance(module, nn.Embedding):
                embedding_rows = rows
                model.set_input_embeddings(QuantEmbedding(rows))
            else:
                parent, _, child = module_name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, child, linear(rows, ext))
        else:
            weight = _dense(kind, data, (n, k) if len(tensor.shape) > 1 else (k,))
            if order is not None:
                weight = weight[torch.from_numpy(order)]
            set_module_tensor_to_device(model, name, "cpu", value=weight)
    for module_name, bias in biases.items():
        model.get_submodule(module_name).bias = nn.Parameter(bias, requires_grad=False)
    if isinstance(model.lm_head, nn.Linear) and model.lm_head.weight.is_meta:
        if embedding_rows is None:
            raise ValueError(f"{gguf_file} has no output weight and no quantized token embedding to tie it to")
        model.lm_head = linear(embedding_rows, ext)  # tied: the output layer is the embedding's blocks
    missing = [n for n, p in (*model.named_parameters(), *model.named_buffers()) if p.is_meta]
    if missing:
        raise ValueError(f"{gguf_file} lacks tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return model.eval().requires_grad_(False)
