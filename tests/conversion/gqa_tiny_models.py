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

