"""``hf-accel convert-gqa``: convert a checkpoint to fewer K/V heads and report what changed.

    hf-accel convert-gqa --model DIR|FILE.gguf|default --num-kv-heads N --method M --out DIR

Loads the model (``default`` or no ``--model``: the embedded SmolLM2-135M-Instruct), measures it,
pools its K/V heads (:func:`hf_accel.conversion.convert_to_gqa`), optionally runs a short LoRA
recovery fine-tune, measures again and writes a safetensors checkpoint that stock transformers loads
(``AutoModelForCausalLM.from_pretrained(DIR)``). The before/after table has the KV-cache bytes per
token, perplexity on the fixed pydoc topics text (:mod:`hf_accel.evaluation`) and, when CUDA is
present, decode tokens/s through ``hf_accel.accelerate_model`` + ``generate``.

Errors print one line to stderr and return 2. The checkpoint is written into a hidden directory inside ``--out``
first and moved into place once complete: a write that fails or is interrupted leaves ``--out`` as it was
(:func:`_write_checkpoint`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

PROG = "hf-accel convert-gqa"


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


DEFAULT_CONTEXT_LENGTH = 512  # tokens per perplexity / calibration window
DEFAULT_CALIBRATION_TOKENS = 4096


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``convert-gqa`` options to ``parser``."""
    from hf_accel.conversion.gqa import GROUPINGS, METHODS

    parser.add_argument("--model", default=None,
                        help="local model directory or .gguf file; 'default' or omitted: embedded SmolLM2 (a folder "
                             "named default here is loaded instead)")
    parser.add_argument("--num-kv-heads", type=int, required=True,
                        help="new number of K/V heads (a divisor of the current number; 1 = MQA)")
    parser.add_argument("--method", choices=METHODS, default="mean",
                        help="pooling: mean (GQA paper; default), norm, activation or pca (calibrated, refits Q/O)")
    parser.add_argument("--grouping", choices=GROUPINGS, default="adjacent",
                        help="which heads share a group: adjacent (paper; default) or similarity (calibrated)")
    parser.add_argument("--out", required=True, help="output directory for the converted checkpoint")
    parser.add_argument("--overwrite", action="store_true",
                        help="allow a non-empty --out directory (an earlier checkpoint there is replaced once the new "
                             "one is written in full)")
    parser.add_argument("--dtype", default="auto",
                        help="float32, bfloat16 or float16: the conversion runs in it and the checkpoint is written "
                             "in it; auto (default): runs in bf16 on CUDA, else fp32, and writes the checkpoint in "
                             "the source checkpoint's dtype (its config's, else its safetensors weights'; for a "
                             "GGUF, the dtype it ran in)")
    parser.add_argument("--device", default="auto", help="cpu, cuda or cuda:N; auto: cuda when present (default)")
    parser.add_argument("--calibration-file", default=None,
                        help="UTF-8 text for the calibrated methods and the recovery fine-tune "
                             "(default: the last pydoc topics, disjoint from the evaluation text)")
    parser.add_argument("--calibration-tokens", type=int, default=None,
                        help="calibration tokens used, in whole windows of --context-length (default 4096; with "
                             "--method pca at least one window more than the model's hidden size)")
    parser.add_argument("--eval-tokens", type=int, default=4096,
                        help="perplexity tokens from the pydoc topics text; 0 skips perplexity (default 4096)")
    parser.add_argument("--context-length", type=int, default=None,
                        help="perplexity / calibration window (default 512, or the model's positions if fewer)")
    parser.add_argument("--recovery-steps", type=int, default=0,
                        help="LoRA recovery fine-tune steps on the calibration text (default 0: none)")
    parser.add_argument("--decode-tokens", type=int, default=128,
                        help="tokens generated for decode tok/s (CUDA; default 128)")


def _pick_device(name: str) -> str:
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    from hf_accel.models import check_device

    try:
        return str(check_device(name))
    except ValueError as e:  # "device must be cpu, cuda or cuda:N ...", "device cuda requested but no CUDA GPU ..."
        raise CliError("--" + str(e).replace("device must be cpu,", "device must be auto, cpu,", 1)) from None


def _measure(model, tokenizer, eval_ids, args, device: str, kv_dtype=None) -> dict:
    """KV heads, KV-cache bytes per token in ``kv_dtype`` (the written checkpoint's dtype; default the model's),
    perplexity and (on CUDA) decode speed of ``model`` as it is now."""
    from hf_accel import accelerate_model, revert_model
    from hf_accel.conversion.gqa import kv_cache_bytes_per_token
    from hf_accel.evaluation import perplexity
    from hf_accel.integrations.measure import measure_generate

    row = {
        "num_kv_heads": model.config.num_key_value_heads,
        "kv_bytes_per_token": kv_cache_bytes_per_token(model.config, kv_dtype or model.dtype),
        "kv_dtype": str(kv_dtype or model.dtype).replace("torch.", ""),
        "perplexity": None,
        "decode_tokens_per_s": None,
    }
    if eval_ids is not None:
        row["perplexity"] = perplexity(model, eval_ids, context_length=args.context_length, progress=True).perplexity
    if device.startswith("cuda") and args.decode_tokens > 1:
        prompt = (eval_ids if eval_ids is not None else
                  tokenizer(["def main():"] * 1, return_tensors="pt").input_ids)[:, :512].to(device)
        inputs = {"input_ids": prompt, "attention_mask": torch.ones_like(prompt)}
        gen = dict(do_sample=False, max_new_tokens=args.decode_tokens, min_new_tokens=args.decode_tokens,
                   pad_token_id=tokenizer.pad_token_id)
        accelerate_model(model)
        try:
            with torch.inference_mode():
                model.generate(**inputs, **{**gen, "max_new_tokens": 8, "min_new_tokens": 8})
            stats = measure_generate(model, inputs, **gen)
        finally:
            revert_model(model)
        if stats.ttft_s is not None and stats.steps > 1:
            row["decode_tokens_per_s"] = (stats.steps - 1) / (stats.seconds - stats.ttft_s)
    return row


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_table(before: dict, after: dict, ppl_label: str, no_gpu: bool) -> str:
    """The before/after table as text."""
    lines = [f"{'':<34}{'before':>14}{'after':>14}"]
    lines.append(f"{'KV heads':<34}{before['num_kv_heads']:>14}{after['num_kv_heads']:>14}")
    kv_label = f"KV cache bytes / token ({before.get('kv_dtype', '?')})"
    lines.append(f"{kv_label:<34}{before['kv_bytes_per_token']:>14,}{after['kv_bytes_per_token']:>14,}")
    lines.append(f"{ppl_label:<34}{_fmt(before['perplexity'], '.3f'):>14}{_fmt(after['perplexity'], '.3f'):>14}")
    tok = "decode tok/s" + (" (needs CUDA)" if no_gpu else "")
    lines.append(f"{tok:<34}{_fmt(before['decode_tokens_per_s'], '.1f'):>14}"
                 f"{_fmt(after['decode_tokens_per_s'], '.1f'):>14}")
    return "\n".join(lines)


#: Weight files of a transformers checkpoint (single file, shards, their index): those an earlier checkpoint left
#: in ``--out`` that the new one does not replace are removed (under ``--overwrite``).
_WEIGHT_FILE = re.compile(r"(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")


def _write_checkpoint(model, tokenizer, out: Path) -> None:
    """``save_pretrained`` of the model and the tokenizer into ``out``, all or nothing.

    ``out`` is made if it is missing (with its missing parents), and both are written first into a new hidden
    directory inside it (``.partial-*``: the same file system, also where ``out`` is a mount point). If that fails or
    is interrupted (a full disk, Ctrl-C, SIGTERM), the hidden directory and the directories this call made are
    removed, and an existing ``out`` is left as it was: also an earlier checkpoint under ``--overwrite``, or the
    source checkpoint itself. Then the written files move up into ``out`` by renames, weights first and
    ``config.json`` last, with SIGINT and SIGTERM deferred until done (a failed move removes the hidden
    directory), and weight files of an earlier checkpoint that the new one did not replace (old shards, their
    index, a ``pytorch_model.bin``) are removed. Other files in ``out``, and ``out`` itself (its mode, owner,
    ACLs, a shell's working directory in it), stay."""
    made = [p for p in (out, *out.parents) if not p.exists()]  # missing directories, nearest first
    out.mkdir(parents=True, exist_ok=True)
    stage = None
    try:
        stage = Path(tempfile.mkdtemp(prefix=".partial-", dir=out))
        with _sigterm_raises():
            model.save_pretrained(stage)
            tokenizer.save_pretrained(stage)
    except BaseException:
        if stage is not None:
            shutil.rmtree(stage, ignore_errors=True)
        if made:
            shutil.rmtree(made[-1], ignore_errors=True)
        raise
    with _signals_deferred():
        try:
            written = sorted(stage.iterdir(),
                             key=lambda e: (e.name == "config.json", not _WEIGHT_FILE.fullmatch(e.name)))
            for entry in written:
                target = out / entry.name
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                os.replace(entry, target)
            names = {e.name for e in written}
            for old in out.iterdir():
                if _WEIGHT_FILE.fullmatch(old.name) and old.name not in names and old.is_file():
                    old.unlink()
        finally:
            shutil.rmtree(stage, ignore_errors=True)


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM (``timeout``, ``docker stop``, job schedulers) raises SystemExit(143) while inside, so that the cleanup
    of a failed write runs as it does for Ctrl-C. (Python runs signal handlers in the main thread, whichever thread
    the signal reaches; called from another thread this does nothing.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _signals_deferred():
    """SIGINT and SIGTERM recorded while inside and acted on when it ends (KeyboardInterrupt, SystemExit(143)), so
    that the written files move into place together. Python-level handlers: they run in the main thread whichever
    thread the signal reaches (a thread mask would cover only the main thread). Called from another thread this
    does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if signal.SIGINT in caught:
        raise KeyboardInterrupt
    if signal.SIGTERM in caught:
        raise SystemExit(128 + signal.SIGTERM)


def _config_dtype(config):
    """The torch dtype a checkpoint's config names (``dtype``, or ``torch_dtype`` in older configs) if it is
    float32, bfloat16 or float16; else None (a GGUF's config names none)."""
    for name in ("dtype", "torch_dtype"):
        # torch_dtype from the instance's own attributes: transformers 5's property warns that it is deprecated
        value = getattr(config, "dtype", None) if name == "dtype" else vars(config).get("torch_dtype")
        if isinstance(value, str):
            value = getattr(torch, value, None)
        if value in (torch.float32, torch.bfloat16, torch.float16):
            return value
    return None


def _weights_dtype(model_arg):
    """The dtype of a model directory's floating safetensors weights (float32, bfloat16 or float16: the first
    floating tensor of its first file, as transformers' ``dtype="auto"`` falls back to), for a config that names
    none; None for a GGUF, ``.bin`` weights or another dtype."""
    path = Path(model_arg).expanduser() if model_arg is not None else None
    files = sorted(p for p in path.glob("*.safetensors") if _WEIGHT_FILE.fullmatch(p.name)) \
        if path is not None and path.is_dir() else []  # model.safetensors or its shards, not an adapter's file
    if not files:
        return None
    from safetensors import safe_open

    names = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    with safe_open(str(files[0]), framework="pt") as f:
        for key in f.keys():
            kind = f.get_slice(key).get_dtype()
            if kind.startswith(("F", "BF")):
                return names.get(kind)
    return None


def _calibration_tokens(method: str, hidden: int | None, context_length: int, given: int | None) -> int:
    """``--calibration-tokens``: ``given``, or by default 4096, raised for ``pca`` to the fewest whole windows of
    ``context_length`` tokens that exceed ``hidden`` (pca inverts each layer's input second moment, [hidden + 1]
    square, so it needs more tokens than that). CliError where a given count uses no more tokens than ``hidden``."""
    least = (hidden // context_length + 1) * context_length if method == "pca" and hidden else 0
    if given is None:
        return max(DEFAULT_CALIBRATION_TOKENS, least)
    used = given // context_length * context_length
    if 0 < used < least:  # (fewer tokens than one window: refused as such by the caller)
        raise CliError(f"--method pca needs more calibration tokens than the model's hidden size {hidden} (it inverts "
                       f"each layer's input second moment): --calibration-tokens {given} uses {used} (whole windows "
                       f"of --context-length {context_length}); give at least {least}")
    return given


def _check_out(out: Path, overwrite: bool) -> None:
    """CliError before any work when ``--out`` cannot become the checkpoint directory: a file, a non-empty
    directory without ``--overwrite``, or a path under a file or a directory where no directory can be made."""
    if out.is_symlink() and not out.exists():
        raise CliError(f"--out {str(out)!r} is a symbolic link to a path that does not exist")
    if out.exists():
        if not out.is_dir():
            raise CliError(f"--out {str(out)!r} is a file, not a directory")
        if any(out.iterdir()) and not overwrite:
            raise CliError(f"--out {str(out)!r} exists and is not an empty directory (pass --overwrite to reuse it)")
        parent = out
    else:
        parent = next((p for p in out.absolute().parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise CliError(f"--out {str(out)!r} cannot be created: {str(parent)!r} is a file")
    if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
        raise CliError(f"--out {str(out)!r} cannot be written: no write permission in {str(parent)!r}")
    if parent is not None:
        # os.access answers for the permission bits only: root passes it where mkdir still fails (a read-only
        # mount, /proc, /sys), so a directory is made and removed there too
        try:
            os.rmdir(tempfile.mkdtemp(prefix=".hf-accel-probe-", dir=parent))
        except OSError as e:
            raise CliError(f"--out {str(out)!r} cannot be written: making a directory in {str(parent)!r} failed "
                           f"({e.strerror or type(e).__name__})") from None


def _run(args) -> int:
    from hf_accel.conversion.gqa import (PCA_UNSUPPORTED, _check_model, check_num_kv_heads, convert_to_gqa,
                                         kv_head_choices)
    from hf_accel.conversion.pooling import CALIBRATED_METHODS
    from hf_accel.conversion.recovery import DEFAULT_SEQ_LEN, recover_with_lora
    from hf_accel.evaluation import calibration_text, evaluation_ids
    from hf_accel.models.loading import load_config, load_model

    if args.context_length is not None and args.context_length < 2:  # perplexity predicts each token from those before it
        raise CliError(f"--context-length must be >= 2; got {args.context_length}")
    for name in ("calibration_tokens", "decode_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if args.num_kv_heads < 1:  # before the model loads (its own head count is checked after)
        raise CliError(f"--num-kv-heads must be >= 1; got {args.num_kv_heads}")
    for name in ("eval_tokens", "recovery_steps"):
        if getattr(args, name) < 0:
            raise CliError(f"--{name.replace('_', '-')} must be >= 0; got {getattr(args, name)}")
    if 0 < args.eval_tokens < 2:
        raise CliError("--eval-tokens must be 0 (skip) or >= 2")
    if not args.out.strip():  # Path("") is the current directory
        raise CliError("--out must name a directory; got an empty string")
    out = Path(args.out)
    _check_out(out, args.overwrite)
    device = _pick_device(args.device)
    if args.dtype != "auto":
        from hf_accel.models.loading import _resolve_dtype

        try:
            _resolve_dtype(args.dtype)
        except ValueError as e:
            raise CliError(f"--dtype: {e}, or auto") from None
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    calibration = None
    if args.calibration_file is not None:
        if not args.calibration_file.strip():
            raise CliError("--calibration-file is empty; give a UTF-8 text file (or leave it out for pydoc text)")
        path = Path(args.calibration_file)
        if not path.is_file():
            raise CliError(f"--calibration-file {str(path)!r} is not a file")
        try:
            calibration = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise CliError(f"--calibration-file {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not calibration.strip():
            raise CliError(f"--calibration-file {str(path)!r} holds no text")

    if args.model is not None and not args.model.strip():
        raise CliError("--model is empty; give a model directory or .gguf file (or leave it out for the embedded "
                       "model)")
    model_arg = args.model  # "default": the embedded model, unless a folder of that name is here (load_model)
    config = load_config(model_arg)  # seconds: a count the model cannot take is refused before its load
    if getattr(config, "num_key_value_heads", None) and getattr(config, "num_attention_heads", None):
        check_num_kv_heads(config, args.num_kv_heads)
    max_pos = getattr(config, "max_position_embeddings", None)
    if args.context_length is None:
        args.context_length = min(DEFAULT_CONTEXT_LENGTH, max_pos) if max_pos else DEFAULT_CONTEXT_LENGTH
    elif max_pos and args.context_length > max_pos:  # windows past the trained positions: meaningless perplexity
        raise CliError(f"--context-length {args.context_length} is more than the model's {max_pos} positions "
                       "(max_position_embeddings)")
    if args.method == "pca" and getattr(config, "model_type", None) in PCA_UNSUPPORTED:  # before the model loads
        raise CliError(f"--method pca does not support model_type {config.model_type!r} (its per-head q/k norms "
                       "undo the query-side compensation); use --method mean, norm or activation")
    calibrated = args.method in CALIBRATED_METHODS or args.grouping == "similarity"
    args.calibration_tokens = _calibration_tokens(args.method, getattr(config, "hidden_size", None),
                                                  args.context_length, args.calibration_tokens)
    if calibrated and args.calibration_tokens < args.context_length:
        raise CliError(f"--calibration-tokens {args.calibration_tokens} is less than --context-length "
                       f"{args.context_length}: the calibration reads whole windows of --context-length tokens")
    source_dtype = None
    if args.dtype == "auto":
        source_dtype = _config_dtype(config) or _weights_dtype(model_arg)
    t0 = time.perf_counter()
    try:  # strict: weights missing or of no place in the model would be written as random or dropped
        model, tokenizer = load_model(model_arg, dtype=dtype, device=device, strict=True)
    except RuntimeError as e:  # transformers' own load errors (not OSError / ValueError)
        detail = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise CliError(f"could not load the model: {type(e).__name__}: {detail}") from None
    _check_model(model)  # a model type the conversion does not take: its one-line error before anything else
    print(f"loaded {type(model).__name__} ({model.config.model_type}, {model.config.num_attention_heads} heads, "
          f"{model.config.num_key_value_heads} KV heads, {dtype}, {device}) in {time.perf_counter() - t0:.1f} s",
          file=sys.stderr)
    if args.num_kv_heads not in kv_head_choices(model):
        convert_to_gqa(model, args.num_kv_heads)  # raises the ValueError that names the valid choices
    eval_ids = evaluation_ids(tokenizer, args.eval_tokens) if args.eval_tokens else None
    needs_text = args.method in ("activation", "pca") or args.grouping == "similarity" or args.recovery_steps
    if needs_text and calibration is None:
        try:
            calibration = calibration_text(40_000 if not args.recovery_steps else 120_000,
                                           avoid_tokens=max(args.eval_tokens, 1), tokenizer=tokenizer)
        except ValueError:
            what = " and ".join([f"--method {args.method}"] * (args.method in ("activation", "pca"))
                                + ["--grouping similarity"] * (args.grouping == "similarity")
                                + [f"--recovery-steps {args.recovery_steps}"] * bool(args.recovery_steps))
            raise CliError(f"--eval-tokens {args.eval_tokens}: the perplexity text would overlap the calibration "
                           f"text that {what} needs (both come from Python's pydoc topics); use fewer "
                           "--eval-tokens or give --calibration-file") from None
    cal_ids = None
    if needs_text:
        cal_ids = tokenizer(calibration, return_tensors="pt", add_special_tokens=False).input_ids
        if args.recovery_steps and cal_ids.numel() <= DEFAULT_SEQ_LEN:  # before the conversion and perplexity runs
            raise CliError(f"--recovery-steps {args.recovery_steps} trains on windows of {DEFAULT_SEQ_LEN} tokens: the "
                           f"calibration text has {cal_ids.numel()}; give a --calibration-file of more than "
                           f"{DEFAULT_SEQ_LEN} tokens")

    before = _measure(model, tokenizer, eval_ids, args, device, kv_dtype=source_dtype)
    convert_to_gqa(model, args.num_kv_heads, method=args.method, grouping=args.grouping, calibration_text=cal_ids,
                   calibration_tokens=args.calibration_tokens, context_length=args.context_length, progress=True)
    if args.recovery_steps:
        model, stats = recover_with_lora(model, cal_ids, steps=args.recovery_steps, progress=True)
        print(f"LoRA recovery: {stats.steps} step{'s' if stats.steps != 1 else ''} in {stats.seconds:.0f} s, loss {stats.first_loss:.3f} -> "
              f"{stats.last_loss:.3f}", file=sys.stderr)
    after = _measure(model, tokenizer, eval_ids, args, device, kv_dtype=source_dtype)

    if source_dtype is not None and source_dtype != model.dtype:
        model.to(source_dtype)
        print(f"writing the checkpoint in {str(source_dtype).replace('torch.', '')} (the source checkpoint's dtype; "
              f"the conversion ran in {dtype})", file=sys.stderr)
    from safetensors import SafetensorError

    try:
        _write_checkpoint(model, tokenizer, out)
    except SafetensorError as e:  # safetensors' I/O errors (a full disk, ...) are not OSErrors
        raise CliError(f"could not write the checkpoint to {str(out)!r}: {type(e).__name__}: {e}") from None
    except OSError as e:  # the path in the message is the file that failed; name --out too
        raise CliError(f"could not write the checkpoint to --out {str(out)!r}: {e}") from None
    label = (f"perplexity (pydoc, {eval_ids.shape[1]} tok)" if eval_ids is not None else "perplexity (skipped)")
    print(format_table(before, after, label, not device.startswith("cuda")))
    print(f"wrote {out} (method={args.method}, grouping={args.grouping}"
          f"{f', LoRA {args.recovery_steps} steps' if args.recovery_steps else ''})")
    return 0


def run(args) -> int:
    """Run ``convert-gqa`` with parsed ``args``; returns the exit status (0 ok, 2 user error)."""
    from safetensors import SafetensorError

    from hf_accel.models.loading import ModelNotFoundError

    try:
        return _run(args)
    except (CliError, ValueError, TypeError, ModelNotFoundError, OSError, SafetensorError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if isinstance(e, SafetensorError):  # a corrupt or cut-off weights file of the model read
            msg = f"could not read the model's weights: {type(e).__name__}: {msg}"
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
