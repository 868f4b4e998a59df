"""PEFT LoRA test models shared by the test modules in this folder (imported as ``from peft_lora_models import ...``;
pytest puts this folder on ``sys.path`` for its test modules).

``_lora_model``: a tiny llama wrapped in a peft LoRA adapter on the attention projections, its B matrices drawn
so that the adapter changes the output (peft initialises them to zero); ``_all_linear_lora``: the same with LoRA on
every projection and the LM head; ``_lora_layers``: the model's LoRA layers.
"""

from __future__ import annotations

import torch


def _lora_model(tiny, seed):
    from peft import LoraConfig, get_peft_model

    base = tiny.model("llama", seed=seed)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                        lora_dropout=0.0)
    peft_model = get_peft_model(base, config)
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:  # peft initialises B to zero; make the adapter matter
                p.normal_(0.0, 0.2)
    return peft_model.eval()


def _lora_layers(peft_model):
    from peft.tuners.lora import LoraLayer

    layers = [m for m in peft_model.modules() if isinstance(m, LoraLayer)]
    assert layers
    return layers


ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def _all_linear_lora(tiny, seed, model_type="llama", std=0.4):
    """A tiny model (``tiny.model(model_type, seed)``) in a PeftModel with a rank-4 LoRA adapter on every projection
    and the LM head, its B matrices drawn with ``std``."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(tiny.model(model_type, seed=seed),
                                LoraConfig(r=4, lora_alpha=8, target_modules=ALL_LINEAR, lora_dropout=0.0)).eval()
    torch.manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, std)
    return peft_model
