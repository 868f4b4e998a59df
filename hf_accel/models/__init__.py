"""Model loading: the embedded SmolLM2-135M-Instruct GGUF, or any local transformers model directory."""

from hf_accel.models.loading import (
    DEFAULT_GGUF_ENV,
    INSTALL_HINT,
    ModelNotFoundError,
    check_device,
    find_default_gguf,
    load_config,
    load_default_model,
    load_model,
    load_tokenizer,
)

__all__ = [
    "DEFAULT_GGUF_ENV",
    "INSTALL_HINT",
    "ModelNotFoundError",
    "check_device",
    "find_default_gguf",
    "load_config",
    "load_default_model",
    "load_model",
    "load_tokenizer",
]
