"""Decode attention over a paged KV cache vs SDPA on contiguous K/V, and KV memory of 64 requests.

Part 1 (bandwidth): one query token per sequence, GQA 32/8, head_dim 128, bf16, at (B1, S32k),
(B16, S8k), (B64, S2k). Ours: ``paged_attention`` on block pools (block_size 16, block table a random
permutation so blocks are scattered); sdpa-flash: ``scaled_dot_product_attention`` with the flash
backend on contiguous K/V. Metric: TB/s of K+V bytes read (2*B*S*H_kv*D*2 bytes / median time) and %
of the 4.27 TB/s device-copy ceiling. A small sweep of our tiling (BLOCK_N, warps, stages, splits, block-id
chunking) runs in the same process; every configuration is checked against SDPA before it is timed. A
read-only reference kernel (``_read_kv_kernel``) loads the same K/V on the same kind of grid and only sums
it: what plain loads reach on each shape.

Timing: ``REPS`` (10) back-to-back calls are captured in one CUDA graph and the graph replayed
(``triton.testing.do_bench``, median, L2 flushed between replays); time per call = replay / ``REPS``, for
SDPA as for ours. This is how the decode step runs attention (inside a CUDA graph, next to other kernels):
an eager Python launch of a Triton kernel plus its merge kernel costs tens of microseconds of host time,
and one graph launch ~10 us, each about as long as the whole B1 S32k read. Every shape's K/V (134-537 MB)
is larger than the 50 MB L2, so consecutive calls in the graph read from HBM. ``--eager`` times single
eager calls instead (the method of the results before 2026-12-01).

Part 2 (memory): 64 requests of random lengths 100-2000 tokens (seed 0), SmolLM2-135M's KV shape
(30 layers, 3 KV heads, head_dim 64, bf16): bytes allocated by a PagedCache's blocks vs a padded
DynamicCache / StaticCache holding the same batch (tensors really allocated; bytes from the tensors).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import require_cuda, write_results  # noqa: E402

from hf_accel.kernels.paged_attention import paged_attention  # noqa: E402

COPY_CEILING_TBS = 4.27
SHAPES = [(1, 32768), (16, 8192), (64, 2048)]
H, H_KV, D, BLOCK = 32, 8, 128, 16
REPS = 10  # calls per captured graph


@triton.jit
def _read_kv_kernel(KC, VC, BlockTable, Out, stride_kb, stride_ks, stride_kh, stride_tb, num_kv_heads,
                    tokens_per_split, seq_len, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, PAGED: tl.constexpr):
    """Read-only reference: streams every K and V element the decode kernel reads, on the same grid
    (sequence x KV head, split), and only sums them. Paged: through the block table as ``paged_attention``
    addresses them; contiguous: K/V as [B, H_kv, S, D]. Its TB/s is what plain loads on this grid reach."""
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = pid_bh // num_kv_heads
    h = pid_bh % num_kv_heads
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    start = pid_s * tokens_per_split
    end = tl.minimum(seq_len, start + tokens_per_split)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if PAGED:
            phys = tl.load(BlockTable + b * stride_tb + offs_n // BLOCK_SIZE).to(tl.int64)
            ptr = (phys[:, None] * stride_kb + (offs_n % BLOCK_SIZE)[:, None] * stride_ks + h * stride_kh
                   + offs_d[None, :])
        else:
            ptr = (pid_bh.to(tl.int64) * seq_len + offs_n.to(tl.int64))[:, None] * HEAD_DIM + offs_d[None, :]
        acc += tl.load(KC + ptr).to(tl.float32) + tl.load(VC + ptr).to(tl.float32)
    tl.store(Out + (pid_bh * tl.num_programs(1) + pid_s) * HEAD_DIM + offs_d, tl.sum(acc, 0))


def b1_case(S: int, seed: int):
    """Batch-1 decode inputs at KV length ``S`` on the GPU: GQA ``H``/``H_KV``, head_dim ``D``, bf16 pools of
    ``BLOCK``-token blocks in a random order (``randperm`` block table). Returns (k_cache, v_cache, table,
    seq_lens, q)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    nb = S // BLOCK
    k_cache = torch.randn(nb, BLOCK, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v_cache = torch.randn(nb, BLOCK, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    table = torch.randperm(nb, device="cuda", generator=g).view(1, nb).int()
    seq_lens = torch.full((1,), S, dtype=torch.int32, device="cuda")
    q = torch.randn(1, H, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return k_cache, v_cache, table, seq_lens, q


def contiguous_kv(k_cache, v_cache, table, S):
    """The K/V of a :func:`b1_case` as contiguous [1, H_KV, S, D] tensors."""
    k = k_cache[table.long()].reshape(1, S, H_KV, D).transpose(1, 2).contiguous()
    v = v_cache[table.long()].reshape(1, S, H_KV, D).transpose(1, 2).contiguous()
    return k, v


def sdpa_reference(q, k, v):
    """float32 SDPA of one query token over contiguous K/V, as [1, 1, H, D] (``paged_attention``'s output layout)."""
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True).transpose(1, 2)


def read_only_call(k_cache, v_cache, block_table, S, splits, k=None, v=None):
    """A zero-argument launch of :func:`_read_kv_kernel` (BLOCK_N 64, 4 warps, 3 stages) on the grid of
    ``paged_attention`` with about ``splits`` KV splits of whole 64-key tiles: through the block table, or from the
    contiguous [B, H_kv, S, D] ``k`` / ``v`` when given. Returns (launch, splits used)."""
    B, H_kv, D = block_table.shape[0], k_cache.shape[2], k_cache.shape[3]
    tps = triton.cdiv(triton.cdiv(S, splits), 64) * 64
    ns = triton.cdiv(S, tps)
    out = torch.empty(B * H_kv * ns * D, device=k_cache.device, dtype=torch.float32)
    paged = k is None
    kc, vc = (k_cache, v_cache) if paged else (k, v)

    def launch():
        _read_kv_kernel[(B * H_kv, ns)](
            kc, vc, block_table, out, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_table.stride(0), H_kv, tps, S, BLOCK_N=64, HEAD_DIM=D, BLOCK_SIZE=k_cache.shape[1],
            PAGED=paged, num_warps=4, num_stages=3)

    return launch, ns


def read_ceiling(k_cache, v_cache, block_table, k, v, S, time_ms, splits_options):
    """Best TB/s of :func:`_read_kv_kernel` over ``splits_options`` (BLOCK_N 64, 4 warps), paged and contiguous."""
    nbytes = 2 * k.numel() * k.element_size()
    best = {}
    for paged in (True, False):
        for splits in splits_options:
            launch, ns = read_only_call(k_cache, v_cache, block_table, S, splits,
                                        *((None, None) if paged else (k, v)))
            ms = time_ms(launch)
            tbs = nbytes / (ms * 1e-3) / 1e12
            key = "paged" if paged else "contiguous"
            if key not in best or tbs > best[key][0]:
                best[key] = (tbs, ns, ms)
    return best


def capture_calls(fn, reps: int = REPS) -> torch.cuda.CUDAGraph:
    """``reps`` back-to-back calls of ``fn`` captured in one CUDA graph, after one eager warm-up call."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph


def _timer(eager: bool):
    import triton.testing as tt

    def time_ms(fn):
        if eager:
            return tt.do_bench(fn, warmup=25, rep=100)
        return tt.do_bench(capture_calls(fn).replay, warmup=10, rep=100) / REPS

    return time_ms


def parse_variants(text):
    """``'NAME=VALUE[,NAME=VALUE...];...'`` -> list of {NAME: value} settings of
    :mod:`hf_accel.kernels.paged_attention` module constants (value ``None``, an int, or a string). ValueError
    for a name the module does not have or an item without ``=``."""
    import hf_accel.kernels.paged_attention as pa

    variants = []
    for group in filter(None, (text or "").split(";")):
        setting = {}
        for item in group.split(","):
            name, sep, value = item.partition("=")
            if not sep or not name.isupper() or not hasattr(pa, name):
                raise ValueError(f"--variants item {item!r}: expected NAME=VALUE with NAME a constant of "
                                 f"hf_accel.kernels.paged_attention (e.g. MERGE_WARPS=None)")
            setting[name] = None if value == "None" else int(value) if value.lstrip("-").isdigit() else value
        variants.append(setting)
    return variants


def timed_with(settings, fn):
    """``fn()`` with the :mod:`hf_accel.kernels.paged_attention` constants of ``settings`` set, restored after."""
    import hf_accel.kernels.paged_attention as pa

    saved = {name: getattr(pa, name) for name in settings}
    try:
        for name, value in settings.items():
            setattr(pa, name, value)
        return fn()
    finally:
        for name, value in saved.items():
            setattr(pa, name, value)


def bench_bandwidth(rows, quick=False, eager=False, configs=None, shapes=SHAPES, variants=()):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    time_ms = _timer(eager)

    table = []
    for B, S in shapes:
        g = torch.Generator(device="cuda").manual_seed(B * 100003 + S)
        blocks_per_seq = S // BLOCK
        num_blocks = B * blocks_per_seq
        k_cache = torch.randn(num_blocks, BLOCK, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v_cache = torch.randn(num_blocks, BLOCK, H_KV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        block_table = torch.randperm(num_blocks, device="cuda", generator=g).view(B, blocks_per_seq).int()
        seq_lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
        q = torch.randn(B, H, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
        # The same K/V, contiguous per sequence, for SDPA: [B, H_kv, S, D].
        k = k_cache[block_table.long()].reshape(B, S, H_KV, D).transpose(1, 2).contiguous()
        v = v_cache[block_table.long()].reshape(B, S, H_KV, D).transpose(1, 2).contiguous()
        nbytes = 2 * B * S * H_KV * D * 2
        shape = {"B": B, "H": H, "H_kv": H_KV, "L": 1, "S": S, "D": D, "block_size": BLOCK, "dtype": "bfloat16"}

        with sdpa_kernel(SDPBackend.MATH):
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
        ref = ref.transpose(1, 2)  # [B, 1, H, D]

        def record(provider, ms, extra=None):
            tbs = nbytes / (ms * 1e-3) / 1e12
            rows.append({"bench": "decode", "provider": provider, "shape": {**shape, **(extra or {})},
                         "metric": "kv_bandwidth", "unit": "TB/s", "value": tbs})
            rows.append({"bench": "decode", "provider": provider, "shape": {**shape, **(extra or {})},
                         "metric": "pct_of_copy_ceiling", "unit": "%", "value": 100 * tbs / COPY_CEILING_TBS})
            rows.append({"bench": "decode", "provider": provider, "shape": {**shape, **(extra or {})},
                         "metric": "latency", "unit": "us", "value": ms * 1e3})
            return tbs

        for backend, name in ((SDPBackend.FLASH_ATTENTION, "sdpa-flash"), (SDPBackend.CUDNN_ATTENTION, "sdpa-cudnn")):
            try:
                with sdpa_kernel(backend):
                    fn = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
                    err = (fn().transpose(1, 2).float() - ref).abs().max().item()
                    assert err < 2e-2, f"{name} error {err}"
                    ms = time_ms(fn)
                table.append((B, S, name, "", record(name, ms)))
            except (RuntimeError, AssertionError) as e:
                print(f"{name} unavailable at B{B} S{S}: {str(e).splitlines()[0][:120]}")

        splits_options = (16, 32, 64, 128) if B == 1 else (1, 2, 3, 4, 6)
        for key, (tbs, ns, ms) in read_ceiling(k_cache, v_cache, block_table, k, v, S, time_ms,
                                               splits_options).items():
            record(f"read-only-{key}", ms, {"config": f"splits{ns}"})
            table.append((B, S, f"read-only ({key})", f"splits{ns}", tbs))

        best = None
        if configs is None:
            configs = [(64, 4, 3, None, None)] if quick else list(itertools.product(
                (64,), (4,), (2, 3), (None, 2, 4, 32, 64), (None, 0)))
        for block_n, warps, stages, splits, *rest in configs:
            extra = rest[1] if len(rest) > 1 else {}
            chunk = rest[0] if rest else None  # chunk_tokens (0: block ids loaded by each tile)
            kw = dict(num_splits=splits, block_n=block_n, num_warps=warps, num_stages=stages)
            if chunk is not None:
                kw["chunk_tokens"] = chunk
            kw.update({k: bool(v) for k, v in extra.items() if k in ("pdl", "trigger", "preload_kv")})
            for key in ("split_multiple", "block_m"):
                if extra.get(key):
                    kw[key] = extra[key]
            if extra.get("merge"):
                kw["merge_counters"] = torch.zeros(B * H_KV, dtype=torch.int32, device="cuda")
            try:
                out = paged_attention(q, k_cache, v_cache, block_table, seq_lens, S, **kw)
            except Exception as e:  # a tiling the compiler rejects (e.g. out of shared memory)
                print(f"config {kw} failed: {type(e).__name__}")
                continue
            err = (out.float() - ref).abs().max().item()
            assert err < 2e-2, f"ours {kw} error {err}"
            ms = time_ms(lambda: paged_attention(q, k_cache, v_cache, block_table, seq_lens, S, check_blocks=False,
                                                 **kw))
            tag = f"n{block_n}w{warps}s{stages}{'-splits' + str(splits) if splits else ''}"
            if chunk is not None:
                tag += f"-chunk{chunk}" if chunk else "-ids-in-loop"
            tag += "".join(f"-{k}{v}" for k, v in extra.items())
            tbs = record("ours-sweep", ms, {"config": tag})
            print(f"B{B} S{S} {tag:34} {tbs:6.2f} TB/s", flush=True)
            if best is None or tbs > best[0]:
                best = (tbs, tag, ms)
        def default_call():
            return paged_attention(q, k_cache, v_cache, block_table, seq_lens, S, check_blocks=False)

        ms = time_ms(default_call)
        table.append((B, S, "ours (default)", "", record("ours", ms)))
        if variants:
            # module-constant variants of the default call, each checked, then the default again (drift)
            for setting in variants:
                tag = ",".join(f"{k}={v}" for k, v in setting.items())
                err = timed_with(setting, lambda: (default_call().float() - ref).abs().max().item())
                assert err < 2e-2, f"ours {tag} error {err}"
                ms = timed_with(setting, lambda: time_ms(default_call))
                table.append((B, S, "ours (variant)", tag, record("ours-variant", ms, {"config": tag})))
            ms = time_ms(default_call)
            table.append((B, S, "ours (default, again)", "", record("ours-again", ms)))
        if best:
            table.append((B, S, "ours (best of sweep)", best[1], best[0]))
            rows.append({"bench": "decode", "provider": "ours-best", "shape": {**shape, "config": best[1]},
                         "metric": "kv_bandwidth", "unit": "TB/s", "value": best[0]})
        k_cache = v_cache = k = v = None  # frees the memory; not `del`: the lambdas above close over these names
        torch.cuda.empty_cache()
    return table


def bench_memory(rows):
    from transformers import DynamicCache, LlamaConfig, StaticCache

    from hf_accel.cache import BlockManager

    layers, h_kv, d, elt = 30, 3, 64, 2
    cfg = LlamaConfig(hidden_size=576, num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=h_kv,
                      head_dim=d, intermediate_size=1536, vocab_size=49152)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(100, 2001, (64,), generator=g).tolist()
    tokens = sum(lengths)
    max_len = max(lengths)
    token_bytes = 2 * layers * h_kv * d * elt  # K+V, all layers
    out = {}
    # PagedCache's block manager: each request gets ceil(len / 16) blocks; pools sized to what is allocated.
    m = BlockManager(num_blocks=sum(-(-n // BLOCK) for n in lengths) + 64, block_size=BLOCK)
    for n in lengths:
        m.allocate(n)
    m.check()
    out["paged"] = m.num_allocated_blocks * BLOCK * token_bytes
    # Padded batch: DynamicCache holding [64, h_kv, max_len, d] per layer (a left-padded batch).
    dyn = DynamicCache()
    before = torch.cuda.memory_allocated()
    for layer in range(layers):
        kv = torch.randn(64, h_kv, max_len, d, device="cuda", dtype=torch.bfloat16)
        dyn.update(kv, kv.clone(), layer)
        del kv
    out["dynamic"] = sum(ly.keys.numel() * elt + ly.values.numel() * elt for ly in dyn.layers)
    measured_dyn = torch.cuda.memory_allocated() - before
    del dyn
    torch.cuda.empty_cache()
    st = StaticCache(config=cfg, max_cache_len=max_len)
    kv = torch.randn(64, h_kv, 1, d, device="cuda", dtype=torch.bfloat16)
    for layer in range(layers):
        try:
            st.update(kv, kv, layer, {"cache_position": torch.zeros(1, dtype=torch.long, device="cuda")})
        except TypeError:
            st.update(kv, kv, layer)
    out["static"] = sum(ly.keys.numel() * elt + ly.values.numel() * elt for ly in st.layers)
    del st
    used = tokens * token_bytes
    shape = {"model": "smollm2-135m", "requests": 64, "len_min": 100, "len_max": 2000, "block_size": BLOCK,
             "tokens": tokens, "dtype": "bfloat16"}
    table = []
    for name, provider in (("paged", "ours-paged"), ("dynamic", "hf-dynamic-padded"), ("static", "hf-static-padded")):
        waste = 100 * (out[name] - used) / out[name]
        rows.append({"bench": "kv_memory", "provider": provider, "shape": shape, "metric": "kv_bytes",
                     "unit": "bytes", "value": out[name]})
        rows.append({"bench": "kv_memory", "provider": provider, "shape": shape, "metric": "waste_pct",
                     "unit": "%", "value": waste})
        table.append((provider, out[name], waste))
    rows.append({"bench": "kv_memory", "provider": "hf-dynamic-padded", "shape": shape,
                 "metric": "cuda_memory_allocated_delta", "unit": "bytes", "value": measured_dyn})
    return table, used


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="no tiling sweep")
    ap.add_argument("--eager", action="store_true", help="time eager calls instead of CUDA-graph replays")
    ap.add_argument("--skip-memory", action="store_true", help="bandwidth part only")
    ap.add_argument("--shapes", default=None, help="only these (B, S): 'BxS,...', e.g. '1x32768'")
    ap.add_argument("--configs", default=None,
                    help="sweep only these: 'block_n,warps,stages,splits|None[,chunk_tokens][,key=int...];...' "
                         "with keys pdl, trigger, preload_kv (0/1: PDL launches between the graph's calls), "
                         "merge (1: splits merged in the kernel), split_multiple (keys per split rounded to it), "
                         "block_m (query rows per program)")
    ap.add_argument("--variants", default=None,
                    help="also time the default call with these settings of hf_accel.kernels.paged_attention's "
                         "constants, then the default again: 'NAME=VALUE[,NAME=VALUE];...', e.g. "
                         "'MERGE_WARPS=None;MERGE_WARPS=None,MERGE_PDL_TRIGGER=after_wait'")
    args = ap.parse_args()
    variants = parse_variants(args.variants)
    configs = None
    if args.configs:
        configs = []
        for c in args.configs.split(";"):
            items = c.split(",")
            pos = [None if v == "None" else int(v) for v in items if "=" not in v]
            extra = {k: int(v) for k, v in (item.split("=") for item in items if "=" in item)}
            configs.append(tuple(pos + ([None] if len(pos) < 5 else []) + [extra]) if extra else tuple(pos))
    require_cuda(__file__)
    rows = []
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in x.split("x")) for x in args.shapes.split(",")]
    table = bench_bandwidth(rows, quick=args.quick, eager=args.eager, configs=configs, shapes=shapes,
                            variants=variants)
    meta = {"timing": "eager" if args.eager else "cuda_graph", "variants": args.variants}
    if args.skip_memory:
        write_results("bench_decode", rows, meta)
        for B, S, prov, cfg, tbs in table:
            print(f"B{B:<3}S{S:<9}{prov:24}{cfg:22}{tbs:8.2f}{100 * tbs / COPY_CEILING_TBS:8.1f}")
        return
    mem, used = bench_memory(rows)
    write_results("bench_decode", rows, meta)
    print(f"\n{'shape':14}{'provider':24}{'config':22}{'TB/s':>8}{'% ceil':>8}")
    for B, S, prov, cfg, tbs in table:
        print(f"B{B:<3}S{S:<9}{prov:24}{cfg:22}{tbs:8.2f}{100 * tbs / COPY_CEILING_TBS:8.1f}")
    print(f"\nKV memory, 64 requests, {used / 2**20:.1f} MiB of tokens:")
    for prov, nbytes, waste in mem:
        print(f"  {prov:20} {nbytes / 2**20:9.1f} MiB  waste {waste:5.2f}%")


if __name__ == "__main__":
    main()
