"""Federated data as a table with a client-id column, from local files (nothing is downloaded).

``data.dataset: table`` reads one of three formats (``data.kwargs.path``):

- Parquet (``*.parquet``, through pyarrow: the ``tables`` extra). A rank reads only the label
  and client columns to survey, and only its clients' rows (a pushed-down filter) to train.
- A Hugging Face dataset saved with ``save_to_disk`` (a folder with ``state.json`` and Arrow
  files, or a ``DatasetDict`` folder with ``train``/``test`` splits), memory-mapped through
  pyarrow: pages of other clients' rows are never read.
- NumPy ``.npz``: one array per column. The feature arrays are read whole, then a rank keeps
  only its clients' rows (npz cannot be read in part).

Every distinct client id (sorted) is one logical client; ``data.partition: natural`` keeps that
split and lets each rank read only the clients it hosts. Features are ``feature_columns`` (by
default every column but the client and label columns): numbers or fixed-length lists,
concatenated per row into float32 (int64 when every column is integer: token ids), reshaped to
``shape`` when given. The held-out set is ``test_path`` (the same format) or a DatasetDict's
``test`` split; without one, the held-out set is empty and server-side evaluation must stay off.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch

from mpifl.learning.sources import ClientIndex, classes_in, read_whole

if TYPE_CHECKING:  # the 'tables' extra: imported where a table is read
    import pyarrow


def _pyarrow() -> ModuleType:
    try:
        import pyarrow
        import pyarrow.compute
        import pyarrow.parquet
    except ImportError as err:
        raise ImportError("data.dataset 'table' reads Parquet and Arrow files with pyarrow: "
                          "pip install 'mpifl[tables]'") from err
    return pyarrow


def table_format(path: Path) -> str:
    """'parquet', 'npz', 'arrow' (a saved Hugging Face dataset) or 'arrow-dict' (a saved DatasetDict)."""
    if path.is_dir():
        if (path / "dataset_dict.json").exists():
            return "arrow-dict"
        if (path / "state.json").exists():
            return "arrow"
        raise ValueError(f"{path}: a folder, but not a saved Hugging Face dataset (no state.json)")
    if path.suffix in (".parquet", ".npz"):
        return path.suffix[1:]
    raise ValueError(f"{path}: unknown table format (use .parquet, .npz or a save_to_disk folder)")


def _arrow_table(folder: Path) -> pyarrow.Table:
    """A saved Hugging Face dataset's Arrow files, memory-mapped, as one pyarrow table."""
    pa = _pyarrow()
    state = json.loads((folder / "state.json").read_text())
    parts = [pa.ipc.open_stream(pa.memory_map(str(folder / f["filename"]))).read_all()
             for f in state["_data_files"]]
    return pa.concat_tables(parts)


def _columns(table: pyarrow.Table, names: Sequence[str], path: Path, rows_of: str = "") -> dict[str, np.ndarray]:
    """Columns of a pyarrow table (read from ``path``; ``rows_of``: whose rows, where not the file's all) as numpy
    arrays; list columns as (rows, length) arrays. A null is refused: it would become a NaN input, or a label or
    client id of nothing; so is a NaN or infinite float, which would become the same input (Parquet's statistics
    count nulls, not NaN, so it is seen where the rows are read)."""
    pa = _pyarrow()
    out = {}
    for name in names:
        column = table.column(name).combine_chunks()
        _refuse_nulls(path, name, column.null_count)
        if pa.types.is_list(column.type) or pa.types.is_fixed_size_list(column.type) \
                or pa.types.is_large_list(column.type):
            lengths = np.unique(pa.compute.list_value_length(column).to_numpy(zero_copy_only=False))
            if len(lengths) > 1:
                raise ValueError(f"column {name!r}: lists of different lengths {lengths.tolist()}")
            flat = column.flatten()
            _refuse_nulls(path, name, flat.null_count)
            out[name] = flat.to_numpy(zero_copy_only=False).reshape(len(column), -1)
        else:
            out[name] = column.to_numpy(zero_copy_only=False)
        _refuse_nonfinite(path, f"column {name!r}", out[name], rows_of)
    return out


def _rows_of(ids: Sequence | np.ndarray | None) -> str:
    """Whose rows a read of client ``ids`` holds, for a message that counts a row among them ('' for every row)."""
    return "" if ids is None else f"the rows read for {len(ids)} client id{'' if len(ids) == 1 else 's'}"


def _refuse_nulls(path: Path, name: str, nulls: int) -> None:
    """Refuse a column holding ``nulls`` > 0 nulls, naming the file and the column."""
    if nulls:
        raise ValueError(f"{path}: column {name!r} has {nulls} null value{'s' if nulls > 1 else ''} (a missing "
                         "label, client id or feature cannot be trained on: fill or drop those rows)")


def _parquet_nulls(path: Path, names: Sequence[str]) -> None:
    """Refuse nulls in the columns ``names`` of a Parquet file from its statistics, without reading them."""
    metadata = _pyarrow().parquet.ParquetFile(path).metadata
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        for i in range(row_group.num_columns):
            column = row_group.column(i)
            name = column.path_in_schema.split(".")[0]
            stats = column.statistics
            if name in names and stats is not None and stats.has_null_count:
                _refuse_nulls(path, name, stats.null_count)


CHUNK_BYTES = 1 << 24  # what a finiteness check holds at once beyond the data: 16 MiB of values and their flags


def _refuse_nonfinite(path: Path, what: str, values: np.ndarray, rows_of: str = "") -> None:
    """Refuse NaN or infinite floats in ``values``, an npz file's array or a table's column (``what``: "array 'x'",
    "column 'x'"): a NaN input poisons the model it trains, as a null would. The first such row is named, counted
    in the file, or among the rows read when ``rows_of`` says whose they are (one client's rows of a table). Checked
    a slice of rows at a time, so the check holds little beyond ``values``."""
    if values.dtype.kind not in "fc" or not values.size:
        return
    rows = max(1, CHUNK_BYTES // max(1, values[:1].nbytes))
    for start in range(0, len(values), rows):
        chunk = values[start:start + rows]
        bad = ~np.isfinite(chunk.reshape(len(chunk), -1)).all(axis=1)
        if bad.any():
            row = start + int(np.argmax(bad))
            where = f"row {row} of {rows_of}" if rows_of else f"row {row}"
            raise ValueError(f"{path}: {what} has a NaN or infinite value in {where} (a feature that is not a number "
                             "cannot be trained on: fill or drop those rows)")


class TableSource:
    """A table with a client-id column; see the module docstring."""

    def __init__(self, path: str, test_path: str | None = None, client_column: str = "client_id",
                 label_column: str = "label", feature_columns: Sequence[str] | None = None,
                 shape: Sequence[int] | None = None) -> None:
        self.path, self.test_path = Path(path), Path(test_path) if test_path else None
        self.client, self.label = client_column, label_column
        self.features, self.shape = list(feature_columns) if feature_columns else None, shape

    def _read(self, path: Path, names: Sequence[str], ids: Sequence | np.ndarray | None = None,
              split: str = "train") -> dict[str, np.ndarray]:
        """Columns of one file; only the rows of client ``ids`` when given (pushed down where the format can)."""
        kind = table_format(path)
        if kind == "npz":
            with np.load(path, allow_pickle=False) as arrays:
                missing = [n for n in names if n not in arrays.files]
                if missing:
                    raise ValueError(f"{path}: no column {missing[0]!r} (it has {', '.join(arrays.files)})")
                keep = np.isin(arrays[self.client], np.asarray(ids)) if ids is not None else slice(None)
                out = {}
                for n in names:
                    values = arrays[n]
                    # every row, not only those kept: the survey reads each feature array here, so it refuses any row's
                    _refuse_nonfinite(path, f"array {n!r}", values)
                    out[n] = values[keep]
                return out
        pa = _pyarrow()
        if kind == "parquet":
            table = self._parquet_rows(path, names, ids)
        else:
            path = path / split if kind == "arrow-dict" else path  # a DatasetDict's split is named in messages
            table = _arrow_table(path)
            missing = [n for n in names if n not in table.column_names]
            if missing:
                raise ValueError(f"{path}: no column {missing[0]!r} (it has {', '.join(table.column_names)})")
            if ids is not None:
                table = table.filter(pa.compute.is_in(table.column(self.client), value_set=pa.array(list(ids))))
            table = table.select(list(names))
        return _columns(table, names, path, _rows_of(ids))

    def _parquet_rows(self, path: Path, names: Sequence[str], ids: Sequence | np.ndarray | None) -> pyarrow.Table:
        """Columns ``names`` of every row, or of the rows of clients ``ids``, one row group at a time:
        groups whose client-id range (the file's statistics) holds none of ``ids`` are skipped unread,
        so memory stays one group plus the result."""
        pa = _pyarrow()
        file = pa.parquet.ParquetFile(path, memory_map=True)
        missing = [n for n in names if n not in file.schema_arrow.names]
        if missing:
            raise ValueError(f"{path}: no column {missing[0]!r} (it has {', '.join(file.schema_arrow.names)})")
        column = file.schema_arrow.get_field_index(self.client)
        wanted = pa.array(list(ids)) if ids is not None else None
        parts = []
        for group in range(file.metadata.num_row_groups):
            if wanted is None:
                parts.append(file.read_row_group(group, columns=list(names)))
                continue
            assert ids is not None  # wanted is set exactly when ids is
            stats = file.metadata.row_group(group).column(column).statistics
            if stats is not None and stats.has_min_max and (stats.max < min(ids) or stats.min > max(ids)):
                continue
            keep = pa.compute.is_in(file.read_row_group(group, columns=[self.client]).column(0), value_set=wanted)
            if pa.compute.any(keep).as_py():
                parts.append(file.read_row_group(group, columns=list(names)).filter(keep))
        table = pa.concat_tables(parts) if parts else file.schema_arrow.empty_table().select(list(names))
        pa.default_memory_pool().release_unused()
        return table

    def _feature_names(self, path: Path) -> list[str]:
        if self.features:
            return self.features
        kind = table_format(path)
        if kind == "npz":
            with np.load(path, allow_pickle=False) as arrays:
                names = list(arrays.files)
        elif kind == "parquet":
            names = list(_pyarrow().parquet.read_schema(path).names)
        else:
            names = _arrow_table(path / "train" if kind == "arrow-dict" else path).column_names
        return [n for n in names if n not in (self.client, self.label)]

    def _inputs(self, columns: dict[str, np.ndarray], names: Sequence[str]) -> torch.Tensor:
        """One input row per table row: the feature columns side by side, reshaped to ``shape``."""
        parts = [columns[n].reshape(len(columns[n]), -1) for n in names]
        integer = all(np.issubdtype(p.dtype, np.integer) for p in parts)
        x = np.concatenate(parts, axis=1).astype(np.int64 if integer else np.float32)
        return torch.from_numpy(x.reshape(len(x), *self.shape) if self.shape else x)

    def _test(self, names: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        if self.test_path is None and table_format(self.path) == "arrow-dict" and (self.path / "test").exists():
            path, split = self.path, "test"
        elif self.test_path is not None:
            path, split = self.test_path, "train"
        else:
            return torch.empty(0), torch.empty(0, dtype=torch.int64)
        columns = self._read(path, [*names, self.label], split=split)
        return self._inputs(columns, names), torch.from_numpy(columns[self.label].astype(np.int64))

    def survey(self) -> tuple[ClientIndex, tuple[torch.Tensor, torch.Tensor]]:
        """Every client's labels (clients in id order) and the test split; inputs are read for one client only (a
        Parquet file's features are checked for nulls from its statistics, an Arrow folder's from its batches'
        headers; an npz file's arrays are read whole for that client, NaN and infinities refused as they are)."""
        for key, path in (("path", self.path), ("test_path", self.test_path)):
            if path is not None and not path.exists():
                raise FileNotFoundError(f"data.kwargs.{key}: no file or folder {str(path)!r}")
        names = self._feature_names(self.path)
        kind = table_format(self.path)
        if kind == "parquet":
            _parquet_nulls(self.path, names)
        elif kind != "npz":  # memory-mapped Arrow: a column's null count is in its batches' headers
            folder = self.path / "train" if kind == "arrow-dict" else self.path
            table = _arrow_table(folder)
            for name in names:
                _refuse_nulls(folder, name, table.column(name).null_count)
        columns = self._read(self.path, [self.client, self.label])
        ids, codes = np.unique(columns[self.client], return_inverse=True)
        order = np.argsort(codes, kind="stable")  # clients in id order, rows in file order
        labels = np.split(columns[self.label].astype(np.int64)[order], np.cumsum(np.bincount(codes))[:-1])
        x_test, y_test = self._test(names)
        first = self._inputs(self._read(self.path, names, ids[:1]), names)[:1]
        if len(x_test) == 0:
            x_test = first[:0]
        index = ClientIndex(tuple(labels), tuple(first.shape[1:]), first.dtype, classes_in(*labels, y_test.numpy()),
                            {"features": names}, tuple(ids.tolist()), "table client id")
        return index, (x_test, y_test)

    def read_clients(self, index: ClientIndex, clients: Sequence[int]) -> dict[int, torch.Tensor]:
        """The inputs of ``clients``, reading only their rows (Parquet row groups without them stay unread)."""
        ids, names = index.ids, index.where["features"]
        wanted = [ids[c] for c in sorted(clients)]
        if not wanted:
            return {}
        columns = self._read(self.path, [self.client, *names], wanted)
        x = self._inputs(columns, names)
        position = {v: c for c, v in zip(sorted(clients), wanted)}
        owner = np.array([position[v] for v in columns[self.client].tolist()], dtype=np.int64)
        out = {}
        for c in sorted(clients):
            rows = torch.from_numpy(np.flatnonzero(owner == c))
            out[c] = x[rows]
        return out


def table(path: str, test_path: str | None = None, client_column: str = "client_id", label_column: str = "label",
          feature_columns: Sequence[str] | None = None, shape: Sequence[int] | None = None) -> tuple:
    """(x_train, y_train, x_test, y_test, clients), every client read (see ``TableSource``)."""
    return read_whole(TableSource(path, test_path, client_column, label_column, feature_columns, shape))
