"""Image datasets in the IDX format of MNIST, from a local folder (nothing is downloaded).

An IDX file is a big-endian header (two zero bytes, a dtype code, the number of dimensions,
then each dimension as a 4-byte unsigned integer) followed by the values, C order. A folder
holds the four files of the MNIST layout, each plain or gzipped: ``train-images-idx3-ubyte``,
``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte`` and ``t10k-labels-idx1-ubyte``.

``idx`` reads any such folder; ``fashion_mnist`` reads Fashion-MNIST (Xiao et al. 2017) where
Debian's ``dataset-fashion-mnist`` package puts it. Images become float32 (N, 1, H, W) in
[0, 1], labels int64.
"""
from __future__ import annotations

import gzip
import math
import zlib
from pathlib import Path

import numpy as np
import torch

FASHION_MNIST = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_INSTALL = "sudo apt-get install dataset-fashion-mnist"
SPLITS = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
          "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}
# The IDX type codes (LeCun's MNIST page): 08 unsigned byte, 09 signed byte, 0B short, 0C int, 0D float, 0E double.
DTYPES: dict[int, np.dtype] = {0x08: np.dtype(">u1"), 0x09: np.dtype(">i1"), 0x0B: np.dtype(">i2"),
                               0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


def idx_file(folder: Path, name: str) -> Path:
    """The file ``name`` in ``folder``, plain or gzipped (the plain one when both are there)."""
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"data.kwargs.path: no {name} (or {name}.gz) in {folder}")


def folder_problem(dataset: str, path: str) -> str | None:
    """Why ``dataset`` cannot be read from the folder ``path`` (it or some of the four files missing), or None;
    checked before MPI starts."""
    folder = Path(path).expanduser()
    names = [name for pair in SPLITS.values() for name in pair]
    missing = [name for name in names if not ((folder / name).is_file() or (folder / f"{name}.gz").is_file())]
    if not missing:
        return None
    what = "no such folder" if not folder.is_dir() else f"missing {', '.join(missing)}, plain or .gz"
    if dataset == "fashion_mnist":
        return (f"data.dataset 'fashion_mnist': no Fashion-MNIST IDX files in {path} ({what}): install them with "
                f"`{FASHION_MNIST_INSTALL}`, or set data.kwargs.path to a folder that holds them")
    return f"data.kwargs.path: no MNIST-layout IDX files in {path} for data.dataset {dataset!r} ({what})"


def idx_bytes(path: Path) -> bytes:
    """The file's contents, decompressed when it is gzipped: a bad gzip stream is a ValueError naming the file."""
    if path.suffix != ".gz":
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as stream:
            return stream.read()
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        raise ValueError(f"{path}: not a whole gzip file ({err})") from None


def read_idx(path: Path) -> np.ndarray:
    """One IDX file as an array (a read-only view of its bytes), its header checked against its length."""
    raw = idx_bytes(path)
    if raw[:2] == b"\x1f\x8b":
        raise ValueError(f"{path}: gzipped, but not named .gz: rename it {path.name}.gz")
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in DTYPES or raw[3] == 0:
        raise ValueError(f"{path}: not an IDX file (magic number {raw[:4].hex() or 'missing'}; expected "
                         f"0000, a type code among {', '.join(f'{c:02x}' for c in DTYPES)}, and 1 or more dimensions)")
    dtype, ndim = DTYPES[raw[2]], raw[3]
    start = 4 + 4 * ndim
    if len(raw) < start:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} bytes; {ndim} dimensions need {start})")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = start + math.prod(shape) * dtype.itemsize
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "longer than its header says"
        raise ValueError(f"{path}: {what}: {len(raw)} bytes, the header {shape} of {dtype.name} needs {expected}")
    return np.frombuffer(raw, dtype=dtype, offset=start).reshape(shape)


def read_split(folder: Path, images_name: str, labels_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One split's images as float32 (N, 1, H, W) in [0, 1] and its labels as int64, the counts checked."""
    images_path, labels_path = idx_file(folder, images_name), idx_file(folder, labels_name)
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3 or images.dtype != np.uint8:
        raise ValueError(f"{images_path}: expected unsigned-byte images (N, H, W), got {images.dtype.name} "
                         f"{images.shape}")
    if labels.ndim != 1 or labels.dtype.kind not in "iu":
        raise ValueError(f"{labels_path}: expected integer labels (N,), got {labels.dtype.name} {labels.shape}")
    if len(images) != len(labels):
        raise ValueError(f"{labels_path}: {len(labels)} labels for the {len(images)} images of {images_path}")
    if len(labels) == 0:
        raise ValueError(f"{images_path}: no images (the header says 0)")
    if labels.min() < 0:
        raise ValueError(f"{labels_path}: label {int(labels.min())} at index {int(labels.argmin())}: class labels "
                         "are 0, 1, 2, ...")
    x = images.astype(np.float32)  # the one float copy; scaled in place
    x /= 255.0
    return torch.from_numpy(x).unsqueeze(1), torch.from_numpy(labels.astype(np.int64))


def idx(path: str) -> tuple[torch.Tensor, ...]:
    """The MNIST-layout IDX files in the folder ``path``: (x_train, y_train, x_test, y_test)."""
    return read_folder("idx", path)


def fashion_mnist(path: str = FASHION_MNIST) -> tuple[torch.Tensor, ...]:
    """Fashion-MNIST (28x28 clothing images, 10 classes), where Debian's package installs it unless ``path``."""
    return read_folder("fashion_mnist", path)


def read_folder(dataset: str, path: str) -> tuple[torch.Tensor, ...]:
    """Both splits of an MNIST-layout folder, its missing files named first (with the dataset's install hint)."""
    problem = folder_problem(dataset, path)
    if problem:
        raise FileNotFoundError(problem)
    folder = Path(path).expanduser()
    (x_train, y_train), (x_test, y_test) = read_split(folder, *SPLITS["train"]), read_split(folder, *SPLITS["test"])
    test_images, test_labels = (idx_file(folder, name) for name in SPLITS["test"])
    if x_train.shape[1:] != x_test.shape[1:]:
        raise ValueError(f"{test_images}: {tuple(x_test.shape[2:])} images, but the training images are "
                         f"{tuple(x_train.shape[2:])}")
    if int(y_test.max()) > int(y_train.max()):
        raise ValueError(f"{test_labels}: label {int(y_test.max())}, but the training labels go up to "
                         f"{int(y_train.max())}: the model has a class per training label")
    return x_train, y_train, x_test, y_test
