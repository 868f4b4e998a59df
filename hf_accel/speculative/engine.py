"""Speculative decoding on the fast path: draft ``k`` tokens, verify them in one target pass over the
paged cache, commit the accepted ones plus one target token per row.

One *verify step* (a "round") per row: the last committed token ``x`` and ``k`` drafts go through the
target as ``q_len = k + 1`` tokens at the row's own cache length and rotary positions (the decode step
generalised to several tokens: paged prefill attention with a causal mask), then
:func:`~.verify.greedy_accept` / :func:`~.verify.rejection_sample` pick ``n + 1`` tokens to commit.
Rejected drafts are rolled back by not advancing the row's cache length: their K/V stay in slots past
the length, masked out and overwritten by the next step, so the cache is exactly what plain decoding
would have written (``tests/speculative`` checks this). Rows advance by their own accepted counts
(batch > 1); finished rows commit nothing.

The whole round (drafting, verify pass, acceptance, bookkeeping) is static-shape device work and is
captured in one CUDA graph per (batch bucket, table bucket, k); the host replays it and reads a few
counters (one sync per round), which it needs to adapt ``k``:

*Adaptive draft length.* The per-draft acceptance probability ``a`` is estimated by the maximum
likelihood of a truncated geometric (accepted drafts / drafts examined, recent rounds weighted more), the
expected tokens per round is ``(1 - a^(k+1)) / (1 - a)`` (Leviathan et al. 2023, §3.1, Eq. 1), and each
round uses the k in ``{0, 1, 2, 4, ..., k_max}`` with the most expected tokens per second, with round
times measured on this machine (a prior until measured). ``k = 0`` is plain decoding ("backed off"); every
16th backed-off round probes the best ``k > 0`` again so the estimate can recover.

*Match-gated prompt lookup* (``SpeculativeConfig.match_gated``, the default with ``adaptive`` at batch 1): each round
ends with the next round's n-gram lookup, and the host chooses the next round's k from the rows' matched
n-gram lengths (:class:`~.draft_length._GatedChooser`): a round in which no row matched, or only matched
n-grams that rarely hold, is a plain step rather than a verify pass over drafts that would be rejected.
The host then waits for each round before launching the next (no round in flight).

*A draft model while backed off.* Plain rounds do not run the draft model: its paged cache lags behind
the committed tokens and is caught up by one forward over a fixed window of the last committed tokens
right before the next round that drafts (:func:`~.draft_window.catch_up_inputs` says why the window
is exact).
"""

from __future__ import annotations

import time
import weakref

import torch

from hf_accel._logging import log_once
from hf_accel.cache import paged_cache
from hf_accel.engine.call_options import call_inputs, eos_ids, passed_cache, repetition_penalty, sampling_warpers
from hf_accel.engine.graphs import capture as capture_graph
from hf_accel.engine.transfers import fill_from_host
from hf_accel.kernels.argmax import argmax_rows
from hf_accel.kernels.commit_tokens import (INFO_CLASS_COUNTS, INFO_SIZE, NUM_CLASSES,
                                            commit_tokens, commit_tokens_ref)
from hf_accel.kernels.host_counters import HostCounters, host_counters_available, publish_counters, publish_counters_ref
from hf_accel.kernels.ngram_lookup import ngram_lookup
from hf_accel.kernels.verify_inputs import verify_inputs, verify_inputs_ref
from hf_accel.speculative.config import _NO_DRAFT_STEP, SpeculativeConfig, check_draft, head_rows_reason
from hf_accel.speculative.proposers import draft_chain, prompt_lookup
from hf_accel.speculative.verify import rejection_sample, sample
from hf_accel.speculative import draft_length
from hf_accel.speculative.draft_length import _GatedChooser, _KChooser, _candidates
from hf_accel.speculative.draft_window import catch_up_inputs, catch_up_width, refeed_inputs
from hf_accel.speculative.round_counters import read_ungated_round, update_gated
from hf_accel.speculative.state import RoundState

#: A round's verify inputs (last committed token + drafts, positions, cache lengths) from one
#: :func:`~hf_accel.kernels.verify_inputs.verify_inputs` launch where the round runs Triton kernels, instead of
#: ~9 small PyTorch kernels inside the round's graph.
VERIFY_INPUTS_KERNEL = True

#: Match-gated lookup at batch 1: the n-gram lookup kernel writes the class counts (and clamps the class) in
#: its own launch (:func:`~hf_accel.kernels.ngram_lookup.ngram_lookup`'s ``class_counts``) instead of a zero
#: fill, a bool-to-int64 cast and a scatter-add after it: three kernels less in every round's graph. The round
#: times did not resolve the difference (H200, real SmolLM2 bf16, ``profile_speculative_round-counts-kernel-on/off-
#: 20261203-8c738be.json``: gated plain round 0.523 vs 0.519 ms, gated k = 15 round 0.640 vs 0.644, with the
#: unchanged plain step at 0.496 vs 0.489 in the same two runs).
LOOKUP_CLASS_COUNTS_KERNEL = True

#: Each round's graph ends with a kernel that writes its counters into page-locked host memory, which the host
#: polls (:mod:`hf_accel.kernels.host_counters`), instead of a device-to-host copy after the round and a wait on
#: its CUDA event. Synthetic rounds on an H100 (``profile_round_readback-*-h100-20261206-e2234c8.json``): the copy
#: cost the GPU 11.1-11.4 µs per round, the kernel's stores 1.5-2.4 µs; a round the host waits for before it
#: launches the next (match-gated) 12.0-15.4 µs against 6.0-6.7 µs. Real SmolLM2 bf16 on an H100, on / off in
#: turns, two runs each (``bench_speculative-mapped-counters-*-h100-20261206-ef54d56.json``): early exit's plain
#: rounds at batch 1 (one per queued item) 0.435-0.443 ms against 0.440-0.450 (one outlier of 0.726), its speedup
#: 0.96-1.06x against 0.92-0.99x; prompt lookup's match-gated rounds and batch 8 did not separate from the
#: run-to-run spread (passages at batch 1 2.45x / 2.22x against 2.37x / 2.34x), as with the gated-only mailbox of 3
#: December (3fc1e09, reverted in 2835f61). Where page-locked memory cannot be written from the device, the copy is
#: used (logged). The poll releases the GIL between reads (added after these runs).
HOST_MAPPED_COUNTERS = True


class SpeculativeEngine:
    """Speculative ``generate`` for one target model (and its :class:`~hf_accel.engine.fast_generate.FastEngine`)
    with one proposer method. Created by ``accelerate_model(model, speculative=...)`` or per call from
    ``generate(assistant_model=...)`` / ``generate(prompt_lookup_num_tokens=...)``."""

    def __init__(self, fast, config: SpeculativeConfig):
        self.fast = fast
        self.model = fast.model
        self.config = config
        self.draft_fast = None
        self.draft_accelerated_here = False
        n_layers = len(self.model.model.layers)
        if config.method == "early_exit":
            if n_layers < 2:
                raise ValueError("early-exit drafting needs a model with at least 2 layers")
            self.exit_layer = config.exit_layer or max(1, n_layers // 2)
            if self.exit_layer >= n_layers:
                raise ValueError(f"exit_layer must be < the model's {n_layers} layers, got {self.exit_layer}")
        if config.method == "draft_model":
            self.draft_fast = self._draft_engine(config.draft_model)
        self.graphs: dict = {}
        self.states: dict = {}
        self.round_times: dict = {}  # graph key -> {k: seconds per round}, carried from call to call
        self._graph_cache = None  # weak references to the caches whose pools the graphs read
        self.last_stats: dict | None = None

    def _draft_engine(self, draft):
        """The draft model's FastEngine; accelerates the draft if it is not yet (reverted again if a check
        after that fails, so a refused draft is left as it was)."""
        from hf_accel.integrations.patch import _STATE_ATTR, accelerate_model, is_accelerated, revert_model

        check_draft(self.model, draft)
        self.draft_accelerated_here = not is_accelerated(draft)
        if self.draft_accelerated_here:
            accelerate_model(draft)
            # named by accelerate_model's error if the caller then accelerates the draft with other options
            getattr(draft, _STATE_ATTR)["draft_of"] = type(self.model).__name__
        try:
            engine = getattr(draft, "_hf_accel_engine", None)
            if engine is None:
                raise ValueError(_NO_DRAFT_STEP)
            reason = engine._model_reason()
            if reason:
                raise ValueError(f"the draft model cannot run hf-accel's decode step: {reason}")
        except BaseException:
            if self.draft_accelerated_here:
                revert_model(draft)
                self.draft_accelerated_here = False
            raise
        engine.fused = self.fast.fused
        return engine

    def draft_changed(self) -> bool:
        """Whether the draft model no longer runs this engine's draft decode engine: the caller reverted it
        (``revert_model``), perhaps accelerating it again since (a new engine)."""
        return getattr(self.config.draft_model, "_hf_accel_engine", None) is not self.draft_fast

    def owns_draft(self) -> bool:
        """Whether the draft model is this engine's to revert: it accelerated the draft, and the draft still runs
        that acceleration (the caller neither reverted it nor reverted and accelerated it again since)."""
        return (self.draft_accelerated_here and self.config.draft_model is not None and self.draft_fast is not None
                and not self.draft_changed())

    def match_gated(self, batch: int) -> bool:
        """Whether a call of ``batch`` rows chooses its rounds from the next round's prompt-lookup matches
        (:class:`_GatedChooser`); ``SpeculativeConfig.match_gated=None``: for one row only."""
        cfg = self.config
        gated = batch == 1 if cfg.match_gated is None else cfg.match_gated
        return cfg.method == "prompt_lookup" and cfg.adaptive and gated

    # -- eligibility ----------------------------------------------------------------------------------
    def check(self, gc, model_kwargs) -> str | None:
        """Why this call cannot decode speculatively (None if it can); the caller then runs the plain fast path.
        ``model_kwargs``: the call's ``input_ids`` [batch, prompt_len], ``streamer`` and passed cache
        (``past_key_values`` / ``cache``), as for :meth:`generate`; ``gc.return_dict_in_generate`` is read too."""
        if model_kwargs.get("streamer") is not None and model_kwargs["input_ids"].shape[0] > 1:
            return ("a streamer with more than one row (a verify step commits a different number of tokens per "
                    "row; a streamer takes one token per row at a time)")
        if ((passed_cache(model_kwargs) is not None or getattr(gc, "return_dict_in_generate", False))
                and model_kwargs["input_ids"].shape[0] > 1):
            # the returned cache must hold what transformers' loop leaves, also the K/V of the padding a row that
            # finished first is fed while the others go on: verify steps stop a finished row instead (at batch 1
            # every position before the last token holds the committed token's K/V)
            return "a passed cache or return_dict_in_generate with more than one row (multi-turn batches)"
        if (gc.min_length or 0) > 0 or (gc.min_new_tokens or 0) > 0:
            return "min_length / min_new_tokens (their logits processor depends on each position's length)"
        if repetition_penalty(gc) is not None:
            return "repetition_penalty (each verified position's penalty depends on the drafts before it)"
        if len(eos_ids(gc.eos_token_id)) > 8:
            return "more than 8 EOS ids"
        if self.config.method == "early_exit" and self.exit_layer >= len(self.model.model.layers):
            return (f"exit_layer {self.exit_layer} is not below the model's {len(self.model.model.layers)} layers now "
                    "(layers were removed since accelerate_model)")
        if self.draft_fast is not None:
            # the draft changed since it was checked (moved, cast, put in training mode): its engine releases
            # what it built for the old weights, and a draft it cannot run declines here
            reason = self.draft_fast._model_reason()
            if reason is not None:
                return f"the draft model cannot run hf-accel's decode step now: {reason}"
            draft_vocab, target_vocab = self.draft_fast.vocab_size, self.fast.vocab_size
            if draft_vocab != target_vocab:  # e.g. resize_token_embeddings on one of them since the set-up
                return (f"the draft model's vocabulary ({draft_vocab} tokens) differs from the target's "
                        f"({target_vocab}) now; the draft must share the target's tokenizer")
            reason = head_rows_reason(self.model, self.config.draft_model)
            if reason is not None:  # an LM head replaced on one of them since the set-up
                return reason + " now"
            return self._pools_reason(gc, model_kwargs["input_ids"])
        return None

    def _pools_reason(self, gc, input_ids) -> str | None:
        """Why the target's and the draft model's KV pools of this call do not fit together in free device
        memory (None where they do, or where free memory cannot be read). ``FastEngine.check`` checked the
        target's alone; a pool that must grow is replaced, so its old bytes count as free."""
        grown = freed = 0
        for engine in (self.fast, self.draft_fast):
            need, have = engine.blocks_needed(gc, input_ids), engine._pool_blocks()
            if need > have:
                grown += need * engine._block_bytes()
                freed += have * engine._block_bytes()
        if not grown:  # both pools hold the call: no free-memory read
            return None
        free = paged_cache.free_kv_bytes(self.model.device)
        if free is None:
            return None
        if grown > free + freed:
            return (f"the target's and the draft model's KV caches of prompt + max_new_tokens ({grown / 2**30:.1f} GiB "
                    f"to allocate) do not fit in free device memory ({(free + freed) / 2**30:.1f} GiB)")
        return None

    # -- one round --------------------------------------------------------------------------------------
    def _round(self, k: int, st: RoundState, ctx) -> None:
        """Draft ``k`` tokens, verify, commit (updates ``st``; device work only)."""
        b = st.lengths.shape[0]
        inputs = verify_inputs if ctx["kernels"] and VERIFY_INPUTS_KERNEL else verify_inputs_ref
        draft_probs = None
        if k == 0:  # plain round; a draft model's cache lags until _catch_up_draft
            drafts = st.drafts[:, :0]
            valid = st.valid[:, :0]
        elif ctx["gated"]:  # looked up at the end of the previous round
            drafts, valid = st.drafts[:, :k], st.valid[:, :k]
        elif self.config.method == "prompt_lookup":
            drafts, valid = prompt_lookup(st.tokens, st.lengths, st.starts, k, self.config.max_ngram,
                                          self.config.min_ngram, use_kernel=ctx["kernels"])
        elif self.config.method == "early_exit":
            x0, pos0, cache_lens = inputs(st.tokens, st.lengths, st.starts, st.drafts[:, :0])
            drafts, draft_probs = draft_chain(ctx["early"], x0, pos0, cache_lens, ctx["block_table"],
                                              ctx["key_mask"], k, ctx["warp"], ctx["do_sample"])
            valid = torch.ones_like(drafts, dtype=torch.bool)
        else:  # draft model: re-feed the last two committed tokens (fills the gap after k accepted drafts)
            ids2, pos2, lens2 = refeed_inputs(st)
            drafts, draft_probs = draft_chain(ctx["draft2"], ids2, pos2, lens2, ctx["draft_block_table"],
                                              ctx["draft_key_mask"], k, ctx["warp"], ctx["do_sample"],
                                              next_step=ctx["draft1"])
            valid = torch.ones_like(drafts, dtype=torch.bool)
        ids, positions, cache_lens = inputs(st.tokens, st.lengths, st.starts, drafts)
        logits = ctx["verify"][k].forward_tokens(ids, positions, cache_lens, ctx["block_table"], ctx["key_mask"])
        if ctx["do_sample"]:
            probs = torch.softmax(ctx["warp"](logits.flatten(0, 1)), dim=-1).view_as(logits)
            out, n = rejection_sample(drafts, valid, draft_probs, probs)
        else:
            # greedy: the commit counts the matching prefix
            if ctx["kernels"] and logits.is_cuda:
                vocab = logits.shape[-1]
                out = argmax_rows(logits.view(-1, vocab), scratch=st.argmax_scratch(vocab)).view(b, k + 1)
            else:
                out = logits.argmax(dim=-1)
            n = None
        commit = commit_tokens if ctx["kernels"] and b <= 256 else commit_tokens_ref  # one program: <= 256 rows
        commit(out, n, drafts, valid, st.tokens, st.lengths, st.remaining, st.active, st.eos, st.info, st.totals,
               count_step=k > 0, classes=st.ngram if ctx["gated"] else None)
        if ctx["gated"]:
            self._lookup_next(st, ctx)
        host = ctx.get("host")
        # published by the replays of the round's graph (not by the warm-up runs before its capture, which the
        # host does not count), or by every eager round
        if host is not None and (not ctx["use_graph"] or torch.cuda.is_current_stream_capturing()):
            publish = publish_counters if ctx["kernels"] else publish_counters_ref
            publish(st.info[: host.n], host.seq, host.ring)

    def _lookup_next(self, st: RoundState, ctx) -> None:
        """Match-gated prompt lookup: the next round's drafts, valid masks and match classes into ``st``, and
        the active rows per class into ``info[INFO_CLASS_COUNTS:]`` (device work only)."""
        cfg = self.config
        k_max = st.drafts.shape[1]
        counts = st.info[INFO_CLASS_COUNTS: INFO_CLASS_COUNTS + NUM_CLASSES]
        if LOOKUP_CLASS_COUNTS_KERNEL and ctx["kernels"] and st.tokens.shape[0] == 1:  # counts in the same launch
            ngram_lookup(st.tokens, st.lengths, st.starts, k_max, cfg.max_ngram, cfg.min_ngram,
                         out=(st.drafts, st.valid, st.ngram), class_counts=counts, active=st.active,
                         check_lengths=False)  # the engine's own rows (no device read before a round)
            return
        prompt_lookup(st.tokens, st.lengths, st.starts, k_max, cfg.max_ngram, cfg.min_ngram, use_kernel=ctx["kernels"],
                      out=(st.drafts, st.valid, st.ngram))
        if cfg.max_ngram >= NUM_CLASSES:  # longer matches share the last class
            st.ngram.clamp_(max=NUM_CLASSES - 1)
        counts.zero_()
        counts.scatter_add_(0, st.ngram, st.active.long())

    def _catch_up_draft(self, st: RoundState, ctx) -> None:
        """One draft-model forward over :func:`~.draft_window.catch_up_inputs` (device work only; writes the
        draft's cache)."""
        ids, pos, lens = catch_up_inputs(st, ctx["catch_up_width"])
        ctx["draft_catch_up"].forward_tokens(ids, pos, lens, ctx["draft_block_table"], ctx["draft_key_mask"],
                                             last_only=True)

    def _run_graph(self, gkey, fn, st: RoundState, ctx, replay: bool = True) -> bool:
        """``fn()`` (device work on ``st`` and the caches) as a CUDA-graph replay once captured under ``gkey``;
        with ``replay=False`` only the capture, leaving ``st`` as it was. Returns True if captured now."""
        if not ctx["use_graph"]:
            fn()
            return False
        graph = self.graphs.get(gkey)
        captured = graph is None
        if captured:
            saved = st.snapshot()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile / pick kernels outside the graph; the state is restored after
                    fn()
                    st.restore(saved)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with capture_graph(graph):
                fn()
            self.graphs[gkey] = graph
        if replay:
            graph.replay()
        return captured

    def _run_round(self, k: int, st: RoundState, ctx, key, replay: bool = True) -> bool:
        """One round (a CUDA-graph replay once captured; with ``replay=False`` only the capture, leaving
        ``st`` as it was). Returns True if the graph was captured now."""
        return self._run_graph((*key, k), lambda: self._round(k, st, ctx), st, ctx, replay)

    def _run_catch_up(self, st: RoundState, ctx, key, replay: bool = True) -> bool:
        """:meth:`_catch_up_draft` (a CUDA-graph replay once captured, as :meth:`_run_round`)."""
        return self._run_graph((*key, "catch_up"), lambda: self._catch_up_draft(st, ctx), st, ctx, replay)

    # -- generate -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, gc, model_kwargs, assisted: bool = False):
        """Speculative ``generate`` for a call the fast path accepted (``FastEngine.check``) and
        :meth:`check` allows.

        Args:
            gc: the call's prepared ``GenerationConfig``.
            assisted: the call asked for it with transformers' assisted-generation arguments: a streamer gets each
                round's committed tokens as one [1, n] tensor, as transformers' assisted loop puts them; else (the
                model was accelerated with ``speculative=``, the call is a plain ``generate``) one [1] tensor per
                token, as transformers' plain loop puts them.
            model_kwargs: ``input_ids`` [batch, prompt_len] int64 (left padded), optional ``attention_mask``
                [batch, prompt_len], ``streamer`` (batch 1) and a passed PagedCache (batch 1: a previous turn's,
                continued as :meth:`~hf_accel.engine.fast_generate.FastEngine.start` does).

        Returns:
            [batch, prompt_len + new] int64 — prompt and new tokens, ``pad_token_id`` after a row's EOS, as
            transformers returns them (with ``return_dict_in_generate``, transformers' output class holding them
            and the cache: ``FastEngine._output``); ``self.last_stats`` holds the counters (see
            ``speculative_stats``).

        The caller holds the target's ``FastEngine.call_lock``; a draft model's engine lock is taken here
        (the draft's own ``generate`` calls in other threads wait).
        """
        if self.draft_fast is None:
            return self._generate(gc, model_kwargs, assisted)
        with self.draft_fast.call_lock:
            return self._generate(gc, model_kwargs, assisted)

    def _generate(self, gc, model_kwargs, assisted: bool = False) -> torch.Tensor:
        fast, cfg = self.fast, self.config
        device = fast.device
        input_ids = model_kwargs["input_ids"].to(device)
        streamer = model_kwargs.get("streamer")
        batch, prompt_len = input_ids.shape
        max_new = fast._max_new(gc, prompt_len)
        attention_mask, eos_list, pad = call_inputs(gc, model_kwargs, input_ids, fast.vocab_size)
        warp = sampling_warpers(gc)
        # (the warpers' unused input ids: made only when there are warpers, not as a launch before every prefill)
        no_ids = torch.zeros(1, 1, dtype=torch.long, device=device) if len(warp) else None

        def warp_fn(scores):
            return warp(no_ids, scores) if len(warp) else scores

        k_max = cfg.num_draft_tokens
        lookahead = k_max + 1
        # a draft model that may back off catches up over a window of this width (its positions and slots
        # must fit in every row's reserved blocks, for short generations too)
        width = catch_up_width(_KChooser.max_plain_run)
        catch_up = cfg.method == "draft_model"
        if catch_up:
            lookahead = max(lookahead, width - prompt_len - max_new)
        prefix = passed_cache(model_kwargs)  # batch 1 (check): the previous turn's cache, continued
        if gc.do_sample:
            log_once("spec:sampling", "hf-accel: speculative sampling by rejection sampling (Leviathan et al. 2023, "
                     "Chen et al. 2023): each token has the target's distribution, but a seed gives other draws "
                     "than transformers' sampling loop")
        step, logits = fast.start(input_ids, attention_mask, max_new, lookahead=lookahead, prefix=prefix)
        cache = fast.cache
        draft_cache = None
        try:
            ctx = {"warp": warp_fn, "do_sample": bool(gc.do_sample), "block_table": step.block_table,
                   "key_mask": step.key_mask, "use_graph": step.use_graph,
                   # one-launch Triton kernels for the lookup and the commit on CUDA (and on CPU with the
                   # fused step, under Triton's interpreter); their PyTorch references otherwise
                   "kernels": step.fused or device.type == "cuda",
                   "gated": self.match_gated(batch)}
            nb = step.max_blocks
            ctx["verify"] = {k: fast._step_for(batch, nb, q_len=k + 1) for k in _candidates(k_max)}
            if cfg.method == "early_exit":
                ctx["early"] = fast._step_for(batch, nb, q_len=1, num_layers=self.exit_layer)
            if cfg.method == "draft_model":
                dfast = self.draft_fast
                dstep, _ = dfast.start(input_ids, attention_mask, max_new, lookahead=lookahead)
                draft_cache = dfast.cache
                if dstep.batch != step.batch:
                    raise RuntimeError("draft and target decode steps have different batch buckets")
                ctx.update(draft_block_table=dstep.block_table, draft_key_mask=dstep.key_mask,
                           draft1=dstep, draft2=dfast._step_for(batch, dstep.max_blocks, q_len=2))
                if catch_up:
                    ctx.update(catch_up_width=width,
                               draft_catch_up=dfast._step_for(batch, dstep.max_blocks, q_len=width))
            caches = (self.fast.cache, self.draft_fast.cache if self.draft_fast is not None else None)
            if self._graph_cache is None or any(c is not (r() if r is not None else None)
                                                for c, r in zip(caches, self._graph_cache)):
                self.graphs.clear()  # graphs point at the pools of these caches and at the states
                self.states.clear()
                # weak: a fast engine that replaces its cache (a larger pool) frees the old pools at once
                self._graph_cache = tuple(None if c is None else weakref.ref(c) for c in caches)
            rows = step.batch
            # graphs bake in the buffers, the sampling settings, the pad id and the lookup's n-gram lengths
            mapped = HOST_MAPPED_COUNTERS and host_counters_available(device)
            key = (rows, nb, bool(gc.do_sample), gc.temperature, gc.top_k, gc.top_p, pad, k_max, ctx["gated"],
                   cfg.max_ngram, cfg.min_ngram, mapped)
            st = self.states.get(key)
            if st is None or not ctx["use_graph"]:
                st = self.states[key] = RoundState(rows, nb * step.block_size + 1, device, k_max)
                if mapped:
                    # gated rounds' choices read the class counts and histograms; ungated ones the counters before
                    st.host = HostCounters(INFO_SIZE if ctx["gated"] else INFO_CLASS_COUNTS, device)
            st.reset(pad)
            host = ctx["host"] = st.host
            st.tokens[:batch, :prompt_len] = input_ids
            if st.eos_ids != tuple(eos_list):  # fill kernels: the prefill is queued, a copy would wait (transfers.py)
                fill_from_host(st.eos, eos_list, -1)
                st.eos_ids = tuple(eos_list)
            first = sample(torch.softmax(warp_fn(logits), dim=-1)) if gc.do_sample else logits.argmax(dim=-1)
            st.tokens[:batch, prompt_len] = first
            st.lengths[:batch] = prompt_len + 1
            st.starts[:batch] = prompt_len - attention_mask.long().sum(-1)
            st.remaining[:batch] = max_new - 1
            st.active[:batch] = (st.remaining[:batch] > 0) & ~torch.isin(first, st.eos)
            if streamer is not None:
                streamer.put(input_ids.cpu())
                streamer.put(first.cpu()[None] if assisted else first.cpu())
            gated = ctx["gated"]
            counts = None
            if gated:  # the first round's lookup; then each round looks up the next one's drafts at its end
                self._lookup_next(st, ctx)
                chooser = _GatedChooser(k_max, self._draft_cost())
            else:
                chooser = _KChooser(k_max, cfg.adaptive, self._draft_cost())
            chooser.times = dict(self.round_times.get(key, {}))  # round times are the machine's, kept per shape
            replays = {}  # k -> its round graph's replay (match-gated: the host launches it the moment it chose)
            if ctx["use_graph"]:  # capture every draft length the chooser may pick now, not mid-generation
                for k in chooser.ks:
                    self._run_round(k, st, ctx, key, replay=False)
                if catch_up and 0 in chooser.ks:
                    self._run_catch_up(st, ctx, key, replay=False)
                if gated:
                    replays = {k: self.graphs[(*key, k)].replay for k in chooser.ks}
            # plain rounds since the last round that drafted; a draft model's cache lags by at most that many
            # tokens (+ 2) and is caught up before the next round that drafts
            plain_run = 0
            ks: dict[int, int] = {}
            # On the GPU the host queues the next round before reading the previous one's counters (one
            # round in flight), so the GPU never waits for the host; the adaptive k uses counters one round old.
            # Match-gated rounds need the previous round's lookup, so none is in flight while choosing.
            ahead = self._rounds_ahead(ctx["use_graph"], streamer is not None, gated)
            pinned, pinned_np = st.host_counters(ctx["use_graph"])

            def counters(event, slot, number):
                """A queued item's counters: polled where its last round wrote them (``number``), else its copy
                (``pinned[slot]``) once its event has completed."""
                if number is not None:
                    return host.wait(number)
                if event is not None:
                    event.synchronize()
                return pinned_np[slot]
            if gated:
                # The first read of the device: the host work above ran while the prefill was on the GPU.
                counts = st.info[INFO_CLASS_COUNTS: INFO_CLASS_COUNTS + NUM_CLASSES].tolist()
            running, max_remaining = bool(st.active.any()), max_new - 1
            inflight: list = []
            deferred = None  # match-gated: the chooser's update for the last round read, run after the next launch
            last_done = None
            slot = 0
            launched = 0  # rounds queued in this call
            while running:
                if gated:
                    k, rounds = chooser.choose(counts, max_remaining, burst=streamer is None)
                    number = host.expect(rounds) if host is not None else None
                    replay = replays.get(k) if streamer is None else None
                    if replay is not None:  # the GPU waits for this launch: nothing else before it
                        for _ in range(rounds):
                            replay()
                else:
                    # every queued round commits at least one token per active row: the rounds in flight leave
                    # at most this budget, so a burst never runs past it (it used to, by up to a burst, when
                    # the last counters read were a round old)
                    budget = max_remaining - sum(item[3] for item in inflight)
                    if budget <= 0 and inflight:  # the rounds in flight finish every row: read them
                        event, done_slot, k, rounds, captured, t0, number = inflight.pop(0)
                        running, max_remaining = read_ungated_round(chooser, event, counters(event, done_slot, number),
                                                                  k, rounds, captured, t0, last_done)
                        last_done = (event, captured) if event is not None else last_done
                        continue
                    k, rounds = chooser.choose(max(budget, 1), burst=streamer is None and
                                               batch >= draft_length.UNGATED_PLAIN_BURSTS_FROM_BATCH)
                    number = host.expect(rounds) if host is not None else None
                    replay = None
                ks[k] = ks.get(k, 0) + rounds
                launched += rounds
                if launched > max_new + 2 * draft_length._PLAIN_BURST + 2:
                    # every round commits a token per active row, and at most an item of rounds is queued past the
                    # end: more rounds mean the counters read on the host are wrong; an error, not an endless loop
                    raise RuntimeError(f"hf-accel: speculative decoding queued {launched} rounds for at most {max_new} "
                                       f"new tokens per row: the rounds' counters read on the host are wrong (a bug; "
                                       f"HOST_MAPPED_COUNTERS={HOST_MAPPED_COUNTERS})")
                before = st.lengths[:batch].clone() if streamer is not None else None
                t0 = time.perf_counter()
                captured = False
                if k == 0:
                    plain_run += rounds
                    assert not catch_up or plain_run <= chooser.max_plain_run, \
                        "plain rounds past the draft's catch-up window"
                else:
                    if catch_up and plain_run:  # counted in this round's time
                        captured |= self._run_catch_up(st, ctx, key)
                    plain_run = 0
                if replay is None:
                    for _ in range(rounds):
                        captured |= self._run_round(k, st, ctx, key)
                if host is None:
                    pinned[slot].copy_(st.info, non_blocking=ctx["use_graph"])
                event = None
                if ctx["use_graph"]:  # the rounds' times
                    event = torch.cuda.Event(enable_timing=True)
                    event.record()
                inflight.append((event, slot, k, rounds, captured, t0, number))
                slot = (slot + 1) % 3
                if deferred is not None:  # the previous round's counters, while this round runs
                    update_gated(chooser, *deferred)
                    deferred = None
                if gated and batch == 1:  # the next choice for each match class, while this round runs
                    chooser.prepare(burst=streamer is None)
                if len(inflight) <= ahead:
                    continue
                event, done_slot, k, rounds, captured, t0, number = inflight.pop(0)
                row = counters(event, done_slot, number)
                if gated:  # only what the next choice needs before the next launch; the rest after it
                    counts = row[INFO_CLASS_COUNTS: INFO_CLASS_COUNTS + NUM_CLASSES].tolist()
                    # CUDA events are read after the next launch; without them (eager rounds) the wall clock now
                    timing = ((event, last_done) if event is not None
                              else None if captured else (time.perf_counter() - t0) / rounds)
                    deferred = (row, k, rounds, captured, timing)
                    last_done = (event, captured)
                else:
                    read_ungated_round(chooser, event, row, k, rounds, captured, t0, last_done)
                    if event is not None:
                        last_done = (event, captured)
                running, max_remaining = bool(row[0]), int(row[4])
                if streamer is not None:
                    after = st.lengths[:batch]
                    if int(after[0]) > int(before[0]):
                        new = st.tokens[:1, int(before[0]): int(after[0])].cpu()
                        if assisted:  # [1, n], as transformers' assisted loop puts them
                            streamer.put(new)
                        else:  # [1] per token, as its plain loop does
                            for token in new[0]:
                                streamer.put(token[None])
            if deferred is not None:
                update_gated(chooser, *deferred)
            if streamer is not None:
                streamer.end()
            if cfg.adaptive:
                self.round_times[key] = dict(chooser.times)
            totals = st.totals.tolist()
            # rounds counted on the device: the host may have queued some after every row had finished
            rounds_per_k = {k: totals[4 + k] for k in sorted(ks) if totals[4 + k]}
            self.last_stats = {
                "method": cfg.method,
                "num_draft_tokens": k_max,
                "match_gated": gated,
                "verify_steps": sum(v for k, v in rounds_per_k.items() if k > 0),
                "backed_off_steps": rounds_per_k.get(0, 0),
                "draft_lengths": {str(k): v for k, v in rounds_per_k.items()},
                "draft_tokens": totals[0],
                "accepted_tokens": totals[1],
                "acceptance_rate": totals[1] / totals[0] if totals[0] else None,
                "mean_accepted_per_step": totals[1] / totals[2] if totals[2] else None,
                "mean_tokens_per_step": totals[3] / totals[2] if totals[2] else None,
                # completion to completion, the host's turnaround included (CUDA events; wall clock on CPU)
                "round_ms": {str(k): 1e3 * t for k, t in sorted(chooser.times.items())},
            }
            generated = int((st.lengths[:batch] - prompt_len).max())
            fast.last_stats = cache.memory_stats(length=prompt_len + generated - 1)
            return fast._output(gc, st.tokens[:batch, : prompt_len + generated].clone(), prefix)
        finally:
            cache.release()
            if draft_cache is not None:
                draft_cache.release()

    @staticmethod
    def _rounds_ahead(graphs: bool, streaming: bool, gated: bool) -> int:
        """Rounds the host queues before reading a round's counters: one on the GPU (CUDA graphs), none with a
        streamer (each round's tokens go out as they come), for match-gated rounds (each needs the last one's
        lookup) or for eager rounds (synchronous on the CPU anyway)."""
        return 1 if (graphs and not streaming and not gated) else 0

    def close(self) -> None:
        """Drop captured graphs and states; revert the draft model if this engine owns it (:meth:`owns_draft`)."""
        self.graphs.clear()
        self.states.clear()
        if self.owns_draft():
            from hf_accel.integrations.patch import revert_model

            revert_model(self.config.draft_model)
        self.draft_accelerated_here = False

    def _draft_cost(self) -> float:
        """Prior time of one drafted token relative to a plain decode step (replaced by measurements)."""
        if self.config.method == "prompt_lookup":
            return 0.03
        if self.config.method == "early_exit":
            return self.exit_layer / len(self.model.model.layers) + 0.05
        d, t = self.config.draft_model, self.model
        ratio = sum(p.numel() for p in d.parameters()) / max(sum(p.numel() for p in t.parameters()), 1)
        return min(1.0, ratio + 0.1)
