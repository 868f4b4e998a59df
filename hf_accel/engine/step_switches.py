"""The fused decode step's kernel choices: module constants that :mod:`hf_accel.engine.decode_step` reads when it
builds a step, each with the H200 measurement behind its value. Benchmarks A/B them (``--set NAME=VALUE``);
tests set them with ``monkeypatch.setattr(step_switches, NAME, value)``. A step already built (and its CUDA
graph) keeps the choices it was built with.
"""

#: Token rows (batch x q_len) up to which the fused step runs a layer's matmuls through
#: :func:`~hf_accel.kernels.fused_linear.fused_linear` (norm / SwiGLU fused in, 4 kernels) instead of
#: RMSNorm + cuBLAS + SwiGLU (7 kernels); 0 turns that off. H200, bf16, one layer inside a CUDA graph
#: (``bench_fused_linear-20261201.json``): SmolLM2 (hidden 576) 19.4 vs 22.3 us at 1 row, 20.8 vs 22.2 at
#: 16, but 24.2 vs 22.4 at 32 rows; Llama-3-8B (hidden 4096) 142 vs 131 us at 1 row (cuBLAS streams the
#: large q/k/v and gate/up matrices faster), hence also :data:`FUSED_LINEAR_MAX_HIDDEN`. The LM head stays on
#: cuBLAS (SmolLM2 30.3 vs 32.3 us). The whole-K path (:data:`FUSED_LINEAR_WHOLE_K`) with one 32-row program per
#: output tile was far slower still: SmolLM2-shaped verify forwards of 17 / 32 tokens took 2.82 / 7.28 ms with 32
#: here against 0.99 / 0.99 on cuBLAS, 16 tokens 0.611 either way (H200,
#: ``profile_step_splits-max-rows-20261203-4924036.json``). It now runs 17-32 rows as two 16-row programs
#: (:data:`~hf_accel.kernels.fused_linear_tiles.WHOLE_K_BLOCK_M`), up to
#: :data:`~hf_accel.kernels.fused_linear_tiles.WHOLE_K_MAX_ROWS`. Real SmolLM2 bf16 decode, H200, one run each with both
#: settings in turns: bs24 34133 tok/s with 32 against 22871 with 16 (step 0.68 vs 1.03 ms), bs32 45608 against
#: 30558 (``bench_generate-smollm2-max-rows-ab-20261203-3da9682.json``); bs48 50865 with 128 against 42416 with 32
#: (0.91 vs 1.09 ms), bs64 67296 against 55659 (0.92 vs 1.11 ms;
#: ``bench_generate-smollm2-max-rows-128-ab-20261203-6a89104.json``). Prompt lookup at bs8 with 128
#: (``bench_speculative-bs8-max-rows-128-20261203-6a89104.json``): verify rounds of 24 / 40 / 72 rows took 0.64 /
#: 0.86 / 0.98 ms (passages; code 0.63 / 0.83 / 0.95) against 0.96 / 1.03 / 1.08 on cuBLAS earlier that day, but
#: 128 rows 1.27 (code) against 1.15; hence 72,
#: the most rows measured faster than cuBLAS (73-128 not measured between). On the Llama-3-8B shape (hidden above
#: :data:`FUSED_LINEAR_MAX_HIDDEN`, so cuBLAS either way) bs24 / bs32 did not separate
#: (``bench_generate-8b-max-rows-ab-20261203-da2307b.json``). It also lets prompt lookup verify up to 31 drafts at
#: batch 1 (``num_draft_tokens``).
FUSED_LINEAR_MAX_ROWS = 72
#: The same limit for models whose layers do not all fit the whole-K path (a matmul input wider than
#: :data:`~hf_accel.kernels.fused_linear_tiles.WHOLE_K_MAX`, e.g. an intermediate size of 4864 or 8192): their K-loop
#: tiles lost to cuBLAS at 32 rows in the measurement above (24.2 vs 22.4 us per SmolLM2-shaped layer).
FUSED_LINEAR_K_LOOP_MAX_ROWS = 16
FUSED_LINEAR_MAX_HIDDEN = 2048

#: Steps of one token row (batch 1 decode) run every matmul, the LM head included, through
#: :func:`~hf_accel.kernels.gemv.gemv` (norm / SwiGLU fused in as with ``fused_linear``); False keeps
#: fused_linear / cuBLAS there. H200, bf16, all matmuls of one Llama-3-8B-shaped token inside a CUDA
#: graph (``bench_gemv-20261201-244e9b5.json``): cuBLAS (+ RMSNorm and SwiGLU kernels) 4.246 ms, gemv
#: 4.102 ms, gemv with PDL 4.062 ms. ``bench_generate`` bs1 at 337a953, tok/s: Llama-3-8B shape 215.6
#: (209.9 without gemv), SmolLM2 1372 (1038).
GEMV_ONE_ROW = True

#: One row only: a several-row variant of the GEMV (each weight tile multiplied into 2-16 rows on CUDA
#: cores) was measured and removed. H200, SmolLM2 bf16 (``bench_generate-gemv-rows-ab-20261201-17ed39b.json``):
#: bs16 decode 4676 tok/s against 17410 with fused_linear, and prompt-lookup verify passes slowed down
#: with it (``bench_speculative-gemv-rows-20261201-17ed39b.json``).

#: The fused step's gemv / fused_linear kernels are launched with programmatic dependent launch
#: (:mod:`hf_accel.kernels.pdl`) on Hopper: each one's launch and first weight loads overlap the tail of
#: the kernel before it. ``bench_generate`` bs1 at 337a953, tok/s: SmolLM2 1372 vs 1245 without, Llama-3-8B
#: shape 215.6 vs 214.4. :data:`ATTENTION_PDL` does the same for RoPE + cache write, paged attention and
#: its split merge (they wait at their start, without letting the next kernel launch early).
DECODE_PDL = True
ATTENTION_PDL = True

#: One-row steps of models without a per-head q/k norm run RoPE and the K/V cache write as the Q/K/V
#: GEMV's epilogue (:func:`~hf_accel.kernels.gemv.gemv_rope`, bitwise the separate kernels' results; one
#: kernel less per layer). Alone it gained nothing (Llama-3-8B shape bs1, ``bench_generate`` in one run,
#: ``bench_generate-gemv-rope-ab-20261201-3899aa9.json``: 234.7 tok/s with it, 235.2 without). With it the
#: attention kernel launches while the GEMV runs, which :data:`ATTENTION_PRELOAD` and
#: :data:`ATTENTION_TRIGGER` use: the three together, after the whole-row norm prologue
#: (:data:`GEMV_NORM_K`), 243.6 tok/s vs 240.9 without them (``bench_generate-8b-ab-20261201-983acc2.json``);
#: the captured step 3.948 vs 3.992 ms (``profile_decode_step-ablate-8b-20261201-983acc2.json``).
GEMV_ROPE = True

#: Split-KV partitions can be merged inside the paged attention kernel (the last split program of a row
#: block to arrive merges; ``merge_counters`` of :func:`~hf_accel.kernels.paged_attention.paged_attention`)
#: instead of a second kernel per layer. Off: slower on the H200. ``bench_generate`` in one run
#: (``bench_generate-merge-trigger-ab-20261201-2f27f97.json``), tok/s: Llama-3-8B shape bs1 231.8 with it
#: vs 235.2 without; SmolLM2 bs1 1613.6 vs 1660.0. SmolLM2 verify pass of 16 tokens
#: (``profile_speculative_round`` at 2f27f97, one run per switch setting; only the all-on run's JSON,
#: ``profile_speculative_round-20261201-2f27f97.json``, was kept): 0.962 ms without it vs 0.988 with it
#: (trigger and split-K on in both); all three switches off 0.849 ms. Again on an H100 at d20b15c (today's
#: kernels, random SmolLM2-shaped weights, ``profile_step_splits-switch-sweep-*-h100-20261206-d20b15c.json``):
#: one-row step 0.461 / 0.494 ms with it vs 0.437 / 0.438, 16-token verify pass 0.767 / 1.028 vs 0.620 / 0.627 at
#: 305 / 600 cached tokens. :data:`FUSED_LINEAR_LM_HEAD` in the same sweep: verify 0.647 / 0.653 ms.
FUSED_MERGE = False

#: With PDL, the paged attention kernel of one-row steps lets the next kernel (the split merge) launch early:
#: ``trigger`` of :func:`~hf_accel.kernels.paged_attention.paged_attention` (True: once its programs pass
#: their wait; "after_keys": once their K/V tiles are in; False: as they exit). Steps of more rows keep
#: False. With the RoPE kernel in place it lost (Llama-3-8B shape bs1 218.8 tok/s with True vs 235.2
#: without, same run as above; SmolLM2 bs1 1707.5 vs 1660.0); with :data:`GEMV_ROPE` and
#: :data:`ATTENTION_PRELOAD` it is part of the gain above. "after_keys" with the merge kernel: 4.100 vs
#: 4.114 ms per captured step (``profile_decode_step-ablate-8b-trigger-20261201-284a03f.json``).
ATTENTION_TRIGGER = True

#: fused_linear calls of the step (2-16 token rows) can split K so that a matmul of few output tiles runs
#: about this many programs per SM (capped at one K tile per program; each program then loads its weight
#: share before its PDL wait, as the one-row GEMV does); 0 = no split. Off: SmolLM2's 16-token verify
#: pass took 0.988 ms with 1 program per SM (``profile_speculative_round-20261201-2f27f97.json``) vs 0.942 ms
#: without (a profile run of the same day whose file was not kept); one layer's four matmuls alone, 16 rows,
#: 20.96 vs 22.75 us (``bench_fused_linear-split-20261201-2f27f97.json``).
FUSED_LINEAR_SPLIT_PROGRAMS_PER_SM = 0

#: With PDL, the paged attention of one-row steps loads its first tile's cached K/V (all but this step's
#: new tokens) before waiting for the Q/K/V kernel (``preload_kv``; with :data:`GEMV_ROPE` that kernel lets
#: it launch early). Alone no gain was measured (``bench_generate-preload-ab-20261201-c93ff88.json``, 8B
#: bs1: 232.7 tok/s with gemv_rope + preload, 233.6 with gemv_rope alone, 233.4 with neither); with
#: :data:`ATTENTION_TRIGGER` too, see :data:`GEMV_ROPE`. Steps of more rows do not preload.
ATTENTION_PRELOAD = True

#: Weight tiles each one-row GEMV program loads before its PDL wait (``preload_tiles`` of
#: :func:`~hf_accel.kernels.gemv.gemv`): more bytes in flight while the kernel before it drains, but more
#: registers per program. 1: 2 and 4 were slower (numbers under :data:`GEMV_NORM_K`).
GEMV_PRELOAD_TILES = 1

#: Input columns per step of the one-row GEMVs' RMSNorm prologue (``norm_k`` of
#: :func:`~hf_accel.kernels.gemv.gemv`): None = the whole row at once, 0 = one K tile per step (before; each
#: step an L2 round trip before the first weight tile is used). H200, Llama-3-8B shape bs1, captured step
#: (``profile_decode_step-ablate-8b-norm-20261201-baee8c4.json``): 4.067 ms with the whole row vs 4.120 / 4.129
#: in K tiles; :data:`GEMV_PRELOAD_TILES` 2 / 4 were slower (4.316 / 4.355 ms vs 4.121,
#: ``profile_decode_step-ablate-8b-20261201-b3675d9.json``).
GEMV_NORM_K = None

#: ``single_pass`` of the one-row GEMVs (:func:`~hf_accel.kernels.gemv.gemv`): a small model's rows (<= 2048
#: wide) as one weight tile, one read of the input row for the norm and the product, weights of up to 1024
#: columns converted before the PDL wait (wider models are unaffected). H100, bf16, on in turns with off at
#: 9002324: SmolLM2-shaped one-row step (random weights, captured) 0.437-0.441 vs 0.488-0.496 ms at 305 / 600
#: cached tokens (``profile_step_splits-single-pass-ab-*-h100-20261206-9002324.json``); real SmolLM2 bs1
#: ``generate`` 2187 vs 1985 tok/s, bs16 unchanged (25189 vs 25049;
#: ``bench_generate-smollm2-single-pass-ab-h100-20261206-9002324.json``).
GEMV_SINGLE_PASS = True

#: The same for the step's fused_linear calls (2-16 rows): 0 = one K tile per step (the kernel's default),
#: 512 = what was tried. 0: the wider steps were slower on SmolLM2 (H200, one run each,
#: ``profile_speculative_round-*-20261201-023be27.json``: 16-token verify forward 0.904 ms with 512 vs
#: 0.844 with 0; ``bench_generate-20261201-023be27.json``: bs16 16861 tok/s with 512 vs 17623 with 0 and
#: the other switches of that change off; the plain ``ours`` rows of those files ran with 512, the default then).
FUSED_LINEAR_NORM_K = 0

#: One-row steps fuse the final residual add + RMSNorm into the LM head GEMV (True), or run the
#: :func:`~hf_accel.kernels.rms_norm.rms_norm` kernel first (False): with the norm fused, each of the head's
#: ~32k programs re-reads the hidden state and the residual to compute it.
GEMV_LM_HEAD_NORM = True

#: Steps of 2-16 token rows (verify passes, small batches) run the final residual add + RMSNorm + LM head as
#: one :func:`~hf_accel.kernels.fused_linear.fused_linear` launch with PDL (logits rounded to the model dtype,
#: then float32, as cuBLAS + ``.float()`` give them) instead of the RMSNorm kernel, cuBLAS and a float32 copy.
#: Needs the step's fused_linear path and a plain ``nn.Linear`` LM head in the model dtype. Off: slower. H200,
#: SmolLM2-shaped random bf16 weights, batch-1 verify forwards in CUDA graphs, contexts 305 / 450, two runs in turns
#: (``profile_step_splits-lm-head-20261203-f6bf997.json``): 16 tokens 0.643 ms with it vs 0.615, 2 tokens 0.569 vs
#: 0.544 (the whole-K tiles hold 32 x 576 weights per program: 1536 programs over the 49152 outputs).
FUSED_LINEAR_LM_HEAD = False

#: The fused step looks each token's rotary cos/sin up in a table computed once per step object by the
#: model's rotary module (one gather kernel; the module's per-step computation is ~8 kernels), and computes
#: cache slots and sequence lengths in one kernel (:func:`~hf_accel.kernels.reshape_and_cache.slot_mapping`;
#: ~8 PyTorch kernels otherwise). Both give bitwise the same values. Llama-3-8B shape bs1, captured step
#: (``profile_decode_step-ablate-8b-20261201-983acc2.json``): 3.992 ms with both vs 4.019 without.
ROTARY_TABLE = True
SLOT_KERNEL = True

#: The fused step gathers the token embeddings and rotary rows by indexing (``weight[ids]``: one kernel over
#: every element) instead of ``torch.nn.functional.embedding``, whose CUDA kernel for few indices
#: (``indexSelectSmallIndex``) walks the indices one after another: 2 gathers of a 16-token verify pass took
#: 19.9 µs against 4.6 µs for one token (``profile_speculative_round-20261203-9303593.json``, profiled). Both
#: copy the same rows. Only where the embedding module is a plain ``nn.Embedding`` (no scale of its own, no
#: ``max_norm``).
GATHER_BY_INDEX = True

#: Steps of 2-16 token rows (speculative verify passes, small batches) of models without a per-head q/k norm
#: run RoPE and the K/V cache write as the Q/K/V fused_linear's epilogue
#: (:func:`~hf_accel.kernels.fused_linear.fused_linear_rope`; one kernel less per layer), as
#: :data:`GEMV_ROPE` does for one row. Needs head_dim / 2 a multiple of 16. H200, random SmolLM2-shaped bf16
#: weights, verify forward inside a CUDA graph (``profile_verify_tiles-20261201-26dae0b.json``, 3 timings each):
#: 16 tokens 0.828-0.833 ms with it vs 0.836 without, 2 tokens 0.791 vs 0.800.
FUSED_LINEAR_ROPE = True

#: The step's fused_linear calls take the small-layer tiles (``small_tiles`` of
#: :func:`~hf_accel.kernels.fused_linear.fused_linear`: one-warp programs of 16 outputs for o / down, 128-wide K
#: steps for gate/up). Off: faster in a chain of matmuls alone, slower inside the step (numbers in
#: :func:`hf_accel.kernels.fused_linear_tiles._tiles`).
FUSED_LINEAR_SMALL_TILES = False

#: The step's fused_linear / fused_linear_rope calls (2-16 rows, no split-K) load each program's first weight
#: tile before their PDL wait (``preload``), as the one-row GEMVs do (:data:`GEMV_PRELOAD_TILES`). Off: H200,
#: SmolLM2-shaped random bf16 weights, 305-token prompt, medians of 4 graph timings in one run
#: (``profile_verify_switches-20261202-f792bb3.json``): a verify forward of 16 tokens 0.838 vs 0.835 ms, of 2
#: tokens 0.774 vs 0.791, a bs16 decode step 0.903 vs 0.890.
FUSED_LINEAR_PRELOAD = False

#: Steps of 2-16 token rows launch the paged attention as one-row steps do (:data:`ATTENTION_TRIGGER`,
#: :data:`ATTENTION_PRELOAD`): the first tile's cached K/V loaded before the wait for the Q/K/V kernel, the
#: split merge launched early. Needs the Q/K/V kernel to write the cache (:data:`FUSED_LINEAR_ROPE`). With
#: the K-loop matmuls it lost (``profile_verify_switches-20261202-f792bb3.json``: 16 tokens 0.881 ms vs
#: 0.835, 2 tokens 0.767 vs 0.791, bs16 0.954 vs 0.890); with :data:`FUSED_LINEAR_WHOLE_K` it wins, see there.
MULTI_ROW_ATTENTION_OVERLAP = True

#: The step's fused_linear / fused_linear_rope calls (2-16 rows) take the whole-K path (``whole_k`` of
#: :func:`~hf_accel.kernels.fused_linear.fused_linear`): each program loads its weight rows over all input
#: columns before its PDL wait, then the input rows once, as the one-row GEMV does, instead of a K loop whose
#: every tile is a memory round trip after the wait. Inputs the path does not take
#: (:func:`~hf_accel.kernels.fused_linear_tiles.whole_k_fits`: wider than
#: :data:`~hf_accel.kernels.fused_linear_tiles.WHOLE_K_MAX`, float32 on a GPU, a GPU with less shared memory than the
#: H200) keep the loop (and :data:`FUSED_LINEAR_PRELOAD`,
#: :data:`FUSED_LINEAR_SPLIT_PROGRAMS_PER_SM`, :data:`FUSED_LINEAR_NORM_K` apply only to the loop). H200,
#: SmolLM2-shaped random bf16 weights, 305-token prompt, CUDA graphs, medians of 4 timings in one run
#: (``profile_verify_switches-whole-k-20261202-c8967fe.json``): verify forward of 16 tokens 0.704 ms vs 0.826
#: with the loop, 0.673 with :data:`MULTI_ROW_ATTENTION_OVERLAP` too; of 2 tokens 0.642 / 0.545 vs 0.793; a
#: bs16 step 0.764 / 0.710 vs 0.888. Real SmolLM2 bf16, ``bench_speculative`` in one run
#: (``bench_speculative-whole-k-on/off-20261202-c8967fe.json``): plain bs8 10953 vs 7933 tok/s on the passage
#: prompts, 5100 vs 3671 on the code prompts, 13074 vs 9560 open-ended.
FUSED_LINEAR_WHOLE_K = True

#: The in-graph greedy loop's pick + bookkeeping (argmax, pad for finished rows, token write, EOS check,
#: next-step inputs, counters) runs as one :func:`~hf_accel.kernels.argmax.greedy_tail` launch on CUDA
#: instead of ~10 PyTorch kernels (``torch.argmax`` of a 49k-entry row alone is a multi-block reduction).
GREEDY_TAIL_KERNEL = True

#: KV splits of the paged attention in forwards over more token rows than the step's own (the bucketed
#: prompt prefill, chunked prefill): None = the kernel's default (~2 programs per SM: a 512-token SmolLM2
#: prompt got 4 splits and a merge kernel per layer), or a fixed count. 1: the causal row blocks of a
#: prompt already give the grid its programs, and no merge kernel runs (measured in
#: ``profile_call_overhead``).
PREFILL_NUM_SPLITS = 1

#: A prompt prefill with nothing cached before it (the bucketed prefill) runs its attention as
#: :func:`~hf_accel.kernels.prefill.prefill_attention` (FlashAttention-2) over the forward's own K/V — rotated K
#: from the RoPE kernel's second output, V the projection's — instead of the paged kernel over the cache (which
#: the RoPE kernel still writes). H200, SmolLM2's shape, bf16, one call (``profile_prefill_attention-20261203-
#: da2307b.json``): 4.8 / 5.3 / 6.3 / 7.5 µs at 192 / 256 / 384 / 512 tokens against 8.8 / 10.5 / 13.9 / 17.2
#: for the paged kernel as the prefill ran it.
PREFILL_CONTIGUOUS_ATTENTION = True

#: Pipeline stages of the paged attention kernel inside the step: 3 (the kernel's default too; every
#: end-to-end number in ``bench_generate`` / ``bench_speculative`` was measured with it).
DECODE_ATTENTION_STAGES = 3

#: Pipeline stages of the paged attention in batch-1 verify passes (the step's own 2+ token rows; other steps
#: of several rows keep :data:`DECODE_ATTENTION_STAGES`). H100, random SmolLM2-shaped bf16 weights, forwards in
#: CUDA graphs, 2 vs 3 stages in turns, two runs each (``profile_step_splits-verify-stages-ab-*-h100-20261206-
#: d20b15c.json``): 16-token verify pass 0.603 / 0.609 vs 0.627 / 0.628 ms at 600 cached tokens, 0.623 / 0.629
#: vs 0.648 / 0.648 at 1000, 0.623 / 0.625 vs 0.623 / 0.622 at 305; the one-row step was not changed by it
#: (0.438-0.458 ms either way). End to end not measured.
VERIFY_ATTENTION_STAGES = 2

#: Fewest keys per KV split of the step's paged attention
#: (:func:`~hf_accel.engine.decode_step.default_num_splits`). H200, Llama-3-8B
#: shape bs1 (``bench_generate-gemv-rope-ab-20261201-3899aa9.json``): 234.7 tok/s at 64, 230.7 at 128,
#: 235.1 at 32. At batch 1 SmolLM2's grid has 3 programs before splitting, and fewer, longer splits lose:
#: random SmolLM2-shaped bf16 weights, forwards in CUDA graphs (``profile_step_splits-20261203-afa165e.json``),
#: 305 cached tokens, one-row step / 16-token verify pass: 0.490 / 0.611 ms with the default 8 splits, 0.553 /
#: 0.703 with 4, 0.703 / 0.909 with 1 (600 tokens: 0.492 / 0.611 with 16 splits, 1.052 / 1.216 with 1).
DECODE_MIN_SPLIT_KEYS = 64

#: The in-graph greedy step ends with a kernel that writes its rows' unfinished flags into page-locked host memory
#: (:mod:`hf_accel.kernels.host_counters`), which the greedy loop's end-of-sequence check polls, instead of a
#: device-to-host copy after each step and a CUDA event. Synthetic rounds on an H100: the copy cost the GPU 11.1-11.4
#: µs per round, the kernel's stores 1.5-2.4 µs (``profile_round_readback-*-h100-20261206-e2234c8.json``). Where a
#: kernel cannot write page-locked memory, the copy is used. Checked on an H100 at c569471
#: (``tests/engine/test_fast_generate_gpu.py``, whose EOS-lag test counts the steps run, and
#: ``tests/kernels/test_host_counters.py``: 50 passed). End to end it did not separate from the spread: H100, off / on
#: / off / on at f908423, 8 prompts per category at batch 1, 3 passes each
#: (``bench_speculative-greedy-host-flags-{off-1,on-2,off-3,on-4}-h100-20261206-f908423.json``), the plain path's
#: tok/s per pass off / on: passages 2109-2128 / 2122-2155, code 1972-2022 / 1949-2012, open-ended 2175-2199 /
#: 2185-2224. Off: the plain path is every call's, and a poll costs host time a CUDA event wait does not.
GREEDY_HOST_FLAGS = False
