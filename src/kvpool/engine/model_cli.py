"""``kvpool model path NAME``: the Hugging Face folder of a model kvpool knows.

Other engines (vLLM, SGLang) load weights from a Hugging Face folder; this prints the
folder that kvpool's own engine loads for the same name (converting a GGUF to
safetensors once, as :func:`kvpool.engine.models.load_model` does), so that every engine
serves the same weights and so the same KV. Only the path goes to stdout (for
``vllm serve "$(kvpool model path smollm2)"``); conversion progress goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvpool.engine.models import converted_folder, resolve_source
from kvpool.errors import UserError

HELP = ("facts about the models kvpool knows; 'kvpool model path NAME' prints the Hugging "
        "Face folder of NAME (converting its GGUF to safetensors once) for vllm/sglang")


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    path = sub.add_parser(
        "path", help="print the Hugging Face folder of a model (converts a GGUF once)",
        description="Print the Hugging Face model folder (config.json, safetensors, "
                    "tokenizer) of NAME on stdout, converting its GGUF to safetensors once "
                    "into $KVPOOL_CACHE_DIR/models or ~/.cache/kvpool/models, so that vLLM "
                    "or SGLang serve the weights kvpool's engine uses: "
                    'vllm serve "$(kvpool model path smollm2)".')
    path.add_argument("name", help="'smollm2', a .gguf file or a Hugging Face model folder")


def model_folder(spec: str, progress=None) -> Path:
    """The Hugging Face folder of ``spec`` ("smollm2", a .gguf file, or a folder).

    Raises UserError for an unknown spec and for the tiny models ("tiny-random", ...),
    whose weights exist only in memory (built from a seed) and have no folder.
    """
    kind, name, path = resolve_source(spec)
    if kind == "tiny":
        raise UserError(f"{name} is built in memory and has no model folder; "
                        "give 'smollm2', a .gguf file or a model folder")
    if kind == "gguf":
        path = converted_folder(path, name, progress or (lambda line: print(line, file=sys.stderr)))
    return path.resolve()


def run(args: argparse.Namespace) -> int:
    print(model_folder(args.name))
    return 0
