"""One decode step of a llama-family model (llama, mistral, qwen2, qwen3) over a paged KV cache,
replayable as a CUDA graph.

The step reads only static buffers (token ids, rotary positions, cache lengths, block table, key
mask) and writes the next-token logits, so one captured graph serves every step of every sequence
state whose batch fits its bucket: ``graph.replay()`` replaces ~30 Python-launched kernels per layer
(the host overhead that bounds transformers' own loop, ~20-30 ms per token on a slow host) with a single
launch. The block table is reserved for the whole generation before the first step, so the host does
no work between replays; slots are computed on the device from the cache length.

Two variants of the same step:

- *fused* (CUDA, standard llama-family blocks): one Triton kernel for RoPE (+ Qwen3's per-head q/k
  norm) + writing K/V into the cache, the paged decode kernel, and matmuls with Q/K/V and gate/up merged
  (:mod:`.merged_weights`). For steps of few token rows on small models the matmuls are
  :func:`~hf_accel.kernels.fused_linear.fused_linear` calls with the residual add + RMSNorm and the SwiGLU
  gate fused in (7 kernels per layer with the split-KV merge); otherwise cuBLAS with separate residual
  add + RMSNorm and SwiGLU kernels (10). Either way ~35 kernels of transformers' layer become a few, each
  rounding where transformers rounds;
- *modules* (CPU, or anything non-standard): the model's own modules (RMSNorm, rotary embedding,
  projections, MLP) with hf-accel's ``reshape_and_cache`` + ``paged_attention``.

The paged kernel runs with a fixed number of KV splits so its grid is static. Graph capture follows PyTorch's ``torch.cuda.graph``
(warm-up on a side stream, then capture into a private memory pool).
"""

from __future__ import annotations

import functools

import torch
import triton

from hf_accel._logging import log_once
from hf_accel.engine import step_switches as switches
from hf_accel.engine.fused_support import fused_linear_supported, fused_supported, plain_linear
from hf_accel.engine.graphs import capture as capture_graph
from hf_accel.engine.transfers import fill_from_host
from hf_accel.kernels.argmax import greedy_tail, scratch_for
from hf_accel.kernels.fused_linear import fused_linear, fused_linear_rope
from hf_accel.kernels.fused_linear_tiles import max_rows, split_k_for, whole_k_fits
from hf_accel.kernels.gemv import gemv, gemv_rope
from hf_accel.kernels.host_counters import HostCounters, host_counters_available, publish_counters
from hf_accel.kernels.paged_attention import paged_attention
from hf_accel.kernels.paged_attention_torch import paged_attention_sdpa
from hf_accel.kernels.prefill import prefill_attention
from hf_accel.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from hf_accel.kernels.reshape_and_cache import slot_mapping as slot_mapping_kernel
from hf_accel.kernels.reshape_and_cache import slot_mapping_ref
from hf_accel.kernels.rms_norm import rms_norm
from hf_accel.kernels.rope_cache import rope_and_cache
from hf_accel.kernels.swiglu import swiglu


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def attention_row_blocks(rows: int) -> int:
    """Row blocks of the paged attention grid for ``rows`` = q_len x GQA group query rows per KV head."""
    return triton.cdiv(rows, 16 if rows <= 16 else (32 if rows <= 32 else 64))


def default_num_splits(programs: int, capacity: int, device) -> int:
    """FlashDecoding partitions for a step whose grid has ``programs`` (batch x KV heads x row blocks)
    before splitting and whose block table spans ``capacity`` tokens.

    Small grids read fastest with ~4 programs per SM, larger ones with ~2 (H200 sweep,
    ``bench_decode-20261130.json``); a split holds at least 64 keys, because a program's time is
    dominated by dependent block-table + K/V loads: at bs1 and a 1k-token table, 4 splits of 256 keys
    took 10 us per layer for SmolLM2 (``profile_decode_step-20261201.json``)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    want = triton.cdiv((4 if programs < 32 else 2) * sms, programs)
    return max(1, min(want, triton.cdiv(capacity, switches.DECODE_MIN_SPLIT_KEYS)))


def _no_step() -> None:
    """:attr:`DecodeStep.on_step` of a step no engine counts."""


class DecodeStep:
    """Static buffers + step function (+ CUDA graph on GPU) for ``batch`` rows of ``q_len`` new tokens.

    ``q_len`` is 1 for decoding; ``q_len = k + 1`` verifies ``k`` draft tokens in one pass (speculative
    decoding: the last accepted token followed by the drafts). ``num_layers`` < the model's layer count
    runs only the first layers (then the final norm and LM head): the early-exit draft of
    self-speculative decoding, writing K/V of those layers into the same cache.

    Buffers (all on the model's device):
        input_ids: [batch, q_len] int64 — tokens fed at this step.
        position_ids: [batch, q_len] int64 — their rotary positions (padding-aware, as transformers
            computes them).
        cache_lens: [batch] int32 — tokens already cached; token ``t`` goes to slot ``cache_lens + t``.
        block_table: [batch, max_blocks] int32 — reserved for the whole generation.
        key_mask: [batch, max_blocks * block_size] uint8 — 0 for padding positions.
        logits: [batch, q_len, vocab] float32 — output.
    """

    def __init__(self, model, cache, batch: int, max_blocks: int, use_graph: bool, fused: bool | None = None,
                 merged=None, q_len: int = 1, num_layers: int | None = None):
        self.model = model
        #: called as each step, verification or prefill starts (the engine sets its ``CallLock.step``)
        self.on_step = _no_step
        self.cache = cache
        self.batch = batch
        self.q_len = q_len
        self.num_layers = len(model.model.layers) if num_layers is None else num_layers
        if not 1 <= self.num_layers <= len(model.model.layers):
            raise ValueError(f"num_layers must be in [1, {len(model.model.layers)}], got {num_layers}")
        self.max_blocks = max_blocks
        self.block_size = cache.block_size
        self.capacity = max_blocks * cache.block_size
        dev = model.device
        self.input_ids = torch.zeros(batch, q_len, dtype=torch.long, device=dev)
        self.position_ids = torch.zeros(batch, q_len, dtype=torch.long, device=dev)
        self.cache_lens = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros(batch, max_blocks, dtype=torch.int32, device=dev)
        self.key_mask = torch.zeros(batch, self.capacity, dtype=torch.uint8, device=dev)
        self.logits = None
        self.graph = None
        self.graph_greedy = None
        self.greedy = None
        self._greedy_eos = None  # the EOS ids in greedy["eos"] (init_greedy)
        self._argmax_scratch = {}  # argmax_scratch: logits shape -> greedy_tail / argmax_rows scratch
        self._host_flags = None  # host_flags: page-locked rows + events of the greedy loop's EOS check
        #: the in-graph greedy step's unfinished flags, written by its graph into page-locked memory
        #: (:data:`~hf_accel.engine.step_switches.GREEDY_HOST_FLAGS`; set at its capture), or None
        self.greedy_flags: HostCounters | None = None
        self.greedy_flags_number = 0  # the number the last replay of the greedy graph publishes
        self.graphs: dict = {}  # extra captured programs (DecodeStep.replay), keyed by their owner
        self.prefill_buffers: dict = {}  # static inputs of the bucketed prefill, keyed by padded length
        self._rotary_rows = None  # fused step: the rotary table (_rotary_table)
        self.use_graph = use_graph and dev.type == "cuda"
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        attn0 = model.model.layers[0].self_attn
        self.head_dim = attn0.head_dim
        # fused=None: on CUDA when supported. fused=True on CPU runs the Triton kernels (interpreter; tests).
        self.fused = dev.type == "cuda" if fused is None else fused
        if self.fused:
            reason = fused_supported(model)
            if reason is not None:  # the module step runs instead: correct, slower
                log_once(f"fused-step:{reason}",
                         f"hf-accel: the fused decode step does not take this model ({reason}); the decode step "
                         "runs the model's own modules with hf-accel's attention and cache")
                self.fused = False
        self.merged = merged  # list of MergedLayer (fused step only) or None; sets small_linear
        row_blocks = attention_row_blocks(q_len * (self.num_heads // self.num_kv_heads))
        self.num_splits = default_num_splits(batch * self.num_kv_heads * row_blocks, self.capacity, dev)
        # Arrival counters (zeros; every launch leaves them at zero) of the split-KV merge inside the
        # attention kernel and of fused_linear's split-K, owned by this step: its kernels run one at a time.
        self.merge_counters = torch.zeros(batch * self.num_kv_heads * row_blocks, dtype=torch.int32, device=dev)
        widest = max([model.lm_head.weight.shape[0]] + [m.weight.shape[0] for m in model.modules()
                                                         if isinstance(m, torch.nn.Linear)])
        self.linear_counters = torch.zeros(triton.cdiv(2 * widest, 16), dtype=torch.int32, device=dev)
        # the widest and narrowest inputs of a layer's matmuls: whether all of them take fused_linear's whole-K
        # path (more rows)
        layer0 = model.model.layers[0]
        projections = [getattr(layer0.self_attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        projections += [getattr(layer0.mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        widths = [m.weight.shape[1] for m in map(plain_linear, projections) if m is not None]
        if not widths:  # (a model the fused step does not take: not read)
            widths = [m.weight.shape[1] for m in layer0.modules() if isinstance(m, torch.nn.Linear)] or [0]
        self.linear_max_k, self.linear_min_k = max(widths), min(widths)
        self.sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1

    @property
    def merged(self):
        return self._merged

    @merged.setter
    def merged(self, value) -> None:
        self._merged = value
        # Whether steps of few rows take the fused norm/linear/SwiGLU kernels (needs merged projections).
        self.small_linear = self.fused and fused_linear_supported(self.model, value) is None
        # Whether one-row steps take gemv (any hidden size); the LM head too when it is a plain Linear.
        self.gemv_linear = self.fused and fused_linear_supported(self.model, value, check_hidden=False) is None
        head = plain_linear(self.model.lm_head)
        self.gemv_lm_head = self.gemv_linear and head is not None and \
            head.weight.dtype == self.model.model.embed_tokens.weight.dtype

    # -- the step ---------------------------------------------------------------------------------
    def forward_tokens(self, input_ids, position_ids, cache_lens, block_table, key_mask,
                       last_only: bool = False, num_splits: int | None = None,
                       logits_index: torch.Tensor | None = None, fresh: bool = False) -> torch.Tensor:
        """Run ``input_ids`` [b, t] at rotary positions ``position_ids`` [b, t] after ``cache_lens`` [b]
        (int32) cached tokens: writes their K/V into the cache and returns float32 logits [b, t, vocab]
        ([b, vocab] of the last position with ``last_only``, or of position ``logits_index`` ([1] or [b]
        int64, fused step only) — for a prompt padded at the end to a bucketed length). ``block_table`` /
        ``key_mask`` are [b, ...] (views of the step's buffers or the caller's). ``fresh``: the caller
        guarantees ``cache_lens`` is all 0 (a prompt prefill), so the fused step may attend over the
        forward's own K/V (:data:`~hf_accel.engine.step_switches.PREFILL_CONTIGUOUS_ATTENTION`)."""
        self.on_step()
        if self.fused:
            return self._forward_fused(input_ids, position_ids, cache_lens, block_table, key_mask, last_only,
                                       num_splits, logits_index, fresh)
        if logits_index is not None:
            raise NotImplementedError("logits_index needs the fused step")
        return self._forward_modules(input_ids, position_ids, cache_lens, block_table, key_mask, last_only)

    def _rotary_table(self, dtype) -> torch.Tensor:
        """[positions, 2 * head_dim] cos | sin of the model's rotary embedding at positions 0 .. capacity +
        q_len - 1, computed once by the model's own rotary module (position-independent frequencies: the
        fast path refuses rope types whose frequencies depend on the sequence length), so each row is
        bitwise what the module returns for that position."""
        table = self._rotary_rows
        if table is None or table.dtype != dtype:
            count = self.capacity + self.q_len
            pos = torch.arange(count, device=self.input_ids.device)[:, None]
            with torch.inference_mode():
                cos, sin = self.model.model.rotary_emb(torch.empty(count, 1, 1, dtype=dtype, device=pos.device), pos)
            table = self._rotary_rows = torch.cat([cos.reshape(count, -1), sin.reshape(count, -1)], dim=1)
        return table

    def _slots(self, cache_lens, block_table, t):
        """Cache slots [b * t] int32 of ``t`` new tokens per row (PyTorch ops; :func:`slot_mapping_ref`)."""
        return slot_mapping_ref(cache_lens, block_table, t, self.block_size)[0]

    def _forward_fused(self, input_ids, position_ids, cache_lens, block_table, key_mask, last_only, num_splits,
                       logits_index=None, fresh=False):
        model = self.model
        inner = model.model
        (b, t), h, d = input_ids.shape, self.num_heads, self.head_dim
        n = b * t
        embed = inner.embed_tokens
        if switches.GATHER_BY_INDEX and type(embed) is torch.nn.Embedding and embed.max_norm is None:
            hidden = embed.weight[input_ids.reshape(n)]
        else:
            hidden = embed(input_ids.reshape(n))
        if switches.ROTARY_TABLE:
            table = self._rotary_table(hidden.dtype)
            positions = position_ids.reshape(n)
            rows = table[positions] if switches.GATHER_BY_INDEX else torch.nn.functional.embedding(positions, table)
            cos, sin = rows[:, :d], rows[:, d:]
        else:
            cos, sin = inner.rotary_emb(hidden[:, None], position_ids.reshape(n, 1))
            cos, sin = cos.reshape(n, d), sin.reshape(n, d)
        if switches.SLOT_KERNEL:
            slot_mapping, seq_lens = slot_mapping_kernel(cache_lens, block_table, t, self.block_size)
        else:
            slot_mapping = self._slots(cache_lens, block_table, t)
            seq_lens = cache_lens + t
        max_seq = block_table.shape[1] * self.block_size
        if num_splits is not None:
            splits = num_splits
        else:  # the step's own rows, or a prefill over more rows
            splits = self.num_splits if t == self.q_len else switches.PREFILL_NUM_SPLITS
        residual, delta = hidden, None
        one_row = self.gemv_linear and switches.GEMV_ONE_ROW and n == 1
        # every matmul of the layer on the whole-K path (programs of up to 64 weight rows: SwiGLU / RoPE pairs)
        whole = (switches.FUSED_LINEAR_WHOLE_K and whole_k_fits(self.linear_max_k, hidden.dtype, hidden.device, 64)
                 and whole_k_fits(self.linear_min_k, hidden.dtype, hidden.device, 64))
        limit = min(switches.FUSED_LINEAR_MAX_ROWS, max_rows(whole) if whole else switches.FUSED_LINEAR_K_LOOP_MAX_ROWS)
        small = not one_row and self.small_linear and n <= limit
        # gemv and fused_linear take the same arguments: the layer's matmuls with norm / SwiGLU fused in
        linear = self._gemv if one_row else (self._split_linear if small else None)
        # Q/K/V with RoPE + the cache write as its epilogue (models without a per-head q/k norm): gemv_rope for
        # one row (2-row pairs per program), fused_linear_rope for 2-16 rows
        rope_linear = None
        if one_row and switches.GEMV_ROPE and d % 4 == 0:
            rope_linear = functools.partial(gemv_rope, preload_tiles=switches.GEMV_PRELOAD_TILES,
                                            norm_k=switches.GEMV_NORM_K, single_pass=switches.GEMV_SINGLE_PASS,
                                            check_slots=False)  # slots from the step's own block tables
        elif small and switches.FUSED_LINEAR_ROPE and (d // 2) % 16 == 0:
            rope_linear = functools.partial(fused_linear_rope, small_tiles=switches.FUSED_LINEAR_SMALL_TILES,
                                            check_slots=False,
                                            preload=switches.FUSED_LINEAR_PRELOAD,
                                            whole_k=switches.FUSED_LINEAR_WHOLE_K and whole_k_fits(
                                                hidden.shape[1], hidden.dtype, hidden.device, 64))
        pdl = switches.DECODE_PDL
        overlap = pdl and switches.ATTENTION_PDL and (
            one_row or (switches.MULTI_ROW_ATTENTION_OVERLAP and rope_linear is not None))
        attn_kw = {"merge_counters": self.merge_counters if switches.FUSED_MERGE else None,
                   "trigger": switches.ATTENTION_TRIGGER if overlap else False,
                   "preload_kv": switches.ATTENTION_PRELOAD and overlap}
        if attention_row_blocks(t * (h // self.num_kv_heads)) * b * self.num_kv_heads > self.merge_counters.numel():
            attn_kw["merge_counters"] = None  # a forward over more rows than the step's own (prefill)
        # a prompt prefill attends over its own K/V (the rotated K also from the RoPE kernel, V the projection's)
        contiguous = fresh and switches.PREFILL_CONTIGUOUS_ATTENTION and rope_linear is None
        if contiguous:
            kv = self.num_kv_heads
            k_rot = torch.empty(n, kv, d, dtype=hidden.dtype, device=hidden.device)
            own_mask = key_mask[:, :t]
            kv_start = (own_mask != 0).to(torch.int32).argmax(dim=1).to(torch.int32)  # once, not per layer
        for layer_idx, layer in enumerate(inner.layers[: self.num_layers]):
            attn, mlp = layer.self_attn, layer.mlp
            ln = layer.input_layernorm
            mw = self.merged[layer_idx] if self.merged is not None else None
            pools = self.cache.layers[layer_idx]
            q_norm = getattr(attn, "q_norm", None)
            if rope_linear is not None and q_norm is None:
                # Residual add + RMSNorm + Q/K/V + RoPE + K/V cache write in one kernel.
                rope_args = (cos, sin, pools.keys, pools.values, slot_mapping, h)
                if delta is None:
                    q = rope_linear(residual, mw.qkv_weight, *rope_args, bias=mw.qkv_bias, norm_weight=ln.weight,
                                    eps=ln.variance_epsilon, pdl=pdl)
                else:
                    q, residual = rope_linear(delta, mw.qkv_weight, *rope_args, bias=mw.qkv_bias, norm_weight=ln.weight,
                                              eps=ln.variance_epsilon, residual=residual, pdl=pdl)
                roped = True
            elif linear is not None:
                roped = False
                # Residual add + RMSNorm + Q/K/V in one kernel (hf_accel.kernels.gemv / fused_linear).
                if delta is None:
                    qkv = linear(residual, mw.qkv_weight, bias=mw.qkv_bias, norm_weight=ln.weight,
                                 eps=ln.variance_epsilon, pdl=pdl)
                else:
                    qkv, residual = linear(delta, mw.qkv_weight, bias=mw.qkv_bias, norm_weight=ln.weight,
                                           eps=ln.variance_epsilon, residual=residual, pdl=pdl)
                q, k, v = qkv.split(mw.qkv_split, dim=1)
            else:
                roped = False
                if delta is None:
                    x = rms_norm(residual, ln.weight, ln.variance_epsilon)
                else:
                    x, residual = rms_norm(delta, ln.weight, ln.variance_epsilon, residual)
                if mw is not None:
                    q, k, v = torch.nn.functional.linear(x, mw.qkv_weight, mw.qkv_bias).split(mw.qkv_split, dim=1)
                else:
                    q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            if not roped:
                q = rope_and_cache(q, k, v, cos, sin, pools.keys, pools.values, slot_mapping,
                                   q_norm.weight if q_norm is not None else None,
                                   attn.k_norm.weight if q_norm is not None else None,
                                   q_norm.variance_epsilon if q_norm is not None else 1e-6,
                                   pdl=pdl and switches.ATTENTION_PDL, k_out=k_rot if contiguous else None,
                                   check_slots=False)
            if contiguous:
                o = prefill_attention(q.view(b, t, h, d).transpose(1, 2), k_rot.view(b, t, kv, d).transpose(1, 2),
                                      v.view(b, t, kv, d).transpose(1, 2), own_mask, causal=True,
                                      sm_scale=attn.scaling, kv_start=kv_start)
            else:
                o = paged_attention(q.view(b, t, h, d).transpose(1, 2), pools.keys, pools.values, block_table,
                                    seq_lens, max_seq, key_mask, causal=True, sm_scale=attn.scaling,
                                    num_splits=splits, num_stages=self._attention_stages(b, t),
                                    pdl=pdl and switches.ATTENTION_PDL, check_blocks=False, **attn_kw)
            ln = layer.post_attention_layernorm
            if linear is not None:
                o_proj, down_proj = plain_linear(attn.o_proj), plain_linear(mlp.down_proj)
                delta = linear(o.view(n, h * d), o_proj.weight, bias=o_proj.bias, pdl=pdl)
                act, residual = linear(delta, mw.gate_up_weight, norm_weight=ln.weight, eps=ln.variance_epsilon,
                                       residual=residual, swiglu=True, pdl=pdl)
                delta = linear(act, down_proj.weight, bias=down_proj.bias, pdl=pdl)
                continue
            delta = attn.o_proj(o.view(n, h * d))
            x, residual = rms_norm(delta, ln.weight, ln.variance_epsilon, residual)
            if mw is not None:
                gate_up = torch.nn.functional.linear(x, mw.gate_up_weight)
                delta = mlp.down_proj(swiglu(gate_up[:, : mw.intermediate], gate_up[:, mw.intermediate :]))
            else:
                delta = mlp.down_proj(swiglu(mlp.gate_proj(x), mlp.up_proj(x)))
        if logits_index is not None:
            rows = torch.arange(b, device=delta.device) * t + logits_index
            delta, residual = delta[rows], residual[rows]
        elif last_only:
            delta, residual = delta.view(b, t, -1)[:, -1], residual.view(b, t, -1)[:, -1]
        norm = inner.norm
        head = plain_linear(model.lm_head) if self.gemv_lm_head else None
        if one_row and self.gemv_lm_head:
            if switches.GEMV_LM_HEAD_NORM:
                # Final residual add + RMSNorm + LM head in one kernel; logits rounded to the dtype, then float32.
                logits, _ = self._gemv(delta.contiguous(), head.weight, bias=head.bias,
                                       norm_weight=norm.weight, eps=norm.variance_epsilon,
                                       residual=residual.contiguous(), out_dtype=torch.float32, pdl=pdl)
            else:
                hidden, _ = rms_norm(delta.contiguous(), norm.weight, norm.variance_epsilon, residual.contiguous())
                logits = self._gemv(hidden, head.weight, bias=head.bias, out_dtype=torch.float32,
                                    pdl=pdl)
            return logits if (last_only or logits_index is not None) else logits.view(b, t, -1)
        if small and switches.FUSED_LINEAR_LM_HEAD and self.gemv_lm_head:
            logits, _ = self._split_linear(delta.contiguous(), head.weight, bias=head.bias,
                                           norm_weight=norm.weight, eps=norm.variance_epsilon,
                                           residual=residual.contiguous(), out_dtype=torch.float32, pdl=pdl)
            return logits if (last_only or logits_index is not None) else logits.view(b, t, -1)
        hidden, _ = rms_norm(delta.contiguous(), norm.weight, norm.variance_epsilon, residual.contiguous())
        logits = model.lm_head(hidden).float()
        return logits if (last_only or logits_index is not None) else logits.view(b, t, -1)

    def _attention_stages(self, batch: int, rows: int) -> int:
        """Pipeline stages of the paged attention for ``rows`` new tokens per sequence:
        :data:`~hf_accel.engine.step_switches.VERIFY_ATTENTION_STAGES` for a batch-1 verify pass (the step's own
        rows, more than one), else :data:`~hf_accel.engine.step_switches.DECODE_ATTENTION_STAGES`."""
        if batch == 1 and rows == self.q_len > 1:
            return switches.VERIFY_ATTENTION_STAGES
        return switches.DECODE_ATTENTION_STAGES

    @staticmethod
    def _gemv(x, weight, **kw):
        """:func:`gemv` with :data:`~hf_accel.engine.step_switches.GEMV_PRELOAD_TILES`,
        :data:`~hf_accel.engine.step_switches.GEMV_NORM_K` and
        :data:`~hf_accel.engine.step_switches.GEMV_SINGLE_PASS`."""
        return gemv(x, weight, preload_tiles=switches.GEMV_PRELOAD_TILES, norm_k=switches.GEMV_NORM_K,
                    single_pass=switches.GEMV_SINGLE_PASS, **kw)

    def _split_linear(self, x, weight, **kw):
        """:func:`fused_linear` with split-K sized by
        :data:`~hf_accel.engine.step_switches.FUSED_LINEAR_SPLIT_PROGRAMS_PER_SM` and this step's arrival counters."""
        split = 1
        if switches.FUSED_LINEAR_SPLIT_PROGRAMS_PER_SM > 0:
            split = split_k_for(weight.shape[0] // (2 if kw.get("swiglu") else 1), weight.shape[1],
                                switches.FUSED_LINEAR_SPLIT_PROGRAMS_PER_SM * self.sms)
        if switches.FUSED_LINEAR_WHOLE_K and whole_k_fits(weight.shape[1], x.dtype, x.device,
                                                          64 if kw.get("swiglu") else 32):
            return fused_linear(x, weight, whole_k=True, **kw)
        return fused_linear(x, weight, split_k=split, counters=self.linear_counters,
                            norm_k=switches.FUSED_LINEAR_NORM_K, small_tiles=switches.FUSED_LINEAR_SMALL_TILES,
                            preload=switches.FUSED_LINEAR_PRELOAD or None, **kw)

    def _forward_modules(self, input_ids, position_ids, cache_lens, block_table, key_mask, last_only):
        model = self.model
        inner = model.model
        (b, t), h, hkv, d = input_ids.shape, self.num_heads, self.num_kv_heads, self.head_dim
        n = b * t
        on_cuda = input_ids.is_cuda
        write = reshape_and_cache if on_cuda else reshape_and_cache_ref
        attend = paged_attention if on_cuda else paged_attention_sdpa
        hidden = inner.embed_tokens(input_ids.reshape(n))  # [n, hidden]
        cos, sin = inner.rotary_emb(hidden[:, None], position_ids.reshape(n, 1))  # [n, 1, d]
        cos, sin = cos.view(n, 1, d), sin.view(n, 1, d)
        slot_mapping = self._slots(cache_lens, block_table, t)
        seq_lens = cache_lens + t
        max_seq = block_table.shape[1] * self.block_size
        for layer_idx, layer in enumerate(inner.layers[: self.num_layers]):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(n, h, d)
            k = attn.k_proj(x).view(n, hkv, d)
            v = attn.v_proj(x).view(n, hkv, d)
            if getattr(attn, "q_norm", None) is not None:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            pools = self.cache.layers[layer_idx]
            write(k, v, pools.keys, pools.values, slot_mapping, check_slots=False)
            kwargs = dict(causal=True, sm_scale=attn.scaling, check_blocks=False)  # the block manager's tables
            if on_cuda:
                kwargs["num_stages"] = self._attention_stages(b, t)
                if t == self.q_len:
                    kwargs["num_splits"] = self.num_splits
            o = attend(q.view(b, t, h, d).transpose(1, 2), pools.keys, pools.values, block_table, seq_lens, max_seq,
                       key_mask, **kwargs)
            hidden = hidden + attn.o_proj(o.reshape(n, h * d))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        if last_only:
            hidden = hidden.view(b, t, -1)[:, -1]
        hidden = inner.norm(hidden)
        logits = model.lm_head(hidden).float()
        return logits if last_only else logits.view(b, t, -1)

    def _forward(self) -> torch.Tensor:
        """The step on its own buffers: logits [batch, q_len, vocab] float32."""
        return self.forward_tokens(self.input_ids, self.position_ids, self.cache_lens, self.block_table,
                                   self.key_mask)

    # -- greedy decoding inside the graph ------------------------------------------------------------
    def _greedy_tail(self, logits: torch.Tensor) -> None:
        """Greedy pick + transformers' end-of-sequence bookkeeping, on the device (no host sync):
        finished rows emit ``pad``; ``steps_run`` counts steps taken while a row was unfinished. One
        :func:`~hf_accel.kernels.argmax.greedy_tail` launch on CUDA
        (:data:`~hf_accel.engine.step_switches.GREEDY_TAIL_KERNEL`)."""
        g = self.greedy
        last = logits[:, -1]
        if self._tail_kernel(last):
            greedy_tail(last, g["tokens"], g["unfinished"], g["pad"], g["eos"], self.input_ids, self.position_ids,
                        self.cache_lens, g["cur"], g["steps_run"], self.argmax_scratch(last))
            return
        nxt = last.argmax(dim=-1)
        g["steps_run"] += g["unfinished"].any()
        nxt = torch.where(g["unfinished"], nxt, g["pad"])
        g["tokens"].scatter_(1, g["cur"].expand(self.batch, 1), nxt[:, None])
        g["unfinished"] &= ~torch.isin(nxt, g["eos"])
        self.input_ids[:, 0].copy_(nxt)
        self.position_ids += 1
        self.cache_lens += 1
        g["cur"] += 1

    def _tail_kernel(self, last: torch.Tensor) -> bool:
        return switches.GREEDY_TAIL_KERNEL and last.is_cuda and self.q_len == 1

    def argmax_scratch(self, last: torch.Tensor):
        """The (partials, counters) scratch of :func:`~hf_accel.kernels.argmax.greedy_tail` / ``argmax_rows``
        over ``last`` [rows, vocab] logits of this step: made at the first (warm-up) call per shape and kept
        for the step's life, since captured graphs hold its addresses."""
        key = tuple(last.shape)
        if key not in self._argmax_scratch:
            self._argmax_scratch[key] = scratch_for(*key, last.device)
        return self._argmax_scratch[key]

    def _warm_up_greedy(self) -> None:
        """The forward and :func:`greedy_tail` once on copies of the greedy state (the kernel compiles and
        its scratch is made before the capture; the step's own state is left as it was)."""
        last = self._forward()[:, -1]
        if self._tail_kernel(last):
            g = {k: v.clone() for k, v in self.greedy.items()}
            greedy_tail(last, g["tokens"], g["unfinished"], g["pad"], g["eos"], self.input_ids.clone(),
                        self.position_ids.clone(), self.cache_lens.clone(), g["cur"], g["steps_run"],
                        self.argmax_scratch(last))

    def init_greedy(self, eos_ids: list[int]) -> dict:
        """Static buffers of the in-graph greedy loop: tokens [batch, capacity] int64 (prompt + output),
        unfinished [batch] bool, cur / steps_run int64 scalars, pad int64 scalar, eos [8] int64 (-1 padded)."""
        if len(eos_ids) > 8:
            raise ValueError("at most 8 EOS ids on the in-graph greedy path")
        if getattr(self, "greedy", None) is None:
            dev = self.input_ids.device
            self.greedy = {
                "tokens": torch.zeros(self.batch, self.capacity + 1, dtype=torch.long, device=dev),
                "unfinished": torch.zeros(self.batch, dtype=torch.bool, device=dev),
                "cur": torch.zeros(1, dtype=torch.long, device=dev),
                "steps_run": torch.zeros((), dtype=torch.long, device=dev),
                "pad": torch.zeros((), dtype=torch.long, device=dev),
                "eos": torch.full((8,), -1, dtype=torch.long, device=dev),
            }
        # Written only when they change (the same ids every call, as a rule), and by fill kernels: this runs right
        # after the prefill is queued, and a copy from pageable host memory would wait for it (transfers.py).
        if self._greedy_eos != tuple(eos_ids):
            fill_from_host(self.greedy["eos"], eos_ids, -1)
            self._greedy_eos = tuple(eos_ids)
        return self.greedy

    def host_flags(self, ring: int):
        """``ring`` page-locked host rows of ``batch`` bools for the greedy loop's unfinished flags, their numpy
        view and one CUDA event per row (made once per step and ring size)."""
        cached = self._host_flags
        if cached is None or cached[0].shape[0] != ring:
            rows = torch.zeros(ring, self.batch, dtype=torch.bool, pin_memory=True)
            cached = self._host_flags = (rows, rows.numpy(), [torch.cuda.Event() for _ in range(ring)])
        return cached

    @torch.inference_mode()
    def run_greedy(self) -> None:
        """One greedy step with its bookkeeping (one graph replay on GPU). With :attr:`greedy_flags`, each replay
        also publishes the unfinished flags, numbered 1, 2, ... over the step's life
        (:attr:`greedy_flags_number` is the last replay's)."""
        self.on_step()
        if not self.use_graph:
            self._greedy_tail(self._forward())
            return
        if self.graph_greedy is None:
            self._warm_up(self._warm_up_greedy)
            flags = None
            if switches.GREEDY_HOST_FLAGS and host_counters_available(self.input_ids.device):
                flags = HostCounters(self.batch, self.input_ids.device)
                scratch = HostCounters(self.batch, self.input_ids.device)  # compiles the kernel outside the capture
                publish_counters(self.greedy["unfinished"], scratch.seq, scratch.ring)
            graph = torch.cuda.CUDAGraph()
            with capture_graph(graph):
                self._greedy_tail(self._forward())
                if flags is not None:
                    publish_counters(self.greedy["unfinished"], flags.seq, flags.ring)
            self.graph_greedy = graph  # kept once captured: a capture that raised (out of memory) is not replayed
            self.greedy_flags = flags
        if self.greedy_flags is not None:
            self.greedy_flags_number = self.greedy_flags.expect(1)
        self.graph_greedy.replay()

    @torch.inference_mode()
    def run(self) -> torch.Tensor:
        """Run one step (graph replay on GPU once captured); returns ``logits`` [batch, q_len, vocab] float32."""
        self.on_step()
        if not self.use_graph:
            self.logits = self._forward()
            return self.logits
        if self.graph is None:
            self._warm_up()
            graph = torch.cuda.CUDAGraph()
            with capture_graph(graph):
                logits = self._forward()
            self.graph, self.logits = graph, logits  # kept once captured (a capture that raised is not replayed)
        self.graph.replay()
        return self.logits

    @torch.inference_mode()
    def replay(self, key, fn):
        """Run ``fn()`` — a function of static buffers that leaves its inputs unchanged, so running it
        twice is harmless — captured in a CUDA graph under ``key`` at first use (GPU); returns its output."""
        self.on_step()
        if not self.use_graph:
            return fn()
        entry = self.graphs.get(key)
        if entry is None:
            self._warm_up(fn)
            graph = torch.cuda.CUDAGraph()
            with capture_graph(graph):
                out = fn()
            entry = self.graphs[key] = (graph, out)
        entry[0].replay()
        return entry[1]

    def _warm_up(self, fn=None) -> None:
        # Warm-up outside the graph (Triton compiles, cuBLAS picks kernels), on a side stream as PyTorch
        # recommends. It only runs the forward: it writes this step's own K/V into slot ``cache_lens``
        # (the values the real step writes again) and changes no other state.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                (fn or self._forward)()
        torch.cuda.current_stream().wait_stream(stream)
