"""Launch configurations of the prefill attention kernel (:mod:`hf_accel.kernels.prefill`) and the tuner that
picks one per call shape on the GPU.

A configuration is a tile shape (``BLOCK_M`` query rows x ``BLOCK_N`` keys), warps, pipeline stages and the
load path (TMA descriptors or pointers). :func:`tune` times each candidate of :func:`candidate_configs` on the
call's own inputs the first time a key (head_dim, dtype, causal, varlen, masks, query- and KV-length buckets)
is seen and keeps the fastest; under ``TRITON_INTERPRET=1`` or on the CPU a fixed small-tile configuration is
used instead. What each choice bought on an H200 is in :func:`hf_accel.kernels.prefill.prefill_attention`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillConfig:
    """One launch configuration of the prefill kernel (see :func:`prefill_attention` for the choices)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    use_tma: bool = True  # K/V tiles through TMA descriptors (sm_90+)
    tma_qo: bool = False  # also Q/O through descriptors (more host work per launch)
    persistent: bool = False
    reverse_m: bool = True
    warp_specialize: bool = False
    programs_per_sm: int = 0  # persistent grid: programs per SM (0: 2 for <= 4 warps, else 1)
    ablate: int = 0  # benchmark-only stage removal (wrong results); 0 in production

    def short(self) -> str:
        s = f"M{self.block_m}N{self.block_n}w{self.num_warps}s{self.num_stages}"
        s += ("-tma4" if self.tma_qo else "-tma") if self.use_tma else "-ptr"
        if self.persistent:
            s += "-pers"
        if not self.reverse_m:
            s += "-fwd"
        if self.warp_specialize:
            s += "-ws"
        if self.ablate:
            s += f"-ablate{self.ablate}"
        return s


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def candidate_configs(head_dim: int, q_bucket: int, dtype: torch.dtype) -> list[PrefillConfig]:
    """The tuner's search space, by head_dim and dtype (``q_bucket``, the query-length bucket, no longer changes it).

    The candidates of one key give bitwise the same output: the same tile shape and warps, so every query row
    folds the same key tiles in the same order; they differ only in the load path (TMA / pointers). A choice
    between tiles whose outputs differ would make results, and greedy tokens after a bf16 near-tie, depend on the
    timing noise of the process that tuned: on an H100 the choice for one key moved between 64x32 and 32x64 tiles
    (SmolLM2, 48-64-token prompts) and between 64x64 and 128x128/8-warp tiles (Llama-3-8B shape, 256 tokens) from
    one process to the next, and those tiles' outputs differ by up to 0.0039
    (``benchmarks/results/probe_prefill_tuner-process*-h100-20261206-87bf69e.json``). Even 32 instead of 64 query
    rows per program changed head_dim-128 outputs by an ulp (not head_dim 64), so 32-row tiles are left out too
    (float32's candidates were 64x32 and 32x32). Given up for this: 64x128 at head_dim 64 (a SmolLM2 layer 266
    against 251 TFLOP/s for 64x64 on an H200) and 128x128 / 8 warps at head_dim 128 (the tuner's pick at 16k
    tokens; 453 against 492 TFLOP/s at B4 L4k, docs/prefill.md)."""
    C = PrefillConfig
    if dtype == torch.float32:  # fp32 tiles are twice the bytes
        return [C(64, 32, 4, 2), C(64, 32, 4, 2, use_tma=False)]
    if head_dim <= 128:
        return [C(64, 64, 4, 3), C(64, 64, 4, 3, use_tma=False)]
    return [C(64, 64, 4, 2), C(64, 64, 4, 2, use_tma=False)]


def default_interpret_config(head_dim: int, q_len: int) -> PrefillConfig:
    # Interpreter: small tiles keep numpy fast and still exercise several blocks per loop.
    bm = 16 if q_len <= 16 else 32
    return PrefillConfig(bm, 32, 4, 1, use_tma=False, reverse_m=True)


TUNED: dict[tuple, PrefillConfig] = {}


def next_pow2(n: int) -> int:
    # plain Python: triton.next_power_of_2 / triton.cdiv cost ~25 us each on a slow host
    return 1 << (max(n, 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def bucket(n: int) -> int:
    return min(max(16, next_pow2(n)), 16384)


def tuned_configs() -> dict[tuple, PrefillConfig]:
    """What the tuner chose so far: {(head_dim, dtype, causal, varlen, masks, q_bucket, kv_bucket): config}."""
    return dict(TUNED)


def tune(launch, args: dict, key: tuple, head_dim: int, max_q: int) -> PrefillConfig:
    """Time each candidate on the call's own inputs with ``launch(**args, cfg=config)`` and keep the fastest
    for the key (:func:`tuned_configs`).

    The score is the wall time per call of back-to-back launches (median of 3 bursts): it is the GPU
    time when the GPU is the bottleneck and the host time per launch when the host is (small prompts
    on a slow host CPU), so a config with a cheaper launch wins where that is what limits.
    """
    import time

    best, best_ms = None, float("inf")
    for cfg in candidate_configs(head_dim, key[5], args["q4"].dtype):
        try:
            launch(**args, cfg=cfg)  # compile
            torch.cuda.synchronize()
            t = time.perf_counter()
            launch(**args, cfg=cfg)
            torch.cuda.synchronize()
            n = min(50, max(3, int(0.01 / max(time.perf_counter() - t, 1e-6))))
            bursts = []
            for _ in range(3):
                t = time.perf_counter()
                for _ in range(n):
                    launch(**args, cfg=cfg)
                torch.cuda.synchronize()
                bursts.append((time.perf_counter() - t) / n * 1e3)
            ms = sorted(bursts)[1]
        except Exception:  # noqa: BLE001 - e.g. out of shared memory for this tile shape
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    if best is None:
        raise RuntimeError(f"no prefill configuration compiled for key {key}")
    TUNED[key] = best
    return best
