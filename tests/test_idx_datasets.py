"""MNIST-layout IDX files from a local folder (``data.dataset: idx``) and Fashion-MNIST where Debian's
``dataset-fashion-mnist`` package puts it (``data.dataset: fashion_mnist``): exact arrays back, clear errors
for broken files, and the install hint before MPI starts."""
from __future__ import annotations

import gzip
import re
import resource
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import MPI_TIMEOUT, ROOT, run_mpi, write_config

from mpifl.cli import main
from mpifl.config import load_config
from mpifl.learning.datasets import dataset_problem, load_dataset
from mpifl.learning.idx import FASHION_MNIST, fashion_mnist, idx

CODES = {np.dtype(np.uint8): 0x08, np.dtype(np.int32): 0x0C}
NAMES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
         "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def idx_bytes(array: np.ndarray) -> bytes:
    """An IDX file: two zero bytes, the type code, the number of dimensions, big-endian sizes, then the values."""
    header = bytes([0, 0, CODES[array.dtype], array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    return header + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> Path:
    """Write ``array`` as an IDX file (gzipped under ``path.gz`` when asked); its path."""
    data = idx_bytes(array)
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def small_set(seed: int = 0) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """50 train and 20 test 28x28 images with known pixels (every byte value occurs) and labels 0..9."""
    rng = np.random.default_rng(seed)
    return {split: (rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8), np.arange(n, dtype=np.uint8) % 10)
            for split, n in (("train", 50), ("test", 20))}


def write_folder(folder: Path, gz: bool = False, label_dtype: type = np.uint8) -> dict:
    """The four MNIST-layout files of :func:`small_set` in ``folder``; the arrays written."""
    folder.mkdir(parents=True, exist_ok=True)
    arrays = small_set()
    for split, (images, labels) in arrays.items():
        write_idx(folder / NAMES[split][0], images, gz)
        write_idx(folder / NAMES[split][1], labels.astype(label_dtype), gz)
    return arrays


def data_config(dataset: str, kwargs: dict):
    return load_config(None, data={"data": {"dataset": dataset, "kwargs": kwargs}, "model": {"name": "cnn"}}).data


@pytest.mark.parametrize("gz,label_dtype", [(False, np.uint8), (True, np.uint8), (False, np.int32)],
                         ids=["plain", "gzipped", "int32-labels"])
def test_the_reader_returns_exactly_the_arrays_written(tmp_path, gz, label_dtype):
    arrays = write_folder(tmp_path, gz, label_dtype)
    data = load_dataset(data_config("idx", {"path": str(tmp_path)}))
    for x, y, split in ((data.x_train, data.y_train, "train"), (data.x_test, data.y_test, "test")):
        images, labels = arrays[split]
        assert x.dtype == torch.float32 and x.shape == (len(images), 1, 28, 28)
        assert torch.equal(x, torch.from_numpy(images.astype(np.float32) / 255.0).unsqueeze(1))
        assert y.dtype == torch.int64 and y.tolist() == labels.tolist()
    assert float(data.x_train.min()) == 0.0 and float(data.x_train.max()) == 1.0
    assert data.input_shape == (1, 28, 28) and data.num_classes == 10


def test_a_broken_header_or_a_short_file_is_a_value_error_naming_the_file(tmp_path):
    write_folder(tmp_path)
    images = tmp_path / NAMES["train"][0]
    good = images.read_bytes()
    images.write_bytes(b"\x00\x01" + good[2:])  # a wrong magic number
    with pytest.raises(ValueError, match=re.escape(f"{images}: not an IDX file (magic number 00010803")):
        idx(str(tmp_path))
    images.write_bytes(good[:-5])  # the last image cut short
    cut = f"{re.escape(str(images))}: truncated: {len(good) - 5} bytes, .* needs {len(good)}"
    with pytest.raises(ValueError, match=cut):
        idx(str(tmp_path))
    images.write_bytes(good[:10])  # cut inside the header's sizes
    with pytest.raises(ValueError, match=re.escape(f"{images}: truncated IDX header")):
        idx(str(tmp_path))
    images.write_bytes(gzip.compress(good))  # gzipped under the plain name
    with pytest.raises(ValueError, match=re.escape(f"{images}: gzipped, but not named .gz")):
        idx(str(tmp_path))
    images.unlink()
    zipped = images.with_name(images.name + ".gz")
    zipped.write_bytes(gzip.compress(good)[:-20])  # a gzip stream cut short
    with pytest.raises(ValueError, match=re.escape(f"{zipped}: not a whole gzip file")):
        idx(str(tmp_path))


def test_images_and_labels_that_differ_in_count_are_a_value_error_naming_both_files(tmp_path):
    arrays = write_folder(tmp_path, gz=True)
    labels = write_idx(tmp_path / NAMES["test"][1], arrays["test"][1][:19], gz=True)
    images = tmp_path / f"{NAMES['test'][0]}.gz"
    with pytest.raises(ValueError, match=re.escape(f"{labels}: 19 labels for the 20 images of {images}")):
        idx(str(tmp_path))


def test_labels_and_image_sizes_the_model_could_not_take_are_a_value_error_naming_the_file(tmp_path):
    arrays = write_folder(tmp_path)
    train_labels, test_images, test_labels = (tmp_path / NAMES["train"][1], tmp_path / NAMES["test"][0],
                                              tmp_path / NAMES["test"][1])
    negative = arrays["train"][1].astype(np.int32)
    negative[7] = -1
    write_idx(train_labels, negative)
    with pytest.raises(ValueError, match=re.escape(f"{train_labels}: label -1 at index 7: class labels are 0, 1, 2")):
        idx(str(tmp_path))
    write_idx(train_labels, arrays["train"][1])
    write_idx(test_images, np.zeros((20, 32, 32), dtype=np.uint8))  # a 32x32 test set beside 28x28 training images
    with pytest.raises(ValueError, match=re.escape(f"{test_images}: (32, 32) images, but the training images are "
                                                   "(28, 28)")):
        idx(str(tmp_path))
    write_idx(test_images, arrays["test"][0])
    beyond = arrays["test"][1].copy()
    beyond[3] = 12  # a class no training image has
    write_idx(test_labels, beyond)
    with pytest.raises(ValueError, match=re.escape(f"{test_labels}: label 12, but the training labels go up to 9")):
        idx(str(tmp_path))
    write_idx(test_images, np.zeros((0, 28, 28), dtype=np.uint8))
    write_idx(test_labels, np.zeros(0, dtype=np.uint8))
    with pytest.raises(ValueError, match=re.escape(f"{test_images}: no images")):
        idx(str(tmp_path))


def test_missing_files_show_at_config_check_time_with_the_install_hint(tmp_path, capsys):
    missing = tmp_path / "no-such-folder"
    problem = dataset_problem(data_config("fashion_mnist", {"path": str(missing)}))
    assert problem is not None and f"no Fashion-MNIST IDX files in {missing} (no such folder)" in problem
    assert "sudo apt-get install dataset-fashion-mnist" in problem
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        fashion_mnist(str(missing))
    write_folder(tmp_path / "partial")
    (tmp_path / "partial" / NAMES["test"][1]).unlink()
    problem = dataset_problem(data_config("idx", {"path": str(tmp_path / "partial")}))
    assert problem == (f"data.kwargs.path: no MNIST-layout IDX files in {tmp_path / 'partial'} for data.dataset "
                       f"'idx' (missing t10k-labels-idx1-ubyte, plain or .gz)")
    assert dataset_problem(data_config("idx", {})) == "data.kwargs.path: idx takes path without a default; set it"
    config = write_config(tmp_path / "fashion.yaml", f"data: {{dataset: fashion_mnist, kwargs: {{path: '{missing}'}}}}"
                                                     "\nmodel: {name: cnn}\n")
    assert main(["validate", str(config)]) == 2  # `mpifl run` checks the same before MPI starts
    assert "config error: data.dataset 'fashion_mnist'" in capsys.readouterr().err


def test_a_federation_trains_on_idx_files(tmp_path):
    write_folder(tmp_path / "data", gz=True)
    cfg = write_config(tmp_path / "idx.yaml", f"""
rounds: 2
clients: {{num_clients: 4, per_round: 2}}
data: {{dataset: idx, kwargs: {{path: '{tmp_path / "data"}'}}, partition: dirichlet}}
model: {{name: cnn, kwargs: {{channels: [4]}}}}
train: {{lr: 0.05, batch_size: 8}}
eval: {{every: 1}}
output: {{progress: false}}
""")
    result = run_mpi(3, "run", str(cfg), "--run-dir", str(tmp_path / "run"), timeout=MPI_TIMEOUT)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run" / "model.h5").is_file()


@pytest.mark.skipif(not Path(FASHION_MNIST).is_dir(),
                    reason=f"Fashion-MNIST is not installed in {FASHION_MNIST} (sudo apt-get install "
                           "dataset-fashion-mnist)")
def test_the_real_fashion_mnist_loads_with_its_shapes():
    start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    data = load_dataset(data_config("fashion_mnist", {}))
    seconds = time.perf_counter() - start
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # ru_maxrss: KiB on Linux
    assert data.x_train.shape == (60000, 1, 28, 28) and data.x_test.shape == (10000, 1, 28, 28)
    assert data.y_train.shape == (60000,) and data.y_test.shape == (10000,) and data.num_classes == 10
    assert data.y_train.bincount().tolist() == [6000] * 10 and data.y_test.bincount().tolist() == [1000] * 10
    assert 0.0 <= float(data.x_train.min()) and float(data.x_train.max()) <= 1.0
    print(f"Fashion-MNIST: {seconds:.2f} s, peak RSS grew {grown_mib:.0f} MiB")


@pytest.mark.skipif(not Path(FASHION_MNIST).is_dir(),
                    reason=f"Fashion-MNIST is not installed in {FASHION_MNIST} (sudo apt-get install "
                           "dataset-fashion-mnist)")
def test_the_shipped_fashion_mnist_config_validates(capsys):
    assert main(["validate", str(ROOT / "configs" / "fashion_mnist.yaml")]) == 0
    assert "valid" in capsys.readouterr().out
