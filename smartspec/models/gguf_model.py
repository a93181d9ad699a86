"""A transformers model built from a GGUF file with its weights left quantized.

Linears become Q8Linear (int8 activations) or QuantLinear (exact, fp32 activations), computed from the blocks;
the token embedding a QuantEmbedding (rows dequantized as they are looked up); the small tensors (norms, biases,
any F32/F16 weight) are read as fp32. The model's config and tokenizer come from the model's folder. Qwen2 and
Llama architectures; a Llama GGUF stores its q and k rows permuted for its rotary layout, and they are put back in
transformers' order, as transformers' own GGUF loader does."""
from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from smartspec.models.gguf_shard import Shard, ShardPlan, wrap_row_parallel
from smartspec.runtime.gguf_blocks import FORMATS, PackedRows, QuantizedRows, unpack
from smartspec.runtime.requantize import WIDER_THAN_4_BITS, to_q4_1

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


def _shape(tensor) -> tuple[int, int]:
    """(rows n, row length k); a vector is one row."""
    return (int(tensor.shape[1]), int(tensor.shape[0])) if len(tensor.shape) > 1 else (1, int(tensor.shape[0]))


def _read(f, tensor, r0: int, r1: int) -> np.ndarray:
    """Rows [r0, r1) of a tensor's bytes, read from the file (not through the reader's memory map, whose pages
    would stay resident beside the packed weights)."""
    n, _ = _shape(tensor)
    row_bytes = int(tensor.n_bytes) // n
    f.seek(int(tensor.data_offset) + r0 * row_bytes)
    return np.frombuffer(f.read((r1 - r0) * row_bytes), dtype=np.uint8)


def _unpack(f, tensor, kind: str, n: int, k: int, chunk_rows: int = 8192) -> QuantizedRows:
    """The tensor's codes and scales, unpacked chunk_rows rows at a time into arrays allocated once."""
    out = None
    for r0 in range(0, n, chunk_rows):
        r1 = min(n, r0 + chunk_rows)
        part = unpack(kind, _read(f, tensor, r0, r1), r1 - r0, k)
        if out is None:
            def alloc(a):
                return None if a is None else np.empty((n, *a.shape[1:]), dtype=a.dtype)
            out = QuantizedRows(kind, alloc(part.q), alloc(part.d), alloc(part.sc), alloc(part.off), alloc(part.mn),
                                part.group, part.superblock, part.nibble)
        for name in ("q", "d", "sc", "off", "mn"):
            if getattr(part, name) is not None:
                getattr(out, name)[r0:r1] = getattr(part, name)
    return out


def _dense(kind: str, data: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's bytes as fp32 of this shape."""
    if kind in ("F32", "F16"):
        values = data.view(np.float32 if kind == "F32" else np.float16)
    else:
        from gguf import GGMLQuantizationType, quants
        logger.warning("GGUF type %s is not kept quantized: dequantized to fp32 at load", kind)
        values = quants.dequantize(data.reshape(shape[0] if len(shape) > 1 else 1, -1),
                                   getattr(GGMLQuantizationType, kind))
    return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))


@dataclass
class _Placing:
    """What placing every tensor of a file shares: the model, how a quantized linear is made (linear(blocks, ext)),
    the biases gathered for after, this rank's shard plan, and whether wide blocks are requantized."""
    model: nn.Module
    linear: Callable
    ext: object
    biases: dict[str, torch.Tensor]
    plan: ShardPlan | None
    requantize: bool


def _place(into: _Placing, f, tensor, order: np.ndarray | None) -> PackedRows | None:
    """Put one GGUF tensor in the model (this rank's part of it, under a shard plan); returns the token
    embedding's blocks when this is it."""
    from accelerate.utils import set_module_tensor_to_device

    from smartspec.runtime.quant_linear import QuantEmbedding

    model, linear, ext, biases, plan, requantize = (into.model, into.linear, into.ext, into.biases, into.plan,
                                                     into.requantize)
    name, kind = hf_name(tensor.name), tensor.tensor_type.name
    (n, k), vector = _shape(tensor), len(tensor.shape) == 1
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    parent, _, child = module_name.rpartition(".")
    rows = plan.rows(module_name) if plan and attr == "weight" else None
    cols = plan.columns(module_name) if plan and attr == "weight" else None
    if attr == "weight" and isinstance(module, nn.Embedding) and kind in FORMATS:
        packed = PackedRows(kind, _read(f, tensor, 0, n), n, k)  # a step looks up a few rows: unpack those
        model.set_input_embeddings(QuantEmbedding(packed))
        return packed
    if attr == "weight" and isinstance(module, nn.Linear) and kind in FORMATS:
        blocks = _unpack(f, tensor, kind, n, k)
        blocks = blocks if order is None else blocks.take(order)
        blocks = blocks if rows is None else blocks.take(np.arange(n)[rows])
        blocks = blocks if cols is None else blocks.columns(cols)
        blocks = to_q4_1(blocks) if requantize and kind in WIDER_THAN_4_BITS else blocks
        setattr(model.get_submodule(parent) if parent else model, child, linear(blocks, ext))
        return None
    value = _dense(kind, _read(f, tensor, 0, n), (n * k,) if vector else (n, k))
    if order is not None:
        value = value[torch.from_numpy(order)]
    if attr == "bias":
        biases[module_name] = value
    elif rows is not None or cols is not None:  # a dense linear, sharded: a linear of this rank's shape
        value = value[rows if rows is not None else slice(None), cols if cols is not None else slice(None)]
        part = nn.Linear(value.shape[1], value.shape[0], bias=False)
        part.weight = nn.Parameter(value.contiguous(), requires_grad=False)
        setattr(model.get_submodule(parent), child, part)
    else:
        set_module_tensor_to_device(model, name, "cpu", value=value)
    return None


def _tie_output_and_check(model: nn.Module, gguf_file: str, embedding_rows: PackedRows | None, linear, ext,
                          int8_activations: bool, requantize: bool) -> None:
    """A model whose file has no output weight gets the token embedding's blocks as its output layer (tied); then
    every parameter must have come from the file."""
    if isinstance(model.lm_head, nn.Linear) and model.lm_head.weight.is_meta:
        if embedding_rows is None:
            raise ValueError(f"{gguf_file} has no output weight and no quantized token embedding to tie it to")
        # tied: the output layer is the embedding's blocks (the int8 kernel packs them a chunk of rows at a time)
        if requantize and embedding_rows.kind in WIDER_THAN_4_BITS:
            model.lm_head = linear(to_q4_1(embedding_rows.unpacked()), ext)
        else:
            model.lm_head = linear(embedding_rows if int8_activations else embedding_rows.unpacked(), ext)
    missing = [n for n, p in (*model.named_parameters(), *model.named_buffers()) if p.is_meta]
    if missing:
        raise ValueError(f"{gguf_file} lacks tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def load_gguf_model(model_dir: str, gguf_file: str, ext, int8_activations: bool = True,
                    shard: Shard | None = None, requantize: bool = False) -> nn.Module:
    """The causal LM of model_dir's config with the weights of gguf_file; ext: the CPU kernels. With a shard:
    that tensor-parallel rank's part of it (smartspec/models/gguf_shard.py). requantize: linears held wider than
    4-bit blocks become Q4_1 (runtime/requantize.py)."""
    from accelerate import init_empty_weights
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM

    from smartspec.runtime.page_arena import PageArena, release_freed_memory
    from smartspec.runtime.quant_linear import Q8Linear, QuantLinear

    # the int8 kernels' weights in one mapping of 2 MiB pages; packed, they take about the file's size
    arena = PageArena(2 * os.path.getsize(gguf_file) + (64 << 20)) if int8_activations else None
    linear = functools.partial(Q8Linear, arena=arena) if int8_activations else QuantLinear
    config = AutoConfig.from_pretrained(model_dir)
    if config.model_type not in ARCHITECTURES:
        raise ValueError(f"quantized GGUF loading supports {ARCHITECTURES}, not {config.model_type!r}")
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    heads = {"attn_q": config.num_attention_heads,
             "attn_k": getattr(config, "num_key_value_heads", None) or config.num_attention_heads}
    embedding_rows: PackedRows | None = None
    biases: dict[str, torch.Tensor] = {}
    tensors = GGUFReader(gguf_file).tensors
    plan = None
    if shard is not None and shard.world > 1:
        kinds = {hf_name(t.name).rpartition(".")[0]: t.tensor_type.name for t in tensors if t.name.endswith("weight")}
        plan = ShardPlan(config, shard, lambda module: FORMATS[kinds[module]][1] if kinds.get(module) in FORMATS else 1)
    placing = _Placing(model, linear, ext, biases, plan, requantize)
    with open(gguf_file, "rb") as f:
        for tensor in tensors:
            release_freed_memory()  # the last tensor's temporaries, before the next one's
            part = tensor.name.split(".")[-2]
            permuted = config.model_type == "llama" and part in heads
            order = _rotary_order(_shape(tensor)[0] if len(tensor.shape) > 1 else int(tensor.shape[0]),
                                  heads[part]) if permuted else None
            embedding_rows = _place(placing, f, tensor, order) or embedding_rows
    for module_name, bias in biases.items():
        bias = bias if plan is None else plan.bias(module_name, bias)
        model.get_submodule(module_name).bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    _tie_output_and_check(model, gguf_file, embedding_rows, linear, ext, int8_activations, requantize)
    if plan is not None:
        wrap_row_parallel(model, plan)
    release_freed_memory()
    if arena is not None:
        logger.info("%.2f GB of packed weights in %s pages", arena.used / 1e9, "2 MiB" if arena.huge_pages else "4 KiB")
    return model.eval().requires_grad_(False)
