"""Training on a device: a replica of the model next to the host exchange buffer.

The host flat buffer is what MPI sends and receives (pinned when the device is a GPU). A
rank that trains on a device keeps, for the whole run:

- a replica of the model on the device (its own flat buffer there, frozen tensors included);
- the round's global model on the device, to reset the replica before each logical client.

Each round: one host-to-device copy after the global model arrives; per logical client, a
device-side reset and training; then one device-to-host copy per update (or, with
``clients.groups``, per group sum, folded on the device). Per-client state (SCAFFOLD's and
FedDyn's vectors, ``model.local`` tensors, Ditto's personal models) stays in host memory, and its
rules run on the replica: the training client's state goes to the device before it trains and
back after. With ``train.device_copy`` the same path runs on the CPU with a separate, non-aliased
replica, which is how the test suite exercises it without a GPU.
"""
from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from mpifl.errors import JobFailure
from mpifl.wire.flat import DTYPES, FlatModel

if TYPE_CHECKING:
    from mpifl.wire.spec import Chunk


def resolve_device(name: str, key: str = "train.device") -> torch.device:
    """``auto`` (cuda when available), ``cpu`` or ``cuda`` (the rank's one visible GPU, see MPIFL_GPUS_PER_NODE);
    ``key`` names the setting in the error."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise JobFailure(f"{key}='cuda' but this rank sees no GPU (torch.cuda.is_available() is False); "
                         "check the CUDA build of torch and MPIFL_GPUS_PER_NODE / CUDA_VISIBLE_DEVICES")
    return torch.device(name)


def training_replica(host: FlatModel, device_name: str, device_copy: bool | None,
                     trainable_only: bool, deterministic: bool = True) -> DeviceReplica | None:
    """The replica a client rank trains, or None to train in the host buffer itself (the CPU default)."""
    device = resolve_device(device_name)
    if not (device_copy if device_copy is not None else device.type != "cpu"):
        return None
    if device.type == "cuda":
        if deterministic:
            use_deterministic_kernels()
        pin_in_place(host.buffer)
    return DeviceReplica(host, device, trainable_only)


# cuBLAS's setting for reproducible results: a fixed workspace per stream, so its reductions do not depend on
# which workspace a call happened to get (NVIDIA's cuBLAS documentation, "Results reproducibility").
CUBLAS_WORKSPACE = ":4096:8"


def use_deterministic_kernels() -> None:
    """Make this rank's CUDA training bitwise reproducible (``train.deterministic``).

    By default cuDNN chooses among convolution algorithms by timing them, and some of them, like
    several of torch's CUDA kernels (index_add, scatter_add, the backward of embedding), sum with
    atomics in whatever order the threads arrive. Then the same client, trained twice on the same
    GPU, gives different last bits, and the run is neither reproducible nor equal across rank
    counts. Deterministic kernels fix the order; an operation that has none raises, naming itself
    (``train.deterministic=false`` allows it). Set before the first cuBLAS call of the process:
    cuBLAS reads its workspace setting when its handle is created.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True)


# The start of what torch raises for an operation that has no deterministic kernel (at::Context::alertNotDeterministic).
NO_DETERMINISTIC_KERNEL = "does not have a deterministic implementation"


def deterministic_hint(error: BaseException) -> str:
    """What to add to a client's failure when it was an operation without a deterministic kernel: the setting
    that allows it, and what that costs; otherwise nothing."""
    if NO_DETERMINISTIC_KERNEL not in str(error):
        return ""
    return ("; mpifl asked for deterministic kernels (train.deterministic, the default on a GPU): "
            "train.deterministic: false allows this operation, and the GPU run is then no longer bitwise "
            "reproducible")


def pin_in_place(buffer: torch.Tensor) -> None:
    """Page-lock a host buffer where it is (no copy, so the model's views stay), for fast, async H2D/D2H copies."""
    status = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel() * buffer.element_size(), 0)
    if int(status) != 0:
        raise RuntimeError(f"could not page-lock the {buffer.numel()}-byte host exchange buffer (CUDA error "
                           f"{int(status)})")


def device_copy(host: FlatModel, device: torch.device, trainable_only: bool, what: str) -> FlatModel:
    """The host model rebuilt on ``device`` (frozen and local tensors come along, once), laid out as the host's
    flat buffer is, so that one copy of that buffer refreshes it; ``what`` names it in the error."""
    flat = FlatModel(copy.deepcopy(host.module).to(device), trainable_only, device=device, local=host.local)
    if flat.spec.hash != host.spec.hash:
        raise RuntimeError(f"the {what}'s layout differs from the host model's")
    return flat


class EvaluationCopy:
    """The global model on the server's GPU, for held-out evaluation (``eval.device``): built once, with the frozen
    and local tensors as built, and refreshed from the host buffer (one host-to-device copy) before each
    evaluation. Only the exchanged tensors change on the server, and they all live in that buffer."""

    def __init__(self, host: FlatModel, device: torch.device, trainable_only: bool):
        self.flat = device_copy(host, device, trainable_only, "evaluation copy")
        self.host = host

    def refreshed(self) -> nn.Module:
        """The module, holding the global model now in the host buffer."""
        self.flat.buffer.copy_(self.host.buffer)
        return self.flat.module


class DeviceReplica:
    """The model on the training device, apart from the host flat buffer that MPI uses."""

    def __init__(self, host: FlatModel, device: torch.device, trainable_only: bool):
        self.flat = device_copy(host, device, trainable_only, "device replica")
        self.global_copy = torch.empty_like(self.flat.buffer)
        self.host = host

    @property
    def on_gpu(self) -> bool:
        """Whether the replica lives in GPU memory (its peak is then reported per round)."""
        return self.flat.buffer.device.type == "cuda"

    def peak_bytes(self) -> int:
        """The most GPU memory this process's tensors have held on the replica's GPU (torch's caching allocator).

        Read from the allocator's nested statistics for this device: ``torch.cuda.max_memory_allocated``
        flattens every statistic first, which cost about 0.5 ms per call on an H100 machine, once per
        client update (2026-11-27)."""
        stats = torch.cuda.memory_stats_as_nested_dict(self.flat.buffer.device)
        return int(stats.get("allocated_bytes", {}).get("all", {}).get("peak", 0))

    def load_global(self) -> None:
        """The global model just arrived in the host buffer: one host-to-device copy."""
        self.global_copy.copy_(self.host.buffer, non_blocking=True)

    def reset(self) -> None:
        """Start a logical client from the global model (device to device)."""
        self.flat.buffer.copy_(self.global_copy)
        self.flat.reset_local_state()

    def global_view(self, chunk: Chunk) -> torch.Tensor:
        """The device copy of the global model's ``chunk``, typed."""
        return self.global_copy[chunk.offset:chunk.offset + chunk.nbytes].view(DTYPES[chunk.dtype])

    def to_host(self) -> None:
        """The trained weights into the host buffer, for encoding and sending (one device-to-host copy)."""
        self.host.buffer.copy_(self.flat.buffer)


class GpuEnergy:
    """NVML's energy counter of one GPU (``nvmlDeviceGetTotalEnergyConsumption``: millijoules since the driver
    loaded; Volta and newer), read through NVIDIA's own bindings (``nvidia-ml-py``, the ``energy`` extra). Where
    there is no counter, ``why`` says why and ``joules`` is None: the run records no energy rather than an
    estimate."""

    def __init__(self, device: torch.device):
        self.handle: object | None = None
        self.why = ""
        try:
            import pynvml
        except ImportError:
            self.why = "nvidia-ml-py is not installed (pip install 'mpifl[energy]')"
            return
        try:
            pynvml.nvmlInit()
            self.handle = _nvml_handle(pynvml, device.index or 0)
            pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle)
        except pynvml.NVMLError as err:
            self.handle, self.why = None, f"NVML has no energy counter here ({err})"

    def joules(self) -> float | None:
        """The counter now, in joules; None without one."""
        if self.handle is None:
            return None
        import pynvml

        return pynvml.nvmlDeviceGetTotalEnergyConsumption(self.handle) / 1000.0


def _nvml_handle(pynvml: object, cuda_index: int) -> object:
    """NVML's handle of CUDA device ``cuda_index``: NVML numbers every GPU of the node, CUDA only the visible ones
    (CUDA_VISIBLE_DEVICES: indices or UUIDs)."""
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if cuda_index < len(visible):
        chosen = visible[cuda_index]
        if not chosen.isdigit():
            return pynvml.nvmlDeviceGetHandleByUUID(chosen)  # type: ignore[attr-defined]
        cuda_index = int(chosen)
    return pynvml.nvmlDeviceGetHandleByIndex(cuda_index)  # type: ignore[attr-defined]
