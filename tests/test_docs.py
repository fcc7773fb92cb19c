"""The documentation: generated reference pages that cannot drift, a site that builds strictly, a short
README whose links work, and tutorial plug-ins that still load."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GENERATOR = DOCS / "gen_reference.py"
REGENERATE = f"run `.venv/bin/python {GENERATOR.relative_to(ROOT)}` and commit the result"


def _generator():
    spec = importlib.util.spec_from_file_location("mpifl_docs_gen_reference", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_generated_pages_are_current():
    stale = [str(path.relative_to(ROOT)) for path, text in _generator().pages().items()
             if not path.is_file() or path.read_text() != text]
    assert not stale, f"{', '.join(stale)} differ from what the code generates now: {REGENERATE}"


def test_generator_is_deterministic():
    gen = _generator()
    assert gen.pages() == gen.pages()


def _schema_keys() -> list[str]:
    """Every dotted leaf key of the config schema, walked here independently of the generator."""
    from mpifl.config import Config

    keys = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
            else:
                keys.append(prefix + f.name)

    walk(Config, "")
    return keys


def test_config_page_lists_every_key():
    page = (DOCS / "reference" / "config.md").read_text()
    missing = [key for key in _schema_keys() if f"`{key}`" not in page]
    assert not missing, f"config keys missing from docs/reference/config.md: {missing}; {REGENERATE}"


def _option_strings() -> list[tuple[str, str]]:
    """(subcommand, option string) for every option of every subcommand of the mpifl parser."""
    from mpifl.cli import _parser

    found = []

    def walk(parser: argparse.ArgumentParser, words: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{words} {name}".strip())
            elif not isinstance(action, argparse._HelpAction):
                found.extend((words, option) for option in action.option_strings)

    walk(_parser(), "")
    return found


def test_cli_page_lists_every_option():
    page = (DOCS / "reference" / "cli.md").read_text()
    sections = {m.group(1): m.start() for m in re.finditer(r"^## `mpifl ([^`]+)`", page, re.MULTILINE)}
    assert sections, "docs/reference/cli.md has no '## `mpifl COMMAND`' sections"
    bounds = sorted(sections.values()) + [len(page)]
    text_of = {name: page[start:bounds[bounds.index(start) + 1]] for name, start in sections.items()}
    missing = [f"{command}: {option}" for command, option in _option_strings()
               if command not in text_of or not re.search(f"`{re.escape(option)}[ `]", text_of[command])]
    assert not missing, f"options missing from docs/reference/cli.md: {missing}; {REGENERATE}"


def test_generated_tables_keep_their_columns():
    """A stray pipe in a doc string or a type (``int | None``) would shift a row's cells."""
    for page in ("config.md", "cli.md"):
        columns = None
        for number, line in enumerate((DOCS / "reference" / page).read_text().splitlines(), 1):
            if not line.startswith("|"):
                columns = None
                continue
            cells = len(re.split(r"(?<!\\)\|", line)) - 2
            columns = columns or cells
            assert cells == columns, f"docs/reference/{page}:{number} has {cells} cells, its table {columns}: {line}"


def test_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed: pip install -c constraints/workstation.txt -e '.[docs]'")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; keep it a front door (at most 250) and link to docs/"


def test_readme_links_exist():
    text = (ROOT / "README.md").read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # code blocks hold no links
    links = re.findall(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)", text) + re.findall(r"!\[[^\]]*\]\(([^)\s]+)\)", text)
    relative = [link for link in links if not re.match(r"^[a-z][a-z0-9+.-]*:", link) and not link.startswith("#")]
    assert relative, "README.md links to no documentation page"
    broken = [link for link in relative if not (ROOT / link.split("#")[0]).exists()]
    assert not broken, f"README.md links to files that do not exist: {broken}"


def _titled_blocks(page: Path) -> dict[str, str]:
    """The code blocks of a page that carry a file title: ```python title="my_fl.py"."""
    pattern = r'^```\w*\s+title="([^"]+)"\n(.*?)^```'
    return {name: body for name, body in re.findall(pattern, page.read_text(), flags=re.MULTILINE | re.DOTALL)}


def test_tutorial_plugins_load(tmp_path):
    """The files the tutorials tell a user to write still import, validate and build, without MPI."""
    files = {}
    for page in ("model-and-data.md", "strategy.md", "trainer.md"):
        files.update(_titled_blocks(DOCS / "tutorials" / page))
    assert {"my_fl.py", "moons.yaml", "my_strategies.py", "my_trainer.py"} <= set(files), sorted(files)
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    quickstart = ROOT / "configs" / "quickstart.yaml"
    script = textwrap.dedent(f"""
        from mpifl.aggregation.strategies import make_strategy
        from mpifl.cli.commands import check_plugins
        from mpifl.config import load_config
        from mpifl.learning.datasets import load_dataset
        from mpifl.learning.models import build_model
        from mpifl.learning.trainers import make_trainer

        moons = load_config("moons.yaml")
        assert not check_plugins(moons)
        data = load_dataset(moons.data)
        model = build_model(moons.model, moons.seed)
        assert model(data.x_test[:4]).shape == (4, 2)
        split = load_config("moons.yaml", ["data.partition=my_fl:label_halves"])
        for name in ("ema_momentum", "sqrt_weighted"):
            cfg = load_config({str(quickstart)!r}, [f"strategy.name=my_strategies:{{name}}"])
            make_strategy(cfg.strategy)
        cfg = load_config({str(quickstart)!r}, ["train.trainer=my_trainer:SmoothedTrainer"])
        assert make_trainer(cfg.train).modifies_weights
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env=env)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr
