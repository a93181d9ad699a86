"""Load a causal LM and its tokenizer from a bundled name, a local directory or a hub id."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from smartspec.models.registry import resolve


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: object
    path: str
    stop_token_ids: frozenset[int]
    max_position_embeddings: int


def stop_token_ids_of(model, tokenizer) -> frozenset[int]:
    eos = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = set(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(i for i in ids if i is not None)


def load_model(model: str, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    lm.requires_grad_(False)
    return LoadedModel(lm, tokenizer, path, stop_token_ids_of(lm, tokenizer),
                       int(getattr(lm.config, "max_position_embeddings", 4096)))
