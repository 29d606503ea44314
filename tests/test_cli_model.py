"""`kvpool model path NAME`: the Hugging Face folder other engines load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.cli import main


def test_help_says_what_the_path_is_for(capsys):
    with pytest.raises(SystemExit):
        main(["model", "path", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Hugging Face model folder" in text and "vllm serve" in text


@pytest.mark.slow
def test_smollm2_path_is_a_loadable_folder_and_only_the_path_goes_to_stdout(capsys):
    assert main(["model", "path", "smollm2"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    folder = Path(out.strip())
    config = json.loads((folder / "config.json").read_text())
    assert config["num_hidden_layers"] == 30
    assert list(folder.glob("*.safetensors")) and (folder / "tokenizer.json").is_file()
    assert main(["model", "path", str(folder)]) == 0  # a folder names itself
    assert Path(capsys.readouterr().out.strip()) == folder


@pytest.mark.parametrize("name,why", [("tiny-random", "no model folder"),
                                      ("no-such-model", "unknown model")])
def test_models_without_a_folder_are_one_line_errors(capsys, name, why):
    assert main(["model", "path", name]) == 2
    err = capsys.readouterr().err
    assert why in err and err.count("\n") == 1 and "Traceback" not in err
