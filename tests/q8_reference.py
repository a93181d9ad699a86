"""The int8-activation linear of engine/kernels/q8_linear.cpp written out in numpy, operation for operation: the
kernel must produce these bits. Integer sums are exact in int64; the float operations are float32, in the
kernel's order."""
import numpy as np

from smartspec.runtime.gguf_blocks import QuantizedRows


def quantize_rows(x: np.ndarray, block: int, group: int):
    """Rows of x [M, K] as int8 blocks: (codes [M, K], scales [M, K/block], code sums [M, K/group])."""
    m, k = x.shape
    blocks = x.astype(np.float32).reshape(m, k // block, block)
    amax = np.abs(blocks).max(axis=2)
    scale = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(1) / scale, np.float32(0)).astype(np.float32)
    codes = np.rint(blocks * inv[:, :, None]).astype(np.int8).reshape(m, k)
    sums = codes.astype(np.int64).reshape(m, k // group, group).sum(axis=2)
    return codes, scale, sums


def q8_linear(rows: QuantizedRows, x: np.ndarray) -> np.ndarray:
    """y [M, N] for the weight rows [N, K] and activations x [M, K]."""
    n, k = rows.shape
    m = x.shape[0]
    g, sb = rows.group, rows.superblock
    codes, dx, sums = quantize_rows(x, sb, g)
    dot = np.einsum("ngi,mgi->mng", rows.q.astype(np.int64).reshape(n, k // g, g),
                    codes.astype(np.int64).reshape(m, k // g, g))  # [M, N, K/G]
    per = sb // g
    scales = rows.sc.astype(np.int64) if rows.sc is not None else np.ones((n, k // g), np.int64)
    sumi = (dot * scales[None]).reshape(m, n, k // sb, per).sum(axis=3)
    acc = np.zeros((m, n), np.float32)
    summ = None
    if rows.off is not None:
        mins = rows.mn.astype(np.int64) if rows.mn is not None else np.ones((n, k // g), np.int64)
        summ = (mins[None] * sums[:, None, :]).reshape(m, n, k // sb, per).sum(axis=3)
    for b in range(k // sb):
        acc = acc + sumi[:, :, b].astype(np.float32) * (rows.d[None, :, b] * dx[:, b, None])
        if summ is not None:
            acc = acc + summ[:, :, b].astype(np.float32) * (rows.off[None, :, b] * dx[:, b, None])
    return acc
