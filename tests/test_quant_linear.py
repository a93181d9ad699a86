"""Linears on GGUF-quantized weights: the unpacked codes dequantize to gguf-py's bits; the exact kernel's output is
bitwise the fp32 kernel's on those weights, and the int8-activation kernel's bitwise its numpy reference
(tests/q8_reference.py), for every row count, alone or batched."""
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from q8_reference import q8_linear
from tiny_gguf import random_tensor

from smartspec.runtime import kernels
from smartspec.runtime.gguf_blocks import FORMATS, PackedRows, unpack
from smartspec.runtime.quant_linear import Q8Linear, QuantEmbedding, QuantLinear

ext = kernels.load()
needs_kernels = pytest.mark.skipif(ext is None, reason=f"kernels unavailable: {kernels.unavailable_reason()}")
needs_vnni = pytest.mark.skipif(ext is None or not ext.q8_linear_available(), reason="no AVX-512 VNNI kernels here")


def gguf_py_dequantized(kind: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    return quants.dequantize(raw, getattr(GGMLQuantizationType, kind)).reshape(n, k).astype(np.float32)


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_unpacked_codes_dequantize_to_gguf_py_bits(kind):
    n, k = 24, 512
    raw = random_tensor(kind, n, k)
    ours, ref = unpack(kind, raw, n, k).dequantize(), gguf_py_dequantized(kind, raw, n, k)
    assert np.array_equal(ours.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_rows_kept_as_stored_unpack_and_look_up_as_the_unpacked_weight(kind):
    n, k = 24, 512
    raw = random_tensor(kind, n, k, seed=7)
    packed, unpacked = PackedRows(kind, raw, n, k), unpack(kind, raw, n, k)
    ids = np.array([5, 0, 23, 5, 11])
    for name in ("q", "d", "sc", "off", "mn"):
        a, b = getattr(packed.take(ids), name), getattr(unpacked.take(ids), name)
        assert (a is None and b is None) or np.array_equal(a, b), name
    looked_up = QuantEmbedding(packed)(torch.from_numpy(ids).view(1, 5))
    assert looked_up.shape == (1, 5, k)
    assert np.array_equal(looked_up[0].numpy().view(np.uint32), unpacked.dequantize()[ids].view(np.uint32))
    unpacked_bytes = sum(a.nbytes for a in (unpacked.q, unpacked.d, unpacked.sc, unpacked.off, unpacked.mn)
                         if a is not None)
    assert packed.shape == (n, k) and packed.raw.nbytes < unpacked_bytes  # the memory it is kept for


@needs_kernels
@pytest.mark.parametrize("kind", sorted(FORMATS))
@pytest.mark.parametrize("n,k", [(40, 768), (16, 256), (33, 1536)])  # padded panels; a k-block tail (768 = 512 + 256)
def test_quant_linear_is_the_fp32_kernel_on_the_dequantized_weight(kind, n, k):
    raw = random_tensor(kind, n, k, seed=n + k)
    layer = QuantLinear(unpack(kind, raw, n, k), ext)
    dense = ext.pack_weight(torch.from_numpy(gguf_py_dequantized(kind, raw, n, k)))
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1))
    ours = layer(x)
    for m in (1, 2, 3, 7, 8, 9, 16, 33, 64):
        assert torch.equal(layer(x[:m]), ext.linear(x[:m], dense, n, None)), m
        assert torch.equal(layer(x[:m]), ours[:m]), m  # a row's output does not depend on the rows beside it
    assert all(torch.equal(layer(x[i:i + 1]), ours[i:i + 1]) for i in range(64))


@needs_kernels
def test_quant_linear_adds_a_bias_and_keeps_leading_dimensions():
    raw = random_tensor("Q8_0", 20, 64)
    bias = torch.randn(20)
    layer = QuantLinear(unpack("Q8_0", raw, 20, 64), ext, bias=bias)
    x = torch.randn(2, 3, 64)
    dense = torch.from_numpy(gguf_py_dequantized("Q8_0", raw, 20, 64))
    assert layer(x).shape == (2, 3, 20)
    assert torch.equal(layer(x).reshape(6, 20), ext.linear(x.reshape(6, 64), ext.pack_weight(dense), 20, bias))


@needs_vnni
@pytest.mark.parametrize("kind", sorted(FORMATS))
# 100 rows (7 panels): whole tiles of 4 panels for every row count, and the panels left over
@pytest.mark.parametrize("n,k", [(40, 768), (16, 256), (33, 1536), (100, 512)])
def test_int8_kernel_is_its_reference_for_every_row_count(kind, n, k):
    raw = random_tensor(kind, n, k, seed=n + k)
    rows = unpack(kind, raw, n, k)
    layer = Q8Linear(rows, ext)
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(1)) * torch.linspace(0.1, 3.0, k)
    x[5] = 0.0  # an all-zero row: scale 0, codes 0
    ref = q8_linear(rows, x.numpy())
    for m in range(1, 65):
        assert np.array_equal(layer(x[:m]).numpy().view(np.uint32), ref[:m].view(np.uint32)), m
    assert all(np.array_equal(layer(x[i:i + 1]).numpy().view(np.uint32), ref[i:i + 1].view(np.uint32))
               for i in range(0, 64, 7))
    dense = x.numpy() @ gguf_py_dequantized(kind, raw, n, k).T  # int8 activations: close, not equal
    assert np.abs(ref - dense).max() < 0.03 * np.abs(dense).max()


CODE_RANGE = {"Q4_K": (0, 15), "Q6_K": (-32, 31), "Q8_0": (-128, 127), "Q5_0": (-16, 15), "Q4_1": (0, 15)}
SCALE_RANGE = {"Q4_K": (0, 63), "Q6_K": (-128, 127)}


@needs_vnni
@pytest.mark.parametrize("kind", sorted(FORMATS))
def test_int8_kernel_is_exact_at_the_extreme_codes(kind):
    """Largest codes, scales and minimums against activation codes of +-127: the kernel sums some terms in 16-bit
    lanes (proven to fit), and these are the sums that come nearest their bounds."""
    n, k = 32, 512
    rows = unpack(kind, random_tensor(kind, n, k, seed=3), n, k)
    low, high = CODE_RANGE[kind]
    rows.q[:] = np.where(np.arange(n)[:, None] % 2 == 0, high, low)
    rows.q[n // 2:, ::3], rows.q[n // 2:, 1::3] = low, high  # mixed codes within a group too
    if rows.sc is not None:
        lo_sc, hi_sc = SCALE_RANGE[kind]
        rows.sc[:] = np.where(np.arange(rows.sc.shape[1]) % 3 == 0, lo_sc, hi_sc)
    if rows.mn is not None:
        rows.mn[:] = 63
    layer = Q8Linear(rows, ext)
    x = torch.ones(6, k)
    x[1] = -1.0
    x[2, ::2] = -1.0
    x[3] = torch.where(torch.arange(k) // 16 % 2 == 0, 1.0, -1.0)  # group sums at +-127 * 16 alternating
    x[4] = torch.randn(k, generator=torch.Generator().manual_seed(2))
    x[5, :k // 2] = -1.0
    ref = q8_linear(rows, x.numpy())
    for m in (1, 6):
        assert np.array_equal(layer(x[:m]).numpy().view(np.uint32), ref[:m].view(np.uint32)), m


@needs_vnni
def test_int8_kernel_adds_a_bias_keeps_leading_dimensions_and_checks_its_input():
    raw = random_tensor("Q4_K", 20, 256)
    rows = unpack("Q4_K", raw, 20, 256)
    bias = torch.randn(20)
    layer = Q8Linear(rows, ext, bias=bias)
    x = torch.randn(2, 3, 256)
    assert layer(x).shape == (2, 3, 20)
    assert torch.equal(layer(x).reshape(6, 20), torch.from_numpy(q8_linear(rows, x.reshape(6, 256).numpy())) + bias)
    with pytest.raises(RuntimeError, match="K must be a multiple of 256"):
        ext.q8_linear(torch.randn(1, 128), "Q4_K", layer.blob, 20, None)
    with pytest.raises(RuntimeError, match="no int8 kernel for GGUF type Q3_K"):
        ext.q8_linear(torch.randn(1, 256), "Q3_K", layer.blob, 20, None)


@needs_vnni
def test_linears_of_one_input_in_one_call_are_each_the_single_linear():
    """q, k and v (or gate and up) in one pass, formats of different block shapes mixed: each output the bits of its
    own call, bias or none, for every row count."""
    k = 512
    shapes = [("Q4_K", 48), ("Q6_K", 16), ("Q8_0", 33), ("Q4_K", 16)]
    layers = [Q8Linear(unpack(kind, random_tensor(kind, n, k, seed=i), n, k), ext,
                       bias=torch.randn(n) if i % 2 == 0 else None) for i, (kind, n) in enumerate(shapes)]
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(4))
    for m in (1, 2, 5, 9):
        ys = ext.q8_linears(x[:m], [la.kind for la in layers], [la.blob for la in layers],
                            [la.out_features for la in layers],
                            [torch.empty(0) if la.bias is None else la.bias.data for la in layers])
        assert [y.shape for y in ys] == [(m, n) for _, n in shapes]
        assert all(torch.equal(y.view(torch.int32), la(x[:m]).view(torch.int32)) for y, la in zip(ys, layers)), m
    with pytest.raises(RuntimeError, match="one kind, blob, output size and bias"):
        ext.q8_linears(x, ["Q4_K"], [layers[0].blob, layers[1].blob], [48], [torch.empty(0)])


def test_unpack_refuses_what_it_cannot_keep_quantized():
    with pytest.raises(ValueError, match="Q2_K is not kept quantized"):
        unpack("Q2_K", np.zeros((1, 84), np.uint8), 1, 256)
    with pytest.raises(ValueError, match="multiples of 256"):
        unpack("Q4_K", np.zeros((1, 144), np.uint8), 1, 128)
