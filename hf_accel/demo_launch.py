"""``hf-accel demo``: find ``demo/app.py`` and start it.

The demo is not part of the installed package: it sits in the repository's ``demo/`` folder, next to
``hf_accel/`` (an editable install from a clone finds it there). ``HF_ACCEL_DEMO_APP`` may point at the
file instead, in a copy of the whole ``demo/`` folder (``app.py`` imports the modules next to it). Importing this module is cheap (no gradio, no torch): the CLI imports it to build its parser.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

DEMO_APP_ENV = "HF_ACCEL_DEMO_APP"
EXIT_USAGE = 2


def _port(text: str) -> int:
    """argparse type of ``--port``: an int in 1..65535."""
    import argparse

    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 1..65535, got {port}")
    return port


def add_arguments(parser) -> None:
    """The options of ``hf-accel demo`` (the same as ``python demo/app.py``)."""
    parser.add_argument("--model", default=None,
                        help="local HF model directory or .gguf file ('default' or omitted: the embedded "
                             "SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=7860, help="port, 1-65535 (default: 7860)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 … (default: cuda if available)")
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help="initial value of the slider (default: 32 on CPU, 128 on GPU)")
    parser.add_argument("--no-preload", action="store_true",
                        help="load the model at the first Generate instead of at start")


def find_demo_app() -> Path | None:
    """Path of ``demo/app.py``: ``$HF_ACCEL_DEMO_APP``, else the ``demo/`` folder next to this package."""
    env = os.environ.get(DEMO_APP_ENV)
    if env:
        path = Path(env).expanduser()
        return path if path.is_file() else None
    path = Path(__file__).resolve().parent.parent / "demo" / "app.py"
    return path if path.is_file() else None


def to_argv(args) -> list[str]:
    """The parsed options back as a command line for ``demo/app.py``'s own parser."""
    argv = ["--host", str(args.host), "--port", str(args.port)]
    if args.model is not None:  # an empty one too: the app says so
        argv += ["--model", str(args.model)]
    if args.device:
        argv += ["--device", str(args.device)]
    if args.max_new_tokens is not None:
        argv += ["--max-new-tokens", str(args.max_new_tokens)]
    if args.no_preload:
        argv.append("--no-preload")
    return argv


def run(args) -> int:
    """Start the demo (blocks until it stops); returns the exit code."""
    app_path = find_demo_app()
    if app_path is None:
        where = os.environ.get(DEMO_APP_ENV) or "the demo/ folder next to the hf_accel package"
        print(f"hf-accel demo: error: demo/app.py not found ({where}); run from a clone of the repository "
              f"(pip install -e '.[demo]') or set {DEMO_APP_ENV} to the file", file=sys.stderr)
        return EXIT_USAGE
    if importlib.util.find_spec("gradio") is None:
        print("hf-accel demo: error: gradio is not installed; run: pip install 'hf-accel[demo]' (in a clone: pip install -e '.[demo]')", file=sys.stderr)
        return EXIT_USAGE
    spec = importlib.util.spec_from_file_location("hf_accel_demo_app", app_path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return int(module.main(to_argv(args)) or 0)
