"""Load a causal LM and its tokenizer from a bundled name, a local directory or a hub id."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from smartspec.models.gguf_shard import Shard
from smartspec.models.registry import ensure_dense, resolve

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: torch.nn.Module | None  # None when loaded without weights (they live in tensor-parallel workers)
    config: object  # the transformers config
    tokenizer: object
    path: str
    stop_token_ids: frozenset[int]
    max_position_embeddings: int


def stop_token_ids_of(generation_config, tokenizer) -> frozenset[int]:
    eos = generation_config.eos_token_id if generation_config is not None else None
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(i for i in ids if i is not None)


def _generation_config(path: str):
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:  # a model directory without generation_config.json
        return None


QUANTIZATIONS = (None, "auto", "gguf", "gguf_exact", "gguf_q4")


def gguf_file_of(path: str) -> str:
    """The one GGUF file in a model folder (the model store keeps it beside the converted weights)."""
    found = sorted(Path(path).glob("*.gguf"))
    if len(found) != 1:
        raise ValueError(f"GGUF quantization needs exactly one .gguf file in {path}, found {len(found)}")
    return str(found[0])


def auto_quantization(path: str, device: str = "cpu", dtype: str = "float32") -> str | None:
    """What "auto" means for this model: "gguf" when its folder holds one GGUF file and the CPU kernels run here
    (cpu, float32), else None (the folder's safetensors)."""
    if not (device == "cpu" and dtype == "float32" and len(list(Path(path).glob("*.gguf"))) == 1):
        return None
    from smartspec.runtime import kernels

    return "gguf" if kernels.load() is not None else None


def load_model(model: str, dtype: str = "float32", device: str = "cpu", weights: bool = True,
               quantization: str | None = None, shard: Shard | None = None, **from_pretrained) -> LoadedModel:
    """`weights=False` reads the tokenizer and config only; extra keywords go to from_pretrained (tp_plan).
    shard: one tensor-parallel rank's part of a GGUF model's quantized weights.
    quantization "gguf": the weights stay in the folder's GGUF block formats, linears computed from them with int8
    activations (llama.cpp's numerics); "gguf_exact": the same weights with fp32 activations, outputs bitwise those
    of None, the dequantized fp32 model; "gguf_q4": as "gguf", with every linear held wider than 4-bit blocks
    re-quantized to Q4_1 at load (runtime/requantize.py: for a draft model); "auto": "gguf" where the folder has a
    GGUF file, else None."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    path = resolve(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if quantization == "auto":
        quantization = auto_quantization(path, device, dtype) if weights and not from_pretrained else None
        if weights:
            logger.info("%s: quantization 'auto' loads %s", model, quantization or "the safetensors weights")
    if weights and quantization in ("gguf", "gguf_exact", "gguf_q4"):
        from smartspec.models.gguf_model import load_gguf_model
        from smartspec.runtime import kernels

        ext = kernels.load()
        if ext is None or device != "cpu" or dtype != "float32":
            state = "loaded" if ext is not None else f"unavailable: {kernels.unavailable_reason()}"
            raise ValueError(f"quantization {quantization!r} runs on the CPU kernels in float32 (here: device {device}, "
                             f"dtype {dtype}, kernels {state})")
        int8 = quantization != "gguf_exact" and ext.q8_linear_available()
        if quantization != "gguf_exact" and not int8:
            logger.warning("this CPU lacks AVX-512 VNNI: quantization %r computes with fp32 activations", quantization)
        lm = load_gguf_model(path, gguf_file_of(path), ext, int8_activations=int8, shard=shard,
                             requantize=quantization == "gguf_q4")
        config, generation = lm.config, _generation_config(path)
    elif weights:
        if shard is not None:
            raise ValueError(f"{model}: shard needs the GGUF weights (quantization 'gguf' or 'gguf_exact'), got "
                             f"{quantization!r}")
        ensure_dense(path)  # a bundled model is fetched as its GGUF file: its fp32 weights are made on first use
        lm = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **from_pretrained)
        lm = lm.eval() if from_pretrained.get("tp_plan") else lm.to(device).eval()
        lm.requires_grad_(False)
        config, generation = lm.config, lm.generation_config
    else:
        lm, config, generation = None, AutoConfig.from_pretrained(path), _generation_config(path)
    return LoadedModel(lm, config, tokenizer, path, stop_token_ids_of(generation, tokenizer),
                       int(getattr(config, "max_position_embeddings", 4096)))
