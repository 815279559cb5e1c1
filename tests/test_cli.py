"""The help a new user reads: ``python -m quack_jax.bench --help`` and ``python -m
quack_jax.build --help`` (their name, a plain description, help for every option, the
cache's real default). The build without CuTe-DSL: ``test_imports.py``."""

import pathlib
import re

import pytest

from quack_jax import _cache, bench, build


def help_text(main, capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def option_helps(text: str) -> dict[str, str]:
    """Each option's help in argparse's --help text, by its first flag ('' where none)."""
    section = text.split("\noptions:\n", 1)[1]
    blocks = re.split(r"\n(?=  -)", section.strip("\n"))
    parts = [re.split(r"\s{2,}", block.strip(), maxsplit=1) for block in blocks]
    return {p[0].split()[0].rstrip(","): (p[1] if len(p) > 1 else "") for p in parts}


@pytest.mark.parametrize("main", [bench.main, build.main], ids=["bench", "build"])
def test_help_names_the_command_and_every_option(main, capsys):
    text = help_text(main, capsys)
    command = main.__module__  # quack_jax.bench or quack_jax.build
    assert text.startswith(f"usage: python -m {command} ")
    assert "``" not in text  # plain text, not reStructuredText
    assert f"{command} --help" not in text  # a description, not a pointer to itself
    helps = option_helps(text)
    assert {"--ops", "--dtypes"} <= helps.keys()
    assert all(helps.values()), [flag for flag, words in helps.items() if not words]


def test_build_help_gives_the_cache_default(capsys, monkeypatch):
    monkeypatch.delenv("QUACK_JAX_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert _cache.cache_dir() == pathlib.Path.home() / ".cache" / "quack_jax"
    words = " ".join(option_helps(help_text(build.main, capsys))["--cache"].split())
    assert "$QUACK_JAX_CACHE, else $XDG_CACHE_HOME/quack_jax, else ~/.cache/quack_jax" in words
