"""Short LoRA recovery fine-tune after head pooling.

Ainslie et al. 2023 ("GQA", §3.1-3.2) recover the quality lost by pooling with uptraining (about 5% of
the pre-training steps). This is the cheap, local version: a LoRA adapter (Hu et al. 2021, "LoRA:
Low-Rank Adaptation of Large Language Models") on the attention projections, trained with peft for a
few hundred steps of next-token loss on a calibration text, then merged into the weights so the
result is again a plain transformers model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from hf_accel._checks import check_int, check_token_ids, model_positions

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclass
class RecoveryStats:
    """What the fine-tune did: losses in nats / token, time in seconds."""

    steps: int
    tokens_seen: int
    seconds: float
    first_loss: float  # mean loss of the first 10% of steps
    last_loss: float  # mean loss of the last 10% of steps
    trainable_parameters: int
    losses: list[float] = field(repr=False, default_factory=list)


#: tokens per training window of :func:`recover_with_lora` unless given
DEFAULT_SEQ_LEN = 128


def recover_with_lora(
    model,
    train_ids: torch.Tensor,
    *,
    steps: int = 150,
    seq_len: int = DEFAULT_SEQ_LEN,
    batch_size: int = 4,
    lr: float = 5e-4,
    rank: int = 16,
    alpha: int = 32,
    target_modules=DEFAULT_TARGETS,
    seed: int = 0,
    progress: bool = False,
):
    """Fine-tune LoRA adapters on ``train_ids`` and merge them into ``model``.

    Each step draws ``batch_size`` random windows of ``seq_len`` tokens from ``train_ids`` (seeded) and
    takes one AdamW step on the causal LM loss; the learning rate decays linearly to 0 after a 10%
    warm-up.

    Args:
        model: a transformers causal LM (plain, trainable dtype: float32 on CPU, bf16/fp32 on GPU).
        train_ids: [n] or [1, n] integer token ids of the training text (in the model's vocabulary), n > seq_len.
        steps, seq_len, batch_size, lr: optimisation settings (lr in AdamW units); ``seq_len`` >= 2 (a window
            of one token has nothing to predict) and at most the model's ``max_position_embeddings``.
        rank, alpha, target_modules: the LoRA adapter (peft ``LoraConfig``).
        seed: seeds the window sampling and the adapter initialisation.
        progress: show a tqdm bar with the running loss.

    Returns:
        (model with the adapters merged — a plain transformers model, eval mode, :class:`RecoveryStats`).

    Raises:
        ValueError: ``train_ids`` not an integer tensor of [n] / [1, n] ids in the model's vocabulary, too few tokens
            for one window, ``steps`` / ``batch_size`` / ``rank`` not an int >= 1, ``seq_len`` not an int in
            [2, max_position_embeddings], or ``lr`` not > 0.
    """
    from peft import LoraConfig, get_peft_model
    from tqdm.auto import tqdm

    check_token_ids(train_ids, model, "train_ids")
    if not (train_ids.dim() == 1 or (train_ids.dim() == 2 and train_ids.shape[0] == 1)):
        raise ValueError(f"train_ids must be one text, [n] or [1, n]; got shape {tuple(train_ids.shape)}")
    ids = train_ids.reshape(-1).long()
    steps, batch_size, rank = (check_int(v, name, minimum=1) for v, name in
                               ((steps, "steps"), (batch_size, "batch_size"), (rank, "rank")))
    max_pos = model_positions(model)
    seq_len = check_int(seq_len, "seq_len", minimum=2, maximum=max_pos,
                        maximum_reason=" (the model's max_position_embeddings)")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"lr must be a number > 0; got {lr!r}")
    if ids.numel() <= seq_len:
        raise ValueError(f"need more than seq_len={seq_len} training tokens; got {ids.numel()}")
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    device = next(model.parameters()).device
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(target_modules),
                        task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: (s + 1) / warmup if s < warmup else max(0.0, (steps - s) / max(1, steps - warmup))
    )
    peft_model.train()
    losses: list[float] = []
    t0 = time.perf_counter()
    bar = tqdm(range(steps), desc="LoRA recovery", disable=not progress, leave=False)
    for _ in bar:
        starts = torch.randint(0, ids.numel() - seq_len, (batch_size,), generator=generator)
        batch = torch.stack([ids[s : s + seq_len] for s in starts.tolist()]).to(device)
        loss = peft_model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    seconds = time.perf_counter() - t0
    merged = peft_model.merge_and_unload()
    merged.eval()
    k = max(1, steps // 10)
    stats = RecoveryStats(
        steps=steps, tokens_seen=steps * batch_size * seq_len, seconds=seconds,
        first_loss=sum(losses[:k]) / k, last_loss=sum(losses[-k:]) / k,
        trainable_parameters=sum(p.numel() for p in params), losses=losses,
    )
    return merged, stats
