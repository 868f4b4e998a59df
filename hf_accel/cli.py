"""``hf-accel`` command line: ``generate`` (the main job), ``convert-gqa``, ``demo``.

``hf-accel generate --prompt TEXT`` loads a model (default: the embedded SmolLM2-135M-Instruct), runs
stock transformers ``generate`` and then the same model after ``accelerate_model`` on the same prompt
(greedy), streams the accelerated answer, and prints a side-by-side table: tokens/s, time to first
token, peak memory, and whether the greedy tokens are identical. ``--speculative prompt_lookup|early_exit``
or ``--draft-model PATH`` runs the accelerated side with speculative decoding and prints its counters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys

from hf_accel import __version__

EXIT_USAGE = 2


class CLIError(Exception):
    """A user-facing error: printed as one line, exit code 2."""


def _fmt_bytes(n):
    return "n/a (CPU)" if n is None else f"{n / 2**20:.1f} MiB"


def _fmt_s(s):
    return "n/a" if s is None else f"{s * 1000:.1f} ms"


_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _dtype_name(value: str) -> str:
    """``--dtype``: float32 / float16 / bfloat16, or the aliases fp32 / fp16 / bf16 (as ``load_model`` takes)."""
    name = _DTYPE_ALIASES.get(value.lower(), value.lower())
    if name not in ("float32", "float16", "bfloat16"):
        raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (choose from float32, float16, bfloat16, "
                                         "fp32, fp16, bf16)")
    return name


def _add_generate(sub):
    p = sub.add_parser("generate", help="stream an answer and compare stock HF generate vs hf-accel")
    p.add_argument("--prompt", required=True, help="the user prompt (chat template applied if the tokenizer has one)")
    p.add_argument("--model", default=None,
                   help="local HF model directory or .gguf file ('default' or omitted: embedded SmolLM2; a folder "
                        "named default here is loaded instead)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--dtype", default=None, type=_dtype_name, metavar="{float32,float16,bfloat16}",
                   help="(or fp32, fp16, bf16) default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompt as raw text")
    p.add_argument("--speculative", default=None, choices=["prompt_lookup", "early_exit"],
                   help="speculative decoding on the accelerated side (greedy output stays the same)")
    p.add_argument("--draft-model", default=None,
                   help="speculative decoding with this draft model (local directory or .gguf, same tokenizer)")
    p.add_argument("--json", dest="json_out", default=None, help="also write the results to this JSON file")
    _add_verbose(p)
    p.set_defaults(func=_run_generate)


def _load(path, dtype, device, what, tokenizer: bool = True):
    from hf_accel.models import ModelNotFoundError, load_model

    try:
        return load_model(path, dtype=dtype, device=device, tokenizer=tokenizer)
    except ModelNotFoundError as e:
        raise CLIError(str(e)) from None
    except Exception as e:  # noqa: BLE001 (files that do not load raise many types: OSError, SafetensorError, ...)
        raise CLIError(f"could not load {what} {path or '(default)'}: {type(e).__name__}: {e}") from None


def _check_draft_config(model_path, draft_path) -> None:
    """Raise CLIError where ``--draft-model`` cannot draft for ``--model`` by their configs alone (not a model,
    an unsupported model type, another vocabulary size): seconds, instead of after the main model's load.
    :func:`~hf_accel.speculative.config.check_draft` checks the loaded models again."""
    from hf_accel.integrations.patch import SUPPORTED_MODEL_TYPES
    from hf_accel.models import ModelNotFoundError, load_config

    configs = []
    for flag, path in (("--model", model_path), ("--draft-model", draft_path)):
        try:
            configs.append(load_config(path))
        except ModelNotFoundError as e:
            raise CLIError(f"{flag}: {e}") from None
        except (OSError, ValueError, KeyError) as e:
            raise CLIError(f"{flag} {path or '(default)'}: could not read its config: {type(e).__name__}: {e}") from None
    target, draft = configs
    model_type = getattr(draft, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CLIError(f"--draft-model {draft_path}: model_type {model_type!r} is not supported "
                       f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    vocab, target_vocab = getattr(draft, "vocab_size", None), getattr(target, "vocab_size", None)
    if vocab != target_vocab:
        raise CLIError(f"--draft-model {draft_path}: its vocab_size ({vocab}) differs from the model's "
                       f"({target_vocab}); a draft must share the model's tokenizer")


def _within_context(max_new: int, prompt_len: int, config) -> int:
    """``--max-new-tokens``, capped (with a note on stderr) where prompt + answer would run past the model's
    ``max_position_embeddings``: both sides of the comparison would generate that long unless an EOS comes.

    Raises:
        CLIError: the prompt alone fills the context."""
    context = getattr(config.get_text_config() if hasattr(config, "get_text_config") else config,
                      "max_position_embeddings", None)
    if not context or prompt_len + max_new <= context:
        return max_new
    if prompt_len >= context:
        raise CLIError(f"the prompt ({prompt_len} tokens) fills the model's context ({context} positions)")
    print(f"hf-accel: --max-new-tokens {max_new} runs past the model's context of {context} positions with this "
          f"{prompt_len}-token prompt; capped to {context - prompt_len}", file=sys.stderr)
    return context - prompt_len


def backoff_hint(spec: dict) -> str | None:
    """Why a speculative call ran mostly plain steps, from its ``speculative_stats`` (None if it did not):
    the measured round times (ms, host turnaround included) of a plain step and of the verify rounds, or, where
    no verify round ran at all, how the draft length chooser gets to one."""
    times = spec.get("round_ms") or {}
    plain = times.get("0")
    verify = [t for k, t in times.items() if k != "0"]
    if spec.get("verify_steps", 0) == 0 and spec.get("backed_off_steps", 0) > 0:
        from hf_accel.speculative.draft_length import _PROBE_EVERY

        what = ("prompt lookup drafts where the last tokens repeat earlier text" if spec.get("method") == "prompt_lookup"
                else f"until rounds are measured the adaptive draft length weighs drafting by its priors; while "
                f"they favour plain steps it tries a draft round after every {_PROBE_EVERY} plain steps")
        return f"  no verify round ran in this answer: {what}; a longer answer gives it more chances"
    if spec.get("backed_off_steps", 0) <= spec.get("verify_steps", 0) or plain is None or not verify:
        return None
    low, high = f"{min(verify):.2f}", f"{max(verify):.2f}"
    took = low if low == high else f"{low}-{high}"
    return (f"  mostly plain steps: here a verify round took {took} ms and a plain step {plain:.2f} ms; the "
            "adaptive draft length drafts only where the tokens a round is expected to accept pay for its time")


#: Tokens a chat template and special tokens may add around the prompt, at most (for the bound below).
_TEMPLATE_TOKENS = 256


def _prompt_ids(tokenizer, prompt: str, chat_template: bool):
    """The prompt's input ids ([1, n] int64, CPU) and attention mask, through the chat template where asked for
    and the tokenizer has one. CLIError where the template fails (it raises, or does not parse)."""
    if chat_template and getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
        except Exception as e:  # jinja2's TemplateError family (syntax errors, raise_exception in the template)
            if not type(e).__module__.startswith("jinja2"):
                raise
            raise CLIError(f"the tokenizer's chat template failed ({type(e).__name__}: {e}); "
                           "--no-chat-template sends the prompt as plain text") from None
    else:
        text = prompt
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)


def _check_prompt_fits_before_loading(model_path, prompt: str, chat_template: bool) -> None:
    """CLIError where the prompt alone fills the model's context, found from its config and tokenizer before its
    weights load (tens of seconds on a CPU). Only a prompt long enough to possibly fill it is tokenized here:
    tokenizers give at most one token per UTF-8 byte, plus what the template adds (:data:`_TEMPLATE_TOKENS`); others
    are checked after the load, with the answer's length (:func:`_within_context`)."""
    from hf_accel.models import ModelNotFoundError, load_config, load_tokenizer

    try:
        config = load_config(model_path)
        context = getattr(config, "max_position_embeddings", None)
        if not context or len(prompt.encode("utf-8")) + _TEMPLATE_TOKENS < context:
            return
        tokenizer = load_tokenizer(model_path)
    except (ModelNotFoundError, OSError, ValueError, KeyError):
        return  # the load below reports what is wrong with the files
    _within_context(1, _prompt_ids(tokenizer, prompt, chat_template)["input_ids"].shape[1], config)


def _run_generate(args) -> int:
    prompt = args.prompt.strip()
    if not prompt:
        raise CLIError("--prompt is empty; give some text to answer")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes the locale could not decode reach Python as lone surrogates
        raise CLIError("--prompt is not valid UTF-8 text (the shell passed bytes of another encoding); pass it as "
                       "UTF-8") from None
    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be >= 1 (got {args.max_new_tokens})")
    if args.speculative and args.draft_model:
        raise CLIError("give either --speculative or --draft-model, not both")
    if args.json_out is not None:
        if not args.json_out.strip():
            raise CLIError("--json needs a file path; got an empty string")
        parent = os.path.dirname(os.path.abspath(args.json_out))
        if os.path.isdir(args.json_out):
            raise CLIError(f"--json {args.json_out}: is a folder; give a file path")
        if not os.path.isdir(parent):
            what = f"{parent} is a file, not a folder" if os.path.exists(parent) else f"folder {parent} does not exist"
            raise CLIError(f"--json {args.json_out}: {what}")
        _check_writable(args.json_out)
    for flag, path in (("--model", args.model), ("--draft-model", args.draft_model)):
        if path is not None and not path.strip():
            raise CLIError(f"{flag} is empty; give a model directory or .gguf file")
        if path is not None and path != "default" and not os.path.exists(path):  # "default": the embedded model
            raise CLIError(f"{flag} {path!r} does not exist")
    import torch  # after the checks that need no torch (a mistyped option is answered at once)

    from hf_accel import accelerate_model, measure_generate, speculative_stats
    device = args.device if args.device is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    from hf_accel.models import check_device

    try:
        check_device(device)
    except ValueError as e:
        raise CLIError(f"--{e}") from None
    dtype = args.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    if args.draft_model:  # a draft that cannot serve is refused from the configs, before any weights load
        _check_draft_config(args.model, args.draft_model)
    _check_prompt_fits_before_loading(args.model, prompt, not args.no_chat_template)
    model, tokenizer = _load(args.model, dtype, device, "model")
    # What accelerate_model would refuse is refused before the stock run, naming the option at fault.
    from hf_accel.integrations.patch import check_model_type
    from hf_accel.speculative.config import SpeculativeConfig
    from hf_accel.speculative.config import check_draft, check_speculative

    try:
        check_model_type(model)
    except ValueError as e:
        raise CLIError(f"--model {args.model}: {e}") from None
    speculative = args.speculative
    if speculative:
        try:
            check_speculative(model, SpeculativeConfig.from_arg(speculative))
        except ValueError as e:
            raise CLIError(f"--speculative {speculative}: {e}") from None
    if args.draft_model:
        # the draft shares the target's tokenizer: its folder needs no tokenizer files
        speculative, _ = _load(args.draft_model, dtype, device, "draft model", tokenizer=False)
        try:
            check_draft(model, speculative)
        except ValueError as e:
            raise CLIError(f"--draft-model {args.draft_model}: {e}") from None
    from transformers import TextStreamer

    inputs = _prompt_ids(tokenizer, prompt, not args.no_chat_template).to(device)
    embedding_rows = model.get_input_embeddings().num_embeddings
    if inputs["input_ids"].numel() and int(inputs["input_ids"].max()) >= embedding_rows:
        raise CLIError(f"the tokenizer gives token id {int(inputs['input_ids'].max())}, past the model's "
                       f"{embedding_rows} embedding rows: the tokenizer does not belong to this model")
    max_new = _within_context(args.max_new_tokens, inputs["input_ids"].shape[1], model.config)
    gen = dict(max_new_tokens=max_new, do_sample=False, pad_token_id=tokenizer.pad_token_id)

    # Warm-up (one short call each) so neither side pays one-time start costs in its numbers.
    model.generate(**inputs, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    tokens_word = "token" if max_new == 1 else "tokens"
    print(f"[{device}, {dtype}] stock transformers generate, up to {max_new} new {tokens_word} (not streamed) ...",
          flush=True)
    stock = measure_generate(model, inputs, **gen)
    try:
        accelerate_model(model, speculative=speculative)
    except ValueError as e:
        raise CLIError(f"cannot accelerate the model: {e}") from None
    model.generate(**inputs, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    print(f"\n[{device}, {dtype}] hf-accel answer:\n", flush=True)
    ours = measure_generate(model, inputs, streamer=TextStreamer(tokenizer, skip_prompt=True,
                                                                 skip_special_tokens=True), **gen)
    identical = torch.equal(stock.sequences, ours.sequences)
    spec = speculative_stats(model)
    rows = [
        ("tokens/s", f"{stock.tokens_per_s:.1f}", f"{ours.tokens_per_s:.1f}"),
        ("time to first token", _fmt_s(stock.ttft_s), _fmt_s(ours.ttft_s)),
        ("new tokens", str(stock.new_tokens), str(ours.new_tokens)),
        ("total time", _fmt_s(stock.seconds), _fmt_s(ours.seconds)),
        ("peak memory", _fmt_bytes(stock.peak_memory_bytes), _fmt_bytes(ours.peak_memory_bytes)),
    ]
    path = "Triton kernels" if device.startswith("cuda") else "PyTorch attention path (no GPU; same op as the kernels)"
    print(f"\n{'':22}{'stock HF':>14}{'hf-accel':>14}")
    for name, a, b in rows:
        print(f"{name:22}{a:>14}{b:>14}")
    print(f"greedy tokens identical: {'yes' if identical else 'NO'}   (hf-accel path: {path})")
    if spec is not None:
        rate = "n/a (no drafts proposed)" if spec["acceptance_rate"] is None else f"{spec['acceptance_rate']:.2f}"
        per_step = "n/a" if spec["mean_tokens_per_step"] is None else f"{spec['mean_tokens_per_step']:.2f}"
        print(f"speculative ({spec['method']}): {spec['verify_steps']} verify steps, {spec['backed_off_steps']} plain "
              f"(backed off), acceptance {rate}, tokens per verify step {per_step}")
        hint = backoff_hint(spec)
        if hint:
            print(hint)
    if args.json_out:
        try:
            _write_json(args.json_out, {
                "device": device, "dtype": dtype, "prompt": prompt, "identical": identical, "speculative": spec,
                "stock": stock.as_dict(), "hf_accel": ours.as_dict(),
                "answer": tokenizer.decode(ours.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)})
        except OSError as e:
            raise CLIError(f"--json {args.json_out}: could not write the results ({e.strerror or e})") from None
    return 0


def _write_json(path: str, data) -> None:
    """``data`` as JSON at ``path``, serialized before the file is opened (an error there leaves the file alone) and
    written in place, so a pipe, ``/dev/stdout`` or an existing file keeps what it is (mode, owner, links). If the
    write fails (a full disk) a file this call created is removed: no empty or cut-off new file stays behind.
    Raises OSError."""
    text = json.dumps(data, indent=2)
    existed = os.path.lexists(path)
    try:
        with open(path, "w") as f:
            f.write(text)
    except BaseException:
        if not existed:
            with contextlib.suppress(OSError):
                os.remove(path)
        raise


def _add_verbose(p) -> None:
    """-v after the subcommand too (SUPPRESS: absent there leaves the top-level flag's value)."""
    p.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                   help="log what hf-accel patches and which path runs")


def _add_optional(sub, name, module, help_text, load: bool):
    """A subcommand whose implementation lives in its own module, imported only when ``load`` (the command
    line names it): its imports (torch) then wait until it runs."""
    import importlib

    p = sub.add_parser(name, help=help_text)
    _add_verbose(p)
    if not load:
        return
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        def missing(_args, error=e):
            raise CLIError(f"{name} is not available: {error}")
        p.set_defaults(func=missing)
        return
    mod.add_arguments(p)
    p.set_defaults(func=mod.run)


def _check_writable(path: str) -> None:
    """CLIError unless ``path`` can be opened for writing (checked before the models load; a file this check
    creates is removed again)."""
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise CLIError(f"--json {path}: cannot be written ({e.strerror or e})") from None
    if not existed:
        os.remove(path)


def build_parser(argv=None) -> argparse.ArgumentParser:
    """The ``hf-accel`` parser for ``argv`` (default ``sys.argv[1:]``): only the subcommand it names loads
    its module."""
    chosen = next((a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(prog="hf-accel", description="Fast LLM inference for Hugging Face transformers.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what hf-accel patches and which path runs")
    parser.add_argument("--version", action="version", version=f"hf-accel {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    _add_optional(sub, "convert-gqa", "hf_accel.conversion.cli", "convert an MHA/GQA checkpoint to fewer KV heads",
                  load=chosen == "convert-gqa")
    _add_optional(sub, "demo", "hf_accel.demo_launch", "start the Gradio demo (stock HF vs hf-accel side by side)",
                  load=chosen == "demo")
    for command_parser in sub.choices.values():  # unrecognized arguments: the subcommand's usage names them
        command_parser.set_defaults(command_parser=command_parser)
    return parser


def main(argv=None) -> int:
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    if args.verbose:
        logging.getLogger("hf_accel").setLevel(logging.INFO)
    try:
        return args.func(args)
    except CLIError as e:
        print(f"hf-accel: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
