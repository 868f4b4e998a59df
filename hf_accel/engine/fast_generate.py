"""``generate`` on the fast decode path: paged prefill, then CUDA-graph decode steps.

Serves the common configurations of ``model.generate()``: greedy and multinomial sampling with
temperature / top-k / top-p, ``max_new_tokens`` / ``max_length``, ``min_new_tokens`` / ``min_length``,
one or several EOS ids, a streamer, batches with left padding, multi-turn calls (``return_dict_in_generate=True``
returns the call's K/V in a PagedCache; a PagedCache passed back is continued: :meth:`FastEngine.start` copies
its K/V into the engine's pools and prefills only the new tokens). Logits processing uses transformers' own
processor classes in transformers' order, and the loop follows transformers' sampling loop (finished
rows emit ``pad_token_id``; the call stops when every row has finished), so greedy output is
token-for-token what transformers produces from the same logits. Everything else returns ``None`` with
a reason and the caller falls back to transformers' loop (still on hf-accel's kernels and cache).

Host syncs: without a streamer, decoding in CUDA graphs puts each step's unfinished flags in page-locked
memory (copied without blocking; with :data:`~hf_accel.engine.step_switches.GREEDY_HOST_FLAGS`, off by default, the
greedy step's graph writes them there itself) and reads those
of the step :data:`EOS_LAG` back, so the call stops at most that many steps after the last row's EOS while the
GPU always has steps queued; without CUDA graphs EOS is
checked every ``sync_every`` steps on a GPU (16 by default) and after every step on a CPU, where the check
costs no wait. Surplus steps only add padding that is trimmed. A streamer needs
each token on the host: one sync per token.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from hf_accel._logging import log_once
from hf_accel.cache.kv_copy import copy_kv
from hf_accel.cache.paged_cache import PagedCache
from hf_accel.engine.call_lock import CallLock
from hf_accel.engine.call_options import call_inputs, passed_cache, repetition_penalty, sampling_warpers
from hf_accel.engine.decode_step import DecodeStep
from hf_accel.engine.eligibility import MAX_LOOKAHEAD, CallChecks
from hf_accel.engine.merged_weights import merge_projections, projections_share_storage, unmerge_projections
from hf_accel.engine.weight_snapshot import weight_snapshot
from hf_accel.kernels.prefill_inputs import prefill_inputs


#: Decode steps in CUDA graphs (no streamer): the host reads each step's end-of-sequence flags this many steps
#: later (:class:`_EosWatch`; the copy lands in page-locked memory meanwhile); a call stops at most this many
#: steps after every row has finished. It replaced a blocking check every ``sync_every`` steps, which ran up
#: to ``sync_every - 1`` surplus steps after the last EOS. 0: that blocking check. H200, real SmolLM2 bf16,
#: bs1, greedy (``ab_eos_lag-20261202-57ad11a.json``): 8 code answers of ~50 tokens 252.5 vs 269.9 ms; 8
#: passage / open-ended answers of mostly 128 tokens 0.2% / 0.8% slower (the per-step copy).
EOS_LAG = 2

#: Decode steps without CUDA graphs on a GPU (eager steps, or ``EOS_LAG = 0``): the host checks the unfinished
#: flags every this many steps (each check waits for the queued steps), so up to this many - 1 surplus steps
#: run after the last EOS. On a CPU the check waits for nothing and runs after every step.
GPU_SYNC_EVERY = 16


def _next_logits(step, batch: int, tokens: torch.Tensor, i: int) -> torch.Tensor:
    """Run the decode step on step ``i``'s tokens [batch] (``i`` = 0: the first new token, whose positions and
    cache lengths :meth:`FastEngine.start` set); returns the next logits [batch, vocab]."""
    step.input_ids[:batch, 0].copy_(tokens)
    if i > 0:
        step.position_ids[:batch] += 1
        step.cache_lens[:batch] += 1
    return step.run()[:batch, 0]


class _RngStates:
    """The default generator's state of ``device`` before each of the last ``keep`` steps' draws (a step's
    ``torch.multinomial``), so that :meth:`restore` can set the state after the first ``n`` steps' draws."""

    def __init__(self, device: torch.device, keep: int):
        self.cuda = device.type == "cuda"
        self.device = device
        self.states: dict[int, torch.Tensor] = {}
        self.keep = keep

    def save(self, step: int) -> None:
        self.states[step] = torch.cuda.get_rng_state(self.device) if self.cuda else torch.get_rng_state()
        self.states.pop(step - self.keep, None)

    def restore(self, step: int) -> None:
        """Set the state saved before step ``step`` (nothing if that step did not run: every step's draw counts)."""
        state = self.states.get(step)
        if state is not None:
            torch.cuda.set_rng_state(state, self.device) if self.cuda else torch.set_rng_state(state)


class _EosWatch:
    """End-of-sequence check of a loop of CUDA-graph steps without blocking: each step's unfinished flags
    are copied to page-locked memory (:meth:`DecodeStep.host_flags`) and read ``lag`` steps later, once
    that step's event has completed, so ``lag`` steps stay queued on the GPU while the host waits. A row's
    flag only ever goes from unfinished to finished, so a stale read can only delay the stop. With
    ``published`` (the in-graph greedy step with :attr:`DecodeStep.greedy_flags`), the step's graph has written
    its flags into page-locked memory itself: the check polls them there instead of copying."""

    def __init__(self, step, lag: int, published: bool = False):
        self.lag = lag
        self.step, self.published = step, published
        self.numbers: list[int] = []
        self.flags = None
        self.calls = 0

    def all_finished(self, unfinished: torch.Tensor) -> bool:
        """Queue the flags of the step just launched (``unfinished``: [rows] bool on the device, rows <= the
        step's batch) and say whether every row had finished ``lag`` steps before it."""
        if self.calls == 0:  # decided after the first step ran (its graph is captured by then)
            self.published = self.published and self.step.greedy_flags is not None
            if not self.published:
                self.flags, self.flags_np, self.events = self.step.host_flags(self.lag + 1)
        if self.published:  # the step's graph wrote them: poll the ones ``lag`` steps back
            self.calls += 1
            self.numbers.append(self.step.greedy_flags_number)
            if len(self.numbers) <= self.lag:
                return False
            return not self.step.greedy_flags.wait(self.numbers.pop(0))[: unfinished.shape[0]].any()
        n, ring = unfinished.shape[0], self.lag + 1
        slot = self.calls % ring
        self.flags[slot, :n].copy_(unfinished, non_blocking=True)
        self.events[slot].record()
        self.calls += 1
        if self.calls <= self.lag:
            return False
        back = (self.calls - 1 - self.lag) % ring
        self.events[back].synchronize()
        return not self.flags_np[back, :n].any()


def _bucket(n: int, minimum: int = 1) -> int:
    p = max(minimum, 1)
    while p < n:
        p *= 2
    return p


#: Prompt prefill buckets at 1.5x steps as well as powers of two (16, 24, 32, 48, ..., 256, 384, 512, ...):
#: a prompt is padded to at most 1.5x its length instead of 2x, and a prefill graph is captured per bucket.
PREFILL_HALF_STEPS = True


def prefill_bucket(n: int) -> int:
    """Padded length of an ``n``-token prompt's bucketed prefill: the smallest power of two >= 16, or (with
    :data:`PREFILL_HALF_STEPS`) 1.5 times one >= 16, that holds it."""
    p = _bucket(n, 16)
    if PREFILL_HALF_STEPS and p >= 32 and 3 * p // 4 >= n:
        return 3 * p // 4
    return p


class FastEngine(CallChecks):
    """Per-model state of the fast path: a persistent PagedCache (pools kept between calls) and the
    captured decode steps, keyed by (batch bucket, block-table width bucket). ``call_lock`` (a
    :class:`CallLock`) is held by whoever runs a call on this state."""

    def __init__(self, model, block_size: int = 16, use_cuda_graphs: bool = True, sync_every: int | None = None,
                 fused: bool | None = None):
        self.model = model
        self.block_size = block_size
        self.use_cuda_graphs = use_cuda_graphs
        self.sync_every = sync_every  # None: GPU_SYNC_EVERY on a GPU, every step elsewhere (see sync_interval)
        self._fused = fused  # None: fused Triton step on CUDA; True forces it (CPU tests under TRITON_INTERPRET)
        self.cache: PagedCache | None = None
        self.steps: dict[tuple, DecodeStep] = {}
        self.last_stats: dict = {}
        self.merged = None  # MergedLayer list once the fused step merged the projections
        self.snapshot = None  # the model's weights when the steps were built (weight_snapshot), None: no steps
        self.call_lock = CallLock()

    def __reduce__(self):
        """``copy.deepcopy(model)`` and ``torch.save(model)`` carry the engine's options and its model only: the
        copy starts without pools, captured steps and lock (CUDA graphs and thread locks do not copy) and builds
        them on its first call."""
        return (FastEngine, (self.model, self.block_size, self.use_cuda_graphs, self.sync_every, self._fused))

    @property
    def fused(self) -> bool | None:
        return self._fused

    @fused.setter
    def fused(self, value: bool | None) -> None:
        if value != self._fused:
            self.steps.clear()  # steps are built for one variant; the next call builds the other
        self._fused = value

    # -- cache / steps ----------------------------------------------------------------------------
    def _ensure_cache(self, num_blocks: int, new_pool_blocks: int | None = None) -> PagedCache:
        """The engine's PagedCache with at least ``num_blocks`` blocks: a new one, when the pool is smaller, of
        ``new_pool_blocks`` (at least ``num_blocks``) or twice the old pool, whichever is larger, within free
        memory."""
        if self._pool_blocks() < num_blocks:
            old = self._pool_blocks()
            fit = self._blocks_that_fit()
            grown = 2 * old if fit is None else min(2 * old, fit)  # doubling, within free memory
            want = max(num_blocks, new_pool_blocks or 0)
            if fit is not None:
                want = max(num_blocks, min(want, fit))
            self.steps.clear()  # graphs point at the old pools
            self.cache = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            self.cache = PagedCache(self.model.config, num_blocks=max(want, grown), block_size=self.block_size)
        return self.cache

    def _step_for(self, batch: int, max_blocks: int, q_len: int = 1, num_layers: int | None = None) -> DecodeStep:
        on_gpu = self.device.type == "cuda" and self.use_cuda_graphs
        key = (_bucket(batch) if on_gpu else batch, _bucket(max_blocks, 8) if on_gpu else max_blocks, q_len,
               num_layers)
        step = self.steps.get(key)
        if step is None:
            step = DecodeStep(self.model, self.cache, key[0], key[1], use_graph=on_gpu, fused=self.fused,
                              q_len=q_len, num_layers=num_layers)
            if step.fused and self.merged is None:
                self.merged = merge_projections(self.model) or []
            step.merged = self.merged or None
            step.on_step = self.call_lock.step  # a call waiting for this one sees it making progress
            self.steps[key] = step
            self.snapshot = weight_snapshot(self.model)  # after the merge, which gives the projections new storage
        return step

    def release(self) -> None:
        """Drop graphs and pools, and give merged projections their own storage back."""
        self.steps.clear()
        self.cache = None
        if self.merged or projections_share_storage(self.model):
            unmerge_projections(self.model)
        self.merged = None
        self.snapshot = None

    def sync_interval(self, device) -> int:
        """Steps between two host checks of the unfinished flags without CUDA graphs: ``sync_every`` if set, else
        :data:`GPU_SYNC_EVERY` on a GPU (each check waits for the queued steps) and 1 on other devices (a check
        costs nothing there, and each surplus step costs a whole forward)."""
        if self.sync_every is not None:
            return self.sync_every
        return GPU_SYNC_EVERY if torch.device(device).type == "cuda" else 1

    # -- generation -------------------------------------------------------------------------------
    def _greedy_in_graph(self, step, logits, input_ids, batch, prompt_len, max_new, pad, eos_list):
        """Greedy without processors or streamer: pick + bookkeeping captured with the step, so the host
        only replays (and reads ``unfinished`` every :meth:`sync_interval` steps)."""
        g = step.init_greedy(eos_list)
        g["tokens"].fill_(pad)
        g["tokens"][:batch, :prompt_len] = input_ids
        g["unfinished"].zero_()
        g["unfinished"][:batch] = True
        g["pad"].fill_(pad)
        g["steps_run"].zero_()
        # First token from the prefill logits, with the same bookkeeping as every later step.
        first = logits.argmax(dim=-1)
        g["steps_run"] += 1
        g["tokens"][:batch, prompt_len] = first
        if eos_list:
            g["unfinished"][:batch] &= ~torch.isin(first, g["eos"])
        step.input_ids[:batch, 0].copy_(first)
        g["cur"].fill_(prompt_len + 1)
        watch = _EosWatch(step, EOS_LAG, published=True) if eos_list and step.use_graph and EOS_LAG > 0 else None
        every = self.sync_interval(g["unfinished"].device)
        for i in range(1, max_new):
            step.run_greedy()
            if not eos_list:
                continue
            if watch is not None:
                if watch.all_finished(g["unfinished"]):
                    break
            elif i % every == 0 and not bool(g["unfinished"].any()):
                break
        n = int(g["steps_run"])
        return n, g["tokens"][:batch].clone()

    def start(self, input_ids, attention_mask, max_new: int, lookahead: int = 0, prefix: PagedCache | None = None):
        """Reserve cache blocks for ``prompt + max_new + lookahead`` tokens per row, prefill the prompt
        and set up the decode step (buffers for the first new token). Returns ``(step, logits)`` with the
        prompt's last-position logits [batch, vocab] float32. The caller releases ``self.cache``.

        ``prefix``: a PagedCache holding the K/V of the prompt's first tokens (a previous turn; checked by
        :meth:`check`): they are copied into this engine's pools and only the rest of the prompt is prefilled, in
        chunks through ``step.forward_tokens`` (not the bucketed prefill graph).

        Prefill runs the fused step's kernels over the whole prompt where the fused step applies (no
        transformers module dispatch: TTFT on a slow host was 25 ms for a 512-token SmolLM2 prompt
        through the modules), else through the model with hf-accel attention on the PagedCache."""
        from hf_accel.integrations.generate import CACHE_KWARG

        model = self.model
        batch, prompt_len = input_ids.shape
        bs = self.block_size
        blocks_per_row = -(-(prompt_len + max_new + lookahead) // bs)
        # a pool made or grown here holds what check() counts for a call of this shape (blocks_needed: the largest
        # lookahead of a speculative call), so that the next such call finds it large enough without reading the
        # device's free memory
        pool_blocks = batch * -(-(prompt_len + max_new + max(lookahead, MAX_LOOKAHEAD)) // bs) + 1
        cache = self._ensure_cache(batch * blocks_per_row + 1, pool_blocks)
        step = self._step_for(batch, blocks_per_row)
        cached = prefix.get_seq_length() if prefix is not None else 0
        # the bucketed prefill graph: its inputs and the decode step's buffers are written by one kernel
        # (prefill_inputs) instead of ~20 eager ops the GPU would wait for
        bucketed = (step.fused and not cached and prompt_len <= max(16, 8192 // batch)
                    and prefill_bucket(prompt_len) <= step.capacity)
        position_ids = None
        if not bucketed:
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
        try:
            if step.fused or cached:
                attn0 = model.model.layers[0].self_attn
                cache.allocate_pools(model.config.num_key_value_heads, attn0.head_dim, next(model.parameters()).dtype,
                                     self.device)
                m = cache.manager
                cache.seq_ids = [m.allocate(0) for _ in range(batch)]
            else:
                # Prefill through the model itself (hf-accel attention on the paged cache). A forward compiled in
                # place (model.compile()) runs uncompiled here: the paged cache's bookkeeping in Python breaks its
                # graph in every layer, and the recompiles made calls ~5x slower (SmolLM2 on a CPU)
                forward = model
                if getattr(model, "_compiled_call_impl", None) is not None:
                    log_once("fast-uncompiled-prefill", "hf-accel: the model's forward is compiled (model.compile()); "
                             "hf-accel's decode path runs the prompt's forward uncompiled (its paged cache would "
                             "break the compiled graph in every layer)")
                    forward = model._call_impl
                out = forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              use_cache=True, logits_to_keep=1, **{CACHE_KWARG: cache})
                logits = out.logits[:, -1, :].float()
                m = cache.manager
            for s in cache.seq_ids:
                # reserve the whole generation: the block table is static from here
                m.append(s, prompt_len + max_new + lookahead - m.length(s))
            scratch_seq = m.allocate(1)
            scratch = m.block_table(scratch_seq)[0]
            table = torch.full((step.batch, step.max_blocks), scratch, dtype=torch.int32)
            for b, s in enumerate(cache.seq_ids):
                t = m.block_table(s)
                table[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
            step.block_table.copy_(table)
            if bucketed:
                logits = self._prefill_bucketed(step, input_ids, attention_mask, batch, prompt_len)
            else:
                step.key_mask.zero_()
                step.key_mask[:batch, :prompt_len] = attention_mask.to(torch.uint8)
                step.key_mask[:batch, prompt_len:] = 1
                step.cache_lens.zero_()
                if cached:
                    copy_kv(prefix, prefix.seq_ids, cache, cache.seq_ids, 0, cached)
                if step.fused or cached:
                    chunk = max(16, 8192 // batch)
                    zeros = step.cache_lens[:batch]
                    with torch.inference_mode():
                        for c in range(cached, prompt_len, chunk):
                            e = min(prompt_len, c + chunk)
                            logits = step.forward_tokens(input_ids[:, c:e], position_ids[:, c:e], zeros + c,
                                                         step.block_table[:batch], step.key_mask[:batch],
                                                         last_only=True)
                step.cache_lens[:batch] = prompt_len
                step.position_ids.zero_()
                step.position_ids[:batch, 0] = attention_mask.long().sum(-1)
                step.input_ids.zero_()
        except BaseException:
            cache.release()
            raise
        return step, logits

    @torch.inference_mode()
    def _prefill_bucketed(self, step, input_ids, attention_mask, batch: int, prompt_len: int) -> torch.Tensor:
        """Prefill the whole prompt in one fused forward over static buffers of a bucketed length
        (:func:`prefill_bucket`), captured as a CUDA graph per (batch bucket, table bucket, length bucket) on the GPU:
        the eager prefill launched ~10 kernels per layer from Python, which on a slow host made the time to
        first token host-bound. The padding tokens after the prompt write K/V into slots the decode steps
        overwrite before reading them (or into the scratch block past a row's reservation); the prompt's
        own tokens never attend to them (causal). One kernel (:func:`~hf_accel.kernels.prefill_inputs.prefill_inputs`)
        writes the graph's inputs and sets the decode step's key mask, cache lengths, positions and ids for the
        first new token. Returns the logits of the last prompt token [batch, vocab] float32."""
        length = prefill_bucket(prompt_len)
        key = ("prefill", length)
        bufs = step.prefill_buffers.get(length)
        if bufs is None:
            dev = step.input_ids.device
            bufs = {"ids": torch.zeros(step.batch, length, dtype=torch.long, device=dev),
                    "pos": torch.zeros(step.batch, length, dtype=torch.long, device=dev),
                    "zeros": torch.zeros(step.batch, dtype=torch.int32, device=dev),
                    "index": torch.zeros(1, dtype=torch.long, device=dev)}
            step.prefill_buffers[length] = bufs
        if input_ids.dtype != torch.long or input_ids.stride(-1) != 1:
            input_ids = input_ids.long().contiguous()
        if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex or attention_mask.stride(-1) != 1:
            attention_mask = attention_mask.long().contiguous()
        prefill_inputs(input_ids, attention_mask, bufs["ids"], bufs["pos"], step.key_mask, step.cache_lens,
                       step.position_ids, step.input_ids, bufs["index"])

        def prefill():
            return step.forward_tokens(bufs["ids"], bufs["pos"], bufs["zeros"], step.block_table, step.key_mask,
                                       logits_index=bufs["index"], fresh=True)

        if length > 2048:  # a graph's private pool would keep the long prefill's activations: run it eagerly
            return prefill()[:batch]
        return step.replay(key, prefill)[:batch].clone()

    @torch.inference_mode()
    def generate(self, gc, model_kwargs) -> torch.Tensor | GenerateDecoderOnlyOutput:
        """Decode a call :meth:`check` accepted (the caller holds ``call_lock``).

        Args:
            gc: the call's prepared ``GenerationConfig``.
            model_kwargs: ``input_ids`` [batch, prompt_len] int64 (left padded), optional ``attention_mask``
                [batch, prompt_len], ``streamer``, and a passed PagedCache (``past_key_values`` / ``cache``).

        Returns:
            [batch, prompt_len + new] int64, ``pad_token_id`` after a row's EOS, as transformers returns them; with
            ``return_dict_in_generate``, transformers' output class holding them and the call's PagedCache (see
            :meth:`_output`). A passed PagedCache is grown in place.
        """
        device = self.device
        input_ids = model_kwargs["input_ids"].to(device)
        streamer = model_kwargs.get("streamer")
        batch, prompt_len = input_ids.shape
        max_new = self._max_new(gc, prompt_len)
        if max_new <= 0:
            return input_ids
        attention_mask, eos_list, pad = call_inputs(gc, model_kwargs, input_ids, self.vocab_size)

        processors = LogitsProcessorList()
        if repetition_penalty(gc) is not None:  # first, as in transformers' processor list
            processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty(gc)))
        # transformers' _prepare_generated_length: min_new_tokens, when set, takes precedence over min_length
        min_length = (gc.min_length or 0) if gc.min_new_tokens is None else prompt_len + gc.min_new_tokens
        # the EOS ids on the device, made only for the length processors and the eager loop below (a copy from host
        # memory that the host waits for, before the prefill; the graphed greedy loop writes its own with fills)
        eos_t = (torch.tensor(eos_list, dtype=torch.long, device=device)
                 if eos_list and (min_length > 0 or (gc.min_new_tokens or 0) > 0) else None)
        if eos_list and min_length > 0:
            processors.append(MinLengthLogitsProcessor(min_length, eos_t, device=device))
        if eos_list and (gc.min_new_tokens or 0) > 0:
            processors.append(MinNewTokensLengthLogitsProcessor(prompt_len, gc.min_new_tokens, eos_t,
                                                                device=device))
        processors.extend(sampling_warpers(gc))

        prefix = passed_cache(model_kwargs)
        step, logits = self.start(input_ids, attention_mask, max_new, prefix=prefix)
        cache = self.cache
        try:
            if not gc.do_sample and not len(processors) and streamer is None and len(eos_list) <= 8:
                n, tokens = self._greedy_in_graph(step, logits, input_ids, batch, prompt_len, max_new, pad, eos_list)
                self.last_stats = cache.memory_stats(length=prompt_len + n - 1)
                return self._output(gc, tokens[:, : prompt_len + n], prefix)
            if eos_t is None:
                eos_t = torch.tensor(eos_list, dtype=torch.long, device=device)
            tokens = torch.full((batch, prompt_len + max_new), pad, dtype=torch.long, device=device)
            tokens[:, :prompt_len] = input_ids
            unfinished = torch.ones(batch, dtype=torch.bool, device=device)
            steps_run = torch.zeros((), dtype=torch.long, device=device)
            if streamer is not None:
                streamer.put(input_ids.cpu())
            cur = prompt_len
            watch = (_EosWatch(step, EOS_LAG) if eos_list and streamer is None and step.use_graph and EOS_LAG > 0
                     else None)
            # Sampling: the random-number state before each recent step's draw. Steps past the last EOS (the host
            # learns of it a few steps late) draw too; the state after the draws transformers' loop makes is put
            # back at the end, so that later draws (the next call's) are the ones they would be.
            every = self.sync_interval(device)
            rng = _RngStates(device, max(EOS_LAG, every) + 2) if gc.do_sample and eos_list else None
            for i in range(max_new):
                if rng is not None:
                    rng.save(i)
                scores = processors(tokens[:, :cur], logits) if len(processors) else logits
                if gc.do_sample:
                    probs = torch.softmax(scores, dim=-1)
                    next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
                else:
                    next_tokens = scores.argmax(dim=-1)
                steps_run += unfinished.any()
                next_tokens = torch.where(unfinished, next_tokens, torch.full_like(next_tokens, pad))
                tokens[:, cur] = next_tokens
                cur += 1
                if streamer is not None:
                    streamer.put(next_tokens.cpu())
                if eos_list:
                    unfinished &= ~torch.isin(next_tokens, eos_t)
                if i == max_new - 1:
                    break
                if watch is not None:
                    if watch.all_finished(unfinished):
                        break
                elif (streamer is not None or (i + 1) % every == 0) and eos_list and not bool(unfinished.any()):
                    break
                logits = _next_logits(step, batch, next_tokens, i)
            if streamer is not None:
                streamer.end()
            n = int(steps_run)
            if rng is not None:
                rng.restore(n)  # the state after n draws, as after transformers' loop
            self.last_stats = cache.memory_stats(length=prompt_len + n - 1)
            return self._output(gc, tokens[:, : prompt_len + n], prefix)
        finally:
            cache.release()

    @torch.inference_mode()
    def decode_prepared(self, input_ids: torch.Tensor, logits_processor, stopping_criteria, gc, model_kwargs,
                        streamer=None, prefix: PagedCache | None = None):
        """transformers' sampling / greedy loop (``GenerationMixin._sample``) on the fast path: the decoding method
        ``generate`` calls after its own preparation (``custom_generate=``), for calls :meth:`check` accepts only
        with ``prepared_loop=True``. Each step's logits (float32) go through transformers' ``logits_processor``
        with the tokens so far, the token is sampled or picked as there, rows that finished get the pad id,
        and ``stopping_criteria`` (length, EOS, time, the caller's) decide when to stop; the forward passes are
        hf-accel's paged prefill and decode steps (CUDA graphs on GPU). The caller holds ``call_lock``.

        Args:
            input_ids: [batch, prompt_len] int64, left padded, as transformers prepared them (rows already
                repeated for ``num_return_sequences``; the streamer already has them).
            logits_processor / stopping_criteria: transformers' prepared ``LogitsProcessorList`` /
                ``StoppingCriteriaList``.
            gc: transformers' prepared ``GenerationConfig`` (``max_length`` resolved, ``_pad_token_tensor`` set).
            model_kwargs: the rest of transformers' model kwargs (``attention_mask`` [batch, prompt_len] or None
                when it holds no padding; the cache transformers made is not used).
            streamer: gets each step's tokens [batch] and ``end()``.
            prefix: a PagedCache the caller passed (a previous turn's; :meth:`check` accepted it), continued.

        Returns:
            [batch, prompt_len + new] int64, or with ``return_dict_in_generate`` transformers' output class with the
            sequences, ``scores`` / ``logits`` (tuples of [batch, vocab] float32 per step) where asked, and the
            call's PagedCache (:meth:`_output`).

        Raises:
            RuntimeError: ``max_length`` leaves no room for a new token (``check`` refuses such calls).
        """
        device = self.device
        input_ids = input_ids.to(device)
        batch, prompt_len = input_ids.shape
        max_new = (gc.max_length or 0) - prompt_len
        if max_new <= 0:
            raise RuntimeError(f"max_length {gc.max_length} leaves no new token after {prompt_len} prompt tokens")
        mask = model_kwargs.get("attention_mask")
        mask = torch.ones_like(input_ids) if mask is None else mask.to(device)
        as_dict = bool(getattr(gc, "return_dict_in_generate", False))
        scores = () if as_dict and gc.output_scores else None
        raw_logits = () if as_dict and gc.output_logits else None
        pad = gc._pad_token_tensor
        has_eos_criteria = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
        unfinished = torch.ones(batch, dtype=torch.long, device=device)
        step, logits = self.start(input_ids, mask, max_new, prefix=prefix)
        cache = self.cache
        try:
            ids = input_ids
            for i in range(max_new):
                next_logits = logits.to(copy=True, dtype=torch.float32)
                next_scores = logits_processor(ids, next_logits)
                if scores is not None:
                    scores += (next_scores,)
                if raw_logits is not None:
                    raw_logits += (next_logits,)
                if gc.do_sample:
                    probs = torch.softmax(next_scores, dim=-1)
                    next_tokens = torch.multinomial(probs, num_samples=1).squeeze(1)
                else:
                    next_tokens = torch.argmax(next_scores, dim=-1)
                if has_eos_criteria:
                    next_tokens = next_tokens * unfinished + pad.to(device) * (1 - unfinished)
                ids = torch.cat([ids, next_tokens[:, None]], dim=-1)
                if streamer is not None:
                    streamer.put(next_tokens.cpu())
                unfinished = unfinished & ~stopping_criteria(ids, scores)
                if unfinished.max() == 0 or i == max_new - 1:  # the cache holds max_new new tokens per row
                    break
                logits = _next_logits(step, batch, next_tokens, i)
            if streamer is not None:
                streamer.end()
            self.last_stats = cache.memory_stats(length=ids.shape[1] - 1)
            return self._output(gc, ids, prefix, scores=scores, logits=raw_logits)
        finally:
            cache.release()

    def _output(self, gc, sequences: torch.Tensor, prefix: PagedCache | None, **outputs):
        """What ``generate`` returns: ``sequences``, or with ``return_dict_in_generate`` transformers' output
        class holding them, ``outputs`` (``scores`` / ``logits``: tuples of per-step tensors, or None) and the K/V of
        every token but the last (what transformers' loop leaves in its cache) in ``prefix`` (the caller's cache,
        grown in place) or a new growable PagedCache. A passed cache gets them without ``return_dict_in_generate``
        too, as transformers' loop fills it. The tensors returned are ordinary tensors, not inference tensors (as
        transformers returns them: a caller may feed them to a forward tracked by autograd, or write into them)."""
        as_dict = getattr(gc, "return_dict_in_generate", False)
        with torch.inference_mode(False):
            sequences = sequences.clone()
            outputs = {k: None if v is None else tuple(t.clone() for t in v) for k, v in outputs.items()}
        if prefix is None and not as_dict:
            return sequences
        batch, keep = sequences.shape[0], sequences.shape[1] - 1
        target = prefix
        if target is None:
            target = PagedCache(self.model.config, num_blocks=max(1, batch * -(-keep // self.block_size)),
                                block_size=self.block_size, growable=True)
        self._export(target, keep, batch)
        if not as_dict:
            return sequences
        fields = {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)}
        return GenerateDecoderOnlyOutput(sequences=sequences, **outputs,
                                         **{"cache" if "cache" in fields else "past_key_values": target})

    def _export(self, target: PagedCache, keep: int, batch: int) -> None:
        """Write the K/V of token positions ``target.get_seq_length() .. keep - 1`` of this call's rows from the
        engine's pools into ``target`` (room checked by :meth:`check`, or ``target.growable``). Its pools are
        created (or grown) as ordinary tensors, not inference tensors: the caller may continue the cache outside
        ``torch.inference_mode`` (transformers' loop writes into it in place)."""
        with torch.inference_mode(False):
            if not all(layer.is_initialized for layer in target.layers):
                attn0 = self.model.model.layers[0].self_attn
                target.allocate_pools(self.model.config.num_key_value_heads, attn0.head_dim,
                                      next(self.model.parameters()).dtype, self.device)
            m = target.manager
            if not target.seq_ids:
                target.seq_ids = [m.allocate(0) for _ in range(batch)]
            start = target.get_seq_length()
            need = m.blocks_needed_together(target.seq_ids, keep - start)
            if need > m.num_free_blocks:
                target._grow(max(need - m.num_free_blocks, m.num_blocks))
        copies = []
        for s in target.seq_ids:
            copies += m.append(s, keep - start)
        for src, dst in copies:  # copy-on-write of shared partly filled blocks
            for layer in target.layers:
                layer.keys[dst].copy_(layer.keys[src])
                layer.values[dst].copy_(layer.values[src])
        copy_kv(self.cache, self.cache.seq_ids, target, target.seq_ids, start, keep)
        for layer in target.layers:
            layer.length = keep
        target._step = None
