"""The forward of a Llama-family model (Llama, Qwen2) on int8-activation GGUF weights, one kernel call per decoder
layer (engine/kernels/decoder_layer.cpp) instead of transformers' modules: the same layers, without the per-op
dispatch that costs a decode step about a third of its time. Other models, and the other numerics, run through
transformers' modules as written."""
from __future__ import annotations

import logging

import torch

from smartspec.runtime.quant_linear import Q8Linear

logger = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # inverse frequencies fixed at load
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
NO_BIAS = torch.empty(0)


def unsupported(model: torch.nn.Module) -> str | None:
    """Why the fused forward cannot run this model (None: it can)."""
    cfg = model.config
    if cfg.model_type not in ARCHITECTURES:
        return f"architecture {cfg.model_type!r}"
    if getattr(cfg, "hidden_act", None) != "silu":
        return f"activation {cfg.hidden_act!r}"
    if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in getattr(cfg, "layer_types",
                                                                                              None) or ()):
        return "sliding-window attention"
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is None or getattr(rotary, "rope_type", None) not in STATIC_ROPE:
        return f"rotary embedding {getattr(rotary, 'rope_type', None)!r}"
    for layer in model.model.layers:
        if any(not isinstance(layer.get_submodule(name), Q8Linear) for name in LINEARS):
            return "linears other than int8-activation GGUF blocks"
        if layer.self_attn.scaling != layer.self_attn.head_dim ** -0.5:
            return "attention scaling other than head_dim ** -0.5"
    return None


class FusedDecoder:
    """Runs a step's packed tokens through the model; logits of the kept rows, as ModelRunner.execute."""

    def __init__(self, model: torch.nn.Module, ext) -> None:
        cfg = model.config
        self.model, self._ext = model, ext
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
        self.head_dim = model.model.layers[0].self_attn.head_dim
        rotary = model.model.rotary_emb
        self.inv_freq, self.rope_scale = rotary.inv_freq.float(), float(rotary.attention_scaling)
        self.layers = []
        for layer in model.model.layers:
            linears = [layer.get_submodule(name) for name in LINEARS]
            self.layers.append((layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data,
                                float(layer.input_layernorm.variance_epsilon), [m.blob for m in linears],
                                [m.kind for m in linears], [m.out_features for m in linears],
                                [NO_BIAS if m.bias is None else m.bias.data for m in linears]))

    @classmethod
    def build(cls, model: torch.nn.Module, ext) -> FusedDecoder | None:
        reason = unsupported(model)
        if reason is not None:
            logger.info("fused decoder not used (%s): transformers' modules run the model", reason)
            return None
        return cls(model, ext)

    def __call__(self, inputs, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        h = self.model.model.embed_tokens(inputs.ids).to(torch.float32).contiguous().clone()
        cos, sin = self._ext.rope_tables(inputs.positions, self.inv_freq, self.rope_scale)
        step = (inputs.slots, inputs.block_tables, inputs.seq_of, inputs.kv_len, inputs.tree_base, inputs.tree_mask)
        for (attn_norm, mlp_norm, eps, blobs, kinds, outs, biases), (k_cache, v_cache) in zip(self.layers, kv_caches):
            self._ext.q8_decoder_layer(h, attn_norm, mlp_norm, eps, blobs, kinds, outs, biases, self.heads,
                                       self.kv_heads, self.head_dim, cos, sin, k_cache, v_cache, *step)
        norm = self.model.model.norm
        return self.model.lm_head(self._ext.rms_norm(h[inputs.keep], norm.weight.data, norm.variance_epsilon))
