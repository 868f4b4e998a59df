"""Every script of ``benchmarks/`` answers ``--help`` on any machine (exit code 0, no CUDA, no file written), and
the GPU-only ones, run without a GPU, stop with one line naming what they need (``common.require_cuda``) before
they write anything.

The scripts are loaded as modules (not as ``__main__``) in this process and their ``main`` is called with
``sys.argv`` set, as ``python benchmarks/<script>.py ...`` would; a script that touched CUDA would call
``torch.cuda._lazy_init``, which is replaced by a function that fails the test.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.benchmarks.bench_module import BENCH, load_bench

#: modules of benchmarks/ that other scripts import and that are not scripts themselves (no ``__main__`` block)
HELPERS = {"common", "graph_switch"}
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem not in HELPERS)
#: GPU-only runs {script: arguments} tried without a GPU, one of each kind of set-up before the GPU work: a kernel
#: sweep, a compile pool that wrote a result file first, a Llama-3-8B-shaped model built on the CPU, a script
#: that ran at import, a --device option
GPU_ONLY = {"bench_argmax": (), "bench_decode": ("--quick",), "bench_generate": (), "bench_prefill": (),
            "bench_multi_turn": ("--device", "cuda"), "profile_call_phases": (), "profile_generate_call": ()}
#: what must not run on the way to the refusal ({script: module functions}): building the 8B-shaped model in
#: float32 on the CPU (~32 GB) would take the test process down instead of failing it
FORBID = {"bench_generate": ("llama8b",)}


def _files(folder) -> set:
    """(name, size, mtime) of every file under ``folder``: a new or rewritten file changes the set."""
    return {(str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


@pytest.fixture
def run_script(monkeypatch, tmp_path):
    """``run_script(name, *args, forbid=())``: loads ``benchmarks/<name>.py``, calls its ``main()`` with
    ``sys.argv`` = [script, *args] in an empty working directory, without $OUT, with CUDA's initialisation and
    the module's functions named in ``forbid`` made to fail, and returns the ``SystemExit`` it raised (the test
    fails if it returned instead). Fails too if a file appeared in ``benchmarks/results/`` or the working
    directory."""

    def fail(what):
        def called(*args, **kwargs):
            raise AssertionError(what)

        return called

    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [*sys.path])  # the scripts put benchmarks/ on it
    monkeypatch.setattr(torch.cuda, "_lazy_init", fail("the script initialised CUDA"))
    results = BENCH / "results"

    def run(name: str, *args: str, forbid=()) -> SystemExit:
        before = _files(results)
        module = load_bench(name)
        for attr in forbid:
            monkeypatch.setattr(module, attr, fail(f"{name} called {attr}"))
        monkeypatch.setattr(sys, "argv", [str(BENCH / f"{name}.py"), *args])
        try:
            with pytest.raises(SystemExit) as exit_info:
                module.main()
        finally:
            assert _files(results) == before, f"{name} wrote into benchmarks/results/"
            assert not list(tmp_path.iterdir()), f"{name} wrote into the working directory"
        return exit_info.value

    return run


def test_helpers_are_not_scripts_and_every_script_has_a_main():
    for name in HELPERS:
        assert 'if __name__ == "__main__"' not in (BENCH / f"{name}.py").read_text(), name
    for name in SCRIPTS:
        text = (BENCH / f"{name}.py").read_text()
        assert 'if __name__ == "__main__"' in text and "\ndef main(" in text, name


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_answers_without_cuda_or_files(name, run_script, capsys):
    exit_info = run_script(name, "--help")
    out = capsys.readouterr().out
    assert exit_info.code == 0, out
    assert out.startswith("usage: "), out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what the scripts do without a CUDA GPU")
@pytest.mark.parametrize("name", GPU_ONLY)
def test_gpu_only_script_stops_with_one_line_without_a_gpu(name, run_script, capsys):
    exit_info = run_script(name, *GPU_ONLY[name], forbid=FORBID.get(name, ()))
    captured = capsys.readouterr()
    assert exit_info.code == 2
    assert captured.out == ""
    assert captured.err.startswith(f"{name}.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    assert captured.err.count("\n") == 1, captured.err
