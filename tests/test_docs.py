"""The documentation: generated reference pages that cannot drift, a site that builds strictly, a short
README whose links work, tutorial plug-ins that still load, and a testing page that describes every test file."""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import shutil
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


def test_generated_pages_link_the_docs_pages_their_descriptions_name():
    # a description's "(docs/how-to/faults.md)" showed as plain text on the site
    for page in ("config.md", "cli.md"):
        text = (DOCS / "reference" / page).read_text()
        plain = [m.group(0) for m in re.finditer(r"(?<![\[/])docs/[\w./\\-]+\.md(?!\]\()", text)]
        assert plain == [], f"docs/reference/{page} names {plain} without linking them; {REGENERATE}"
    assert _generator()._linked("see (docs/how-to/faults.md)") == "see ([docs/how-to/faults.md](../how-to/faults.md))"


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


FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})")
ACCIDENTAL_HEADING = re.compile(r"^ {0,3}#[^\s#]")


def _accidental_headings(text: str) -> list[tuple[int, str]]:
    """Lines outside fenced code that begin with ``#`` and a word: Markdown makes each an <h1>."""
    found, fence = [], ""
    for number, line in enumerate(text.splitlines(), 1):
        if opened := FENCE.match(line):
            marker = opened.group(1)
            if not fence:
                fence = marker
            elif marker[0] == fence[0] and len(marker) >= len(fence) and not line.strip()[len(marker):].strip():
                fence = ""
            continue
        if not fence and ACCIDENTAL_HEADING.match(line):
            found.append((number, line))
    return found


def test_accidental_headings_are_found_outside_code_only():
    text = "## Real\ntext wrapped before\n#C = 3 here\n```bash\n#!/bin/bash\n#PBS -l walltime\n```\n"
    assert _accidental_headings(text) == [(3, "#C = 3 here")]


def test_no_wrapped_line_starts_a_heading_by_accident():
    # a paragraph re-wrapped so that a line begins "#C = 3" renders as a page title and cuts the table of contents
    pages = sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]
    found = [f"{page.relative_to(ROOT)}:{number}: {line}" for page in pages
             for number, line in _accidental_headings(page.read_text())]
    assert found == [], "re-wrap these lines so no line of prose begins with '#':\n" + "\n".join(found)


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


# Each plug-in tutorial shows the runnable examples' own files (tests/test_examples.py runs them), included
# with pymdownx.snippets in a fence of their own: ```python title="..." linenums="1" / --8<-- "path" / ```.
TUTORIAL_EXAMPLES = {
    "model-and-data.md": ("custom_model_and_data", "natural_partition"),
    "strategy.md": ("custom_strategy",),
    "trainer.md": ("custom_trainer",),
    "stateful-algorithm.md": ("moon",),
}
SNIPPET_LINE = re.compile(r'^[ \t]*-{1,}8<-{1,}[ \t]', re.MULTILINE)
INCLUDE = re.compile(r'^[ \t]*```(\w*)([^\n]*)\n[ \t]*--8<--[ \t]+"([^"]+)"[ \t]*\n[ \t]*```[ \t]*$', re.MULTILINE)


@dataclasses.dataclass
class Include:
    page: str
    path: str
    start: int | None  # a line range (pymdownx.snippets ``path:START:END``), or None for the whole file
    end: int | None
    attrs: dict[str, str]

    def __str__(self) -> str:
        where = f":{self.start}:{self.end}" if self.start else ""
        return f"{self.page}: --8<-- {self.path}{where}"


def _includes(page: Path) -> list[Include]:
    """The snippet includes of a page; each must be the only line of its fenced block."""
    text = page.read_text()
    found: list[Include] = []
    for match in INCLUDE.finditer(text):
        _, attrs, spec = match.groups()
        path, *bounds = spec.split(":")
        start = int(bounds[0]) if bounds and bounds[0] else None
        end = int(bounds[1]) if len(bounds) > 1 and bounds[1] else None
        fence = dict(re.findall(r'(\w+)="([^"]*)"', attrs))
        found.append(Include(str(page.relative_to(ROOT)), path, start, end, fence))
    alone = len(SNIPPET_LINE.findall(text))
    assert alone == len(found), f"{page.relative_to(ROOT)}: a --8<-- line that is not alone in a fenced code block"
    return found


def _documented_includes() -> list[Include]:
    pages = sorted((DOCS / "tutorials").glob("*.md")) + [DOCS / "reference" / "plugins.md"]
    return [include for page in pages for include in _includes(page)]


def test_plugin_tutorials_include_the_examples_whole():
    """No hand-written copy of a plug-in can drift from the code the suite runs: each tutorial shows its
    examples' code and config by inclusion, each file whole once (ranges may explain parts)."""
    for page, folders in TUTORIAL_EXAMPLES.items():
        whole = {i.path for i in _includes(DOCS / "tutorials" / page) if i.start is None and i.end is None}
        assert any(path.startswith("examples/") for path in whole), f"docs/tutorials/{page} includes no example file"
        wanted = {str(f.relative_to(ROOT)) for folder in folders for f in sorted((ROOT / "examples" / folder).iterdir())
                  if (f.suffix == ".py" and f.name != "__init__.py") or f.name == "config.yaml"}
        missing = sorted(wanted - whole)
        assert not missing, f"docs/tutorials/{page} does not include these example files whole: {missing}"


def test_included_files_exist_and_line_ranges_still_fit():
    """A range names its first line in the fence's title (``title="path: def build"``) and shows it as
    ``linenums``; when the example changes under it, this says which include to move."""
    includes = _documented_includes()
    assert includes
    for inc in includes:
        file = ROOT / inc.path
        assert file.is_file(), f"{inc}: no such file"
        lines = file.read_text().splitlines()
        if inc.start is None and inc.end is None:
            assert inc.attrs.get("linenums", "1") == "1", f"{inc}: a whole file is numbered from 1"
            continue
        start, end = inc.start or 1, inc.end or len(lines)
        assert 1 <= start <= end <= len(lines), f"{inc}: outside the file's {len(lines)} lines"
        assert inc.attrs.get("linenums") == str(start), f'{inc}: give the fence linenums="{start}"'
        title = inc.attrs.get("title", "")
        anchor = title.split(": ", 1)[1] if title.startswith(inc.path + ": ") else None
        assert anchor, f'{inc}: give the fence title="{inc.path}: <how line {start} begins>"'
        first = lines[start - 1]
        assert first.strip().startswith(anchor), (
            f"{inc}: line {start} now reads {first.strip()!r}, not {anchor!r}: the example changed, move the range")
        indent = len(first) - len(first.lstrip())
        after = lines[end] if end < len(lines) else ""
        assert not after.strip() or len(after) - len(after.lstrip()) <= indent, (
            f"{inc}: the range stops inside a block (line {end + 1} continues it): the example changed, move the range")
        if file.suffix == ".py":
            compile(textwrap.dedent("\n".join(lines[start - 1:end])), str(inc), "exec")


def _readme_commands(folder: str) -> list[str]:
    """The commands an example's README runs (its indented code block)."""
    text = (ROOT / "examples" / folder / "README.md").read_text()
    return [line.strip() for line in text.splitlines() if line.startswith("    ") and "mpifl " in line]


def test_plugin_tutorials_run_the_examples_as_their_readmes_say():
    for page, folders in TUTORIAL_EXAMPLES.items():
        text = (DOCS / "tutorials" / page).read_text()
        for folder in folders:
            readme = f"examples/{folder}/README.md"
            commands = _readme_commands(folder)
            kinds = [next((k for k in ("validate", "run") if f"mpifl {k} " in c), None) for c in commands]
            assert "validate" in kinds and "run" in kinds, f"{readme} should validate, then run: {commands}"
            assert kinds.index("validate") < kinds.index("run"), f"{readme}: validate first, then run"
            for command in commands:
                assert command in text, f"docs/tutorials/{page} does not run `{command}` as {readme} does"
            where = [text.index(c) for c in commands]
            assert where == sorted(where), f"docs/tutorials/{page} runs {readme}'s commands in another order"


def test_every_test_file_is_described_on_the_testing_page():
    page = (DOCS / "explanation" / "testing.md").read_text()
    undescribed = [p.name for p in sorted((ROOT / "tests").glob("test_*.py")) if f"`{p.name}`" not in page]
    assert not undescribed, f"docs/explanation/testing.md has no row for {undescribed}"


FEATURES = ("FedAvg", "FedProx", "FedNova", "SCAFFOLD", "FedDyn", "FedBN", "Ditto", "MOON", "APFL", "FedAsync",
            "FedBuff", "FedCompass", "DP-FedAvg", "secure aggregation", "LoRA", "out-of-core", "PBS", "Slurm",
            "memray", "mpifl sweep", "mpifl status", "mpifl report", "mpifl compare", "TensorBoard",
            "accept_failures", "faults:", "Krum", "Multi-Krum", "Bulyan", "geometric median")


def test_the_readme_and_the_docs_index_name_the_same_features():
    readme, index = (ROOT / "README.md").read_text(), (ROOT / "docs" / "index.md").read_text()
    assert [f for f in FEATURES if f not in readme] == [] and [f for f in FEATURES if f not in index] == []


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> Path:
    if importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed: pip install -c constraints/workstation.txt -e '.[docs]'")
    site = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--site-dir", str(site)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stderr
    return site


def test_the_built_site_loads_no_script_from_the_network(built_site):
    # an offline cluster's browser: Material's offline plugin would fetch its WebWorker shim from unpkg.com
    remote = [(page.relative_to(built_site), src) for page in built_site.rglob("*.html")
              for src in re.findall(r'<script src="(https?://[^"]+)"', page.read_text())]
    assert remote == []


def test_no_list_item_of_the_site_is_swallowed_by_the_paragraph_above_it(built_site):
    # Python-Markdown reads "- item" straight under a paragraph line (no blank line between) as more of that
    # paragraph, so the page shows a stray "- " mid-sentence instead of a bullet
    swallowed = [(page.relative_to(built_site), text[item.start() - 40:item.start() + 40])
                 for page in built_site.rglob("*.html")
                 for text in re.findall(r"<p>((?:(?!</p>).)*)</p>", page.read_text(), re.S)
                 if (item := re.search(r"\n- ", text))]
    assert swallowed == []


def test_search_works_with_the_site_opened_from_disk(built_site):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("no headless chromium here (Debian: apt-get install chromium)")
    # Material runs the search in the query string on load; from file://, only the offline plugin's inlined index
    # and the WebWorker shim make that work
    done = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=15000",
                           "--dump-dom", (built_site / "index.html").as_uri() + "?q=pmi2"],
                          capture_output=True, text=True, timeout=120)
    assert "how-to/slurm.html?h=pmi2" in done.stdout, done.stderr[-2000:]
