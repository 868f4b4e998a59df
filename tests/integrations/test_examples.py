"""The examples' own argument checks (the examples themselves run on the embedded model: README)."""

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_speculative_example_refuses_method_and_draft_model_together():
    """--method picks a proposer without a second model; with --draft-model as well one of them would be
    ignored, so the pair is refused before any model loads."""
    run = subprocess.run([sys.executable, str(EXAMPLES / "speculative_decoding.py"), "--method", "early_exit",
                          "--draft-model", "/nonexistent"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1].endswith("error: give either --method or --draft-model, not both")
