"""Paged attention on the torch path, one layer, in the forms a GPU may run it: which kernel each shape can use and
how long it takes, so the attention path is chosen by measurement.

Forms (all read the same paged cache through the same block tables):
- `gathered_gqa`: the first form: per-position gather in every layer, `enable_gqa` with a boolean mask;
- `folded` (smartspec/runtime/attention.py): the slots and mask computed once per step, whole blocks gathered,
  each KV head's query heads folded into the query length, so no K/V repeat and no `enable_gqa`; CUDA's
  memory-efficient and cuDNN kernels take its mask. Timed per layer (the per-step layout is not in the time).
Each form is checked against the reference (fp32 math) before it is timed.

    python scripts/bench_attention.py                      # on a GPU: the default pair's head shapes, bf16
    python scripts/bench_attention.py --device cpu --quick # the script itself on a CPU (seconds)

Prints one line per shape and form (kernel, ms, max error); writes <out>/bench_attention.json.
Its figures: docs/benchmarks.md, "On a GPU" (the attention kernels chosen there)."""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from smartspec.runtime import attention  # noqa: E402
from smartspec.runtime.attention import QueryGroup, _torch_paged_attention, lay_out  # noqa: E402

SHAPES = [(1, 1, 256), (1, 5, 256), (1, 1, 4096), (64, 1, 256), (64, 5, 256), (64, 1, 2048), (8, 16, 1024),
          (1, 512, 512)]  # (rows, query tokens a row, longest context)
QUICK = [(1, 1, 40), (3, 5, 70), (2, 64, 64)]


class Heads(NamedTuple):
    """The attention's shape: query heads, KV heads, head dim, and the KV cache's block size."""
    heads: int
    kv_heads: int
    dim: int
    block: int


def make_case(rows: int, width: int, ctx: int, shape: Heads, dtype, device, seed: int = 0):
    """rows of `width` queries each over up to `ctx` cached positions in scattered blocks: q, K and V caches, and
    the query group that reads them."""
    heads, kv_heads, dim, block = shape
    g = torch.Generator().manual_seed(seed)
    lengths = [ctx] + [int(x) for x in torch.randint(max(width, ctx // 2), ctx + 1, (rows - 1,), generator=g)]
    nblocks = [-(-n // block) for n in lengths]
    perm = torch.randperm(sum(nblocks) + 1, generator=g)  # blocks scattered over the cache
    tables, at = torch.zeros(rows, max(nblocks), dtype=torch.int64), 0
    for r, n in enumerate(nblocks):
        tables[r, :n] = perm[at:at + n]
        at += n
    cache_blocks = sum(nblocks) + 1
    k_cache = torch.randn(cache_blocks, block, kv_heads, dim, generator=g).to(device, dtype)
    v_cache = torch.randn(cache_blocks, block, kv_heads, dim, generator=g).to(device, dtype)
    q = torch.randn(rows * width, heads, dim, generator=g).to(device, dtype)
    # row r's queries are its last `width` positions (a decode, a verify chain, a prefill chunk)
    kv_len = torch.tensor([[n - width + 1 + j for j in range(width)] for n in lengths]).view(rows, width, 1)
    group = QueryGroup(None, None, rows, width, -(-ctx // block) * block, tables.to(device), kv_len.to(device),
                       None, None)
    return q, k_cache, v_cache, group


def gathered_gqa(q, k_cache, v_cache, g: QueryGroup, scale: float) -> torch.Tensor:
    """The form this project used first: K/V gathered position by position in every layer, `enable_gqa` with a
    boolean mask (torch >= 2.5; on CUDA the math kernel or cuDNN take it, the memory-efficient kernel does not)."""
    T, H, D = q.shape
    bs, kvh = k_cache.shape[1], k_cache.shape[2]
    pos = torch.arange(g.kv_width, device=q.device)
    blocks = g.block_tables[:, pos // bs]
    keys = k_cache[blocks, pos % bs].transpose(1, 2)
    values = v_cache[blocks, pos % bs].transpose(1, 2)
    seen = pos < g.kv_len
    out = F.scaled_dot_product_attention(q.view(g.rows, g.width, H, D).transpose(1, 2), keys, values,
                                         attn_mask=seen[:, None], scale=scale, enable_gqa=H != kvh)
    return out.transpose(1, 2).reshape(T, H, D)


def reference(q, k_cache, v_cache, g: QueryGroup, scale: float) -> torch.Tensor:
    """fp32, the math kernel, the old form: an independent check of the new one."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([SDPBackend.MATH]):
        return gathered_gqa(q.float(), k_cache.float(), v_cache.float(), g, scale)


def timed(fn, device, reps):
    for _ in range(3):
        fn()
    samples = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            samples.append(1000 * (time.perf_counter() - t))
    return statistics.median(samples)


def arguments() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--quick", action="store_true", help="small shapes: check the script itself")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="results")
    return ap


def main(argv=None) -> int:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ap = arguments()
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    shape = Heads(12, 2, 128, 16) if not args.quick else Heads(4, 2, 16, 16)
    heads, kv_heads, dim, block = shape
    backends = {"auto": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    rows_out = []
    print(f"{'rows':>4s} {'width':>5s} {'ctx':>5s} {'form':12s} {'kernel':9s} {'ms':>8s} {'max err':>8s}", flush=True)
    for rows, width, ctx in (QUICK if args.quick else SHAPES):
        q, k, v, g = make_case(rows, width, ctx, shape, dtype, args.device)
        scale = dim ** -0.5
        ref = reference(q, k, v, g, scale)
        layout = lay_out(g, block, heads // kv_heads)  # once per step: what a layer reuses
        forms = {"gathered_gqa": gathered_gqa,
                 "folded": lambda q, k, v, g, s, lay=layout: _torch_paged_attention(q, k, v, [lay], s, 0)}
        for form, fn in forms.items():
            for kernel, backend in backends.items():
                row = {"rows": rows, "width": width, "ctx": ctx, "form": form, "kernel": kernel}
                attention._kernels.clear()  # "auto": the module chooses (and logs) its own kernel
                if backend is not None and args.device == "cuda":  # the module takes the kernel named here
                    attention._kernels[(dtype, kv_heads, dim)] = backend
                try:
                    ctx_mgr = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
                    with ctx_mgr:
                        got = fn(q, k, v, g, scale)
                        row["max_err"] = float((got.float() - ref).abs().max())
                        row["ms"] = timed(lambda: fn(q, k, v, g, scale), args.device, args.reps)
                except Exception as exc:  # a kernel that does not take this form: recorded, not fatal
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
                rows_out.append(row)
                ms = f"{row['ms']:8.3f}" if "ms" in row else "       -"
                err = f"{row['max_err']:8.4f}" if "max_err" in row else row.get("error", "")
                print(f"{rows:4d} {width:5d} {ctx:5d} {form:12s} {kernel:9s} {ms} {err}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    attention._kernels.clear()
    q, k, v, g = make_case(1, 1, 64, shape, dtype, args.device)
    _torch_paged_attention(q, k, v, [lay_out(g, block, heads // kv_heads)], dim ** -0.5, 0)
    print(f"the kernel the folded form chooses on its own: {attention.attention_kernels()}")
    (out / "bench_attention.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "torch": torch.__version__,
         "chosen": attention.attention_kernels(),
         "dtype": args.dtype, "heads": [heads, kv_heads, dim], "block": block, "rows": rows_out}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
