"""hf-accel demo: stock Hugging Face ``generate`` and the accelerated model side by side.

Start it with ``hf-accel demo`` or ``python demo/app.py`` (options: ``--help``). One prompt runs through
two model instances holding the same weights: the left pane is the model exactly as transformers loads
it, the right pane is a copy passed through :func:`hf_accel.accelerate_model` (plus any other feature
toggled on). Both stream their tokens with live tokens/s and time to first token, and a plot shows the
KV-cache memory of each over the generation.

The UI is built so that every hf-accel feature is one entry of ``FEATURES`` (``features.py``): a toggle
appears only for features the installed package has.

Only the public API is used: ``hf_accel``, ``hf_accel.models``, ``hf_accel.cache`` (the block-size limit),
``hf_accel.demo_launch`` (the command-line options shared with ``hf-accel demo``) and, when present,
``hf_accel.conversion``.

This file is the entry point (command line and launch). The demo's other modules sit next to it in
``demo/`` and are imported by their own names: this file puts its folder on ``sys.path``, so that works
also when it is loaded from its path (``hf-accel demo`` and the tests do that). It re-exports the names
the tests use; a test that patches a name patches it in the module that uses it, not here.

- ``features.py``: the feature toggles and how the accelerated model is built from them;
- ``request.py``: the form's checks and the generation settings;
- ``measurements.py``: KV-cache memory and the stats line, plot rows and summary that show it;
- ``model_runs.py``: the device, the loaded models and one pane's generation in a thread;
- ``page.py``: the Gradio page and its Generate handler.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

_DEMO_DIR = str(Path(__file__).resolve().parent)
if _DEMO_DIR not in sys.path:
    sys.path.insert(0, _DEMO_DIR)

import hf_accel  # noqa: E402
from hf_accel.demo_launch import add_arguments  # noqa: E402  (one definition of the options)

# The demo's own modules (demo/*.py).
try:
    import features  # noqa: F401, E402  (the first of them: a copy of app.py alone fails here, in one line)
except ModuleNotFoundError as e:
    if e.name != "features":
        raise
    raise SystemExit(f"hf-accel demo: error: {__file__} needs the other modules of the demo/ folder next to it "
                     f"(features.py, measurements.py, model_runs.py, page.py, request.py); copy the whole folder")
from features import FEATURES, Feature, available_features, build_accelerated, enabled_features  # noqa: E402
from measurements import (  # noqa: E402
    KVUsage, cache_of, kv_cache_bytes, kv_plot_rows, kv_usage, stats_html, summary_text,
)
from model_runs import DeviceInfo, ModelStore, PaneRun, pick_device  # noqa: E402
from page import CSS, build_app, run_comparison, status_html  # noqa: E402
from request import (  # noqa: E402
    EMPTY_PROMPT_MESSAGE, MAX_NEW_TOKENS, GenSettings, first_line, generate_kwargs, validate_request,
)

# What other code reaches through this module (the tests as ``app.<name>``): the command line below and,
# re-exported, the names of the modules above that the tests use.
__all__ = [
    "EMPTY_PROMPT_MESSAGE", "FEATURES", "MAX_NEW_TOKENS", "DeviceInfo", "Feature", "GenSettings", "KVUsage",
    "ModelStore", "PaneRun", "add_arguments", "available_features", "build_accelerated", "build_app",
    "cache_of", "enabled_features", "generate_kwargs", "kv_cache_bytes", "kv_plot_rows", "kv_usage",
    "listen_problem", "main", "model_problem", "pick_device", "run_comparison", "stats_html", "status_html",
    "summary_text", "validate_request",
]


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def model_problem(model: str | None) -> str | None:
    """Why ``--model`` names no model hf-accel can load (an empty string, a missing path, a folder without
    ``config.json``, a file that is not a ``.gguf``, a config transformers cannot read), or None (also for the
    default model, which loads at the first Generate if it is missing). Reads the config only (seconds)."""
    if model is None:
        return None
    if not str(model).strip():
        return "--model is empty; give a model directory or .gguf file (or leave it out for the embedded model)"
    from hf_accel.models import ModelNotFoundError, load_config

    try:
        config = load_config(model)
    except ModelNotFoundError as e:
        return f"--model: {e}"
    except (OSError, ValueError, KeyError) as e:
        return f"--model {model}: could not read its config: {type(e).__name__}: {first_line(e)}"
    model_type = getattr(config, "model_type", None)
    if model_type not in hf_accel.SUPPORTED_MODEL_TYPES:
        return (f"--model {model}: hf-accel does not support model_type {model_type!r} (supported: "
                f"{', '.join(hf_accel.SUPPORTED_MODEL_TYPES)})")
    from pathlib import Path

    path = Path(model).expanduser()
    weights = ("*.safetensors", "*.bin", "*.pt", "*.pth")
    if path.is_dir() and not any(next(path.glob(pattern), None) for pattern in weights):
        return f"--model {model}: the folder has no weights ({', '.join(weights)})"
    return None


def listen_problem(host: str, port: int) -> str | None:
    """Why the page cannot be served on ``host``:``port`` (None: it can, as far as a socket bound there now
    tells), in terms of the launcher's flags: Gradio's own message names its port search and ``launch()``
    arguments instead. IPv6 hosts are refused (Gradio's server URL cannot hold one); a name's IPv4 addresses
    must all be free."""
    import ipaddress
    import socket

    try:
        if ipaddress.ip_address(host.strip("[]")).version == 6:
            return f"--host {host!r}: IPv6 addresses are not supported by the demo's server; use an IPv4 address"
    except ValueError:
        pass  # a name
    try:
        infos = socket.getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        return f"--host {host!r} is not an IPv4 address of this machine ({getattr(e, 'strerror', None) or e})"
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as sock:
            try:
                sock.bind(address)
            except OSError as e:
                return f"cannot listen on {host}:{port} ({e.strerror or e}): choose another --port or --host"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="hf-accel demo", description="Stock HF generate vs hf-accel, side by side.")
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        import gradio  # noqa: F401
        import pandas  # noqa: F401
    except ImportError:
        print("hf-accel demo: error: gradio is not installed; run: pip install 'hf-accel[demo]' (in a clone: pip install -e '.[demo]')", file=sys.stderr)
        return 2
    try:
        device = pick_device(args.device)
    except ValueError as e:
        print(f"hf-accel demo: error: {e}", file=sys.stderr)
        return 2
    if args.max_new_tokens is not None and not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        print(f"hf-accel demo: error: --max-new-tokens must be between 1 and {MAX_NEW_TOKENS} "
              f"(got {args.max_new_tokens})", file=sys.stderr)
        return 2
    problem = listen_problem(args.host, args.port) or model_problem(args.model)
    if problem:
        print(f"hf-accel demo: error: {problem}", file=sys.stderr)
        return 2
    n_default = args.max_new_tokens or (32 if device.device == "cpu" else 128)
    store = ModelStore(device)
    app = build_app(store, default_model=args.model, default_max_new_tokens=n_default)
    if not args.no_preload:
        def preload():
            try:
                store.load(args.model)
                store.accelerated({f.key: f.setting_default for f in available_features() if f.default})
                print("hf-accel demo: model loaded", flush=True)
            except Exception as e:  # shown again on the page at the first Generate
                print(f"hf-accel demo: could not preload the model: {first_line(e)}", file=sys.stderr, flush=True)
        threading.Thread(target=preload, name="hf-accel-demo-preload", daemon=True).start()
    import gradio as gr

    print(f"hf-accel demo on {device.label}: http://{args.host}:{args.port}", flush=True)
    try:
        app.queue(default_concurrency_limit=1).launch(
            server_name=args.host, server_port=args.port, show_error=False, ssr_mode=False, quiet=True,
            css=CSS, theme=gr.themes.Default(), footer_links=[],
        )
    except OSError as e:
        print(f"hf-accel demo: error: cannot listen on {args.host}:{args.port}: {first_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
