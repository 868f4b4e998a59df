"""Tiny random models of every supported family, built in code (nothing downloaded)."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
VOCAB = 97


def build(model_type: str = "llama", num_heads: int = 8, num_kv_heads: int = 8, head_dim: int = 8,
          layers: int = 2, dtype=torch.float64, **extra):
    """A random tiny model in eval mode; float64 so exactness checks can be tight."""
    config_cls, model_cls = FAMILIES[model_type]
    kwargs = dict(hidden_size=num_heads * head_dim, intermediate_size=96, num_hidden_layers=layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim,
                  vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=False)
    if model_type == "llama":
        kwargs["attention_bias"] = extra.pop("attention_bias", False)
    if model_type == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(extra)
    model = model_cls(config_cls(**kwargs)).to(dtype).eval()
    with torch.no_grad():  # larger-than-init weights so that head differences matter in the logits
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.normal_(0, 1.2 / m.in_features**0.5)
                if m.bias is not None:
                    m.bias.normal_(0, 0.3)
            elif isinstance(m, torch.nn.Embedding):
                m.weight.normal_(0, 1.0)
    return model


def tokens(batch: int = 2, seq: int = 24) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq))


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits



def write_gguf(path, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 8, layers: int = 2, seed: int = 0):
    """Write a tiny random llama GGUF file (float32 tensors, a byte-level BPE tokenizer of 259 tokens) to
    ``path`` and return it; transformers' ``gguf_file=`` loader (and so ``hf_accel.models.load_model``) reads
    it like the embedded SmolLM2, GGUF quantizer object included."""
    import gguf
    import numpy as np
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = [*bytes_to_unicode().values(), "Ġt", "Ġa", "<|endoftext|>"]
    hidden, ffn = num_heads * head_dim, 64
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_types([1] * (len(vocab) - 1) + [3])  # 3: control
    # Two merges: transformers' GGUF reader turns a one-element list into its element (a string), which older
    # tokenizers releases refuse as BPE merges ("failed to extract enum PyMerges").
    writer.add_token_merges(["Ġ t", "Ġ a"])
    writer.add_bos_token_id(len(vocab) - 1)
    writer.add_eos_token_id(len(vocab) - 1)
    rng = np.random.default_rng(seed)

    def tensor(name, *shape):
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.2).astype(np.float32))

    tensor("token_embd.weight", len(vocab), hidden)
    tensor("output_norm.weight", hidden)
    tensor("output.weight", len(vocab), hidden)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden)
        tensor(f"blk.{i}.ffn_norm.weight", hidden)
        tensor(f"blk.{i}.attn_q.weight", num_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_k.weight", num_kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_v.weight", num_kv_heads * head_dim, hidden)
        tensor(f"blk.{i}.attn_output.weight", hidden, num_heads * head_dim)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ffn)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
