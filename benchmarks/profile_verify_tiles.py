"""Verify-pass time of a SmolLM2-shaped model (random bf16 weights, no download) for the decode step's
FUSED_LINEAR_ROPE x FUSED_LINEAR_SMALL_TILES switches: the target forward over q_len = 2 and 16 tokens after
a 305-token prompt, captured in a CUDA graph, median of 50 replays, 3 timings per setting (ms). Writes
``$OUT/profile_verify_tiles.json`` ({"rope<0|1>_tiles<0|1>_q<q_len>": [ms, ms, ms]}).

    python benchmarks/profile_verify_tiles.py
"""
import json
import os
import sys

import torch

sys.path.insert(0, "benchmarks")
from profile_speculative_round import time_graph
from transformers import AutoModelForCausalLM, LlamaConfig
import hf_accel.engine.decode_step as ds
from hf_accel import accelerate_model
cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)
torch.manual_seed(0)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
accelerate_model(model)
fast = model._hf_accel_engine
ids = torch.randint(100, 49000, (1, 305), device="cuda")
res = {}
with torch.inference_mode():
    step, logits = fast.start(ids, torch.ones_like(ids), 128, lookahead=17)
    nb, P = step.max_blocks, 305
    for rope in (True, False):
        for tiles in (True, False):
            ds.FUSED_LINEAR_ROPE, ds.FUSED_LINEAR_SMALL_TILES = rope, tiles
            for q in (2, 16):
                v = fast._step_for(1, nb, q_len=q)
                v.input_ids.copy_(ids[:, :q]); v.position_ids.copy_(torch.arange(P, P + q, device="cuda")[None])
                v.cache_lens.fill_(P); v.block_table.copy_(step.block_table); v.key_mask.copy_(step.key_mask)
                f = lambda: v.forward_tokens(v.input_ids, v.position_ids, v.cache_lens, v.block_table, v.key_mask)
                ms = [time_graph(f)[0] for _ in range(3)]
                res[f"rope{int(rope)}_tiles{int(tiles)}_q{q}"] = ms
                print(f"rope={rope} tiles={tiles} q={q}: {[round(m, 4) for m in ms]}", flush=True)
    fast.cache.release()
json.dump(res, open(os.environ.get("OUT", ".") + "/profile_verify_tiles.json", "w"), indent=1)
