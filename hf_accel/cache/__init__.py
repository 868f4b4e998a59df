"""Paged KV cache: block manager and the transformers ``Cache`` built on it."""

from hf_accel.cache.block_manager import BlockManager, OutOfBlocksError
from hf_accel.cache.paged_cache import MAX_BLOCK_SIZE, PagedCache, PagedStep, active_step

__all__ = ["MAX_BLOCK_SIZE", "BlockManager", "OutOfBlocksError", "PagedCache", "PagedStep", "active_step"]
