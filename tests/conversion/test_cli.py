"""``hf-accel convert-gqa`` (hf_accel.conversion.cli) on a tiny local model with a tiny tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from hf_accel.conversion.cli import main
from hf_accel.evaluation import pydoc_topics_text

from gqa_tiny_models import build, write_gguf


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=96, special_tokens=["<unk>", "<eos>"], limit_alphabet=60)
    tk.train_from_iterator([pydoc_topics_text()[:20_000]], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-mha")
    model = build("llama", num_heads=4, num_kv_heads=4, head_dim=8, layers=2, dtype=torch.float32)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


ARGS = ["--eval-tokens", "300", "--context-length", "64", "--calibration-tokens", "256", "--device", "cpu"]


def test_convert_writes_a_stock_loadable_checkpoint_and_a_table(model_dir, tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["--model", str(model_dir), "--num-kv-heads", "2", "--method", "activation", "--out", str(out), *ARGS])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    table = captured.out
    # 2 (K,V) * 2 layers * heads * 8 dims * 4 bytes
    assert "KV cache bytes / token" in table and "512" in table and "256" in table
    ppl_line = next(line for line in table.splitlines() if line.startswith("perplexity"))
    before, after = (float(x) for x in ppl_line.split()[-2:])
    assert before > 1 and after > 1 and before != after
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.num_key_value_heads == 2
    assert loaded.model.layers[0].self_attn.k_proj.weight.shape == (16, 32)
    assert (out / "tokenizer.json").is_file()


def test_a_kv_head_count_the_model_cannot_take_is_refused_before_its_weights_load(model_dir, tmp_path, capsys,
                                                                                 monkeypatch):
    """Read from the config alone (a GGUF's metadata takes seconds, its dequantized load many more)."""
    import hf_accel.models.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **kw: pytest.fail("the weights were loaded"))
    rc = main(["--model", str(model_dir), "--num-kv-heads", "3", "--out", str(tmp_path / "o"), *ARGS])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == ("hf-accel convert-gqa: error: num_kv_heads=3 must divide the current 4 (pooling "
                                   "merges whole groups); valid choices for this model (4 query heads, 4 KV heads): "
                                   "[1, 2, 4]")


@pytest.mark.parametrize("argv, message", [
    (["--num-kv-heads", "3"], "valid choices"),
    (["--num-kv-heads", "0"], "--num-kv-heads must be >= 1"),
    (["--num-kv-heads", "2", "--calibration-file", "/nonexistent/file.txt"], "is not a file"),
    (["--num-kv-heads", "2", "--eval-tokens", "-1"], "--eval-tokens must be >= 0; got -1"),
    (["--num-kv-heads", "2", "--recovery-steps", "-3"], "--recovery-steps must be >= 0; got -3"),
    (["--num-kv-heads", "2", "--dtype", "float64"], "--dtype: unknown dtype 'float64'; choose one of float32, fp32, "
                                                    "float16, fp16, bfloat16, bf16, or auto"),
])
def test_user_errors_are_one_line_and_exit_2(model_dir, tmp_path, capsys, argv, message):
    rc = main(["--model", str(model_dir), "--out", str(tmp_path / "o"), *ARGS, *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith("hf-accel convert-gqa: error:") and message in err[-1]
    assert not any("Traceback" in line for line in err)


@pytest.mark.parametrize("out", ["", "  "])
def test_empty_out_is_refused_before_the_model_loads(out, tmp_path, capsys, monkeypatch):
    """--out "" would be the current directory (Path("")); refused, nothing written there."""
    monkeypatch.chdir(tmp_path)
    assert main(["--model", str(tmp_path / "nope"), "--num-kv-heads", "1", "--out", out, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "--out must name a directory; got an empty string" in err and not any(tmp_path.iterdir())


def test_bad_num_kv_heads_is_refused_before_the_model_loads(tmp_path, capsys):
    """A count below 1 needs no model to refuse: the nonexistent --model is never looked at."""
    assert main(["--model", str(tmp_path / "nope"), "--num-kv-heads", "-2", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--num-kv-heads must be >= 1" in err and "does not exist" not in err


def test_short_context_length_is_refused_before_the_model_loads(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nope"), "--num-kv-heads", "1", "--context-length", "1",
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--context-length must be >= 2; got 1" in err and "does not exist" not in err


@pytest.mark.parametrize("kind", ["file", "under_file"])
def test_an_out_path_that_cannot_be_a_directory_is_refused_before_the_model_loads(kind, tmp_path, capsys):
    """--out naming a file, or a path under a file: refused first (was: after loading, measuring and converting,
    with a raw OSError or an --overwrite hint that cannot help)."""
    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    out = a_file if kind == "file" else a_file / "sub"
    assert main(["--model", str(tmp_path / "nope"), "--num-kv-heads", "1", "--out", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    want = "is a file, not a directory" if kind == "file" else f"cannot be created: {str(a_file)!r} is a file"
    assert want in err and "does not exist" not in err and "--overwrite" not in err


def test_an_out_link_to_nothing_and_a_negative_context_length_are_refused_first(tmp_path, capsys):
    link = tmp_path / "outlink"
    link.symlink_to(tmp_path / "missing" / "target")
    assert main(["--model", str(tmp_path / "nope"), "--num-kv-heads", "1", "--out", str(link)]) == 2
    assert "is a symbolic link to a path that does not exist" in capsys.readouterr().err
    assert main(["--model", str(tmp_path / "nope"), "--num-kv-heads", "1", "--out", str(tmp_path / "o"),
                 "--context-length", "-5"]) == 2
    assert "--context-length must be >= 2; got -5" in capsys.readouterr().err


def test_a_calibration_file_that_is_not_utf8_is_named(model_dir, tmp_path, capsys):
    bad = tmp_path / "cal.txt"
    bad.write_bytes(b"abc\x8d\xff def")
    rc = main(["--model", str(model_dir), "--out", str(tmp_path / "o"), *ARGS, "--num-kv-heads", "2",
               "--method", "activation", "--calibration-file", str(bad)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and f"--calibration-file {str(bad)!r} is not UTF-8 text" in err


def test_recovery_on_a_calibration_file_shorter_than_one_window_is_refused_before_converting(model_dir, tmp_path,
                                                                                            capsys, monkeypatch):
    """--recovery-steps with a calibration file of fewer tokens than a training window: refused once the text is
    tokenized, before the perplexity runs and the conversion (was: after both, naming seq_len, which the CLI has no
    flag for)."""
    import hf_accel.conversion.gqa as gqa

    monkeypatch.setattr(gqa, "convert_to_gqa", lambda *a, **k: pytest.fail("converted"))
    short = tmp_path / "cal.txt"
    short.write_text("A few words of text.")
    rc = main(["--model", str(model_dir), "--out", str(tmp_path / "o"), *ARGS, "--num-kv-heads", "2",
               "--recovery-steps", "2", "--calibration-file", str(short)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and "--recovery-steps 2 trains on windows of 128 tokens: the calibration text has " in err
    assert "give a --calibration-file of more than 128 tokens" in err and not (tmp_path / "o").exists()


def test_a_context_length_past_the_model_positions_is_refused_before_its_weights_load(model_dir, tmp_path, capsys,
                                                                                         monkeypatch):
    import hf_accel.models.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    max_pos = AutoModelForCausalLM.from_pretrained(model_dir).config.max_position_embeddings
    rc = main(["--model", str(model_dir), "--out", str(tmp_path / "o"), "--num-kv-heads", "2", "--device", "cpu",
               "--context-length", str(max_pos + 1)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and f"--context-length {max_pos + 1} is more than the model's {max_pos} positions" in err


def test_unsupported_model_type_is_one_line_and_exit_2(tmp_path, capsys):
    """A GPT2 folder: the conversion's own error (no num_key_value_heads in its config to report)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = tmp_path / "gpt2"
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=96)).save_pretrained(gpt2)
    _tokenizer().save_pretrained(gpt2)
    rc = main(["--model", str(gpt2), "--num-kv-heads", "1", "--out", str(tmp_path / "o"), *ARGS])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2, err
    assert err[-1].startswith("hf-accel convert-gqa: error:") and "does not support model_type 'gpt2'" in err[-1]
    assert not any("Traceback" in line for line in err) and not (tmp_path / "o").exists()


def test_missing_model_and_busy_out_dir(model_dir, tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nope"), "--num-kv-heads", "1", "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    assert main(["--model", str(model_dir), "--num-kv-heads", "1", "--out", str(busy), *ARGS]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_gguf_file_at_its_own_kv_head_count_is_written(tmp_path, capsys):
    """--num-kv-heads equal to the GGUF model's own count: nothing to pool, and the checkpoint is still written
    (without the GGUF quantizer object that makes save_pretrained refuse) and loads in stock transformers."""
    gguf = write_gguf(tmp_path / "tiny.gguf", num_heads=4, num_kv_heads=2)
    out = tmp_path / "out"
    rc = main(["--model", str(gguf), "--num-kv-heads", "2", "--out", str(out), *ARGS])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.num_key_value_heads == 2
    assert (out / "tokenizer.json").is_file()


@pytest.mark.parametrize("error", [OSError("No space left on device"), RuntimeError("interrupted")],
                         ids=["user-error", "other-error"])
@pytest.mark.parametrize("out_kind", ["new-nested", "existing-empty"])
def test_a_failed_save_leaves_no_output_behind(model_dir, tmp_path, monkeypatch, capsys, error, out_kind):
    """A failure while writing the checkpoint (here: after the weights, before the tokenizer) removes what
    the command created: the directories it made, or the files it wrote into an --out that existed empty."""
    from transformers import PreTrainedModel

    original = PreTrainedModel.save_pretrained

    def save_then_fail(self, *args, **kwargs):
        original(self, *args, **kwargs)
        raise error

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_then_fail)
    if out_kind == "new-nested":
        top = tmp_path / "new"
        out = top / "sub" / "out"
    else:
        top = out = tmp_path / "empty"
        out.mkdir()
    argv = ["--model", str(model_dir), "--num-kv-heads", "2", "--out", str(out), "--eval-tokens", "0",
            "--device", "cpu"]
    if isinstance(error, OSError):  # a user error: one line, exit status 2
        assert main(argv) == 2
        assert "No space left on device" in capsys.readouterr().err
    else:
        with pytest.raises(RuntimeError, match="interrupted"):
            main(argv)
    if out_kind == "new-nested":
        assert not top.exists()
    else:
        assert out.is_dir() and not any(out.iterdir())


def test_eval_tokens_that_leave_no_calibration_text_name_the_flag(model_dir, tmp_path, capsys):
    """Evaluation and calibration texts both come from pydoc; too many --eval-tokens is a one-line flag error
    (not the text's character offsets), and nothing is written."""
    out = tmp_path / "out"
    rc = main(["--model", str(model_dir), "--num-kv-heads", "2", "--method", "pca", "--out", str(out),
               "--eval-tokens", "100000000", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and not out.exists()
    assert err[-1] == ("hf-accel convert-gqa: error: --eval-tokens 100000000: the perplexity text would overlap the "
                       "calibration text that --method pca needs (both come from Python's pydoc topics); use fewer "
                       "--eval-tokens or give --calibration-file")


def test_an_empty_model_or_calibration_file_is_named_before_loading(model_dir, tmp_path, capsys, monkeypatch):
    import hf_accel.models.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **kw: pytest.fail("the weights were loaded"))
    assert main(["--model", "", "--num-kv-heads", "1", "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "hf-accel convert-gqa: error: --model is empty; give a model directory or .gguf file (or leave it out for "
        "the embedded model)")
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n")
    assert main(["--model", str(model_dir), "--num-kv-heads", "2", "--method", "pca", "--calibration-file", str(empty),
                 "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip().endswith(f"--calibration-file {str(empty)!r} holds no text")


def test_an_empty_calibration_file_path_is_named(model_dir, tmp_path, capsys):
    assert main(["--model", str(model_dir), "--num-kv-heads", "2", "--method", "pca", "--calibration-file", "",
                 "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err.strip().endswith("--calibration-file is empty; give a UTF-8 text file (or leave it "
                                                    "out for pydoc text)")


@pytest.mark.parametrize("device, message", [("cuda:x", "--device must be auto, cpu, cuda or cuda:N (got 'cuda:x')"),
                                             ("tpu", "--device must be auto, cpu, cuda or cuda:N (got 'tpu')")])
def test_a_bad_device_is_named_before_loading(device, message, tmp_path, capsys, monkeypatch):
    """``cuda:x`` passed the old prefix check and failed inside torch after the load."""
    import hf_accel.models.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **kw: pytest.fail("the weights were loaded"))
    assert main(["--model", str(tmp_path / "nope"), "--num-kv-heads", "1", "--out", str(tmp_path / "o"),
                 "--device", device]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"hf-accel convert-gqa: error: {message}"


def _tiny_dir(path, model_type="llama", dtype=torch.float32, **extra):
    model = build(model_type, num_heads=4, num_kv_heads=4, head_dim=8, layers=2, dtype=dtype, **extra)
    model.save_pretrained(path)
    _tokenizer().save_pretrained(path)
    return path


def test_pca_on_qwen3_and_too_few_calibration_tokens_are_refused_before_the_weights_load(tmp_path, capsys,
                                                                                        monkeypatch):
    """Both follow from the config and the flags alone; before, the model loaded and its perplexity ran first, and
    too few calibration tokens were reported as a calibration text that was too short."""
    import hf_accel.models.loading as loading

    qwen3 = _tiny_dir(tmp_path / "qwen3", "qwen3")
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    rc = main(["--model", str(qwen3), "--num-kv-heads", "2", "--method", "pca", "--out", str(tmp_path / "o"), *ARGS])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and err == ("hf-accel convert-gqa: error: --method pca does not support model_type 'qwen3' (its "
                               "per-head q/k norms undo the query-side compensation); use --method mean, norm or "
                               "activation")
    llama = _tiny_dir(tmp_path / "llama")
    for method in ("activation", "pca"):
        rc = main(["--model", str(llama), "--num-kv-heads", "2", "--method", method, "--out", str(tmp_path / "o"),
                   "--context-length", "64", "--calibration-tokens", "63", "--device", "cpu"])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert rc == 2 and err == ("hf-accel convert-gqa: error: --calibration-tokens 63 is less than "
                                   "--context-length 64: the calibration reads whole windows of --context-length "
                                   "tokens")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_auto_dtype_writes_the_source_checkpoints_dtype(dtype, tmp_path, capsys):
    """--dtype auto runs in float32 on a CPU and writes the checkpoint in its source's dtype (before: a float16 or
    bfloat16 checkpoint came back as float32, twice the size); an explicit --dtype writes that dtype."""
    src = _tiny_dir(tmp_path / "src", dtype=dtype)
    out = tmp_path / "out"
    rc = main(["--model", str(src), "--num-kv-heads", "2", "--out", str(out), "--eval-tokens", "0", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 0, err
    name = str(dtype).replace("torch.", "")
    assert f"writing the checkpoint in {name} (the source checkpoint's dtype; the conversion ran in float32)" in err
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.dtype == dtype and loaded.model.layers[0].self_attn.k_proj.weight.dtype == dtype
    out32 = tmp_path / "out32"
    assert main(["--model", str(src), "--num-kv-heads", "2", "--out", str(out32), "--eval-tokens", "0",
                 "--device", "cpu", "--dtype", "float32"]) == 0
    assert AutoModelForCausalLM.from_pretrained(out32).model.layers[0].self_attn.k_proj.weight.dtype == torch.float32


def test_overwrite_removes_an_earlier_sharded_checkpoints_index(model_dir, tmp_path, capsys):
    """--overwrite into a folder with a sharded checkpoint: transformers removes the old shards; their index, which
    the single-file checkpoint does not replace, goes too (it named files that are gone)."""
    out = tmp_path / "out"
    AutoModelForCausalLM.from_pretrained(model_dir).save_pretrained(out, max_shard_size="20KB")
    assert (out / "model.safetensors.index.json").is_file()
    rc = main(["--model", str(model_dir), "--num-kv-heads", "2", "--out", str(out), "--overwrite",
               "--eval-tokens", "0", "--device", "cpu"])
    assert rc == 0, capsys.readouterr().err
    assert (out / "model.safetensors").is_file() and not (out / "model.safetensors.index.json").exists()
    assert not list(out.glob("model-*-of-*.safetensors"))
    assert AutoModelForCausalLM.from_pretrained(out).config.num_key_value_heads == 2


def test_a_write_error_that_is_not_an_oserror_is_one_line_and_exit_2(model_dir, tmp_path, monkeypatch, capsys):
    """safetensors reports a full disk as its own SafetensorError, not an OSError: one line, exit 2, no traceback,
    and no half-written output (other exceptions still propagate: test_a_failed_save_leaves_no_output_behind)."""
    from safetensors import SafetensorError
    from transformers import PreTrainedModel

    def fail(self, *args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", fail)
    out = tmp_path / "new" / "out"
    rc = main(["--model", str(model_dir), "--num-kv-heads", "2", "--out", str(out), "--eval-tokens", "0",
               "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1] == (f"hf-accel convert-gqa: error: could not write the checkpoint to {str(out)!r}: "
                                   "SafetensorError: Error while serializing: I/O error: No space left on device "
                                   "(os error 28)")
    assert not (tmp_path / "new").exists()


def test_a_cut_off_weights_file_is_one_line(model_dir, tmp_path, capsys):
    """A model folder whose model.safetensors is cut off: one error line naming the weights, exit 2 (was a
    SafetensorError traceback)."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    rc = main(["--model", str(broken), "--out", str(tmp_path / "o"), *ARGS, "--num-kv-heads", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1
    assert "could not read the model's weights: SafetensorError" in err[0]


def test_kv_bytes_are_those_of_the_written_checkpoints_dtype(tmp_path, capsys):
    """A bfloat16 checkpoint converted on a CPU (which runs in float32) is written in bfloat16: the table's KV bytes
    per token are bfloat16's (they used to be float32's, twice as many) and say which dtype they count."""
    src = tmp_path / "bf16"
    model = build("llama", num_heads=4, num_kv_heads=4, head_dim=8, layers=2, dtype=torch.bfloat16)
    model.save_pretrained(src)
    _tokenizer().save_pretrained(src)
    out = tmp_path / "out"
    rc = main(["--model", str(src), "--num-kv-heads", "2", "--out", str(out), *ARGS])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    kv_line = next(line for line in captured.out.splitlines() if line.startswith("KV cache bytes"))
    # 2 (K,V) * 2 layers * heads * 8 dims * 2 bytes
    assert "(bfloat16)" in kv_line and kv_line.split()[-2:] == ["256", "128"]
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def test_a_truncated_gguf_is_one_line_and_exit_2(cut_gguf, tmp_path, capsys):
    """A GGUF file cut off after its first MiB: one error line naming it (the GGUF reader's bare struct.error used
    to escape as a traceback with exit 1)."""
    cut = cut_gguf(1 << 20)
    assert main(["--model", str(cut), "--num-kv-heads", "1", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hf-accel convert-gqa: error: ") and "could not be read as a GGUF file" in err[-1]


def _convert(src, out, *extra):
    return main(["--model", str(src), "--num-kv-heads", "2", "--out", str(out), "--eval-tokens", "0", "--device",
                 "cpu", *extra])


def _edit_weights(path, edit):
    """Rewrite ``path``'s model.safetensors with ``edit(tensors)`` applied (a dict it may change)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("change", ["missing", "unexpected", "classifier"])
def test_weights_that_do_not_match_the_model_are_refused(change, tmp_path, capsys):
    """A weight missing from the source (transformers fills it at random), one the model has no place for (it is
    dropped), or a sequence-classification checkpoint (no LM head) was converted and written with exit 0, and the
    written checkpoint then loaded with no warning: now one line naming the weights, exit 2, nothing written."""
    src = _tiny_dir(tmp_path / "src")
    if change == "missing":
        _edit_weights(src, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
        want = "1 missing (they would be random: model.layers.1.self_attn.k_proj.weight)"
    elif change == "unexpected":
        _edit_weights(src, lambda t: t.update({"model.extra.weight": torch.ones(2)}))
        want = "1 with no place in the model (they would be dropped: model.extra.weight)"
    else:
        from transformers import AutoModelForSequenceClassification

        AutoModelForSequenceClassification.from_pretrained(src, num_labels=3).save_pretrained(src)
        want = "missing (they would be random: lm_head.weight)"
    out = tmp_path / "out"
    assert _convert(src, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"hf-accel convert-gqa: error: the weights of {str(src)!r} do not match the "
                              "LlamaForCausalLM its config builds: ") and want in err[-1], err[-1]
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["src"]


def test_a_config_that_does_not_match_its_weights_is_one_line(tmp_path, capsys):
    """num_key_value_heads edited in config.json but not in the weights: transformers raised a RuntimeError, shown as
    a traceback with exit 1; now one line naming the weights and both shapes, exit 2."""
    import json

    src = _tiny_dir(tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["num_key_value_heads"] = 2
    (src / "config.json").write_text(json.dumps(config))
    assert main(["--model", str(src), "--num-kv-heads", "1", "--out", str(tmp_path / "out"), "--eval-tokens", "0",
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "4 of another shape than the config gives (model.layers.0.self_attn.k_proj.weight: checkpoint (32, 32), " \
           "model (16, 32);" in err, err


def test_in_place_conversion_that_fails_to_write_leaves_the_source_as_it_was(tmp_path, monkeypatch, capsys):
    """--out equal to --model under --overwrite: a write that failed part-way (a full disk) left the new config
    (2 KV heads) beside the old weights (4), a source that no longer loaded. Now the source is untouched; and a
    write that succeeds replaces it in place, keeping its other files."""
    from transformers import PreTrainedModel

    src = _tiny_dir(tmp_path / "src")
    (src / "README.md").write_text("notes")
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    original = PreTrainedModel.save_pretrained

    def config_then_full_disk(self, path, *args, **kwargs):
        self.config.save_pretrained(path)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", config_then_full_disk)
    assert _convert(src, src, "--overwrite") == 2
    assert "No space left on device" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no staging directory left
    assert AutoModelForCausalLM.from_pretrained(src).config.num_key_value_heads == 4

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", original)
    assert _convert(src, src, "--overwrite") == 0, capsys.readouterr().err
    assert AutoModelForCausalLM.from_pretrained(src).config.num_key_value_heads == 2
    assert (src / "README.md").read_text() == "notes" and [p.name for p in tmp_path.iterdir()] == ["src"]


def test_sigterm_while_writing_leaves_nothing_behind(model_dir, tmp_path, monkeypatch):
    """SIGTERM (timeout, docker stop) during the write left a partial --out (weights and config without
    tokenizer.json) that looked like a checkpoint; now it exits 143 with nothing written, as Ctrl-C does."""
    import os
    import signal

    from transformers import PreTrainedModel

    original = PreTrainedModel.save_pretrained

    def save_then_terminated(self, *args, **kwargs):
        original(self, *args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save_then_terminated)
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as stop:
        _convert(model_dir, tmp_path / "out")
    assert stop.value.code == 143 and list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is before


def test_overwrite_replaces_an_earlier_checkpoints_weight_files_and_keeps_other_files(model_dir, tmp_path, capsys):
    """An --out holding another checkpoint in pytorch_model.bin and a file of the user's: the new checkpoint's files
    move in, the stale .bin goes, the user's file stays; the directory gets the usual permissions."""
    import os

    out = tmp_path / "out"
    old = AutoModelForCausalLM.from_pretrained(model_dir)
    old.config.save_pretrained(out)
    torch.save(old.state_dict(), out / "pytorch_model.bin")
    (out / "notes.txt").write_text("mine")
    assert _convert(model_dir, out, "--overwrite") == 0, capsys.readouterr().err
    assert not (out / "pytorch_model.bin").exists() and (out / "notes.txt").read_text() == "mine"
    assert AutoModelForCausalLM.from_pretrained(out).config.num_key_value_heads == 2
    new = tmp_path / "new"
    assert _convert(model_dir, new) == 0
    umask = os.umask(0)
    os.umask(umask)
    assert new.stat().st_mode & 0o777 == 0o777 & ~umask  # not the private mode of a temporary directory


def test_auto_dtype_without_a_dtype_in_the_config_follows_the_weights(tmp_path, capsys):
    """A float16 checkpoint whose config.json names no dtype (transformers' dtype="auto" reads the weights then)
    was written as float32, twice the size."""
    import json

    src = _tiny_dir(tmp_path / "src", dtype=torch.float16)
    config = json.loads((src / "config.json").read_text())
    config.pop("dtype", None)
    config.pop("torch_dtype", None)
    (src / "config.json").write_text(json.dumps(config))
    assert _convert(src, tmp_path / "out") == 0
    assert "writing the checkpoint in float16" in capsys.readouterr().err
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype="auto")
    assert loaded.model.layers[0].self_attn.k_proj.weight.dtype == torch.float16


def test_model_default_means_what_it_means_to_generate(tmp_path, monkeypatch, capsys):
    """`--model default` with a folder named default in the working directory: generate (load_model) loads the
    folder; convert-gqa loaded the embedded model instead. Both now load the folder."""
    _tiny_dir(tmp_path / "default")
    monkeypatch.chdir(tmp_path)
    assert _convert("default", tmp_path / "out") == 0, capsys.readouterr().err
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.hidden_size == 32


def test_pca_with_no_more_calibration_tokens_than_the_hidden_size_is_refused_before_loading(model_dir, tmp_path,
                                                                                             capsys, monkeypatch):
    """Counted in whole windows, as the conversion uses them: 40 tokens in windows of 16 are 32, no more than the
    hidden size 32 (a check of the count itself passed 40 and failed after the model loaded)."""
    import hf_accel.models.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("weights loaded"))
    rc = main(["--model", str(model_dir), "--num-kv-heads", "2", "--method", "pca", "--out", str(tmp_path / "o"),
               "--context-length", "16", "--calibration-tokens", "40", "--device", "cpu"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert rc == 2 and err == ("hf-accel convert-gqa: error: --method pca needs more calibration tokens than the "
                               "model's hidden size 32 (it inverts each layer's input second moment): "
                               "--calibration-tokens 40 uses 32 (whole windows of --context-length 16); give at least "
                               "48")


def test_default_calibration_tokens_suit_pca_on_a_wide_model():
    """The default 4096 tokens are no more than a 4096-wide model's hidden size: for pca the default grows to the
    fewest whole windows past it (it refused a Llama-8B-shaped model with the default)."""
    from hf_accel.conversion.cli import _calibration_tokens

    assert _calibration_tokens("pca", 4096, 512, None) == 4608
    assert _calibration_tokens("pca", 576, 512, None) == 4096 and _calibration_tokens("mean", 8192, 512, None) == 4096
    assert _calibration_tokens("pca", 4096, 512, 5000) == 5000


def test_a_signal_while_the_files_move_into_place_waits_for_the_moves(model_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C (sent here from another thread, as a signal may reach any thread) while the written files move into an
    earlier checkpoint: the moves finish, then KeyboardInterrupt; the checkpoint is whole (a thread mask on the main
    thread alone left new weights beside the old config.json)."""
    import os
    import signal
    import threading

    import hf_accel.conversion.cli as conversion_cli

    out = tmp_path / "out"
    assert _convert(model_dir, out) == 0  # an earlier checkpoint (2 KV heads) ...
    replace, sent = os.replace, []

    def replace_then_interrupted(src, dst):
        replace(src, dst)
        if not sent:
            sent.append(1)
            t = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT))
            t.start()
            t.join()

    monkeypatch.setattr(conversion_cli.os, "replace", replace_then_interrupted)
    with pytest.raises(KeyboardInterrupt):  # ... replaced by a 1-KV-head one
        main(["--model", str(model_dir), "--num-kv-heads", "1", "--out", str(out), "--overwrite", "--eval-tokens",
              "0", "--device", "cpu"])
    assert sent and AutoModelForCausalLM.from_pretrained(out).config.num_key_value_heads == 1
    assert not list(out.glob(".partial-*"))


def test_an_existing_out_keeps_its_mode_and_inode(model_dir, tmp_path, capsys):
    """An empty --out made beforehand (shared, setgid) was replaced by a new directory of the default mode; a shell
    in it was left in a deleted directory. Now the files move into it."""
    import os

    out = tmp_path / "shared"
    out.mkdir()
    os.chmod(out, 0o2770)
    inode = out.stat().st_ino
    assert _convert(model_dir, out) == 0, capsys.readouterr().err
    assert out.stat().st_ino == inode and out.stat().st_mode & 0o7777 == 0o2770
    assert (out / "config.json").is_file() and not list(out.glob(".partial-*"))


def test_an_out_path_where_mkdir_fails_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    """--out in a directory whose permission bits allow writing but where no directory can be made (as root: /proc,
    /sys, a read-only mount): refused first, naming --out (was: after loading, converting and measuring, with a
    raw OSError). The failing mkdir is simulated so that the test does not depend on who runs it."""
    import hf_accel.conversion.cli as conv_cli

    real = conv_cli.tempfile.mkdtemp

    def refuse(*args, dir=None, **kwargs):
        if dir is not None and Path(dir) == tmp_path:
            raise PermissionError(1, "Operation not permitted")
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(conv_cli.tempfile, "mkdtemp", refuse)
    monkeypatch.setattr(conv_cli.os, "access", lambda *a, **k: True)
    assert main(["--model", str(tmp_path / "nope"), "--num-kv-heads", "1", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--out {str(tmp_path / 'o')!r} cannot be written" in err and "Operation not permitted" in err, err
    assert "does not exist" not in err


def test_an_out_under_proc_is_refused_before_the_model_loads(tmp_path, capsys):
    if not Path("/proc/self").exists():
        pytest.skip("needs Linux's /proc")
    assert main(["--model", str(tmp_path / "nope"), "--num-kv-heads", "1", "--out", "/proc/hf-accel-out"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--out '/proc/hf-accel-out' cannot be written" in err and "does not exist" not in err, err
