"""Federated benchmark data in the LEAF layout, from local files (nothing is downloaded).

LEAF (Caldas et al. 2018) ships each split as JSON files with ``users``, ``num_samples`` and
``user_data: {user: {"x": [...], "y": [...]}}``. Every training user becomes one logical
client (users sorted by name), so the partition is the data's own (``data.partition:
natural``); the test files' samples, pooled, are the held-out set. Three kinds of ``x``:

- FEMNIST-like: rows of numbers (784 become 1 x 28 x 28 images), integer labels.
- Shakespeare-like: strings, and single characters as labels, mapped to ids over LEAF's
  80-character alphabet.
- Sent140-like: raw tweet records (lists whose 5th item is the text), 0/1 labels. Words (LEAF's
  tokenizer) become ids: 0 pads, 1 is an unknown word, 2.. the vocabulary: a local word list
  (``vocab_file``: the first token of each line, as in a GloVe file) or the ``vocab_size`` most
  frequent training words. Each tweet is cut or padded to ``max_words`` (25, as LEAF).

``LeafSource`` reads the files one at a time: the survey keeps only labels (and word
counts), and a rank reading its clients opens only the files that hold them and keeps only them.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from mpifl.learning.sources import ClientIndex, classes_in, read_whole

# LEAF's Shakespeare alphabet (models/utils/language_utils.py), as character ids 0..79.
LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
WORD = re.compile(r"[\w']+|[.,!?;]")  # LEAF's split_line (models/utils/language_utils.py)
PAD, UNKNOWN = 0, 1
NUMBERS, CHARACTERS, TWEETS = "numbers", "characters", "tweets"


def split_files(folder: Path) -> list[Path]:
    """A split folder's JSON files, in name order."""
    files = sorted(folder.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"data.kwargs.path: no LEAF *.json files in {folder}")
    return files


def read_file(path: Path) -> dict:
    """One LEAF file, checked for the keys every LEAF file has."""
    try:
        table = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"data.kwargs.path: {path}: not a JSON file ({err})") from None
    missing = {"users", "user_data"} - set(table) if isinstance(table, dict) else {"users", "user_data"}
    if missing:
        raise ValueError(f"data.kwargs.path: {path}: not a LEAF file (no {', '.join(sorted(missing))})")
    return table


def users_of(folder: Path) -> Iterator[tuple[Path, str, dict]]:
    """(file, user, {"x", "y"}) for every user of a split, one file in memory at a time; each user checked
    (``user_data``), and against its ``num_samples`` entry when the file has them (LEAF's files do)."""
    for path in split_files(folder):
        table = read_file(path)
        listed = Counter(table["users"])
        stated = table.get("num_samples", [])
        if not isinstance(stated, list):
            raise ValueError(f"data.kwargs.path: {path}: num_samples is a {type(stated).__name__}, not a list of "
                             "counts (one per user)")
        for i, user in enumerate(table["users"]):
            if listed[user] > 1:
                raise ValueError(f"data.kwargs.path: {path}: user {user!r} is listed {listed[user]} times in "
                                 "'users' (a user is one client: list it once)")
            data = user_data(path, table, user)
            if i < len(stated) and stated[i] != len(data["y"]):
                raise ValueError(f"data.kwargs.path: {path}: user {user!r}: num_samples says {stated[i]!r} but its "
                                 f"user_data holds {len(data['y'])} samples (a truncated or edited file? make them "
                                 "agree)")
            yield path, user, data
        if "num_samples" in table and len(stated) != len(table["users"]):
            raise ValueError(f"data.kwargs.path: {path}: num_samples has {len(stated)} "
                             f"entr{'y' if len(stated) == 1 else 'ies'}, but 'users' lists {len(table['users'])} "
                             "users (one count per user)")


def user_data(path: Path, table: dict, user: str) -> dict:
    """A user's {"x", "y"} from a LEAF file's table: there, two lists of one length."""
    data = table["user_data"].get(user)
    if data is None:
        raise ValueError(f"data.kwargs.path: {path}: user {user!r} is listed in 'users' but has no 'user_data' "
                         "entry")
    if not isinstance(data, dict) or not isinstance(data.get("x"), list) or not isinstance(data.get("y"), list):
        raise ValueError(f"data.kwargs.path: {path}: user {user!r}: its 'user_data' is not lists 'x' and 'y'")
    if len(data["x"]) != len(data["y"]):
        raise ValueError(f"data.kwargs.path: {path}: user {user!r} has {len(data['x'])} inputs (x) but "
                         f"{len(data['y'])} labels (y)")
    return data


class RowWidths:
    """Checks that every input row of a folder (numbers or characters; tweets are cut to ``max_words``) is as long
    as the first one: rows of different lengths cannot be one array."""

    def __init__(self) -> None:
        self.first: tuple[int, str, Path] | None = None

    def check(self, path: Path, user: str, x: list, kind: str) -> None:
        """Refuse ``user``'s rows (in ``path``) when one's length differs from the first row's seen."""
        if kind == TWEETS or not x or not isinstance(x[0], (list, str)):
            return
        for row, values in enumerate(x):
            width = len(values) if isinstance(values, (list, str)) else -1
            if self.first is None:
                self.first = (width, user, path)
            elif width != self.first[0]:
                unit = "characters" if kind == CHARACTERS else "values"
                raise ValueError(f"data.kwargs.path: {path}: user {user!r}: input row {row} has {width} {unit}, "
                                 f"but user {self.first[1]!r} (in {self.first[2].name}) has rows of "
                                 f"{self.first[0]}: every input row must be as long")


def kind_of(x: list) -> str:
    """Which LEAF dataset a user's ``x`` looks like."""
    first = x[0] if x else []
    if isinstance(first, str):
        return CHARACTERS
    if isinstance(first, list) and first and isinstance(first[-1], str):
        return TWEETS
    return NUMBERS


def tweet_text(row: list) -> str:
    """The text of a Sent140 record (its 5th item, as LEAF's preprocessing writes it)."""
    return str(row[4] if len(row) > 4 else row[-1])


def labels_of(y: list) -> np.ndarray:
    """Labels as int64: numbers as they are, single characters as alphabet ids."""
    if y and isinstance(y[0], str):
        return np.array([LETTERS.find(ch) for ch in y], dtype=np.int64)
    return np.asarray(y, dtype=np.int64)


class Encoder:
    """Turns one user's ``x`` into an input array, the same way on every rank."""

    def __init__(self, kind: str, vocabulary: dict[str, int] | None = None, max_words: int = 25) -> None:
        self.kind, self.vocabulary, self.max_words = kind, vocabulary or {}, max_words

    def __call__(self, x: list) -> np.ndarray:
        """Character ids, padded word ids (tweets) or float32 features, by the folder's layout."""
        if self.kind == CHARACTERS:
            return np.array([[LETTERS.find(ch) for ch in text] for text in x], dtype=np.int64)
        if self.kind == TWEETS:
            ids = np.full((len(x), self.max_words), PAD, dtype=np.int64)
            for i, row in enumerate(x):
                words = [self.vocabulary.get(w, UNKNOWN) for w in WORD.findall(tweet_text(row))][:self.max_words]
                ids[i, :len(words)] = words
            return ids
        return np.asarray(x, dtype=np.float32)


def as_inputs(x: np.ndarray) -> torch.Tensor:
    """Inputs as a tensor; 784-wide rows as 1 x 28 x 28 images (FEMNIST)."""
    tensor = torch.from_numpy(x)
    if x.ndim == 2 and x.shape[1] == 784 and x.dtype == np.float32:
        tensor = tensor.reshape(-1, 1, 28, 28)
    return tensor


def vocabulary(counts: Counter, vocab_size: int, vocab_file: str | None) -> dict[str, int]:
    """Word ids from 2: a word list's order, else the most frequent training words (ties by word)."""
    if vocab_file:
        with open(vocab_file, encoding="utf-8") as lines:
            words = [line.split(maxsplit=1)[0] for line in lines if line.strip()]
    else:
        words = [w for w, _ in sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:vocab_size]]
    return {w: i + 2 for i, w in enumerate(dict.fromkeys(words))}


class LeafSource:
    """A LEAF folder (``train/``, ``test/``) read user by user; see the module docstring."""

    def __init__(self, path: str, vocab_size: int = 10000, max_words: int = 25, vocab_file: str | None = None):
        self.root, self.vocab_size, self.max_words, self.vocab_file = Path(path), vocab_size, max_words, vocab_file

    def survey(self) -> tuple[ClientIndex, tuple[torch.Tensor, torch.Tensor]]:
        """Every user's labels and the encoded test split, reading each training file once."""
        labels: dict[str, np.ndarray] = {}
        files: dict[str, str] = {}
        kinds: set[str] = set()
        widths = RowWidths()
        words: Counter[str] = Counter()
        for path, user, data in users_of(self.root / "train"):
            if user in files:
                raise ValueError(f"data.kwargs.path: {self.root / 'train'}: user {user!r} is in {files[user]} and "
                                 f"in {path.name}; a user's samples must be in one file (merge them there)")
            labels[user], files[user] = user_labels(path, user, data["y"]), path.name
            if data["x"]:  # an empty user shows no layout
                layout = kind_of(data["x"])
                kinds.add(layout)
                widths.check(path, user, data["x"], layout)
            if TWEETS in kinds and not self.vocab_file:
                words.update(w for row in data["x"] for w in WORD.findall(tweet_text(row)))
        if len(kinds) > 1:
            raise ValueError(f"{self.root / 'train'}: users' x mix LEAF layouts ({', '.join(sorted(kinds))})")
        kind = kinds.pop() if kinds else NUMBERS
        encode = Encoder(kind, vocabulary(words, self.vocab_size, self.vocab_file) if kind == TWEETS else None,
                         self.max_words)
        test = []
        for path, user, data in sorted(users_of(self.root / "test"), key=lambda item: item[1]):
            widths.check(path, user, data["x"], kind)
            test.append((encoded(encode, path, user, data["x"]), user_labels(path, user, data["y"])))
        if not test:
            raise ValueError(f"{self.root / 'test'}: the LEAF test split has no users")
        x_test, y_test = np.concatenate([x for x, _ in test]), np.concatenate([y for _, y in test])
        users = sorted(labels)
        index = ClientIndex(tuple(labels[u] for u in users), tuple(as_inputs(x_test[:1]).shape[1:]),
                            as_inputs(x_test[:1]).dtype, classes_in(*labels.values(), y_test),
                            {"files": [files[u] for u in users], "encoder": encode}, tuple(users), "LEAF user")
        return index, (as_inputs(x_test), torch.from_numpy(y_test))

    def read_clients(self, index: ClientIndex, clients: Sequence[int]) -> dict[int, torch.Tensor]:
        """The encoded inputs of ``clients``, opening only the training files that hold them."""
        users, files = index.ids, index.where["files"]
        wanted = {users[c]: c for c in clients}
        out: dict[int, torch.Tensor] = {}
        for name in sorted({files[c] for c in clients}):
            path = self.root / "train" / name
            table = read_file(path)
            for user in set(table["users"]) & wanted.keys():
                x = user_data(path, table, user)["x"]
                out[wanted[user]] = as_inputs(encoded(index.where["encoder"], path, user, x))
        return out


def user_labels(path: Path, user: str, y: list) -> np.ndarray:
    """``labels_of`` a user's ``y``; a label that is not a class (a character outside LEAF's alphabet, a negative
    number, not a number) is refused naming the file and the user."""
    try:
        labels = labels_of(y)
    except (ValueError, TypeError) as err:
        raise ValueError(f"data.kwargs.path: {path}: user {user!r}: labels (y): {err}") from None
    if labels.ndim != 1 or (labels < 0).any():
        raise ValueError(f"data.kwargs.path: {path}: user {user!r}: labels (y) are not all classes 0, 1, ... "
                         "(integers, or characters of LEAF's alphabet)")
    return labels


def encoded(encode: Encoder, path: Path, user: str, x: list) -> np.ndarray:
    """``encode(x)``, an input that cannot be encoded refused naming the file and the user."""
    try:
        return encode(x)
    except (ValueError, TypeError) as err:
        raise ValueError(f"data.kwargs.path: {path}: user {user!r}: inputs (x): {err}") from None


def leaf(path: str, vocab_size: int = 10000, max_words: int = 25, vocab_file: str | None = None) -> tuple:
    """(x_train, y_train, x_test, y_test, clients), every user read; ``clients`` holds each training
    user's sample indices, users sorted by name."""
    return read_whole(LeafSource(path, vocab_size, max_words, vocab_file))
