"""The examples' command lines explain themselves: ``--help`` gives every option's help and
default, and the documented ``make demo`` run is the one the Makefile runs."""

from __future__ import annotations

import argparse
import re
import shlex

import pytest
from test_example import EXAMPLES, load

ROOT = EXAMPLES.parent
CLI_EXAMPLES = [
    "sinusoid",
    "hyperparameters",
    "learned_optimizer",
    "distributed_maml",
    "lora_maml",
    "sharded_maml",
]


def shown(action: argparse.Action) -> bool:
    """Whether ``--help`` lists the action (not ``-h`` itself, not a hidden option)."""
    return not isinstance(action, argparse._HelpAction) and action.help != argparse.SUPPRESS


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("name", CLI_EXAMPLES)
def test_every_option_has_help_and_shows_its_default(name, capsys):
    example = load(name)
    parser = example.parser()
    with pytest.raises(SystemExit) as exit_:
        example.main(["--help"])
    assert exit_.value.code in (0, None)
    out = flat(capsys.readouterr().out)
    assert "(default:" in out
    formatter = parser._get_formatter()
    actions = [a for a in parser._actions if shown(a)]
    assert actions, name
    for action in actions:
        option = "/".join(action.option_strings) or action.dest
        assert action.help and action.help.strip(), f"{name}: {option} has no help"
        if action.default is None or action.default is argparse.SUPPRESS:
            continue
        template = formatter._get_help_string(action)  # the formatter's, defaults added
        assert "%(default)" in template, f"{name}: {option} does not show its default"
        text = flat(formatter._expand_help(action))
        assert str(action.default) in text, (name, option, text)
        assert text in out, f"{name}: {option}'s help is not in --help"


def demo_arguments() -> list[str]:
    """The arguments ``make demo`` gives ``examples/sinusoid.py``."""
    lines = (ROOT / "Makefile").read_text().splitlines()
    start = lines.index(next(line for line in lines if line.startswith("demo:")))
    for line in lines[start + 1 :]:
        if not line.startswith("\t"):
            break
        words = shlex.split(line)
        if "examples/sinusoid.py" in words:
            return words[words.index("examples/sinusoid.py") + 1 :]
    raise AssertionError("the Makefile's demo target does not run examples/sinusoid.py")


def iterations(words: list[str], default: int) -> int:
    return int(words[words.index("--iterations") + 1]) if "--iterations" in words else default


def test_the_sinusoid_docstring_documents_the_demo_the_makefile_runs():
    example = load("sinusoid")
    default = example.parser().get_default("iterations")
    demo = iterations(demo_arguments(), default)
    doc = example.__doc__
    commands = [line.strip() for line in doc.splitlines() if "examples/sinusoid.py" in line]
    documented = [c for c in commands if "make demo" in c]
    assert len(documented) == 1, commands
    words = shlex.split(documented[0].split("#")[0])
    assert iterations(words, default) == demo, (documented[0], demo)
    # no other iteration count beside the demo's and the full length's
    counts = {int(n) for n in re.findall(r"(\d+) iterations", flat(doc))}
    assert counts <= {demo, default}, counts
