"""PagedCache memory: block accounting, out-of-blocks, pool lifetime and growth (tiny random models, float32, CPU).

A dropped cache frees its pools; 1,000 generate calls (and a generate that raises) leave zero blocks allocated;
running out of blocks in the prefill or a decode step raises OutOfBlocksError and leaves the cache unchanged and
usable; a ``num_blocks`` larger than memory raises before anything runs; ``memory_stats`` fields (also with shared
blocks) and the CPU memory sizing; a growable cache grows and keeps its contents.
"""

from __future__ import annotations

import copy
import gc
import random
import weakref

import pytest
import torch
from paged_cache_helpers import Stepper, _assert_same_state, _state, _tokens, accelerate

import hf_accel.cache.paged_cache as paged_cache_mod
import hf_accel.integrations.generate as gen_mod
from hf_accel import accelerate_model
from hf_accel.cache import OutOfBlocksError, PagedCache
from hf_accel.integrations.generate import CACHE_KWARG, last_cache_stats


# --- cache lifetime --------------------------------------------------------------------------------------


def test_dropping_cache_frees_its_pools(tiny):
    model = accelerate(tiny.model("llama"))
    ids, mask = tiny.batch(seed=1)
    s = Stepper(model, PagedCache(model.config, num_blocks=30, block_size=4), ids, mask)
    s.step(_tokens(1, 3, 1))
    pools = [weakref.ref(t) for layer in s.cache.layers for t in (layer.keys, layer.values)]
    cache = weakref.ref(s.cache)
    del s
    gc.collect()
    assert cache() is None
    assert all(p() is None for p in pools), "K/V pools still referenced after the cache was dropped"


def test_out_of_blocks_on_first_forward_leaves_cache_reusable(tiny):
    model = accelerate(tiny.model("llama"))
    ids, mask = tiny.batch(seed=1)  # 3 rows of 11 tokens: 9 blocks of 4
    cache = PagedCache(model.config, num_blocks=4, block_size=4)
    with pytest.raises(OutOfBlocksError):
        Stepper(model, cache, ids, mask)
    assert cache.seq_ids == []
    s = Stepper(model, cache, ids[:1], mask[:1])  # 3 blocks: fits
    assert cache.memory_stats()["blocks_allocated"] == 3 and s.logits.shape[0] == 1


@pytest.mark.parametrize("path", ["stock", "accelerated"])
def test_num_blocks_larger_than_memory_raises_before_anything_runs(path, tiny, monkeypatch):
    """PagedCache(num_blocks=10**12): pools of thousands of TiB. A clear ValueError comes before any pool or block
    list is made (before, the block manager's list of 10**12 free ids ran out of host memory), and on the fast
    path before decoding (it fills the caller's cache at the end, after the whole answer)."""
    model = tiny.model("llama")
    if path == "accelerated":
        model = accelerate_model(model)
        steps = []
        monkeypatch.setattr(gen_mod, "_run_fast", lambda *a, **k: steps.append(1))
    ids, mask = tiny.batch(seed=1)
    cache = PagedCache(model.config, num_blocks=10**12)
    with pytest.raises(ValueError, match=r"PagedCache\(num_blocks=1000000000000, block_size=16\): its pools take "
                                         r"[0-9.]+ GiB .* has [0-9.]+ GiB free"), torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=tiny.PAD,
                       **{CACHE_KWARG: cache})
    assert cache.manager is None and not any(layer.is_initialized for layer in cache.layers)
    if path == "accelerated":
        assert steps == []
    small = PagedCache(model.config, num_blocks=64)  # a size that fits is unaffected
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=tiny.PAD,
                       **{CACHE_KWARG: small})
    assert small.get_seq_length() > 0


# --- 1,000 generate calls leave zero blocks allocated -----------------------------------------------


def _assert_all_empty(caches, call):
    for cache in caches:
        stats = cache.memory_stats()
        assert stats["blocks_allocated"] == 0 and stats["tokens_stored"] == 0, f"call {call}: {stats}"
        assert cache.manager is None or cache.manager.num_free_blocks == cache.manager.num_blocks
        assert cache.seq_ids == [] and all(layer.length == 0 for layer in cache.layers)


@pytest.mark.parametrize("loop", ["transformers", "default"])
def test_thousand_generate_calls_leave_zero_blocks(loop, tiny, monkeypatch, one_thread):
    model = accelerate(tiny.model("llama", num_hidden_layers=1, hidden_size=32, intermediate_size=32), loop)
    alive = weakref.WeakSet()  # every PagedCache made, by whichever path generate takes
    init = PagedCache.__init__

    def recording_init(self, *a, **kw):
        init(self, *a, **kw)
        alive.add(self)

    monkeypatch.setattr(PagedCache, "__init__", recording_init)
    rng = random.Random(0)
    for i in range(1000):
        lengths = tuple(rng.randint(1, 8) for _ in range(rng.randint(1, 3)))
        ids, mask = tiny.batch(seed=i, lengths=lengths)
        new = rng.randint(2, 3)
        out = tiny.greedy(model, ids, mask, new)
        assert out.shape == (len(lengths), max(lengths) + new)
        assert len(alive) >= 1
        _assert_all_empty(alive, i)
        used = last_cache_stats(model)
        assert used["blocks_allocated"] > 0
        if loop == "transformers":
            assert used["tokens_stored"] == len(lengths) * (max(lengths) + new - 1)
        assert paged_cache_mod._active.step is None
    if loop == "transformers":
        gc.collect()
        assert len(alive) == 0, f"{len(alive)} PagedCache objects still referenced after generate returned"


@pytest.mark.parametrize("how", ["greedy", "sampling", "processor", "speculative"])
def test_fast_path_stats_count_the_tokens_written_not_the_reservation(how, tiny):
    """The fast decode path reserves the whole answer (max_new_tokens) up front; its stats count the tokens the call
    left in the cache, as transformers' loop on a PagedCache does (prompt + new tokens - 1 per row), with the
    reserved blocks still counted as allocated. They used to count every reserved slot (near-zero waste)."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class Keep(LogitsProcessor):  # runs the call through transformers' logits-processor path
        def __call__(self, input_ids, scores):
            return scores

    base = tiny.model("llama", num_hidden_layers=1)
    ids, mask = tiny.batch(seed=2)
    free = tiny.greedy(base, ids, mask, 6)
    eos = sorted({int(t) for t in free[:, ids.shape[1] + 2]})  # every row ends by its 3rd new token
    kw = dict(max_new_tokens=100, eos_token_id=eos)
    if how == "sampling":
        kw.update(do_sample=True, top_k=1)  # sampling loop, greedy outcome
    elif how == "processor":
        kw["logits_processor"] = LogitsProcessorList([Keep()])
    stats = {}
    for loop in ("transformers", "default"):
        model = accelerate(copy.deepcopy(base), loop,
                           **({"speculative": "prompt_lookup"} if how == "speculative" and loop == "default" else {}))
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, pad_token_id=tiny.PAD, **kw)
        stats[loop] = (out, last_cache_stats(model))
    (want_out, want), (got_out, got) = stats["transformers"], stats["default"]
    assert torch.equal(got_out, want_out)
    assert got["tokens_stored"] == want["tokens_stored"] == ids.shape[0] * (got_out.shape[1] - 1)
    assert got_out.shape[1] - ids.shape[1] < 100  # stopped early: most of the reservation is empty
    assert got["slots_allocated"] >= ids.shape[0] * (ids.shape[1] + 100)
    assert got["waste_pct"] > 50


def test_fast_path_stats_count_the_scratch_block(tiny):
    """A 2-token answer to a 1-token prompt on the fast path: one block reserved for the row plus the call's scratch
    block (padded rows write there) are allocated, 2 tokens stored: 30 of 32 slots empty (README's example)."""
    model = accelerate(tiny.model("llama", num_hidden_layers=1), "default")
    ids, mask = tiny.batch(seed=4, lengths=(1,))
    tiny.greedy(model, ids, mask, 2)
    import hf_accel

    stats = hf_accel.last_cache_stats(model)  # the top-level export is the same function
    assert stats == last_cache_stats(model)
    assert (stats["blocks_allocated"], stats["tokens_stored"], stats["slots_allocated"]) == (2, 2, 32)
    assert stats["waste_pct"] == pytest.approx(93.75)


def test_blocks_freed_when_generate_raises(tiny, monkeypatch):
    from transformers import LogitsProcessor, LogitsProcessorList

    class Boom(LogitsProcessor):
        def __init__(self):
            self.calls = 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("boom")
            return scores

    model = accelerate(tiny.model("llama", num_hidden_layers=1))
    created = []

    class Recording(PagedCache):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            created.append(self)

    monkeypatch.setattr(gen_mod, "PagedCache", Recording)
    ids, mask = tiny.batch(seed=1)
    with pytest.raises(RuntimeError, match="boom"):
        tiny.greedy(model, ids, mask, 6, logits_processor=LogitsProcessorList([Boom()]))
    (cache,) = created
    assert cache.memory_stats()["blocks_allocated"] == 0
    assert last_cache_stats(model) is None  # a call that raised leaves no stats
    assert paged_cache_mod._active.step is None


# --- out of blocks ------------------------------------------------------------------------------------


def test_out_of_blocks_in_decode_leaves_cache_unchanged(tiny):
    model = accelerate(tiny.model("llama", seed=9))
    ids, mask = tiny.batch(seed=9, lengths=(8, 5, 2))  # width 8 = 2 blocks of 4 per row
    s = Stepper(model, PagedCache(model.config, num_blocks=6, block_size=4), ids, mask)
    before = _state(s.cache)
    with pytest.raises(OutOfBlocksError) as e:
        s.step(_tokens(10, 3, 1))
    assert (e.value.needed, e.value.available) == (3, 0)
    assert "needed 3 more block(s) of 4 tokens" in str(e.value) and "0 free of 6" in str(e.value)
    _assert_same_state(_state(s.cache), before)

    # still usable: roll back one token and decode into the free slot of the last block
    s.cache.crop(-1)
    s.crop_mask(7)
    x = _tokens(11, 3, 1)
    got = s.step(x)
    ref = Stepper(model, PagedCache(model.config, num_blocks=6, block_size=4), ids[:, :7], mask[:, :7])
    # the reference computed position 7's K/V in a prefill of 7 tokens, the cropped cache in one of 8: float32
    # rounding differs with the matmul shapes (1.0e-6 on an AMD EPYC CPU), so not to the last bit
    torch.testing.assert_close(got, ref.step(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["prefill", "decode"])
def test_out_of_blocks_in_generate(case, tiny):
    """A passed PagedCache too small for the call (transformers' loop): OutOfBlocksError naming the blocks needed and
    free; the cache is left as the call found it (empty here: the prefill's K/V are rolled back too, as on the fast
    path, which writes a passed cache only when the call ends), consistent and usable."""
    model = accelerate(tiny.model("qwen2", seed=9))
    ids, mask = tiny.batch(seed=9, lengths=(11, 6, 3) if case == "prefill" else (8, 5, 2))
    cache = PagedCache(model.config, num_blocks=4 if case == "prefill" else 6, block_size=4)
    with pytest.raises(OutOfBlocksError) as e:
        tiny.greedy(model, ids, mask, 4, **{CACHE_KWARG: cache})
    needed, available = (9, 4) if case == "prefill" else (3, 0)
    assert (e.value.needed, e.value.available) == (needed, available)
    msg = str(e.value)
    assert f"needed {needed} more block(s)" in msg and f"{available} free of {cache.manager.num_blocks}" in msg
    stats = cache.memory_stats()
    assert cache.get_seq_length() == 0 and stats["blocks_allocated"] == 0 and stats["tokens_stored"] == 0
    cache.manager.check()
    cache.release()
    assert cache.memory_stats()["blocks_allocated"] == 0


# --- memory_stats --------------------------------------------------------------------------------------


def test_memory_stats_fields(tiny):
    model = accelerate(tiny.model("llama"))  # 2 layers, 2 KV heads, head_dim 16
    cache = PagedCache(model.config, num_blocks=30, block_size=4)
    assert cache.memory_stats() == {"blocks_allocated": 0, "num_blocks": 30, "tokens_stored": 0,
                                    "slots_allocated": 0, "waste_pct": 0.0, "bytes_allocated": 0,
                                    "bytes_reserved": 0}
    ids, mask = tiny.batch(seed=1)  # width 11
    s = Stepper(model, cache, ids, mask)
    per_block = 2 * 2 * (4 * 2 * 16) * 4  # layers * (K+V) * slots * heads * d * fp32 bytes
    stats = cache.memory_stats()
    assert stats == {"blocks_allocated": 9, "num_blocks": 30, "tokens_stored": 33, "slots_allocated": 36,
                     "waste_pct": pytest.approx(100 * 3 / 36), "bytes_allocated": 9 * per_block,
                     "bytes_reserved": 30 * per_block}
    s.step(_tokens(1, 3, 1))
    stats = cache.memory_stats()
    assert (stats["blocks_allocated"], stats["tokens_stored"], stats["waste_pct"]) == (9, 36, 0.0)
    s.step(_tokens(2, 3, 1))
    assert cache.memory_stats()["blocks_allocated"] == 12
    cache.release()
    stats = cache.memory_stats()
    assert (stats["blocks_allocated"], stats["tokens_stored"], stats["bytes_allocated"]) == (0, 0, 0)
    assert stats["bytes_reserved"] == 30 * per_block  # the pools stay allocated
    assert cache.get_seq_length() == 0
    # the sizing helper counts the same bytes
    from hf_accel.cache.paged_cache import kv_block_bytes

    assert kv_block_bytes(model.config, 4, torch.float32) == per_block
    assert kv_block_bytes(model.config, 4, torch.bfloat16, num_layers=1) == per_block // 4


def test_blocks_that_fit_in_cpu_memory(monkeypatch):
    """On a CPU free memory is the system's available memory (90% of it); where it cannot be read, and on
    devices other than CPU and CUDA, nothing is checked (None)."""
    import hf_accel.cache.paged_cache as pc

    assert pc.blocks_that_fit("cpu", 2048) > 0 and pc.free_kv_bytes("cpu") > 0  # this machine's (it changes)
    monkeypatch.setattr(pc, "_available_system_memory", lambda: 10 * 2**20)
    assert pc.free_kv_bytes("cpu") == 9 * 2**20 and pc.blocks_that_fit("cpu", 2**20) == 9
    monkeypatch.setattr(pc, "_available_system_memory", lambda: None)
    assert pc.free_kv_bytes("cpu") is None and pc.blocks_that_fit("cpu", 2048) is None
    assert pc.free_kv_bytes("meta") is None


def test_cpu_memory_capped_by_process_limits(monkeypatch):
    """The CPU's available memory is the least of the machine's, the address space left under RLIMIT_AS and the
    memory left under the memory cgroup's limit (v2 files first, then v1; v1's "no limit" value ignored)."""
    import resource

    import hf_accel.cache.paged_cache as pc

    gib, page = 2**30, __import__("os").sysconf("SC_PAGE_SIZE")
    files = {"/proc/self/statm": gib // page}  # 1 GiB of address space in use
    monkeypatch.setattr(pc, "_read_int", files.get)
    monkeypatch.setattr(pc, "_machine_available_memory", lambda: 10 * gib)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert pc._process_memory_headroom() == (None, None) and pc._available_system_memory() == 10 * gib
    monkeypatch.setattr(resource, "getrlimit", lambda which: (4 * gib, resource.RLIM_INFINITY))
    assert pc._process_memory_headroom() == (3 * gib, None) and pc._available_system_memory() == 3 * gib
    files.update({"/sys/fs/cgroup/memory/memory.limit_in_bytes": 2 * gib,
                  "/sys/fs/cgroup/memory/memory.usage_in_bytes": gib // 2})
    assert pc._available_system_memory() == gib * 3 // 2  # v1 cgroup
    files.update({"/sys/fs/cgroup/memory.max": 8 * gib, "/sys/fs/cgroup/memory.current": 7 * gib})
    assert pc._process_memory_headroom() == (3 * gib, gib)  # v2 read first
    files.pop("/sys/fs/cgroup/memory.max")
    files["/sys/fs/cgroup/memory/memory.limit_in_bytes"] = 9223372036854771712  # v1's "no limit"
    assert pc._process_memory_headroom() == (3 * gib, None) and pc._available_system_memory() == 3 * gib
    monkeypatch.setattr(pc, "_machine_available_memory", lambda: None)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert pc._available_system_memory() is None


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's")
def test_cpu_memory_under_a_real_address_space_limit():
    """Under ``ulimit -v`` the CPU's free KV bytes stay below the limit (a pool sized from the machine's memory
    alone failed to allocate there: generate with a large max_new_tokens raised the allocator's error)."""
    import subprocess
    import sys

    limit = 6 * 2**30
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, ({0}, {0})); "
            "import hf_accel.cache.paged_cache as pc; print(pc.free_kv_bytes('cpu', 1.0))").format(limit)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    free = int(done.stdout.split()[-1])
    assert 0 < free < limit


def test_memory_stats_with_shared_blocks(tiny):
    model = accelerate(tiny.model("llama"))
    cache = PagedCache(model.config, num_blocks=30, block_size=4)
    ids, mask = tiny.batch(seed=1)  # width 11: 3 blocks per row, the last one 3/4 full
    Stepper(model, cache, ids, mask)
    cache.reorder_cache(torch.tensor([0, 0, 0]))  # three beams share row 0's blocks
    stats = cache.memory_stats()
    assert (stats["blocks_allocated"], stats["slots_allocated"]) == (3, 12)
    assert stats["waste_pct"] == pytest.approx(100 / 12)  # 11 tokens in 12 shared slots


# --- a growable cache ------------------------------------------------------------------------------------


def test_growable_cache_grows_and_keeps_its_contents(tiny, one_thread):
    """A growable PagedCache of 2 blocks takes a prefill and steps far past them: the pools grow (the cached
    K/V copied over), the logits equal those of a cache large enough from the start; a non-growable one
    raises OutOfBlocksError, unchanged."""
    model = accelerate(tiny.model("llama", seed=53))
    ids, mask = tiny.batch(seed=54)
    small = Stepper(model, PagedCache(model.config, num_blocks=2, block_size=4, growable=True), ids, mask)
    big = Stepper(model, PagedCache(model.config, num_blocks=80, block_size=4), ids, mask)
    for i in range(6):
        x = _tokens(55 + i, 3, 1 + i % 3)
        torch.testing.assert_close(small.step(x), big.step(x), rtol=0, atol=1e-5)
        small.cache.manager.check()
    assert small.cache.manager.num_blocks > 2
    assert small.cache.memory_stats()["num_blocks"] == small.cache.manager.num_blocks
    fixed = PagedCache(model.config, num_blocks=2, block_size=4)
    with pytest.raises(OutOfBlocksError, match="needed"):
        Stepper(model, fixed, ids, mask)
    assert fixed.memory_stats()["blocks_allocated"] == 0


@pytest.mark.parametrize("speculative", [None, "prompt_lookup", "draft_model"])
def test_a_repeated_call_reads_no_free_memory(tiny, monkeypatch, speculative):
    """The fast path's pool, made by a call, holds what the check counts for a call of that shape (the largest
    speculative lookahead included): the same call again neither reads the device's free memory nor makes a new
    pool, and gives the same tokens (with a draft model: the joint check of both pools reads it only when one must
    grow)."""
    model = tiny.model("llama", seed=3)
    if speculative == "draft_model":
        from hf_accel.speculative.config import SpeculativeConfig

        draft = copy.deepcopy(model)
        draft.model.layers = torch.nn.ModuleList(list(draft.model.layers)[:1])
        draft.config.num_hidden_layers = 1
        speculative = SpeculativeConfig(method="draft_model", draft_model=draft)
    model = accelerate_model(model, speculative=speculative)
    ids, mask = tiny.batch(seed=4)

    def greedy():  # no min_new_tokens (speculative decoding declines it)
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                              pad_token_id=tiny.PAD)

    first = greedy()
    engine = model._hf_accel_engine
    pool = engine.cache
    reads = []
    free_kv_bytes = paged_cache_mod.free_kv_bytes
    monkeypatch.setattr(paged_cache_mod, "free_kv_bytes", lambda *a, **k: reads.append(1) or free_kv_bytes(*a, **k))
    assert torch.equal(greedy(), first)
    assert not reads and engine.cache is pool
    assert (model._hf_accel_spec_stats is not None) == (speculative is not None)  # the speculative path ran


@pytest.mark.parametrize("loop", ["transformers", "default"])
@pytest.mark.parametrize("fail_at", [1, 2])
def test_last_cache_stats_is_none_after_a_call_that_raised_and_a_copy_otherwise(loop, fail_at, tiny):
    """A call that raises (here its streamer, on the prompt's put or on the first token's) leaves no stats: they
    used to stay the previous call's, or claim the whole reservation as written. Stats are a copy: changing the
    returned dict changes nothing."""
    model = accelerate(tiny.model("llama", num_hidden_layers=1), loop)
    ids, mask = tiny.batch(seed=7)
    tiny.greedy(model, ids, mask, 3)
    stats = last_cache_stats(model)
    stats["blocks_allocated"] = -1
    assert last_cache_stats(model)["blocks_allocated"] > 0

    class Fails:
        puts = 0

        def put(self, value):
            self.puts += 1
            if self.puts == fail_at:
                raise KeyboardInterrupt("stop")

        def end(self):
            pass

    with pytest.raises(KeyboardInterrupt):
        tiny.greedy(model, ids[:1], mask[:1], 6, streamer=Fails())
    assert last_cache_stats(model) is None
    tiny.greedy(model, ids, mask, 3)
    assert last_cache_stats(model)["tokens_stored"] == ids.shape[0] * (ids.shape[1] + 3 - 1)


def test_last_cache_stats_of_a_passed_paged_cache_is_none_after_a_call_that_raised(tiny):
    from hf_accel.cache import PagedCache

    model = accelerate(tiny.model("llama", num_hidden_layers=1), "transformers")
    ids, mask = tiny.batch(seed=7, lengths=(5,))
    cache = PagedCache(model.config, num_blocks=8, block_size=16)
    kwarg = tiny.cache_kwarg(model)
    out = tiny.greedy(model, ids, mask, 2, **{kwarg: cache})
    assert last_cache_stats(model)["tokens_stored"] == 6

    class Fails:
        def put(self, value):
            raise KeyboardInterrupt("stop")

        def end(self):
            pass

    with pytest.raises(KeyboardInterrupt):
        tiny.greedy(model, torch.cat([out, ids], 1), torch.ones(1, out.shape[1] + ids.shape[1], dtype=torch.long), 2,
                    **{kwarg: cache}, streamer=Fails())
    assert last_cache_stats(model) is None
