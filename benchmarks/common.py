"""Shared helpers of the benchmark scripts: result metadata and the JSON file layout.

Every run writes one file ``<bench>-<YYYYMMDD>.json`` = {"meta": {...}, "rows": [...]}, to ``$OUT`` when
that variable is set, else to ``benchmarks/results/``.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path


def git_sha() -> str:
    """The commit benchmarked: $HF_ACCEL_GIT_SHA if set (copies of the tree without .git), else git's HEAD."""
    if os.environ.get("HF_ACCEL_GIT_SHA"):
        return os.environ["HF_ACCEL_GIT_SHA"]
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def require_cuda(script: str, alternative: str | None = None) -> None:
    """Returns when a CUDA GPU is present; else ends the process with exit code 2 and one line on stderr,
    ``<script> needs a CUDA GPU (torch.cuda.is_available() is False)[; <alternative>]``.

    Call it after the arguments are parsed (so that ``--help`` answers on any machine) and before any CUDA
    tensor, model load or result file. ``script``: the caller's ``__file__`` (or its name); ``alternative``:
    what runs without a GPU instead (e.g. ``"--tiny runs on CPU"``), appended to the line."""
    import torch

    if torch.cuda.is_available():
        return
    hint = f"; {alternative}" if alternative else ""
    print(f"{Path(script).name} needs a CUDA GPU (torch.cuda.is_available() is False){hint}", file=sys.stderr)
    raise SystemExit(2)


def meta() -> dict:
    import torch
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton_version,
        "transformers": transformers.__version__,
        "git_sha": git_sha(),
        "date": datetime.date.today().isoformat(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }


def write_results(bench: str, rows: list[dict], extra_meta: dict | None = None) -> Path:
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{bench}-{datetime.date.today():%Y%m%d}.json"
    m = meta()
    if extra_meta:
        m.update(extra_meta)
    path.write_text(json.dumps({"meta": m, "rows": rows}, indent=1))
    print(f"wrote {path}")
    return path


def graph_replay_us(fn, per: int, rep_ms: int = 25) -> float:
    """µs per unit of work of ``fn`` (which runs ``per`` units) captured in one CUDA graph after one eager
    warm-up call: the ``triton.testing.do_bench`` median of graph replays (5 ms warm-up, ``rep_ms``)."""
    import torch
    import triton.testing

    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=5, rep=rep_ms) * 1e3 / per


def time_in_turns(variants: dict, iters: int, passes: int, reset=None, label: str = "pass") -> dict:
    """µs per iteration of each ``fn(iters)`` of ``variants`` {name: fn}, CUDA-synced wall clock, timed in turns
    over ``passes`` so that drift hits every variant alike (``reset()`` runs before each timing); returns
    {name: [µs per iteration, one per pass]} and prints each pass."""
    import time

    import torch

    times: dict = {n: [] for n in variants}
    for p in range(passes):
        for name, fn in variants.items():
            if reset is not None:
                reset()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(iters)
            torch.cuda.synchronize()
            times[name].append((time.perf_counter() - t0) / iters * 1e6)
        print(f"{label} {p}: " + "  ".join(f"{n} {v[-1]:.2f}" for n, v in times.items()), flush=True)
    return times


def _switch_modules():
    from hf_accel.engine import fast_generate, step_switches
    from hf_accel.speculative import draft_length
    from hf_accel.speculative import engine as speculative_engine

    return step_switches, draft_length, speculative_engine, fast_generate


def parse_overrides(spec: str) -> dict:
    """``"NAME=VALUE+NAME=VALUE"`` -> {NAME: value} for module constants of
    :mod:`hf_accel.engine.step_switches`, :mod:`hf_accel.speculative.draft_length`,
    :mod:`hf_accel.speculative.engine` or :mod:`hf_accel.engine.fast_generate` (A/B runs of their switches);
    values are Python literals."""
    import ast

    out = {}
    for item in filter(None, spec.split("+")):
        name, _, value = item.partition("=")
        if not name.isupper() or not any(hasattr(m, name) for m in _switch_modules()):
            raise ValueError(f"{name!r} is not a switch of hf_accel.engine.step_switches, "
                             f"hf_accel.speculative.draft_length, hf_accel.speculative.engine or "
                             f"hf_accel.engine.fast_generate")
        out[name] = ast.literal_eval(value)
    return out


class decode_step_overrides:  # noqa: N801 (used as a context manager)
    """Sets :func:`parse_overrides` values on their modules and restores them on exit."""

    def __init__(self, spec: str):
        self.values = parse_overrides(spec)
        self.saved = {}

    @staticmethod
    def _module(name):
        return next(m for m in _switch_modules() if hasattr(m, name))

    def __enter__(self):
        self.saved = {k: getattr(self._module(k), k) for k in self.values}
        for k, v in self.values.items():
            setattr(self._module(k), k, v)
        return self

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            setattr(self._module(k), k, v)
        return False


def smollm2_shaped_model(device: str = "cuda"):
    """An accelerated Llama of SmolLM2-135M's shape (hidden 576, 30 layers, 9 / 3 heads of 64, intermediate
    1536, vocab 49152, tied embeddings) with random bf16 weights (seed 0): kernel A/Bs without a download."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_accel import accelerate_model

    cfg = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                      num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    return accelerate_model(model)


def step_over_blocks(fast, step, ids, q_len: int, context: int):
    """A batch-1 :class:`~hf_accel.engine.decode_step.DecodeStep` of ``q_len`` tokens (``fast._step_for``) over the
    cache blocks of row 0 of ``step`` (which holds ``context`` cached tokens): inputs ``ids[:, :q_len]`` at positions
    ``context ..``, ``cache_lens`` = ``context``, the block table and key mask copied. Call under
    ``torch.inference_mode()`` (the step buffers are inference tensors)."""
    import torch

    v = fast._step_for(1, step.max_blocks, q_len=q_len)
    v.input_ids.copy_(ids[:1, :q_len])
    v.position_ids.copy_(torch.arange(context, context + q_len, device=ids.device)[None])
    v.cache_lens.fill_(context)
    v.block_table.copy_(step.block_table[:1])
    v.key_mask.copy_(step.key_mask[:1])
    return v
