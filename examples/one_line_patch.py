"""The one-line patch: an ordinary transformers script, plus `model = accelerate_model(model)`.

    python examples/one_line_patch.py                  # embedded SmolLM2-135M-Instruct
    python examples/one_line_patch.py --model DIR      # any local llama/mistral/qwen2/qwen3 directory
    python examples/one_line_patch.py --max-new-tokens 16
"""

import argparse
import logging

import torch
from transformers import TextStreamer

from hf_accel import accelerate_model
from hf_accel.models import ModelNotFoundError, load_model

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=None, help="local HF model directory or .gguf (default: embedded SmolLM2)")
parser.add_argument("--prompt", default="Give me three tips for writing clear Python code.")
parser.add_argument("--max-new-tokens", type=int, default=96)
args = parser.parse_args()
if args.max_new_tokens < 1:
    parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
logging.basicConfig(level=logging.INFO, format="%(message)s")  # shows what hf-accel patched

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
try:
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)  # or AutoModelForCausalLM.from_pretrained(...)
except ModelNotFoundError as e:
    parser.error(str(e))
except Exception as e:  # files that do not load (no weights, not a GGUF, a corrupt safetensors file, ...)
    parser.error(f"could not load model {args.model}: {type(e).__name__}: {e}")

try:
    model = accelerate_model(model)  # <- the one line
except ValueError as e:  # a model type hf-accel does not run: the message lists the supported ones
    parser.error(str(e))

if tokenizer.chat_template:  # an instruct model: the prompt as a chat turn
    messages = [{"role": "user", "content": args.prompt}]
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
else:  # a base model (its tokenizer has no chat template): the prompt as plain text
    inputs = tokenizer(args.prompt, return_tensors="pt", return_token_type_ids=False)
inputs = inputs.to(device)
model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False,
               streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True))
