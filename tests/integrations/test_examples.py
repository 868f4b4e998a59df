"""The examples' own argument checks (the examples themselves run on the embedded model: README).

The refusals run each example inside the test's process (``_run_here``: ``runpy`` with ``sys.argv`` set, its
stdout/stderr captured, ``SystemExit`` taken as the exit code, any other exception propagating as the
traceback a user would see), which skips a fresh interpreter's imports of torch and transformers; runs that
generate (``_run``) keep a process of their own.
"""

import contextlib
import io
import logging
import runpy
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_speculative_example_refuses_method_and_draft_model_together():
    """--method picks a proposer without a second model; with --draft-model as well one of them would be
    ignored, so the pair is refused before any model loads."""
    run = _run_here("speculative_decoding.py", "--method", "early_exit", "--draft-model", "/nonexistent")
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1].endswith("error: give either --method or --draft-model, not both")


def _run(script, *args):
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=300)


def _run_here(script, *args):
    """``script`` run as ``__main__`` in this process with ``args``: (returncode, stdout, stderr) as ``_run``
    gives them. The root logger's level and handlers and torch's random state are restored afterwards."""
    out, err = io.StringIO(), io.StringIO()
    root = logging.getLogger()
    saved = (sys.argv, root.level, list(root.handlers), torch.random.get_rng_state())
    code = 0
    try:
        sys.argv = [str(EXAMPLES / script), *args]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            runpy.run_path(str(EXAMPLES / script), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved[0]
        root.setLevel(saved[1])
        root.handlers[:] = saved[2]
        torch.random.set_rng_state(saved[3])
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def test_speculative_example_refuses_a_non_positive_length_before_loading():
    run = _run_here("speculative_decoding.py", "--max-new-tokens", "0", "--model", "/nonexistent")
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1].endswith("error: --max-new-tokens must be >= 1, got 0")


def test_one_line_patch_refuses_a_non_positive_length_before_loading():
    run = _run_here("one_line_patch.py", "--max-new-tokens", "-2", "--model", "/nonexistent")
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1].endswith("error: --max-new-tokens must be >= 1, got -2")


def test_examples_name_a_missing_model_in_one_line():
    for script in ("one_line_patch.py", "speculative_decoding.py", "pipeline_streamer_peft.py"):
        run = _run_here(script, "--model", "/nonexistent/model")
        assert run.returncode == 2, run.stderr
        assert "Traceback" not in run.stderr and "/nonexistent/model" in run.stderr.strip().splitlines()[-1]


@pytest.mark.slow
def test_speculative_example_takes_a_draft_folder_without_tokenizer_files(tmp_path):
    """The draft shares the target's tokenizer (README): a draft folder with config and weights only runs."""
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    from hf_accel.models import find_default_gguf

    gguf = find_default_gguf()
    vocab_size = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name).vocab_size  # no weights loaded
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab_size)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    assert not list(tmp_path.glob("tokenizer*"))
    run = _run("speculative_decoding.py", "--draft-model", str(tmp_path), "--max-new-tokens", "4")
    assert run.returncode == 0, run.stderr[-2000:]


@pytest.mark.slow
def test_pipeline_streamer_peft_example_gives_stock_answers():
    """The example's three parts (pipeline, threaded streamer, peft LoRA) each print that the accelerated answer is
    transformers' own; the LoRA adapter it makes changes the answer (it is not a no-op). In float32, also on a GPU
    (whose default, bfloat16, may pick a near-tie differently)."""
    run = _run("pipeline_streamer_peft.py", "--max-new-tokens", "12", "--dtype", "float32")
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    verdicts = [line for line in lines if line.startswith(("pipeline:", "streamer:", "peft LoRA:"))]
    assert verdicts == ["pipeline: same answer", "streamer: same answer", "peft LoRA: same answer"], run.stdout
    answers = [lines[lines.index(v) + 1] for v in verdicts]
    assert answers[0] == answers[1] != answers[2], answers
    assert _run_here("pipeline_streamer_peft.py", "--max-new-tokens", "0").returncode == 2


def test_examples_name_an_empty_model_path():
    for script, flag in (("one_line_patch.py", "--model"), ("speculative_decoding.py", "--model"),
                         ("speculative_decoding.py", "--draft-model"), ("pipeline_streamer_peft.py", "--model")):
        run = _run_here(script, flag, "")
        assert run.returncode == 2, run.stderr
        assert run.stderr.strip().splitlines()[-1].endswith("the model path is empty; give a model directory or "
                                                            ".gguf file"), (script, flag, run.stderr[-500:])


def test_speculative_example_names_a_wrong_model_path_before_loading_the_draft(monkeypatch):
    """A draft that loads and a --model that does not exist: the missing path is named before either model's
    weights load (their configs are read first)."""
    import hf_accel.models
    from hf_accel.models import find_default_gguf

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before both paths were checked")

    monkeypatch.setattr(hf_accel.models, "load_model", no_load)
    run = _run_here("speculative_decoding.py", "--draft-model", str(find_default_gguf()), "--model", "/nonexistent")
    assert run.returncode == 2, run.stderr[-1500:]
    assert run.stderr.strip().splitlines()[-1].endswith("error: --model: model path '/nonexistent' does not exist")


@pytest.mark.slow
def test_speculative_example_refuses_a_draft_of_another_vocabulary_in_one_line(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    run = _run_here("speculative_decoding.py", "--draft-model", str(tmp_path), "--max-new-tokens", "4")
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "--draft-model" in run.stderr.strip().splitlines()[-1] and "vocab_size (1000)" in run.stderr


def test_examples_name_a_model_that_does_not_load_in_one_line(tmp_path):
    """A path that exists but does not load (a .gguf that is not one, a config without weights): one line naming
    the path and transformers' reason, as ``hf-accel generate`` gives, not a traceback."""
    fake = tmp_path / "fake.gguf"
    fake.write_text("not a gguf")
    truncated = tmp_path / "truncated.gguf"
    from hf_accel.models import find_default_gguf

    with open(find_default_gguf(), "rb") as f:  # a real header cut short: struct.error inside gguf
        truncated.write_bytes(f.read(100))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text('{"model_type": "llama"}')
    for script, flag, path in (("one_line_patch.py", "--model", fake),
                               ("speculative_decoding.py", "--model", fake),
                               ("speculative_decoding.py", "--draft-model", fake),
                               ("speculative_decoding.py", "--draft-model", no_weights),
                               ("one_line_patch.py", "--model", truncated)):
        run = _run_here(script, flag, str(path), *(["--max-new-tokens", "4"] if "speculative" in script else []))
        last = run.stderr.strip().splitlines()[-1]
        assert run.returncode == 2 and "Traceback" not in run.stderr, (script, flag, run.stderr[-1500:])
        assert "could not load" in last and str(path) in last, (script, flag, last)


def test_examples_name_an_unsupported_model_type_in_one_line(tmp_path):
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from hf_accel.models import find_default_gguf

    gguf = find_default_gguf()
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp_path)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64)).save_pretrained(tmp_path)
    for script in ("one_line_patch.py", "pipeline_streamer_peft.py"):  # the second used to raise after its stock run
        run = _run_here(script, "--model", str(tmp_path))
        assert run.returncode == 2 and "Traceback" not in run.stderr, (script, run.stderr[-1500:])
        assert "does not support model_type 'gpt2'" in run.stderr.strip().splitlines()[-1], script


@pytest.fixture(scope="module")
def base_model_dir(tmp_path_factory):
    """A tiny llama whose tokenizer has no chat template (a base model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from hf_accel.evaluation import pydoc_topics_text

    path = tmp_path_factory.mktemp("base-model")
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.train_from_iterator([pydoc_topics_text()[:20_000]],
                           trainers.BpeTrainer(vocab_size=96, special_tokens=["<unk>", "<eos>"], limit_alphabet=60))
    # token_type_ids too, as BERT-style tokenizers give them (generate refuses them for a llama)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>",
                                        model_input_names=["input_ids", "token_type_ids", "attention_mask"])
    assert not tokenizer.chat_template and "token_type_ids" in tokenizer("a b")
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("script", ["one_line_patch.py", "speculative_decoding.py", "pipeline_streamer_peft.py"])
def test_examples_run_a_model_without_a_chat_template(script, base_model_dir):
    """A base model (its tokenizer has no chat template) gets the prompt as plain text, without token_type_ids;
    every example ended in a traceback from apply_chat_template."""
    run = _run_here(script, "--model", str(base_model_dir), "--max-new-tokens", "4")
    assert run.returncode == 0, run.stderr
    if script == "pipeline_streamer_peft.py":
        assert run.stdout.count("same answer") == 3, run.stdout
