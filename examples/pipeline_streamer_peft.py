"""The one-line patch under transformers' other entry points: a text-generation pipeline, a streamer fed from a
thread, and a peft LoRA model. Each part runs once as transformers alone and once after `accelerate_model`, and
prints whether the greedy answers are the same.

    python examples/pipeline_streamer_peft.py                  # embedded SmolLM2-135M-Instruct
    python examples/pipeline_streamer_peft.py --model DIR      # any local llama/mistral/qwen2/qwen3 directory

The LoRA adapter is made here with random weights (peft's own initialisation leaves it a no-op): nothing is
downloaded. On a CPU the accelerated side runs the same ops in PyTorch, so expect the same answers, not speed.
"""

import argparse
import threading

import torch
from peft import LoraConfig, get_peft_model
from transformers import TextIteratorStreamer, pipeline

from hf_accel import SUPPORTED_MODEL_TYPES, accelerate_model, revert_model
from hf_accel.models import ModelNotFoundError, load_model

parser = argparse.ArgumentParser()
parser.add_argument("--model", default=None, help="local HF model directory or .gguf (default: embedded SmolLM2)")
parser.add_argument("--prompt", default="Name three rivers in Europe.")
parser.add_argument("--max-new-tokens", type=int, default=32)
parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                    help="default bfloat16 on a GPU, float32 on a CPU; in float32 the answers are identical, in 16 bits "
                         "a near-tie between two tokens may be picked differently")
args = parser.parse_args()
if args.max_new_tokens < 1:
    parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device == "cuda" else torch.float32)
try:
    model, tokenizer = load_model(args.model, dtype=dtype, device=device)
except ModelNotFoundError as e:
    parser.error(str(e))
except Exception as e:  # files that do not load (no weights, not a GGUF, a corrupt safetensors file, ...)
    parser.error(f"could not load model {args.model}: {type(e).__name__}: {e}")
if model.config.model_type not in SUPPORTED_MODEL_TYPES:  # checked before the stock run, not after it
    parser.error(f"hf-accel does not support model_type {model.config.model_type!r}; supported: "
                 f"{', '.join(SUPPORTED_MODEL_TYPES)}")
# an instruct model gets the prompt as a chat turn; a base model (no chat template) as plain text
chat = bool(tokenizer.chat_template)
messages = [{"role": "user", "content": args.prompt}]
greedy = dict(max_new_tokens=args.max_new_tokens, do_sample=False)


def report(part, stock, ours):
    note = "" if stock == ours or dtype == torch.float32 else f" ({dtype}: a near-tie picked differently)"
    print(f"{part}: {'same answer' if stock == ours else 'DIFFERENT answers' + note}\n  {ours!r}")


# 1. A text-generation pipeline over the model.
def ask_pipeline(m):
    generator = pipeline("text-generation", model=m, tokenizer=tokenizer, device=m.device)
    if chat:
        return generator(messages, **greedy)[0]["generated_text"][-1]["content"]
    return generator(args.prompt, return_full_text=False, **greedy)[0]["generated_text"]


stock = ask_pipeline(model)
model = accelerate_model(model)  # <- the one line
report("pipeline", stock, ask_pipeline(model))


# 2. A streamer read while generate runs in another thread (how chat UIs stream).
def ask_streaming(m):
    inputs = (tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
              if chat else tokenizer(args.prompt, return_tensors="pt", return_token_type_ids=False)).to(device)
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    failed = []

    def run():  # an error in generate ends the stream (else the reader below would wait forever) and is re-raised
        try:
            m.generate(**inputs, **greedy, streamer=streamer)
        except Exception as e:
            failed.append(e)
            streamer.end()

    worker = threading.Thread(target=run)
    worker.start()
    text = "".join(piece for piece in streamer)
    worker.join()
    if failed:
        raise failed[0]
    return text


ours = ask_streaming(model)
revert_model(model)
report("streamer", ask_streaming(model), ours)

# 3. A peft LoRA model (the adapter merged into the weights while accelerated; revert_model unmerges it).
torch.manual_seed(0)  # peft draws lora_A from the global generator: the same adapter on every run
lora = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
with torch.no_grad():
    for name, p in lora.named_parameters():
        if "lora_B" in name:
            p.normal_(std=0.2, generator=torch.Generator(device=p.device).manual_seed(0))
lora.eval()
stock = ask_streaming(lora)
lora = accelerate_model(lora)  # <- the same line on the PeftModel
report("peft LoRA", stock, ask_streaming(lora))
