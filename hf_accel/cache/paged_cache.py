"""``PagedCache``: a transformers ``Cache`` whose K/V live in fixed-size blocks (PagedAttention).

Per layer, K and V pools [num_blocks, block_size, num_kv_heads, head_dim]; one block table per
sequence (batch row), shared by all layers and managed by :class:`~hf_accel.cache.block_manager.BlockManager`
(Kwon et al. 2023, §4.2). New tokens are written through a slot mapping
(:func:`~hf_accel.kernels.reshape_and_cache.reshape_and_cache`); attention reads the pools through the
block table (:func:`~hf_accel.kernels.paged_attention.paged_attention`), so nothing is ever copied to
grow the cache.

``update`` returns the new K/V themselves on a sequence's first forward (the prefill then runs the
contiguous kernel), and the pools afterwards; hf-accel's attention function recognises the pools and
takes the step's block table from :func:`active_step`. Fallback paths (e.g. ``output_attentions``) get a
contiguous copy from :meth:`PagedStep.gather`. A model whose attention is not hf-accel's (never accelerated,
or reverted) gets that contiguous copy from ``update`` itself, with a logged note: correct, but each step
copies the whole cache.

Beam search works by forking block tables (copy-on-write), ``crop`` rolls back (speculative decoding).
"""

from __future__ import annotations

import operator
import os
import sys
import threading
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from hf_accel._checks import check_int
from hf_accel._logging import log_once
from hf_accel.cache.block_manager import BlockManager, OutOfBlocksError
from hf_accel.kernels.paged_attention_torch import gather_kv
from hf_accel.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

_active = threading.local()


@dataclass
class PagedStep:
    """Metadata of one forward step, shared by all layers (device tensors built once per step).

    block_table: [batch, max_blocks_per_seq], int32; seq_lens: [batch], int32 (new tokens included);
    slot_mapping: [batch * q_len], int32; max_seq_len: host int; start: tokens cached before the step.
    """

    start: int
    q_len: int
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    max_seq_len: int
    key_cache: torch.Tensor | None = None
    value_cache: torch.Tensor | None = None

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous (keys, values) [batch, num_kv_heads, max_seq_len, head_dim] of this step's layer."""
        rows = range(self.block_table.shape[0])
        keys = torch.stack([gather_kv(self.key_cache, self.block_table, self.max_seq_len, b) for b in rows])
        values = torch.stack([gather_kv(self.value_cache, self.block_table, self.max_seq_len, b) for b in rows])
        return keys, values


# Share of a GPU's free memory (PyTorch's cached but unused memory counted as free) that a pool sized to
# "what fits" may take; the rest is left for activations, logits and captured graphs.
KV_MEMORY_FRACTION = 0.9

#: Largest block size accepted (token slots per block). A block is the unit the pools are reserved in, so a
#: larger one only adds waste (up to ``block_size - 1`` slots per sequence); vLLM's CUDA block sizes stop at
#: a few hundred tokens.
MAX_BLOCK_SIZE = 1024


def check_block_size(block_size) -> None:
    """ValueError unless ``block_size`` is an int in [1, :data:`MAX_BLOCK_SIZE`]."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be an int in [1, {MAX_BLOCK_SIZE}], got {block_size!r}")


def kv_block_bytes(config, block_size: int, dtype: torch.dtype, num_layers: int | None = None) -> int:
    """Bytes of one cache block over all layers: K and V, ``block_size`` tokens, ``num_key_value_heads`` x
    ``head_dim`` each (``num_layers`` defaults to ``config.num_hidden_layers``)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    layers = config.num_hidden_layers if num_layers is None else num_layers
    return 2 * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size() * layers


def free_kv_bytes(device, fraction: float = KV_MEMORY_FRACTION) -> int | None:
    """Bytes of KV cache that fit in ``fraction`` of ``device``'s free memory: on CUDA the device's free
    memory, counting what PyTorch's caching allocator holds unused as free; on CPU the system's available
    memory (Linux ``/proc/meminfo`` MemAvailable, else the free physical pages), capped by the process's
    address-space limit (``ulimit -v``) and its memory cgroup's limit where set. A CPU pool's untouched
    pages cost no memory, but an allocation larger than the machine's memory is refused, and an answer
    cannot use more KV cache than the machine holds. None where it cannot be read (other devices, other
    systems): not checked."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        stats = torch.cuda.memory_stats(device)  # one read (memory_reserved / memory_allocated each make all of it)
        free += stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
        return int(free * fraction)
    if device.type == "cpu":
        free = _available_system_memory()
        return None if free is None else int(free * fraction)
    return None


def _available_system_memory() -> int | None:
    """Bytes of memory available to a new allocation of this process, or None where unknown: the machine's
    (:func:`_machine_available_memory`), capped by the process's address-space limit and its memory cgroup's
    limit where those are set (:func:`_process_memory_headroom`)."""
    bounds = [b for b in (_machine_available_memory(), *_process_memory_headroom()) if b is not None]
    return min(bounds) if bounds else None


def _machine_available_memory() -> int | None:
    """Linux ``/proc/meminfo`` MemAvailable, else the free physical pages; None where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _read_int(path: str) -> int | None:
    """The integer a one-line file holds (a cgroup or procfs value), None where absent, unreadable or "max"."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


#: cgroup memory limits at least this large mean "no limit" (cgroup v1 writes ~2**63 rounded down to a page)
_NO_CGROUP_LIMIT = 2**60


def _process_memory_headroom() -> tuple[int | None, int | None]:
    """(address space left under ``RLIMIT_AS``, memory left under the memory cgroup's limit), each None where no
    limit is set or it cannot be read. A pool larger than the first fails to allocate (``ulimit -v``), one
    larger than the second gets the process killed once its pages are used."""
    address = None
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            used = _read_int("/proc/self/statm")  # pages of virtual memory in use
            if used is not None:
                address = max(soft - used * os.sysconf("SC_PAGE_SIZE"), 0)
    except (ImportError, AttributeError, ValueError, OSError):
        pass
    cgroup = None
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),  # v2
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",  # v1
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit = _read_int(limit_file)
        if limit is not None and limit < _NO_CGROUP_LIMIT:
            cgroup = max(limit - (_read_int(usage_file) or 0), 0)
            break
    return address, cgroup


def blocks_that_fit(device, block_bytes: int, fraction: float = KV_MEMORY_FRACTION) -> int | None:
    """Cache blocks of ``block_bytes`` that fit in ``fraction`` of ``device``'s free memory
    (:func:`free_kv_bytes`); None where memory is not checked."""
    free = free_kv_bytes(device, fraction)
    return None if free is None else free // block_bytes


def active_step(key: torch.Tensor) -> PagedStep | None:
    """The paged step whose key pool is ``key`` (the tensor a PagedCache layer just returned), else None."""
    step = getattr(_active, "step", None)
    if step is not None and step.key_cache is key:
        _active.step = None  # consumed: the thread-local must not keep a layer's pools alive
        return step
    return None


class PagedLayer(CacheLayerMixin):
    """One decoder layer's K/V pools of a :class:`PagedCache`.

    ``keys`` and ``values`` are the pools, [num_blocks, block_size, num_kv_heads, head_dim] (not transformers'
    [batch, num_kv_heads, seq_len, head_dim]): a token's K/V sits in the block its row's block table names.
    :meth:`PagedCache.layer_kv` gives the contiguous copies in transformers' layout."""

    is_compileable = False
    is_sliding = False
    is_croppable = True
    supports_early_init = False

    def __init__(self, cache: "PagedCache", layer_idx: int):
        super().__init__()
        self._cache = cache
        self.layer_idx = layer_idx
        self.length = 0
        self.keys = self.values = None  # pools, named as transformers' layers name their tensors

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        c = self._cache
        num_kv_heads, head_dim = key_states.shape[1], key_states.shape[3]
        c._ensure_manager(key_states)
        shape = (c.manager.num_blocks, c.block_size, num_kv_heads, head_dim)
        self.keys = torch.empty(shape, dtype=key_states.dtype, device=key_states.device)
        self.values = torch.empty(shape, dtype=value_states.dtype, device=value_states.device)
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        for name, t in (("key", key_states), ("value", value_states)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4 or t.shape[0] == 0:
                got = f"shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"PagedCache layer {self.layer_idx}: {name} states must be a tensor [batch >= 1, "
                                 f"num_kv_heads, q_len, head_dim]; got {got}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch, num_kv_heads, q_len, head_dim = key_states.shape
        if value_states.shape != key_states.shape:
            raise ValueError(f"PagedCache layer {self.layer_idx}: key and value states must have one shape "
                             f"[batch, num_kv_heads, q_len, head_dim]; got {tuple(key_states.shape)} and "
                             f"{tuple(value_states.shape)}")
        if self.keys.shape[2:] != (num_kv_heads, head_dim):
            raise ValueError(f"PagedCache layer {self.layer_idx} holds {self.keys.shape[2]} KV heads of size "
                             f"{self.keys.shape[3]} and got {num_kv_heads} of size {head_dim}: a cache belongs to "
                             "one model (pass another model a cache of its own)")
        given = (key_states.dtype, key_states.device, value_states.dtype, value_states.device)
        if given != (self.keys.dtype, self.keys.device, self.values.dtype, self.values.device):
            if self.length:  # (K and V may differ: under autocast a layer's keys can be float32, its values not)
                raise ValueError(
                    f"PagedCache layer {self.layer_idx} holds keys {self.keys.dtype} on {self.keys.device}, values "
                    f"{self.values.dtype} on {self.values.device} and got keys {key_states.dtype} on "
                    f"{key_states.device}, values {value_states.dtype} on {value_states.device}: a cache keeps its "
                    "dtypes and device (pass a new PagedCache)")
            # empty (after reset() / release(), which keep the pools): new pools of the new dtype or device, as
            # transformers' DynamicCache gives a reset cache
            self.lazy_initialization(key_states, value_states)
        if self.layer_idx == 0:  # a new forward: refuse a partial step before anything changes
            self._cache._check_whole_steps()
            self._cache._make_writable()
        start = self.length
        step = self._cache._prepare_step(start, q_len, batch, key_states.device)
        k = key_states.transpose(1, 2).reshape(batch * q_len, num_kv_heads, head_dim)
        v = value_states.transpose(1, 2).reshape(batch * q_len, num_kv_heads, head_dim)
        write = reshape_and_cache if key_states.is_cuda else reshape_and_cache_ref
        try:
            write(k, v, self.keys, self.values, step.slot_mapping, check_slots=False)
        except BaseException:
            if self.layer_idx == 0:  # no layer holds the step yet: the block tables go back to where they were
                self._cache._undo_step(start)
            raise
        fresh = self.length == 0
        self.length += q_len
        if fresh:
            _active.step = None
            return key_states, value_states
        step.key_cache, step.value_cache = self.keys, self.values
        reader = self._cache._attention_reading_pools()
        if reader is not None:
            log_once(f"paged-cache-gather:{reader}",
                     f"hf-accel: PagedCache under attention implementation {reader!r}, which cannot read the "
                     "block pools: every step copies the cached K/V into contiguous tensors (correct, slow; "
                     "hf_accel.accelerate_model(model) makes attention read the pools in place)")
            _active.step = None
            return step.gather()
        _active.step = step
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.length = 0

    def crop(self, new_length: int) -> None:
        self.length = new_length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        pass  # block tables are reordered once, by PagedCache.reorder_cache

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        pass

    def batch_repeat_interleave(self, repeats: int) -> None:
        pass


class PagedCache(Cache):
    """A paged KV cache for ``model.generate(cache=PagedCache(model.config, ...))`` (``past_key_values=`` in
    transformers releases before the ``cache=`` argument, where it is the only name).

    Meant for a model prepared by :func:`hf_accel.accelerate_model`, whose attention reads the pools in place.
    Under any other attention implementation (read from ``config._attn_implementation`` at every update) the
    cache still gives the right K/V, as contiguous copies gathered every step (slow; logged once).

    Args:
        config: the model's own config (``num_hidden_layers`` and ``_attn_implementation`` are read).
        num_blocks: blocks per layer pool. Give this or ``memory_fraction``.
        block_size: token slots per block (default 16, at most :data:`MAX_BLOCK_SIZE`).
        memory_fraction: size the pools to this fraction of the GPU's free memory at the first update (CUDA
            K/V only: with CPU tensors that update raises ValueError; give ``num_blocks`` there).
        growable: when an update needs more blocks than are free, enlarge every layer's pools (at least
            doubling them; the cached K/V are copied into the new pools) instead of raising
            :class:`OutOfBlocksError`. ``generate`` on an accelerated model returns its cache growable (with
            ``return_dict_in_generate=True``), so that it can be passed back for the next turn (the fast decode
            path copies its K/V into its own pools, prefills only the new tokens and writes the new K/V back).

    Raises:
        ValueError: neither or both of ``num_blocks`` and ``memory_fraction``; bad values (``num_blocks`` not
            an int >= 1, ``memory_fraction`` not in (0, 1], ``block_size`` not an int in [1, 1024]); from
            ``update``, a layer index the config does not have, or pools of ``num_blocks`` blocks larger than
            the device's free memory (checked before they are made); from ``crop``, ``reorder_cache``,
            ``batch_select_indices`` and ``batch_repeat_interleave``, non-integer or out-of-range arguments
            (the cache is unchanged).
        TypeError: ``config`` is not a transformers config.
        OutOfBlocksError: (from ``update``) the pool cannot hold the new tokens; the cache is unchanged
            and the message says how many blocks were needed and free.
        RuntimeError: (from ``update``) a forward that failed part-way (any other error, an interrupt) left
            the layers that ran a step ahead of the others; the next forward refuses to start (before
            anything changes), naming the ``crop`` (or ``release``) that recovers. So every forward must update
            every layer, in order, as transformers' models do.

    Attributes:
        token_ids: [batch, n] int64, the token ids whose K/V the first n positions hold, as an accelerated model's
            ``generate`` recorded them (its returned sequences but the last token), or None where the cache was
            written otherwise (the caller's own forwards). Kept by ``crop`` and the row operations; None after
            ``release``. ``generate`` refuses a passed cache whose tokens differ from the call's ``input_ids``.
    """

    def __init__(self, config, *, num_blocks: int | None = None, block_size: int = 16,
                 memory_fraction: float | None = None, growable: bool = False):
        if (num_blocks is None) == (memory_fraction is None):
            raise ValueError("give exactly one of num_blocks and memory_fraction")
        if num_blocks is not None:  # (an integral number: a numpy int too, as BlockManager takes)
            num_blocks = check_int(num_blocks, "num_blocks", minimum=1)
        if memory_fraction is not None and (isinstance(memory_fraction, bool)
                                            or not isinstance(memory_fraction, (int, float))
                                            or not 0 < memory_fraction <= 1):
            raise ValueError(f"memory_fraction must be a number in (0, 1], got {memory_fraction!r}")
        check_block_size(block_size)
        if not callable(getattr(config, "get_text_config", None)):
            raise TypeError(f"config must be a transformers PretrainedConfig (model.config); got {type(config).__name__}")
        num_layers = config.get_text_config().num_hidden_layers
        if num_layers < 1:
            raise ValueError(f"the model config has {num_layers} layers: a KV cache needs at least one")
        self._text_config = config.get_text_config()
        self.block_size = block_size
        self._num_blocks = num_blocks
        self._memory_fraction = memory_fraction
        if not isinstance(growable, bool):
            raise ValueError(f"growable must be True or False, got {growable!r}")
        self.growable = growable
        self._caller_config = None  # the calling attention module's config, during update
        self.manager: BlockManager | None = None
        self.seq_ids: list[int] = []
        self._step: PagedStep | None = None
        self.token_ids: torch.Tensor | None = None
        super().__init__(layers=[PagedLayer(self, i) for i in range(num_layers)])

    # -- sizing -----------------------------------------------------------------------------------
    def _ensure_manager(self, key_states: torch.Tensor) -> None:
        if self.manager is not None:
            return
        num_blocks = self._num_blocks
        if num_blocks is None:
            if not key_states.is_cuda:
                raise ValueError("memory_fraction needs a CUDA device; give num_blocks instead")
            free, _ = torch.cuda.mem_get_info(key_states.device)
            per_block = self._block_bytes(key_states.shape[1], key_states.shape[3], key_states.dtype)
            num_blocks = int(free * self._memory_fraction) // per_block
            if num_blocks < 1:
                raise OutOfBlocksError(1, 0, 0, self.block_size)
        else:
            self.check_pools_fit(key_states.shape[1], key_states.shape[3], key_states.dtype, key_states.device)
        self.manager = BlockManager(num_blocks, self.block_size)

    def _block_bytes(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of one block over every layer's K and V pools."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * self.block_size * num_kv_heads * head_dim * element * len(self.layers)

    def check_pools_fit(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """Raise ValueError where the pools of a cache made with ``num_blocks`` (K and V of every layer, blocks of
        ``block_size`` x ``num_kv_heads`` x ``head_dim`` elements of ``dtype``) are larger than ``device``'s free
        memory (:func:`free_kv_bytes`, all of it). Checked before the pools or the block list are made; a cache
        sized by ``memory_fraction``, or one whose pools exist, passes."""
        if self._num_blocks is None or self.manager is not None:
            return
        free = free_kv_bytes(device, 1.0)
        pools = self._num_blocks * self._block_bytes(num_kv_heads, head_dim, dtype)
        if free is not None and pools > free:
            raise ValueError(
                f"PagedCache(num_blocks={self._num_blocks}, block_size={self.block_size}): its pools take "
                f"{pools / 2**30:.1f} GiB ({len(self.layers)} layers of K and V, {dtype}) and {torch.device(device)} "
                f"has {free / 2**30:.1f} GiB free; give a smaller num_blocks (growable=True lets the pools grow when "
                "needed)")

    def _recovery(self) -> str:
        lengths = [layer.length for layer in self.layers]
        shown = lengths if len(lengths) <= 8 else f"{lengths[:4]} ... {lengths[-4:]}"
        done = min(lengths)
        fix = (f"cache.crop({done}) drops the partial step (the caller's inputs must start at token {done} again)"
               if done else "no step completed: cache.release() empties the cache")
        cause = "a forward failed part-way after some layers wrote their K/V"
        first_short = next((i for i, n in enumerate(lengths) if n != lengths[0]), None)
        if first_short is not None and all(n == lengths[-1] for n in lengths[first_short:]):
            # the layers ahead are the first ones: also what a model running fewer layers than the cache has leaves
            cause += (f", or the model runs {first_short} decoder layers and this cache was built for "
                      f"{len(lengths)} (a cache made for another model's config)")
        return f"Its layers hold {shown} tokens: {cause}; {fix}"

    def _make_writable(self) -> None:
        """Outside ``torch.inference_mode``, replace pools created inside it (inference tensors, which refuse
        in-place writes there: a cache filled under inference mode, then continued without it) by copies."""
        if torch.is_inference_mode_enabled():
            return
        for layer in self.layers:
            if layer.is_initialized and layer.keys.is_inference():
                layer.keys, layer.values = layer.keys.clone(), layer.values.clone()

    def _check_whole_steps(self) -> None:
        """RuntimeError when the layers hold different token counts (a forward failed part-way: an error or an
        interrupt after some layers had written their K/V), called before a forward changes anything."""
        lengths = [layer.length for layer in self.layers]
        if min(lengths) != max(lengths):
            raise RuntimeError(f"PagedCache holds a partial step. {self._recovery()}")

    # -- per-step metadata ------------------------------------------------------------------------
    def _prepare_step(self, start: int, q_len: int, batch: int, device) -> PagedStep:
        step = self._step
        if step is not None and step.start == start and step.q_len == q_len:
            return step  # another layer of the same forward
        m = self.manager
        fresh = not self.seq_ids
        if fresh:
            self.seq_ids = [m.allocate(0) for _ in range(batch)]
        if len(self.seq_ids) != batch:
            raise ValueError(f"PagedCache holds {len(self.seq_ids)} sequences but the batch has {batch} rows")
        if any(m.length(s) != start for s in self.seq_ids):
            raise RuntimeError(f"PagedCache out of sync: a layer starts at {start}, the block tables hold "
                               f"{[m.length(s) for s in self.seq_ids]} tokens. {self._recovery()}")
        needed = m.blocks_needed_together(self.seq_ids, q_len)
        if needed > m.num_free_blocks and self.growable:
            self._grow(max(needed - m.num_free_blocks, m.num_blocks))
        if needed > m.num_free_blocks:
            if fresh:  # leave the cache as it was: empty, not tied to this batch size
                for s in self.seq_ids:
                    m.free(s)
                self.seq_ids = []
            raise OutOfBlocksError(needed, m.num_free_blocks, m.num_blocks, self.block_size)
        copies = []
        for s in self.seq_ids:
            copies += m.append(s, q_len)
        for src, dst in copies:  # copy-on-write of shared partly filled blocks
            for layer in self.layers:
                if layer.is_initialized:
                    layer.keys[dst].copy_(layer.keys[src])
                    layer.values[dst].copy_(layer.values[src])
        table = self._block_table()
        pos = torch.arange(start, start + q_len)
        slots = table[:, pos // self.block_size] * self.block_size + (pos % self.block_size)
        seq_lens = torch.full((batch,), start + q_len, dtype=torch.int32)
        self._step = PagedStep(start, q_len, table.to(device, non_blocking=True),
                               seq_lens.to(device, non_blocking=True),
                               slots.reshape(-1).to(torch.int32).to(device, non_blocking=True), start + q_len)
        return self._step

    def _block_table(self) -> torch.Tensor:
        """[batch, max blocks per sequence] int32 CPU tensor of the sequences' block ids, zero-padded on the right."""
        tables = [self.manager.block_table(s) for s in self.seq_ids]
        table = torch.zeros(len(tables), max(len(t) for t in tables), dtype=torch.int32)
        for b, t in enumerate(tables):
            table[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return table

    def _undo_step(self, start: int) -> None:
        """Take back a step that :meth:`_prepare_step` made and no layer wrote (the first layer's write failed or
        was interrupted): the block tables end at ``start`` again, rows allocated by that step are freed."""
        self._step = None
        m = self.manager
        if start == 0 and all(layer.length == 0 for layer in self.layers):
            for s in self.seq_ids:
                m.free(s)
            self.seq_ids = []
            return
        for s in self.seq_ids:
            if m.length(s) > start:
                m.truncate(s, start)

    def _grow(self, extra: int) -> None:
        """``extra`` more blocks in the manager and in every initialized layer's pools (copied over)."""
        for layer in self.layers:
            if layer.is_initialized:
                for name in ("keys", "values"):
                    pool = getattr(layer, name)
                    bigger = pool.new_empty((pool.shape[0] + extra, *pool.shape[1:]))
                    bigger[: pool.shape[0]].copy_(pool)
                    setattr(layer, name, bigger)
        self.manager.grow(extra)
        self._num_blocks = self.manager.num_blocks if self._num_blocks is not None else None

    def _attention_reading_pools(self) -> str | None:
        """None when the attention that reads this update is hf-accel's (it reads the pools through the step's
        block table); else the name of the attention implementation, which needs contiguous K/V. Read from the
        config of the attention module calling :meth:`update` (the cache may be passed to another model than
        the one it was built for: a stock or reverted copy), else from the config the cache was built with."""
        from hf_accel.integrations.attention import ATTN_NAME  # late: that module imports this one

        config = self._caller_config if self._caller_config is not None else self._text_config
        name = getattr(config, "_attn_implementation", None)
        return None if name == ATTN_NAME else str(name)

    # -- transformers Cache API -------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write one layer's new K/V [batch, num_kv_heads, q_len, head_dim] and return what its attention
        reads (see the module docstring).

        Raises:
            ValueError: a layer index that is not an int or that the cache was not built with; K/V that are not
                a 4-D batch of at least one row, whose heads or head size differ from the layer's pools, or whose
                dtype or device differ from them while the layer holds tokens (an emptied layer makes new pools).
            OutOfBlocksError: the step needs more free blocks than the pool has (nothing changed).
        """
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int):
            raise ValueError(f"layer_idx must be an int; got {layer_idx!r}")
        if not 0 <= layer_idx < len(self.layers):
            raise ValueError(f"PagedCache was built for {len(self.layers)} layers and got an update of layer "
                             f"{layer_idx}: build it from the model's own config (PagedCache(model.config, ...))")
        # transformers' attention modules call update(...) themselves and pick their attention function from
        # their own config right after: that config says whether the pools can be returned in place
        caller = sys._getframe(1).f_locals.get("self")
        config = getattr(caller, "config", None)
        self._caller_config = config if hasattr(config, "_attn_implementation") else None
        try:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        finally:
            self._caller_config = None

    def crop(self, tokens_to_remove) -> None:
        """Roll back: a negative count removes that many tokens, 0 does nothing, a positive value is the
        absolute length to keep (the meaning older transformers gave it, which transformers' own caches now
        refuse); a 0-d integer tensor is accepted. The argument has transformers' ``Cache.crop`` name.

        Raises:
            ValueError: a non-integer or several-element value, more tokens to remove than the cache holds, or,
                after a forward that failed part-way (the first layers hold more tokens than the rest), a length
                the shortest layer does not hold (its K/V at those positions were never written).
        """
        n = _integer(tokens_to_remove, "crop's tokens_to_remove")
        length = self.get_seq_length()
        new_length = length + n if n < 0 else (length if n == 0 else min(n, length))
        if new_length < 0:
            raise ValueError(f"cannot remove {-n} tokens from a cache holding {length}")
        written = min(layer.length for layer in self.layers)
        if new_length > written:
            behind = [i for i, layer in enumerate(self.layers) if layer.length < new_length]
            which = f"layer {behind[0]}" if len(behind) == 1 else f"layers {behind[0]}..{behind[-1]}"
            raise ValueError(f"cannot keep {new_length} tokens: a forward failed part-way and {which} hold"
                             f"{'s' if len(behind) == 1 else ''} only {written}; crop to {written} tokens or fewer "
                             f"(cache.crop({written})), or release the cache")
        if new_length == length and all(self.manager.length(s) == length for s in self.seq_ids):
            return
        for s in self.seq_ids:
            self.manager.truncate(s, new_length)
        for layer in self.layers:
            layer.crop(new_length)
        self._step = None
        if self.token_ids is not None:
            self.token_ids = self.token_ids[:, :new_length]

    def _reindex(self, rows: list[int]) -> None:
        batch = len(self.seq_ids)
        if not rows:
            raise ValueError(f"need at least one row index for a PagedCache of {batch} sequences "
                             "(cache.release() empties it)")
        bad = [r for r in rows if not 0 <= r < batch]
        if bad:
            raise ValueError(f"row indices {bad[:8]} out of range for a PagedCache of {batch} sequences")
        m = self.manager
        new_ids = [m.fork(self.seq_ids[r]) for r in rows]
        for s in self.seq_ids:
            m.free(s)
        self.seq_ids = new_ids
        self._step = None
        if self.token_ids is not None:
            self.token_ids = self.token_ids[torch.tensor(rows, device=self.token_ids.device)]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row r continues beam ``beam_idx[r]`` (block tables forked, copy-on-write).

        beam_idx: 1-D integer tensor of row indices in [0, batch). ValueError otherwise (nothing changed).
        """
        rows = _row_indices(beam_idx, "beam_idx")  # checked on an empty cache too
        if self.seq_ids:
            self._reindex(rows)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (1-D integer tensor, in [0, batch)), in that order."""
        rows = _row_indices(indices, "indices")
        if self.seq_ids:
            self._reindex(rows)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row ``repeats`` (an int >= 1) times in place (block tables shared, copy-on-write)."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"repeats must be an int >= 1, got {repeats!r}")
        if self.seq_ids:
            self._reindex([r for r in range(len(self.seq_ids)) for _ in range(repeats)])

    def reset(self) -> None:
        self.release()

    # -- hf-accel API -----------------------------------------------------------------------------
    def allocate_pools(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """Create the block manager and every layer's pools now (instead of at the first ``update``), for
        callers that write the cache with their own kernels (hf-accel's decode engine)."""
        probe = torch.empty(1, num_kv_heads, 1, head_dim, dtype=dtype, device=device)
        for layer in self.layers:
            if not layer.is_initialized:
                layer.lazy_initialization(probe, probe)

    def release(self) -> None:
        """Free every block (the pools stay allocated; K/V of another dtype or device written next replace them);
        the cache is empty afterwards."""
        if self.manager is not None:
            self.manager.free_all()
        self.seq_ids = []
        self._step = None
        self.token_ids = None
        for layer in self.layers:
            layer.length = 0
        if getattr(_active, "step", None) is not None:
            _active.step = None

    def layer_kv(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Contiguous copies of one layer's cached (keys, values), each [batch, num_kv_heads, seq_len, head_dim] in
        the pools' dtype and device: the layout of transformers' ``DynamicCache`` layers. Positions that the attention
        mask hides (a left-padded batch's padding) are there too, with unspecified values: the fast decode path
        does not write them (stock writes the pad tokens' K/V, which no query attends to). ``seq_len`` is the
        layer's :meth:`get_seq_length`; an empty cache gives None for both.

        Raises:
            IndexError: ``layer_idx`` outside ``[0, len(self.layers))``."""
        layer_idx = operator.index(layer_idx)
        if not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"layer_idx {layer_idx} out of range: the cache has {len(self.layers)} layers")
        layer = self.layers[layer_idx]
        if not layer.is_initialized or not self.seq_ids:
            return None, None
        table = self._block_table().to(layer.keys.device)
        rows = range(table.shape[0])
        keys = torch.stack([gather_kv(layer.keys, table, layer.length, b) for b in rows])
        values = torch.stack([gather_kv(layer.values, table, layer.length, b) for b in rows])
        return keys, values

    def memory_stats(self, length: int | None = None) -> dict:
        """Blocks and bytes: ``blocks_allocated``, ``num_blocks``, ``tokens_stored``, ``slots_allocated``,
        ``waste_pct`` (allocated slots holding no token, in %; shared blocks counted once), ``bytes_allocated`` (K+V of allocated
        blocks over all layers) and ``bytes_reserved`` (the pools).

        ``length``: count each of the cache's sequences as holding its first ``length`` tokens at most, for an owner
        that reserved slots ahead of the tokens it wrote (the fast decode path reserves the whole answer up front);
        the reserved blocks still count as allocated. None: the tokens each sequence holds."""
        m = self.manager
        if m is None:
            return {"blocks_allocated": 0, "num_blocks": self._num_blocks or 0, "tokens_stored": 0,
                    "slots_allocated": 0, "waste_pct": 0.0, "bytes_allocated": 0, "bytes_reserved": 0}
        layers = [layer for layer in self.layers if layer.is_initialized]
        # one block's K + V bytes per layer, from the shape (no tensor view per layer: this runs once per call)
        per_block = sum(2 * (layer.keys.numel() // layer.keys.shape[0]) * layer.keys.element_size()
                        for layer in layers)
        slots = m.num_allocated_blocks * self.block_size
        # per sequence (a shared prefix counts once per sequence)
        if length is not None:
            length = _integer(length, "memory_stats' length")
        tokens = (m.tokens_stored() if length is None
                  else sum(min(m.length(s), max(length, 0)) for s in self.seq_ids))
        fill: dict[int, int] = {}  # physical fill of each block, for the waste figure
        for s in self.seq_ids:
            n = m.length(s) if length is None else min(m.length(s), max(int(length), 0))
            for i, b in enumerate(m.block_table(s)):
                fill[b] = max(fill.get(b, 0), min(self.block_size, n - i * self.block_size))
        used = sum(fill.values())
        return {
            "blocks_allocated": m.num_allocated_blocks,
            "num_blocks": m.num_blocks,
            "tokens_stored": tokens,
            "slots_allocated": slots,
            "waste_pct": 100.0 * (slots - used) / slots if slots else 0.0,
            "bytes_allocated": m.num_allocated_blocks * per_block,
            "bytes_reserved": m.num_blocks * per_block,
        }


def _integer(value, what: str) -> int:
    """``value`` as an int: a Python int (or anything with ``__index__``) or a one-element integer tensor."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{what} must be an int or a one-element integer tensor, got a {value.dtype} "
                             f"tensor of shape {tuple(value.shape)}")
        return int(value.item())
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an int, got {value!r}") from None


def _row_indices(indices, what: str) -> list[int]:
    """Row indices from a 1-D integer tensor (or a list of ints); ValueError for bool or float values."""
    if isinstance(indices, torch.Tensor):
        if indices.dim() != 1 or indices.dtype.is_floating_point or indices.dtype.is_complex \
                or indices.dtype == torch.bool:
            raise ValueError(f"{what} must be a 1-D integer tensor of row indices, got a {indices.dtype} tensor "
                             f"of shape {tuple(indices.shape)}")
        return [int(i) for i in indices.tolist()]
    if not isinstance(indices, (list, tuple, range)):
        raise ValueError(f"{what} must be a 1-D integer tensor (or a list) of row indices, got {indices!r}")
    return [_integer(i, what) for i in indices]
