"""The prompts file of `wattserve bench quant --prompts-file`: what it accepts, and that a
bad one stops the command with one line naming the file, the line and the fault (exit
status 2, no traceback) before any model is loaded."""

from __future__ import annotations

import json
import re

import pytest

from wattserve.bench.quant_accuracy import EXAMPLE_PROMPTS_FILE, PromptsFileError, read_prompts_file
from wattserve.daemon.cli import main

GOOD = {"context": "The sky is", "choices": [" blue", " green"], "answer": 0}


def _line(**change) -> str:
    item = {**GOOD, **change}
    return json.dumps({k: v for k, v in item.items() if v is not ...})


def test_the_example_and_a_file_with_extra_keys_and_blank_lines(tmp_path):
    example = read_prompts_file(EXAMPLE_PROMPTS_FILE)
    assert len(example) >= 40
    assert all(0 <= it["answer"] < len(it["choices"]) == 4 for it in example)
    path = tmp_path / "p.jsonl"
    path.write_text("\n" + _line(id=7) + "\n\n" + _line(answer=1) + "\n")
    assert read_prompts_file(path) == [GOOD, {**GOOD, "answer": 1}]


BAD = {
    "empty": ("", "no items"),
    "blank lines only": ("\n  \n", "no items"),
    "not json": ("{context: 1}\n", "line 1: not JSON"),
    "a list": ("[1, 2]\n", "line 1: not a JSON object"),
    "missing answer": (_line(answer=...), "line 1: missing key(s) answer"),
    "missing two": (_line(context=..., choices=...), "missing key(s) context, choices"),
    "answer too big": (_line(answer=2), "line 1: answer 2 is out of range for 2 choices"),
    "answer negative": (_line(answer=-1), "answer -1 is out of range"),
    "answer a string": (_line(answer="0"), "answer is not an integer"),
    "answer a bool": (_line(answer=True), "answer is not an integer"),
    "one choice": (_line(choices=[" blue"], answer=0), "at least 2"),
    "empty choice": (_line(choices=[" blue", ""]), "non-empty strings"),
    "empty context": (_line(context=""), "context is not a non-empty string"),
    "second line": (_line() + "\n" + _line(answer=5) + "\n", "line 2: answer 5"),
}


@pytest.mark.parametrize("text, message", BAD.values(), ids=BAD.keys())
def test_a_bad_file_is_one_clear_error(tmp_path, capsys, text, message):
    path = tmp_path / "p.jsonl"
    path.write_text(text)
    with pytest.raises(PromptsFileError, match=re.escape(message)):
        read_prompts_file(path)
    assert main(["bench", "quant", "--model", "no-such-model", "--prompts-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"wattserve bench quant: error: {path}") and message in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_a_missing_file_is_one_clear_error(tmp_path, capsys):
    path = tmp_path / "absent.jsonl"
    assert main(["bench", "quant", "--prompts-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"wattserve bench quant: error: {path}: cannot read")


def test_accuracy_only_needs_a_prompts_file(capsys):
    assert main(["bench", "quant", "--accuracy-only"]) == 2
    assert capsys.readouterr().err == (
        "wattserve bench quant: error: --accuracy-only needs --prompts-file\n"
    )
