"""The default text corpus (the standard library's docstrings) is parsed, and a tokenizer trained on a corpus, once per
machine, not once per process: each file's docstrings are cached in the cache folder keyed by its size and
modification time, read back exactly as parsed, parsed again when the file changes; a tokenizer is cached keyed by
its documents and size, and is the one training gives; a cache that is unreadable or cannot be written costs time
only."""
from __future__ import annotations

import os

import pytest

from mpifl.learning import text


@pytest.fixture
def fresh_process(monkeypatch, tmp_path):
    """A process that has read nothing yet, caching into tmp_path/cache."""
    monkeypatch.setenv("MPIFL_CACHE_DIR", str(tmp_path / "cache"))

    def forget() -> None:
        text._parsed.cache_clear()
        text._docstrings_of.cache_clear()
        text._unsaved.clear()
    forget()
    yield forget
    forget()


def test_a_second_process_reads_the_docstrings_from_the_cache_exactly_as_parsed(fresh_process, monkeypatch, tmp_path):
    parsed = text.stdlib_docstrings(max_chars=200_000)
    assert sum(map(len, parsed)) >= 200_000
    assert list((tmp_path / "cache").glob("stdlib-docstrings-*.json"))
    fresh_process()
    monkeypatch.setattr(text, "_parse_docstrings", lambda path: pytest.fail(f"{path} parsed again"))
    assert text.stdlib_docstrings(max_chars=200_000) == parsed


def fake_library(monkeypatch, tmp_path, **files: str) -> dict[str, os.PathLike]:
    paths = {}
    for name, source in files.items():
        paths[name] = tmp_path / f"{name}.py"
        paths[name].write_text(source)
    monkeypatch.setattr(text, "_stdlib_files", lambda: tuple(str(p) for p in paths.values()))
    return paths


def test_a_file_changed_since_it_was_cached_is_parsed_again(fresh_process, monkeypatch, tmp_path):
    paths = fake_library(monkeypatch, tmp_path, a='"""Module a."""\ndef f():\n    """F."""\n', b='"""Module b."""\n')
    assert text.stdlib_docstrings() == ["Module a.", "F.", "Module b."]
    paths["a"].write_text('"""Module a, changed."""\n')
    fresh_process()
    assert text.stdlib_docstrings() == ["Module a, changed.", "Module b."]
    # read back from the cache as it now is
    fresh_process()
    assert text.stdlib_docstrings() == ["Module a, changed.", "Module b."]


@pytest.mark.parametrize("cache", ["half-written", "a file where the folder should be"])
def test_a_cache_that_cannot_be_read_or_written_costs_time_only(fresh_process, monkeypatch, tmp_path, cache):
    fake_library(monkeypatch, tmp_path, a='"""Module a."""\n')
    if cache == "half-written":
        (tmp_path / "cache").mkdir()
        (tmp_path / "cache" / text._cache_name()).write_text('{"x": [1, 2, ["')
    else:
        (tmp_path / "cache").write_text("not a folder")
    assert text.stdlib_docstrings() == ["Module a."]
    fresh_process()
    assert text.stdlib_docstrings() == ["Module a."]


def test_a_tokenizer_trained_before_on_the_same_documents_is_read_from_the_cache_as_trained(fresh_process,
                                                                                          monkeypatch, tmp_path):
    """BPE training is deterministic for the same documents and size, so the cached tokenizer is the one training
    gives; other documents or another size train another."""
    pytest.importorskip("tokenizers")
    docs = text.stdlib_docstrings(max_chars=30_000)
    trained = text.train_tokenizer(docs, 400).to_str()
    files = list((tmp_path / "cache").glob("tokenizer-bpe-*.json"))
    assert len(files) == 1
    monkeypatch.setenv("MPIFL_CACHE_DIR", str(tmp_path / "elsewhere"))  # nothing cached: trained again
    assert text.train_tokenizer(docs, 400).to_str() == trained
    # read, not trained: another tokenizer put in its place is what comes back
    smaller = text.train_tokenizer(docs, 300).to_str()
    monkeypatch.setenv("MPIFL_CACHE_DIR", str(tmp_path / "cache"))
    files[0].write_text(smaller)
    assert text.train_tokenizer(docs, 400).to_str() == smaller
    # keyed by every document, the size and the documents' boundaries
    assert text._tokenizer_cache_name(docs, 400) == files[0].name
    assert text._tokenizer_cache_name(docs, 401) != files[0].name
    assert text._tokenizer_cache_name([*docs[:-1], docs[-1] + "x"], 400) != files[0].name
    assert text._tokenizer_cache_name(["ab", "c"], 400) != text._tokenizer_cache_name(["a", "bc"], 400)


def test_a_cached_tokenizer_that_cannot_be_read_is_trained_again(fresh_process, tmp_path):
    pytest.importorskip("tokenizers")
    docs = text.stdlib_docstrings(max_chars=30_000)
    trained = text.train_tokenizer(docs, 400).to_str()
    (tmp_path / "cache" / text._tokenizer_cache_name(docs, 400)).write_text('{"version": "1.0", "trunc')
    assert text.train_tokenizer(docs, 400).to_str() == trained
