"""Text for causal-LM training, offline: a corpus, a tokenizer, and fixed-length token blocks.

The default corpus is the docstrings of Python's own standard library, read at run time
(about 1.6 M characters on CPython 3.11): every machine has it, nothing is downloaded. It
depends on the Python version, so runs are comparable on one interpreter. Any local UTF-8
files can be named instead. The tokenizer is a local ``tokenizer.json`` (a file or a folder
holding one) or a byte-level BPE trained on the spot with the ``tokenizers`` library.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import inspect
import os
import sys
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from mpifl import caches

if TYPE_CHECKING:  # the 'hf' extra: imported where a tokenizer is loaded or trained
    from tokenizers import Tokenizer

EOS = "<|endoftext|>"
SKIPPED_PACKAGES = ("test", "tests", "idlelib", "lib2to3", "turtledemo", "site-packages")
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def stdlib_docstrings(max_chars: int | None = None) -> list[str]:
    """Module, class and function docstrings of the running Python's standard library, in path order; the files
    past ``max_chars`` are not read. Parsing the whole library takes 5-8 CPU-seconds, paid by every process that
    reads the corpus (``mpifl plan``, ``validate``, each job's reading rank): each file's docstrings are kept in
    the cache folder (mpifl.caches), keyed by its size and modification time, and parsed again only when those
    change."""
    docs, total = [], 0
    try:
        for path in _stdlib_files():
            for doc in _docstrings_of(path):
                docs.append(doc)
                total += len(doc)
                if max_chars is not None and total >= max_chars:
                    return docs
        return docs
    finally:
        _save_parsed()


@functools.cache
def _stdlib_files() -> tuple[str, ...]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return tuple(sorted(str(p) for p in root.rglob("*.py")
                        if not any(part in SKIPPED_PACKAGES for part in p.relative_to(root).parts)))


@functools.cache
def _docstrings_of(path: str) -> tuple[str, ...]:
    """One file's docstrings: from the cache where the file is unchanged since they were cached, else parsed
    (and then cached); once a process either way (``mpifl validate`` builds the corpus twice: the model's shape,
    then the partition)."""
    try:
        stat = os.stat(path)
    except OSError:
        return ()
    stamp = [stat.st_size, stat.st_mtime_ns]
    cached = _parsed().get(path)
    if isinstance(cached, list) and len(cached) == 3 and cached[:2] == stamp and isinstance(cached[2], list):
        return tuple(cached[2])
    docs = _parse_docstrings(path)
    _parsed()[path] = [*stamp, list(docs)]
    _unsaved.add(path)
    return docs


def _parse_docstrings(path: str) -> tuple[str, ...]:
    """``path``'s module, class and function docstrings, in ``ast.walk``'s order."""
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (SyntaxError, ValueError, OSError):
        return ()
    return tuple(doc for node in ast.walk(tree) if isinstance(node, DOCUMENTED) and (doc := ast.get_docstring(node)))


# The cache file of this interpreter's standard library (its parse and its files are the interpreter's), and the
# format of its entries (path -> [size, mtime_ns, docstrings]): bump DOCSTRING_CACHE_FORMAT when what is kept changes.
DOCSTRING_CACHE_FORMAT = 1
_unsaved: set[str] = set()


def _cache_name() -> str:
    root = sysconfig.get_paths()["stdlib"]
    key = hashlib.sha256(f"{DOCSTRING_CACHE_FORMAT} {sys.version} {root}".encode()).hexdigest()[:16]
    return f"stdlib-docstrings-{sys.implementation.cache_tag}-{key}.json"


@functools.cache
def _parsed() -> dict[str, object]:
    """The cached files' entries, read once a process (empty where there is no readable cache)."""
    document = caches.read_json(_cache_name())
    return document if isinstance(document, dict) else {}


def _save_parsed() -> None:
    """Write the cache where this process parsed files it did not hold; merged with what another process may have
    cached meanwhile (the last writer's whole file wins, so an entry is at worst parsed again)."""
    if not _unsaved:
        return
    merged = caches.read_json(_cache_name())
    merged = merged if isinstance(merged, dict) else {}
    merged.update(_parsed())
    caches.write_json(_cache_name(), merged)
    _unsaved.clear()


def read_files(files: Sequence[str] | str, max_chars: int | None = None) -> list[str]:
    """Local UTF-8 text files, one document each (``corpus_files``: one path alone is a list of one)."""
    docs, total = [], 0
    for name in corpus_files(files):
        docs.append(read_text_file(name))
        total += len(docs[-1])
        if max_chars is not None and total >= max_chars:
            break
    return docs


def corpus_files(files: object) -> list[str]:
    """``data.kwargs.files`` as a list of paths: a list as it is, one path alone as a list of one (a string is
    not iterated character by character); anything else is refused naming the key."""
    if isinstance(files, (str, Path)):
        return [str(files)]
    if isinstance(files, (list, tuple)) and not files:  # not the key left out, which reads the docstrings
        raise ValueError("data.kwargs.files: an empty list names no corpus file; name the files, or leave the key "
                         "out to train on the standard library's docstrings")
    if isinstance(files, (list, tuple)) and all(isinstance(name, (str, Path)) for name in files):
        return [str(name) for name in files]
    raise ValueError(f"data.kwargs.files: takes a list of paths to UTF-8 text files (or one path), not {files!r}")


def read_text_file(name: str) -> str:
    """One corpus file's text: a problem (not a file, not UTF-8, no text in it) names ``data.kwargs.files`` and the
    path, since a corpus that merely runs short would otherwise be blamed on ``data.kwargs.seq_len``."""
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"data.kwargs.files: {name!r} is not a file")
    try:
        content = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"data.kwargs.files: {name!r} must be UTF-8 text, but {_undecodable(path)}") from None
    if not content.strip():
        empty = "is empty" if not content else "holds only whitespace"
        raise ValueError(f"data.kwargs.files: {name!r} {empty}; name files that hold text")
    return content


def _undecodable(path: Path) -> str:
    """Where a file stops being UTF-8, as a byte offset into the file (a text-mode read reports offsets into the
    chunk it was decoding, not the file)."""
    try:
        path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        return f"byte 0x{err.object[err.start]:02x} at offset {err.start} does not decode ({err.reason})"
    return "it does not decode"


def load_tokenizer(path: str) -> Tokenizer:
    """A ``tokenizers`` tokenizer from ``tokenizer.json`` or a folder holding one."""
    from tokenizers import Tokenizer

    file = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise ValueError(f"data.kwargs.tokenizer: no tokenizer.json at {path!r}")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as err:  # noqa: BLE001 - the tokenizers library raises a bare Exception for a bad file
        raise ValueError(f"data.kwargs.tokenizer: {str(file)!r} is not a Hugging Face tokenizers JSON file "
                         f"(tokenizer.json, as Tokenizer.save writes it): {err}") from None


BYTES = 256  # a byte-level tokenizer's initial alphabet: every byte has an id of its own
SPECIAL_TOKENS = (EOS,)  # a trained tokenizer's special tokens (train_tokenizer)
FEWEST_TRAINED_IDS = BYTES + len(SPECIAL_TOKENS)  # BPE keeps the alphabet and the special tokens whatever it is asked


def trained_token_ids(vocab_size: int) -> int:
    """How many token ids a tokenizer ``train_tokenizer`` trains to ``vocab_size`` has at most: ``vocab_size``
    (fewer where the corpus runs out of merges), but never fewer than every byte and the special tokens
    (``FEWEST_TRAINED_IDS``, 257), which it holds whatever ``vocab_size`` asks."""
    return max(vocab_size, FEWEST_TRAINED_IDS)


def requested_vocab_size(kwargs: dict) -> int:
    """``data.kwargs.vocab_size``, else ``text``'s default."""
    return int(kwargs.get("vocab_size", inspect.signature(text).parameters["vocab_size"].default))


def token_ids(kwargs: dict) -> tuple[str, int]:
    """How many token ids ``text`` gives with these ``data.kwargs``, and the key that sets it: a named tokenizer's
    (its largest id + 1, read from its file; ``vocab_size`` is then unused), else those of one trained to
    ``vocab_size`` (``trained_token_ids``). Cheap, unlike training: so a model too small for them is refused before
    MPI starts."""
    if kwargs.get("tokenizer"):
        vocabulary = load_tokenizer(str(kwargs["tokenizer"])).get_vocab(with_added_tokens=True)
        return "data.kwargs.tokenizer", max(vocabulary.values(), default=-1) + 1
    return "data.kwargs.vocab_size", trained_token_ids(requested_vocab_size(kwargs))


def fewer_ids(kwargs: dict) -> str:
    """How to make ``text``'s token ids fewer with these ``data.kwargs``: a named tokenizer's ids are its own, so
    lowering ``vocab_size`` (which only a trained one follows) would change nothing, nor would it below a trained
    one's fewest ids."""
    if kwargs.get("tokenizer"):
        return "name a tokenizer with fewer ids in data.kwargs.tokenizer (data.kwargs.vocab_size is for a " \
               "tokenizer trained at start-up)"
    if requested_vocab_size(kwargs) <= FEWEST_TRAINED_IDS:
        return (f"name a tokenizer with fewer ids in data.kwargs.tokenizer (one trained at start-up has at least "
                f"{FEWEST_TRAINED_IDS}, every byte and {EOS}, whatever data.kwargs.vocab_size asks)")
    return "lower data.kwargs.vocab_size"


def vocabulary_problem(kwargs: dict, rows: int) -> str | None:
    """``text``'s token ids with these ``data.kwargs`` (``token_ids``) against a model's ``rows`` embedding rows
    (model.transformers.config's vocab_size): a larger id fails on every client as its first batch is embedded.
    What is wrong, naming both keys, or None."""
    key, ids = token_ids(kwargs)
    if ids <= rows:
        return None
    trained = "" if kwargs.get("tokenizer") or ids == requested_vocab_size(kwargs) else \
        f" trained to {requested_vocab_size(kwargs)}"
    return (f"{key}: the tokenizer{trained} gives {ids} token ids, more than the model's {rows}-row embedding "
            f"(model.transformers.config's vocab_size); raise model.transformers.config's vocab_size to {ids} "
            f"or {fewer_ids(kwargs)}")


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    """A byte-level BPE (GPT-2 style) trained on ``docs``; deterministic for the same input, so the one trained
    before on the same documents, vocabulary size and tokenizers version is read from the cache folder instead
    (training on the standard library's docstrings takes 2-3 CPU-seconds, paid by every process that reads the
    corpus)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ImportError("data.dataset='text' needs the tokenizers library: pip install 'mpifl[hf]'") from None
    name = _tokenizer_cache_name(docs, vocab_size)
    cached = caches.read_text(name)
    if cached is not None:
        with contextlib.suppress(Exception):  # the library raises a bare Exception for a file it cannot read
            return Tokenizer.from_str(cached)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(docs, trainer)
    caches.write_text(name, tokenizer.to_str())
    return tokenizer


def _tokenizer_cache_name(docs: list[str], vocab_size: int) -> str:
    """The cache file of the tokenizer ``train_tokenizer`` trains on ``docs`` to ``vocab_size``: keyed by every
    document (each with its length, so that no two lists hash alike), the size, how mpifl sets the trainer up
    (TOKENIZER_RECIPE) and the library's version."""
    import tokenizers

    digest = hashlib.sha256(f"{TOKENIZER_RECIPE} {tokenizers.__version__} {vocab_size}".encode())
    for doc in docs:
        encoded = doc.encode("utf-8", "surrogatepass")
        digest.update(len(encoded).to_bytes(8, "little"))
        digest.update(encoded)
    return f"tokenizer-bpe-{digest.hexdigest()[:24]}.json"


TOKENIZER_RECIPE = 1  # bump when train_tokenizer's set-up changes: a cached tokenizer is then trained again


def token_blocks(tokenizer: Tokenizer, docs: list[str], seq_len: int) -> torch.Tensor:
    """All documents as one stream (EOS between them) cut into ``[blocks, seq_len]``; the tail is dropped."""
    eos = tokenizer.token_to_id(EOS)
    stream: list[int] = []
    for encoding in tokenizer.encode_batch(docs):
        stream.extend(encoding.ids)
        if eos is not None:
            stream.append(eos)
    blocks = len(stream) // seq_len
    if blocks < 2:
        raise ValueError(f"data.kwargs.seq_len: the corpus has {len(stream)} tokens, fewer than two blocks of "
                         f"{seq_len}")
    return torch.from_numpy(np.asarray(stream[:blocks * seq_len], dtype=np.int64).reshape(blocks, seq_len))


def special_token_ids(tokenizer: Tokenizer, padded: bool = False) -> dict[str, int]:
    """The ids a transformers config names (``bos_token_id``, ``eos_token_id``; ``pad_token_id`` where ``padded``,
    the architecture's config naming one) for a model trained on this tokenizer's ``token_blocks``. ``EOS`` ends
    each document and so begins the next, as GPT-2's ``<|endoftext|>`` does, and it is the one special token a
    tokenizer mpifl trains has: the architecture's own ids (GPT-2's 50256) are other tokens, or none, in it.
    Empty for a tokenizer without ``EOS`` (a model's own, which its config already matches)."""
    eos = tokenizer.token_to_id(EOS)
    if eos is None:
        return {}
    return {"bos_token_id": eos, "eos_token_id": eos, **({"pad_token_id": eos} if padded else {})}


def block_length(kwargs: dict) -> object:
    """The block length ``text`` cuts to with these ``data.kwargs``: their seq_len, else its default."""
    return kwargs.get("seq_len", inspect.signature(text).parameters["seq_len"].default)


class TokenBlocks(tuple):
    """``text``'s (x_train, y_train, x_test, y_test), carrying the tokenizer that made the token ids as JSON
    (``tokenizer``): the run keeps it beside the model (``<run dir>/tokenizer.json``), and ``mpifl export`` writes it
    beside the weights, so that the model can be used on text after the run."""

    tokenizer: str


def text(files: Sequence[str] | str | None = None, tokenizer: str | None = None, vocab_size: int = 8192,
         seq_len: int = 128, test_fraction: float = 0.1, max_chars: int | None = None,
         split_seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Token blocks for causal-LM training: ``x`` is ``[blocks, seq_len]`` token ids (the max
    sequence length), ``y`` is all zeros (one "class", so iid and unbalanced partitions apply).
    A shuffled ``test_fraction`` of the blocks is the held-out split for perplexity."""
    docs = read_files(files, max_chars) if files is not None else stdlib_docstrings(max_chars)
    tok = load_tokenizer(tokenizer) if tokenizer else train_tokenizer(docs, vocab_size)
    blocks = token_blocks(tok, docs, seq_len)
    order = torch.from_numpy(np.random.default_rng(split_seed).permutation(len(blocks)))
    n_test = max(1, int(len(blocks) * test_fraction))
    test, train = blocks[order[:n_test]], blocks[order[n_test:]]
    zeros = lambda n: torch.zeros(n, dtype=torch.long)  # noqa: E731
    parts = TokenBlocks((train, zeros(len(train)), test, zeros(len(test))))
    parts.tokenizer = tok.to_str()
    return parts

