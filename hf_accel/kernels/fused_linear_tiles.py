"""Tile choices of :func:`~hf_accel.kernels.fused_linear.fused_linear` / ``fused_linear_rope``: the K-loop path's
tiles (from H200 sweeps), whether the whole-K path fits a GPU's shared memory and its column chunks, and a
split-K count for a target grid size. Host-side only (no kernels); the measurements behind each choice are in
the docstrings.
"""

from __future__ import annotations

import functools

import torch
import triton

#: Most token rows the K-loop path takes (one row tile: every weight is read once). Larger inputs belong to
#: cuBLAS, whose tensor-core tiles win once the matmul is no longer a pure weight stream.
MAX_ROWS = 32

#: Most token rows the whole-K path (``whole_k``) takes: rows run in blocks of :data:`WHOLE_K_BLOCK_M`, one
#: program per (output tile, row block), each block after the first reading the weights from L2.
WHOLE_K_MAX_ROWS = 128


def max_rows(whole_k: bool) -> int:
    """Most input rows :func:`fused_linear` / :func:`fused_linear_rope` take on the path ``whole_k`` selects."""
    return WHOLE_K_MAX_ROWS if whole_k else MAX_ROWS

#: Widest input that takes the small-layer tiles of :func:`_tiles` (what the H200 sweep measured).
SMALL_K = 2048


def _tiles(rows: int, n: int, k: int, norm: bool, swiglu: bool, block_n: int | None, block_k: int | None,
           num_warps: int | None, num_stages: int | None, small_tiles: bool = False):
    """Tiles from the H200 sweep (``benchmarks/results/bench_fused_linear-20261201.json``, bf16, times inside
    CUDA graphs): 256-wide K steps won every shape (SmolLM2 qkv 5.2 vs 7.0 us at 128); 32 output rows per
    program, 64 from 16k outputs (LM heads); 5 pipeline stages for plain matmuls, 3 with the norm prologue
    (SmolLM2 down 5.0 vs 5.4 us; Llama-3-8B q/k/v 29.3 vs 39.7 us at 32 rows per program).

    Tried and removed: the whole K (<= 1024) in one tile of 16 output rows, its weights loaded before the
    PDL wait. SmolLM2 bs16 decode fell to 11955 tok/s from 17547 and prompt lookup's passage speedup to
    1.14x from 1.72x (``bench_generate-single-k-20261201-f3989d4.json``,
    ``bench_speculative-single-k-20261201-f3989d4.json``, against the runs at c910fbb / 9d7e918).

    ``small_tiles`` (off by default): inputs up to :data:`SMALL_K` wide (outputs < 16k) take the tiles of a
    second sweep, with PDL, 16 rows, 30 layers' weights in one graph (SmolLM2 shapes; ``bench_fused_linear
    --pdl``): plain matmuls 16 outputs per program and one warp, gate/up + SwiGLU 128-wide K steps and 2 warps;
    q/k/v with the norm keep 32 x 256 and 4 warps. A layer's four matmuls alone: 19.6 vs 22.7 us at 16 rows
    (``bench_fused_linear-pdl-20261201-26dae0b.json``). Inside the decode step they lost: SmolLM2 verify
    forward of 16 tokens 0.877 vs 0.836 ms, of 2 tokens 0.887 vs 0.800 (random SmolLM2-shaped weights,
    ``profile_verify_tiles-20261201-26dae0b.json``); bs16 decode 16513 vs 18104 tok/s
    (``bench_generate-smollm2-20261201-26dae0b.json``).

    A coordinate search inside the step (one tile parameter of one projection changed at a time: block_n, block_k,
    num_warps, num_stages; SmolLM2-shaped random weights, ``profile_verify_switches-20261202-f792bb3.json``) found
    no change faster by more than 1% on both the 16-token verify forward (0.835 ms) and the bs16 step (0.893 ms)."""
    block_m = 16 if rows <= 16 else 32  # tl.dot's smallest M is 16; rows <= MAX_ROWS
    small = small_tiles and k <= SMALL_K and n < 16384
    if block_k is None:
        block_k = 128 if small and swiglu else (256 if k >= 256 else max(16, triton.next_power_of_2(k)))
    if block_n is None:
        block_n = 64 if n >= 16384 else (16 if small and not norm else 32)
    if num_warps is None:
        num_warps = (4 if norm and not swiglu else 2 if norm else 1) if small else 4
    if num_stages is None:
        num_stages = 3 if norm or small else 5
    return block_m, block_n, block_k, num_warps, num_stages


#: Widest input the whole-K path takes (``whole_k`` of :func:`fused_linear`): the program's weight rows and
#: input rows sit in registers at once.
WHOLE_K_MAX = 4096
#: Narrowest input it takes: its first column chunk is a full ``tl.dot`` K of 16, loaded without a column mask
#: (narrower inputs read past each row and wrote past the residual output's end).
WHOLE_K_MIN = 16

#: Input rows per program of the whole-K path: more rows run as more programs (a third grid dimension), each
#: loading the same weight rows (the second time from L2), since 32 input rows of a whole K do not fit the
#: registers: H200, SmolLM2-shaped verify forwards of 17 / 32 tokens took 2.82 / 7.28 ms with 32-row programs
#: (``profile_step_splits-max-rows-20261203-4924036.json``). With 16-row blocks see
#: :data:`~hf_accel.engine.step_switches.FUSED_LINEAR_MAX_ROWS` (the decode step sends more rows to cuBLAS).
WHOLE_K_BLOCK_M = 16


#: Shared memory per block (bytes, opt-in) of the GPU the whole-K path was measured and tested on in fp16/bf16
#: (H200, inputs up to :data:`WHOLE_K_MAX` wide); GPUs with less keep the K loop for 16-bit inputs.
WHOLE_K_MIN_SHARED_MEMORY = 232448


@functools.lru_cache(maxsize=None)
def _shared_memory_per_block(device_index: int) -> int:
    """The limit Triton checks a compiled kernel's shared memory against at launch ("Hardware limit" of its
    OutOfResources), from Triton's driver; torch's ``shared_memory_per_block_optin`` where that is missing."""
    try:
        from triton.runtime import driver

        return int(driver.active.utils.get_device_properties(device_index)["max_shared_mem"])
    except Exception:  # noqa: BLE001 - another Triton backend or version: ask torch
        props = torch.cuda.get_device_properties(device_index)
        return int(getattr(props, "shared_memory_per_block_optin", 0))


def whole_k_fits(k: int, dtype: torch.dtype, device: torch.device | str, weight_rows: int = 32) -> bool:
    """Whether the whole-K path (``whole_k`` of :func:`fused_linear`) takes ``k`` input features of ``dtype``
    on ``device`` for programs holding ``weight_rows`` weight rows (``block_n``; twice that with SwiGLU's
    gate/up or fused_linear_rope's pairs).

    Always 16 <= ``k`` <= :data:`WHOLE_K_MAX` (16: ``tl.dot``'s smallest K, the narrowest chunk). Under Triton's
    interpreter (CPU tensors) nothing else. On a GPU, fp16/bf16 needs :data:`WHOLE_K_MIN_SHARED_MEMORY` bytes of shared memory per block (where it was tested); float32
    needs its weight and :data:`WHOLE_K_BLOCK_M` input rows over the padded K (:func:`whole_k_chunks`) in
    shared memory: on the H200 a float32 K of 1536 with 32 weight rows asked for (32 + 16) x 1536 x 4 = 294,912
    bytes of its 232,448 (Triton's OutOfResources at launch), while K 576 with 64 rows (184,320) ran."""
    if not WHOLE_K_MIN <= k <= WHOLE_K_MAX:
        return False
    device = torch.device(device)
    if device.type != "cuda":
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    available = _shared_memory_per_block(index)
    if dtype in (torch.float16, torch.bfloat16):
        return available >= WHOLE_K_MIN_SHARED_MEMORY
    if dtype == torch.float32:
        return (weight_rows + WHOLE_K_BLOCK_M) * sum(whole_k_chunks(k)) * 4 <= available
    return False


def _whole_k_tiles(rows: int, k: int, block_n: int | None, num_warps: int | None, x: torch.Tensor,
                   products: int) -> tuple[int, int, int, int, int, int, int]:
    """``(block_m, m_blocks, block_n, block_k, block_k2, num_warps, num_stages)`` of the whole-K path for ``rows``
    input rows (ValueError where :func:`whole_k_fits` is False for ``products`` x ``block_n`` weight rows): rows
    in blocks of :data:`WHOLE_K_BLOCK_M`, 32 outputs per
    program and 8 warps unless given. H200, bf16, SmolLM2 shapes, 30
    layers' weights in one graph, with PDL (``bench_fused_linear-whole-k-20261202-0c90d5b.json``): a layer's
    four matmuls at 16 rows 13.2 us with 32 outputs and 4 warps vs 21.7 with 16 outputs per program (down 3.8
    vs 9.3 us) and 22.6 with the K loop; 64 outputs 19.5. Second sweep
    (``bench_fused_linear-whole-k-warps-20261202-55561cc.json``): 32 outputs and 8 warps 11.5 us at 16 rows
    (10.3 at 2), 4 warps 13.1 (12.4), 2 warps 78.7, 64 outputs and 8 warps 11.9."""
    if not WHOLE_K_MIN <= k <= WHOLE_K_MAX:
        raise ValueError(f"whole_k takes {WHOLE_K_MIN} to {WHOLE_K_MAX} input features, got {k}; use the K loop "
                         "(whole_k=False)")
    block_n = 32 if block_n is None else block_n
    if not whole_k_fits(k, x.dtype, x.device, products * block_n):
        raise ValueError(f"whole_k does not fit {k} input features of {x.dtype} with {products * block_n} weight "
                         f"rows per program in the shared memory of {x.device} (see whole_k_fits); use the K loop "
                         "(whole_k=False).")
    block_k, block_k2 = whole_k_chunks(k)
    return (WHOLE_K_BLOCK_M, triton.cdiv(rows, WHOLE_K_BLOCK_M), block_n, block_k,
            block_k2, 8 if num_warps is None else num_warps, 1)


def whole_k_chunks(k: int) -> tuple[int, int]:
    """The two power-of-two column chunks ``(BLOCK_K, BLOCK_K2)`` the whole-K path covers ``k`` with: the
    largest power of two <= k, then the next power of two >= the rest (0 when k is a power of two), each
    at least 16 (tl.dot's smallest K). 576 -> (512, 64), 1536 -> (1024, 512), 4096 -> (4096, 0)."""
    if k < WHOLE_K_MIN:
        raise ValueError(f"the whole-K path takes at least {WHOLE_K_MIN} input features, got {k}")
    a = 1 << (k.bit_length() - 1)
    rest = k - a
    return a, (max(16, triton.next_power_of_2(rest)) if rest else 0)


def split_k_for(out_features: int, k: int, target_programs: float, rows: int = 16) -> int:
    """A ``split_k`` for :func:`fused_linear` with default tiles: about ``target_programs`` programs in all,
    at least one K tile (``block_k`` columns) per program."""
    _, block_n, block_k, _, _ = _tiles(rows, out_features, k, False, False, None, None, None, None)
    tiles = triton.cdiv(out_features, block_n)
    return max(1, min(triton.cdiv(k, block_k), round(target_programs / tiles)))
