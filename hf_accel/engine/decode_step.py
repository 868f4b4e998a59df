"""One decode step of a llama-family model (llama, mistral, qwen2, qwen3) over a paged KV cache,
replayable as a CUDA graph.

The step reads only static buffers (token ids, rotary positions, cache lengths, block table, key
mask) and writes the next-token logits, so one captured graph serves every step of every sequence
state whose batch fits its bucket: ``graph.replay()`` replaces ~30 Python-launched kernels per layer
(the host overhead that bounds transformers' own loop, ~20-30 ms per token on a slow host) with a single
launch. The block table is reserved for the whole generation before the first step, so the host does
no work between replays; slots are computed on the device from the cache length.

Two variants of the same step:

- *fused* (CUDA, standard llama-family blocks): one Triton kernel for residual add + RMSNorm, one for
  RoPE (+ Qwen3's per-head q/k norm) + writing K/V into the cache, one for the SwiGLU gate, the paged
  decode kernel, and cuBLAS matmuls with Q/K/V and gate/up merged (:mod:`.merged_weights`): about 10
  kernels per layer instead of ~35, each rounding where transformers rounds;
- *modules* (CPU, or anything non-standard): the model's own modules (RMSNorm, rotary embedding,
  projections, MLP) with hf-accel's ``reshape_and_cache`` + ``paged_attention``.

The paged kernel runs with a fixed number of KV splits so its grid is static. Graph capture follows PyTorch's ``torch.cuda.graph``
(warm-up on a side stream, then capture into a private memory pool).
"""

from __future__ import annotations

import torch
import triton

from hf_accel.kernels.paged_attention import paged_attention, paged_attention_ref
from hf_accel.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref
from hf_accel.kernels.rms_norm import rms_norm
from hf_accel.kernels.rope_cache import rope_and_cache
from hf_accel.kernels.swiglu import swiglu


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def fused_supported(model) -> str | None:
    """Why the fused step cannot run this model (None if it can): it needs RMSNorms with ``weight`` and
    ``variance_epsilon``, plain ``nn.Linear`` projections, a SiLU-gated MLP and an even head_dim."""
    inner = model.model
    if getattr(model.config, "hidden_act", None) != "silu":
        return f"hidden_act {getattr(model.config, 'hidden_act', None)!r}"
    norms = [inner.norm] + [n for ly in inner.layers for n in (ly.input_layernorm, ly.post_attention_layernorm)]
    if any(not hasattr(n, "variance_epsilon") or getattr(n, "weight", None) is None for n in norms):
        return "a norm that is not an RMSNorm with weight and variance_epsilon"
    for ly in inner.layers:
        attn, mlp = ly.self_attn, ly.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, getattr(mlp, "gate_proj", None),
                   getattr(mlp, "up_proj", None), getattr(mlp, "down_proj", None)]
        if any(type(m) is not torch.nn.Linear for m in linears):
            return "a projection that is not a plain nn.Linear (e.g. an unmerged adapter or a quantized layer)"
        if getattr(attn, "q_norm", None) is not None and not hasattr(attn.q_norm, "variance_epsilon"):
            return "a q_norm that is not an RMSNorm"
    if inner.layers[0].self_attn.head_dim % 2:
        return "odd head_dim"
    return None


class DecodeStep:
    """Static buffers + step function (+ CUDA graph on GPU) for ``batch`` rows.

    Buffers (all on the model's device):
        input_ids: [batch] int64 — token fed at this step.
        position_ids: [batch] int64 — its rotary position (padding-aware, as transformers computes it).
        cache_lens: [batch] int32 — tokens already cached; the new token goes to slot ``cache_lens``.
        block_table: [batch, max_blocks] int32 — reserved for the whole generation.
        key_mask: [batch, max_blocks * block_size] uint8 — 0 for padding positions.
        logits: [batch, vocab] float32 — output.
    """

    def __init__(self, model, cache, batch: int, max_blocks: int, use_graph: bool, fused: bool | None = None,
                 merged=None):
        self.model = model
        self.cache = cache
        self.batch = batch
        self.max_blocks = max_blocks
        self.block_size = cache.block_size
        self.capacity = max_blocks * cache.block_size
        dev = model.device
        self.input_ids = torch.zeros(batch, dtype=torch.long, device=dev)
        self.position_ids = torch.zeros(batch, dtype=torch.long, device=dev)
        self.cache_lens = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.block_table = torch.zeros(batch, max_blocks, dtype=torch.int32, device=dev)
        self.key_mask = torch.zeros(batch, self.capacity, dtype=torch.uint8, device=dev)
        self.logits = None
        self.graph = None
        self.graph_greedy = None
        self.greedy = None
        self.use_graph = use_graph and dev.type == "cuda"
        cfg = model.config
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        attn0 = model.model.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.scaling = attn0.scaling
        # fused=None: on CUDA when supported. fused=True on CPU runs the Triton kernels (interpreter; tests).
        self.fused = (dev.type == "cuda" if fused is None else fused) and fused_supported(model) is None
        self.merged = merged  # list of MergedLayer (fused step only) or None
        if dev.type == "cuda":
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            programs = batch * self.num_kv_heads
            want = triton.cdiv((4 if programs < 32 else 2) * sms, programs)
            self.num_splits = max(1, min(want, triton.cdiv(self.capacity, 256)))
        else:
            self.num_splits = 1

    # -- the step ---------------------------------------------------------------------------------
    def _forward_fused(self) -> torch.Tensor:
        model = self.model
        inner = model.model
        b, h, d = self.batch, self.num_heads, self.head_dim
        hidden = inner.embed_tokens(self.input_ids)
        cos, sin = inner.rotary_emb(hidden[:, None], self.position_ids[:, None])
        cos, sin = cos.reshape(b, d), sin.reshape(b, d)
        cache_lens = self.cache_lens.long()
        blk = self.block_table.gather(1, (cache_lens // self.block_size)[:, None]).squeeze(1).long()
        slot_mapping = (blk * self.block_size + cache_lens % self.block_size).to(torch.int32)
        seq_lens = self.cache_lens + 1
        residual, delta = hidden, None
        for layer_idx, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            ln = layer.input_layernorm
            if delta is None:
                x = rms_norm(residual, ln.weight, ln.variance_epsilon)
            else:
                x, residual = rms_norm(delta, ln.weight, ln.variance_epsilon, residual)
            mw = self.merged[layer_idx] if self.merged is not None else None
            if mw is not None:
                q, k, v = torch.nn.functional.linear(x, mw.qkv_weight, mw.qkv_bias).split(mw.qkv_split, dim=1)
            else:
                q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            pools = self.cache.layers[layer_idx]
            q_norm = getattr(attn, "q_norm", None)
            q = rope_and_cache(q, k, v, cos, sin, pools.keys, pools.values, slot_mapping,
                               q_norm.weight if q_norm is not None else None,
                               attn.k_norm.weight if q_norm is not None else None,
                               q_norm.variance_epsilon if q_norm is not None else 1e-6)
            o = paged_attention(q.view(b, h, 1, d), pools.keys, pools.values, self.block_table, seq_lens,
                                self.capacity, self.key_mask, causal=True, sm_scale=self.scaling,
                                num_splits=self.num_splits)
            delta = attn.o_proj(o.view(b, h * d))
            ln = layer.post_attention_layernorm
            x, residual = rms_norm(delta, ln.weight, ln.variance_epsilon, residual)
            if mw is not None:
                gate_up = torch.nn.functional.linear(x, mw.gate_up_weight)
                delta = mlp.down_proj(swiglu(gate_up[:, : mw.intermediate], gate_up[:, mw.intermediate :]))
            else:
                delta = mlp.down_proj(swiglu(mlp.gate_proj(x), mlp.up_proj(x)))
        hidden, _ = rms_norm(delta, inner.norm.weight, inner.norm.variance_epsilon, residual)
        return model.lm_head(hidden).float()

    def _forward(self) -> torch.Tensor:
        if self.fused:
            return self._forward_fused()
        model = self.model
        inner = model.model
        b, h, hkv, d = self.batch, self.num_heads, self.num_kv_heads, self.head_dim
        on_cuda = self.input_ids.is_cuda
        write = reshape_and_cache if on_cuda else reshape_and_cache_ref
        attend = paged_attention if on_cuda else paged_attention_ref
        hidden = inner.embed_tokens(self.input_ids)  # [b, hidden]
        cos, sin = inner.rotary_emb(hidden[:, None], self.position_ids[:, None])  # [b, 1, d]
        cos, sin = cos.view(b, 1, d), sin.view(b, 1, d)
        cache_lens = self.cache_lens.long()
        blk = self.block_table.gather(1, (cache_lens // self.block_size)[:, None]).squeeze(1).long()
        slot_mapping = (blk * self.block_size + cache_lens % self.block_size).to(torch.int32)
        seq_lens = self.cache_lens + 1
        for layer_idx, layer in enumerate(inner.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(b, h, d)
            k = attn.k_proj(x).view(b, hkv, d)
            v = attn.v_proj(x).view(b, hkv, d)
            if getattr(attn, "q_norm", None) is not None:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            pools = self.cache.layers[layer_idx]
            write(k, v, pools.keys, pools.values, slot_mapping)
            kwargs = dict(causal=True, sm_scale=self.scaling)
            if on_cuda:
                kwargs["num_splits"] = self.num_splits
            o = attend(q.view(b, h, 1, d), pools.keys, pools.values, self.block_table, seq_lens, self.capacity,
                       self.key_mask, **kwargs)
            hidden = hidden + attn.o_proj(o.view(b, h * d))
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        hidden = inner.norm(hidden)
        return model.lm_head(hidden).float()

    # -- greedy decoding inside the graph ------------------------------------------------------------
    def _greedy_tail(self, logits: torch.Tensor) -> None:
        """Greedy pick + transformers' end-of-sequence bookkeeping, on the device (no host sync):
        finished rows emit ``pad``; ``steps_run`` counts steps taken while a row was unfinished."""
        g = self.greedy
        nxt = logits.argmax(dim=-1)
        g["steps_run"] += g["unfinished"].any()
        nxt = torch.where(g["unfinished"], nxt, g["pad"])
        g["tokens"].scatter_(1, g["cur"].expand(self.batch, 1), nxt[:, None])
        g["unfinished"] &= ~torch.isin(nxt, g["eos"])
        self.input_ids.copy_(nxt)
        self.position_ids += 1
        self.cache_lens += 1
        g["cur"] += 1

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
        self.greedy["eos"].fill_(-1)
        if eos_ids:
            self.greedy["eos"][: len(eos_ids)] = torch.tensor(eos_ids, dtype=torch.long)
        return self.greedy

    @torch.inference_mode()
    def run_greedy(self) -> None:
        """One greedy step with its bookkeeping (one graph replay on GPU)."""
        if not self.use_graph:
            self._greedy_tail(self._forward())
            return
        if self.graph_greedy is None:
            self._warm_up()
            self.graph_greedy = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph_greedy):
                self._greedy_tail(self._forward())
        self.graph_greedy.replay()

    @torch.inference_mode()
    def run(self) -> torch.Tensor:
        """Run one step (graph replay on GPU once captured); returns ``logits`` [batch, vocab] float32."""
        if not self.use_graph:
            self.logits = self._forward()
            return self.logits
        if self.graph is None:
            self._warm_up()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._forward()
        self.graph.replay()
        return self.logits

    def _warm_up(self) -> None:
        # Warm-up outside the graph (Triton compiles, cuBLAS picks kernels), on a side stream as PyTorch
        # recommends. It only runs the forward: it writes this step's own K/V into slot ``cache_lens``
        # (the values the real step writes again) and changes no other state.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
