"""Executes forwards: the paged KV cache (block manager, page arena), the model runner and its backends (CPU
kernels, transformers' modules), attention, sampling. Knows nothing of speculation policy."""
