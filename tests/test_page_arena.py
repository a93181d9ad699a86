"""The page arena: zeroed, aligned, disjoint tensors out of one mapping, torch.zeros when full; weights packed into
it compute the same bits, and a model loaded from GGUF holds its packed weights and KV cache there. Freed chunks
malloc keeps in a thread's heaps go back to the OS when asked."""
import threading

import numpy as np
import pytest
import torch
from tiny_gguf import random_tensor

from smartspec.runtime import kernels
from smartspec.runtime.gguf_blocks import unpack
from smartspec.runtime.page_arena import ALIGN, PageArena, _malloc_trim, release_freed_memory
from smartspec.runtime.quant_linear import Q8Linear

ext = kernels.load()
needs_vnni = pytest.mark.skipif(ext is None or not ext.q8_linear_available(), reason="no AVX-512 VNNI kernels here")


def test_tensors_from_the_arena_are_zero_aligned_and_disjoint_until_it_is_full():
    arena = PageArena(1 << 20)
    a = arena.zeros((3, 5), torch.float32)
    b = arena.zeros((1000,), torch.uint8)
    c = arena.zeros((7, 64), torch.float16)
    for t, shape, dtype in ((a, (3, 5), torch.float32), (b, (1000,), torch.uint8), (c, (7, 64), torch.float16)):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % ALIGN == 0 and not t.any()
    a.fill_(1.0), b.fill_(2), c.fill_(3.0)
    assert a.eq(1.0).all() and b.eq(2).all() and c.eq(3.0).all()  # no tensor wrote into another
    assert b.data_ptr() >= a.data_ptr() + a.nbytes and c.data_ptr() >= b.data_ptr() + b.nbytes
    assert arena.used == c.data_ptr() + c.nbytes - a.data_ptr() and arena.overflowed == 0
    big = arena.zeros((1 << 20,), torch.uint8)  # more than is left: ordinary memory, still zero
    assert arena.overflowed == 1 << 20 and not big.any()
    assert not (a.data_ptr() <= big.data_ptr() < a.data_ptr() + (2 << 20))


def test_tensors_keep_the_mapping_alive():
    t = PageArena(1 << 16).zeros((100,), torch.int32)
    t += 7
    assert t.sum().item() == 700


@needs_vnni
@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K", "Q8_0"])
def test_a_linear_packed_into_the_arena_computes_the_same_bits(kind):
    n, k = 40, 768
    rows = unpack(kind, random_tensor(kind, n, k, seed=3), n, k)
    arena = PageArena(1 << 20)
    placed, plain = Q8Linear(rows, ext, arena=arena), Q8Linear(rows, ext)
    assert torch.equal(placed.blob, plain.blob) and arena.used >= placed.blob.nbytes
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(0))
    assert np.array_equal(placed(x).numpy().view(np.uint32), plain(x).numpy().view(np.uint32))


@needs_vnni
def test_a_gguf_model_keeps_its_packed_weights_and_kv_cache_in_arenas(tiny_gguf):
    from smartspec.config import EngineConfig
    from smartspec.engine.llm_engine import LLMEngine
    from smartspec.types.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(model=tiny_gguf, num_kv_blocks=64, max_model_len=256))
    blobs = [m.blob for m in engine.runner.model.modules() if isinstance(m, Q8Linear)]
    assert blobs
    low, high = min(b.data_ptr() for b in blobs), max(b.data_ptr() + b.nbytes for b in blobs)
    assert high - low < 2 * sum(b.nbytes for b in blobs)  # one mapping, packed (torch's heap would scatter them)
    k0, v0 = engine.runner.kv_caches[0]
    assert not k0.any() and not v0.any() and k0.data_ptr() % ALIGN == 0
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0), "r")
    while engine.has_unfinished():
        engine.step()
    assert k0.any()  # the cache the model writes is the arena's


def _rss() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) << 10


@pytest.mark.skipif(_malloc_trim() is None, reason="not glibc: no malloc_trim")
def test_freed_chunks_of_a_thread_heap_go_back_to_the_os():
    survivors = []

    def fragment():  # what loading a model off the main thread does: large temporaries between small survivors
        scratch = bytearray(8 << 20)
        del scratch  # freeing a mapped chunk raises glibc's mmap threshold: the 1 MiB chunks below go to a heap
        chunks = []
        for _ in range(128):
            chunks.append(bytearray(1 << 20))
            survivors.append(bytearray(4096))
        chunks.clear()

    thread = threading.Thread(target=fragment)
    thread.start()
    thread.join()
    before = _rss()
    release_freed_memory()
    assert before - _rss() >= 64 << 20  # of the 128 MiB freed in the middle of the thread's heaps
