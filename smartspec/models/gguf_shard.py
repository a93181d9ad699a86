"""One tensor-parallel rank's part of a GGUF model, its weights still quantized (Megatron's split).

q, k, v, gate and up keep the output rows of this rank's heads and of its slice of the MLP's intermediate
features; o and down keep the matching input columns, and their outputs are summed over the ranks
(`SummedOverRanks`: gathered, then added in rank order). A column split falls on the block boundaries of the weight's format, so
blocks stay whole and each rank's int8 activation blocks are the ones one process would make. The intermediate
slices are whole superblocks of the down weight, so ranks may hold unequal slices (8960 features in 256-weight
superblocks: 4352 and 4608). The embedding, the norms and the output layer are whole on every rank.

Each rank's linears are batch-invariant, and the sum over ranks is elementwise in a fixed order, so speculation on
sharded weights equals plain decoding on them bit for bit; against one process the sums are grouped differently
(fp32 rounding)."""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

COLUMN_PARALLEL = {"q_proj": "heads", "k_proj": "kv_heads", "v_proj": "kv_heads", "gate_proj": "mlp",
                   "up_proj": "mlp"}
ROW_PARALLEL = {"o_proj": "heads", "down_proj": "mlp"}


@dataclass(frozen=True)
class Shard:
    rank: int
    world: int

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is not one of {self.world} tensor-parallel ranks")


def split(total: int, world: int, align: int) -> list[int]:
    """Boundaries [0, ..., total] of `world` slices of whole `align`-sized units, as even as the units allow."""
    units, rest = divmod(total, align)
    if rest or units < world:
        raise ValueError(f"{total} features do not split into {world} slices of whole {align}-weight blocks")
    return [align * (units * r // world) for r in range(world + 1)]


class ShardPlan:
    """Which rows or columns of each linear one rank keeps. align(module name) -> the block size of that weight's
    GGUF format along its input (1 for a dense weight)."""

    def __init__(self, config, shard: Shard, align) -> None:
        self.shard = shard
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        for name, count in (("attention", heads), ("KV", kv_heads)):
            if count % shard.world:
                raise ValueError(f"{count} {name} heads cannot be split over tensor_parallel_size={shard.world}")
        self._even = {"heads": heads * head_dim, "kv_heads": kv_heads * head_dim}
        self._mlp = {}  # layer -> boundaries of the intermediate features
        for layer in range(config.num_hidden_layers):
            down = f"model.layers.{layer}.mlp.down_proj"
            self._mlp[layer] = self._checked(down, config.intermediate_size, align(down))
            o_proj = f"model.layers.{layer}.self_attn.o_proj"
            bounds = self._bounds("heads")
            if any(b % align(o_proj) for b in bounds):
                raise ValueError(f"{o_proj}: a rank's {heads // shard.world} heads ({bounds[1]} inputs) are not whole "
                                 f"{align(o_proj)}-weight blocks: cannot shard this model over "
                                 f"tensor_parallel_size={shard.world} with its GGUF weights quantized")

    def _checked(self, name: str, total: int, align: int) -> list[int]:
        try:
            return split(total, self.shard.world, align)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}: cannot shard it over tensor_parallel_size={self.shard.world} with its "
                             f"GGUF weights quantized") from None

    def _bounds(self, part: str, layer: int | None = None) -> list[int]:
        if part == "mlp":
            return self._mlp[layer]
        total, world = self._even[part], self.shard.world
        return [total * r // world for r in range(world + 1)]

    def _slice(self, module_name: str, table: dict) -> slice | None:
        m = re.fullmatch(r"model\.layers\.(\d+)\.\w+\.(\w+)", module_name)
        if not m or m.group(2) not in table:
            return None
        bounds = self._bounds(table[m.group(2)], int(m.group(1)))
        return slice(bounds[self.shard.rank], bounds[self.shard.rank + 1])

    def rows(self, module_name: str) -> slice | None:
        """The output rows this rank keeps of a column-parallel linear (None: not one)."""
        return self._slice(module_name, COLUMN_PARALLEL)

    def columns(self, module_name: str) -> slice | None:
        """The input columns this rank keeps of a row-parallel linear (None: not one)."""
        return self._slice(module_name, ROW_PARALLEL)

    def bias(self, module_name: str, bias: torch.Tensor) -> torch.Tensor | None:
        """A column-parallel linear's bias, its rows; a row-parallel one's on rank 0 only (the sum adds it once)."""
        rows = self.rows(module_name)
        if rows is not None:
            return bias[rows]
        if self.columns(module_name) is not None and self.shard.rank:
            return None
        return bias


class SummedOverRanks(nn.Module):
    """A row-parallel linear: this rank's partial output, summed over all ranks (every rank gets the sum).

    The partials are gathered and added in rank order, not all-reduced: a ring all-reduce groups the terms of an
    element by where it falls in the buffer's chunks, which move with the number of rows, and the output would
    then depend on the batch (speculative verification would part from plain decoding at near-ties)."""

    def __init__(self, linear: nn.Module) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        y = self.linear(x).contiguous()
        parts = [torch.empty_like(y) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, y)
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total


def wrap_row_parallel(model: nn.Module, plan: ShardPlan) -> None:
    """Put every row-parallel linear of the model behind its sum over ranks."""
    for name, module in list(model.named_modules()):
        if plan.columns(name) is not None:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, SummedOverRanks(module))
