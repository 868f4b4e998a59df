"""Speculative decoding with the one-line patch: prompt lookup on an input-grounded prompt.

The answer copies from the given passage, so drafts copied from the prompt are often accepted and each
verify step commits several tokens; greedy output is the model's own greedy output.

    python examples/speculative_decoding.py                       # embedded SmolLM2-135M-Instruct
    python examples/speculative_decoding.py --method early_exit   # or a draft: --draft-model DIR
"""

import argparse
import time

import torch
from pydoc_data.topics import topics

import hf_accel
from hf_accel import accelerate_model
from hf_accel.models import ModelNotFoundError, load_config, load_model

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=None, help="local HF model directory or .gguf (default: embedded SmolLM2)")
parser.add_argument("--method", default=None, choices=["prompt_lookup", "early_exit"],
                    help="proposer without a second model (default: prompt_lookup)")
parser.add_argument("--draft-model", default=None, help="a smaller model with the same tokenizer (directory or .gguf)")
parser.add_argument("--max-new-tokens", type=int, default=96)
args = parser.parse_args()
if args.method is not None and args.draft_model is not None:
    parser.error("give either --method or --draft-model, not both")
if args.max_new_tokens < 1:
    parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32


def checked(flag, path, load):
    """``load(path)``, or the parser's one-line error naming ``flag`` and why the path does not load."""
    try:
        return load(path)
    except ModelNotFoundError as e:
        parser.error(f"{flag}: {e}")
    except Exception as e:  # files that do not load (no weights, not a GGUF, a corrupt safetensors file, ...)
        parser.error(f"could not load {flag} {path}: {type(e).__name__}: {e}")


# both paths checked (their configs read: seconds) before either model loads, then the draft (the smaller model)
# first: a path that is wrong or a draft that does not load is named before the target's longer load
paths = [(flag, path) for flag, path in (("--draft-model", args.draft_model), ("--model", args.model))
         if flag == "--model" or path is not None]
for flag, path in paths:
    checked(flag, path, load_config)
for flag, path in paths:  # the draft shares the target's tokenizer: its folder needs no tokenizer files
    loaded = checked(flag, path, lambda p: load_model(p, dtype=dtype, device=device, tokenizer=flag == "--model"))
    if flag == "--model":
        model, tokenizer = loaded
    else:
        speculative = loaded[0]
if args.draft_model is None:
    speculative = args.method or "prompt_lookup"

try:
    model = accelerate_model(model, speculative=speculative)  # <- the one line, with speculative decoding
except ValueError as e:  # a draft hf-accel cannot use (another vocabulary, an unsupported type): named in e
    parser.error(f"--draft-model {args.draft_model}: {e}" if args.draft_model is not None else str(e))

passage = topics["with"][:800]
request = f"Rewrite this passage in plain English, keeping its terms:\n\n{passage}"
if tokenizer.chat_template:  # an instruct model: the request as a chat turn
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": request}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
else:  # a base model (its tokenizer has no chat template): the request as plain text
    inputs = tokenizer(request, return_tensors="pt", return_token_type_ids=False)
inputs = inputs.to(device)
start = time.perf_counter()
out = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False)
seconds = time.perf_counter() - start
print(tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
print(f"\n{out.shape[1] - inputs['input_ids'].shape[1]} tokens in {seconds:.2f} s;", hf_accel.speculative_stats(model))
