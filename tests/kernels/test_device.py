"""The Triton launchers name the problem when given CPU tensors outside Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

import hf_accel.kernels as kernels
from hf_accel.kernels import device
from hf_accel.kernels.argmax import argmax_rows
from hf_accel.kernels.commit_tokens import commit_tokens
from hf_accel.kernels.fused_linear import fused_linear
from hf_accel.kernels.gemv import gemv
from hf_accel.kernels.ngram_lookup import ngram_lookup
from hf_accel.kernels.rms_norm import rms_norm
from hf_accel.kernels.swiglu import swiglu


@pytest.fixture
def not_interpreting(monkeypatch):
    monkeypatch.setattr(device, "kernels_interpreted", lambda: False)


CALLS = {
    "rms_norm": lambda: rms_norm(torch.randn(2, 32), torch.randn(32), 1e-6),
    "swiglu": lambda: swiglu(torch.randn(2, 32), torch.randn(2, 32)),
    "gemv": lambda: gemv(torch.randn(1, 32), torch.randn(16, 32)),
    "argmax_rows": lambda: argmax_rows(torch.randn(2, 8)),
    "fused_linear": lambda: fused_linear(torch.randn(3, 32), torch.randn(16, 32)),
    "ngram_lookup": lambda: ngram_lookup(torch.randint(0, 5, (1, 12)), torch.tensor([10]), torch.tensor([0]), 3),
    "commit_tokens": lambda: commit_tokens(
        torch.zeros(1, 2, dtype=torch.long), None, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool),
        torch.zeros(1, 8, dtype=torch.long), torch.tensor([2]), torch.tensor([4]), torch.tensor([True]),
        torch.tensor([-1]), torch.zeros(8, dtype=torch.long), torch.zeros(3, dtype=torch.long), count_step=True),
}


@pytest.mark.parametrize("op", sorted(CALLS))
def test_cpu_tensors_outside_the_interpreter_raise_a_clear_error(op, not_interpreting):
    with pytest.raises(ValueError, match=rf"{op} runs its Triton kernel on CUDA tensors.*TRITON_INTERPRET=1"):
        CALLS[op]()


@pytest.mark.interpreter
def test_the_interpreter_runs_them():
    for op, call in CALLS.items():
        call()  # no error


def _resolve(name: str):
    """The object a message names: ``torch.argmax`` or a function of some hf_accel.kernels module."""
    import importlib
    import pkgutil

    if name.startswith("torch."):
        return getattr(torch, name.split(".")[1].split("(")[0])
    if name.startswith("hf_accel."):  # a qualified name: it must live where it says
        module_name, _, attr = name.rpartition(".")
        return getattr(importlib.import_module(module_name), attr, None)
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"hf_accel.kernels.{info.name}")
        if hasattr(module, name):
            return getattr(module, name)
    return None


@pytest.mark.parametrize("op", sorted(CALLS))
def test_the_named_pytorch_version_exists(op, not_interpreting):
    with pytest.raises(ValueError) as e:
        CALLS[op]()
    named = str(e.value).split("got a CPU tensor. ")[1].split(" is the PyTorch version")[0].split(" ")[0]
    assert callable(_resolve(named)), f"{op}'s message names {named!r}, which does not exist"


def test_every_launcher_names_an_existing_pytorch_version():
    """Source scan: each check_launch_device call names a reference that exists (its own or the default
    ``<op>_ref``)."""
    import re
    from pathlib import Path

    calls = []
    for path in Path(kernels.__file__).parent.glob("*.py"):
        calls += re.findall(r'check_launch_device\(\w+, "(\w+)",?\s*(?:"([^"]+)")?\)', path.read_text())
    assert len(calls) >= 15
    for op, reference in calls:
        named = (reference or f"{op}_ref").split(" ")[0]
        assert callable(_resolve(named)), f"{op} names {named!r}, which does not exist"


def test_on_device_makes_another_gpu_current_only_where_needed(monkeypatch):
    """A model on cuda:1 while cuda:0 is current: hf-accel's work runs under ``torch.cuda.device(cuda:1)`` (Triton
    launches on the current device); the current device, CPU and an index-less "cuda" get a null context.
    (Stand-ins for torch.cuda's device functions: runs without a GPU.)"""
    import contextlib

    from hf_accel.kernels.device import on_device

    entered = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda d: entered.append(d) or contextlib.nullcontext())
    for d in (torch.device("cpu"), torch.device("cuda"), torch.device("cuda", 0)):
        with on_device(d):
            pass
    assert entered == []
    with on_device(torch.device("cuda", 1)):
        pass
    assert entered == [torch.device("cuda", 1)]


def test_generate_runs_under_the_models_device(tiny, monkeypatch):
    """The generate shim enters :func:`on_device` with the model's device for the whole call."""
    import contextlib

    import hf_accel.integrations.generate as gen
    from hf_accel import accelerate_model

    seen = []

    @contextlib.contextmanager
    def recording(device):
        seen.append(("enter", device))
        yield
        seen.append(("exit", device))

    monkeypatch.setattr(gen, "on_device", recording)
    model = accelerate_model(tiny.model("llama", seed=3))
    ids, mask = tiny.batch(seed=4)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 2
    assert seen == [("enter", torch.device("cpu")), ("exit", torch.device("cpu"))]


def _dot_calls(dt):
    """One small call of each launcher whose kernel uses ``tl.dot``, in dtype ``dt`` (CPU tensors)."""
    from hf_accel.kernels.attention import attention
    from hf_accel.kernels.paged_attention import paged_attention
    from hf_accel.kernels.prefill import prefill_attention

    q, k, v = torch.randn(1, 2, 5, 16).to(dt), torch.randn(1, 1, 5, 16).to(dt), torch.randn(1, 1, 5, 16).to(dt)
    pool = torch.randn(4, 4, 1, 16).to(dt)
    table, lens = torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
    return {
        "fused_linear": lambda: fused_linear(torch.randn(3, 32).to(dt), torch.randn(16, 32).to(dt)),
        "attention": lambda: attention(q, k, v, causal=True),
        "prefill_attention": lambda: prefill_attention(q, k, v, causal=True),
        "paged_attention": lambda: paged_attention(q[:, :, :1], pool, pool.clone(), table, lens, 8),
    }


@pytest.mark.interpreter
@pytest.mark.parametrize("op", ["attention", "fused_linear", "paged_attention", "prefill_attention"])
def test_bfloat16_dot_kernels_refuse_under_the_interpreter(op):
    """Triton's interpreter multiplies bfloat16 bit patterns in tl.dot (triton-lang/triton#11584): the launchers of
    such kernels raise instead of returning values ~1e10; the same calls in float16 run."""
    with pytest.raises(ValueError, match=rf"{op}: Triton's interpreter computes tl.dot of bfloat16.*11584"):
        _dot_calls(torch.bfloat16)[op]()
    out = _dot_calls(torch.float16)[op]()
    out = out[0] if isinstance(out, tuple) else out
    assert torch.isfinite(out.float()).all() and out.float().abs().max() < 1e3


@pytest.mark.interpreter
@pytest.mark.parametrize("bad", ["length_past_capacity", "negative_length", "start_past_length", "int32_lengths",
                                 "float_k", "no_columns"])
def test_ngram_lookup_refuses_rows_it_would_read_past(bad):
    """A length past the row's capacity made the kernel read past the row and return drafts of tokens that are not
    in it (found by a new-user trial); such rows, and arguments of the wrong type, raise."""
    tokens = torch.tensor([[0, 0, 5, 6, 7, 8, 5, 6, 0, 0]])
    lengths, starts, k = torch.tensor([8]), torch.tensor([2]), 3
    if bad == "length_past_capacity":
        lengths = torch.tensor([50])
    elif bad == "negative_length":
        lengths = torch.tensor([-1])
    elif bad == "start_past_length":
        starts = torch.tensor([9])
    elif bad == "int32_lengths":
        lengths = lengths.int()
    elif bad == "float_k":
        k = 2.5
    else:
        tokens = tokens[:, :0]
    with pytest.raises(ValueError, match="lengths|capacity|must be ints|int64"):
        ngram_lookup(tokens, lengths, starts, k)
    drafts, valid = ngram_lookup(torch.tensor([[0, 0, 5, 6, 7, 8, 5, 6, 0, 0]]), torch.tensor([8]),
                                 torch.tensor([2]), 3)
    assert drafts[0, :2].tolist() == [7, 8] and valid[0, :2].all()  # after "5 6": "7 8" (then "5 6" again)


@pytest.mark.parametrize("call,match", [
    (lambda: swiglu(torch.tensor([[3, -2]], dtype=torch.int32), torch.tensor([[2, 2]], dtype=torch.int32)),
     "floating-point dtype"),
    (lambda: swiglu(torch.randn(2, 8), torch.randn(2, 8).half()), "floating-point dtype"),
    (lambda: rms_norm(torch.ones(2, 8, dtype=torch.int64), torch.ones(8), 1e-6), "x must be floating point"),
    (lambda: rms_norm(torch.randn(2, 8), torch.ones(8), torch.tensor(1e-6)), "eps must be a Python float"),
    (lambda: rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6, torch.randn(2, 8).double()), "residual dtype"),
])
def test_norm_and_swiglu_refuse_inputs_they_would_misread(call, match):
    """Integer inputs were computed as integers (swiglu([[3, -2]], [[2, 2]]) gave [[4, 0]]), a tensor eps failed
    inside Triton (found by a new-user trial): clear errors before any launch."""
    with pytest.raises(ValueError, match=match):
        call()
