"""``hf-accel generate`` (the README's main command) on the embedded SmolLM2, and its argument errors."""

from __future__ import annotations

import json

import pytest

from hf_accel import revert_model
from hf_accel.cli import EXIT_USAGE, main


@pytest.mark.parametrize(("argv", "message"), [
    (["generate", "--prompt", "   "], "--prompt is empty"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["generate", "--prompt", "hi", "--speculative", "prompt_lookup", "--draft-model", "x"], "not both"),
    # checked before any model is loaded
    (["generate", "--prompt", "hi", "--device", "tpu"], "--device must be cpu, cuda or cuda:N (got 'tpu')"),
    (["generate", "--prompt", "hi", "--device", ""], "--device must be cpu, cuda or cuda:N (got '')"),
    (["generate", "--prompt", "hi", "--json", "/nonexistent-dir/x.json"], "folder /nonexistent-dir does not exist"),
    (["generate", "--prompt", "hi", "--json", "/"], "--json /: is a folder"),
    (["generate", "--prompt", "hi", "--draft-model", "/nonexistent-model"], "--draft-model '/nonexistent-model' does"),
])
def test_bad_arguments_exit_2_with_a_message(argv, message, capsys):
    assert main(argv) == EXIT_USAGE
    assert message in capsys.readouterr().err


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
