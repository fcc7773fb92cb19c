"""A scale model of one synchronous round: its time from per-byte costs, for any model size and client count.

Model-only exchange of S bytes (E elements) with N participants, one per client rank:

- point-to-point (mpifl's transport): the server sends N x S and receives N x S; it folds N x E
  elements as chunks arrive. Dispatch is bound by the server's link, the return by its link or
  its fold, whichever is slower, or by both added when receiving uses the server's own cores
  (shared memory: MPICH's single-copy path has the receiver copy).
- trees (``transport.dispatch_fanout: 2`` with ``transport.reduce: chain``): the model goes down
  a pipelined binary tree (the server sends 2 x S, plus a fill of one chunk per level); every
  rank sums its clients into one fp32 partial sum (one fold pass) and the sums are added
  along a pipelined chain, so the server receives one fp32 sum (4E bytes) and folds it once,
  after a fill of one chunk per rank. The busiest link carries about 2 x S out and 4E in,
  whatever N.
- out of core: the server also reads S (the current checkpoint) and writes S (the next one),
  overlapped with dispatch and with the return (reader and writer threads), so each phase
  takes the slower of the two.

Every rate is an input (``Rates``): ``POLARIS`` holds published figures for an ALCF
Polaris node, with their sources; ``profiling/scale_check.py`` measures this machine's and
checks the model's growth in N against runs at 3 to 17 ranks. ``mpifl plan --time`` prints
the model for a config.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

GB = 1e9


@dataclass(frozen=True)
class Rates:
    """Per-byte and per-element costs of the steps of a round; bytes or elements per second."""

    name: str
    link: float  # bytes/s one rank sends or receives (a node's network injection, or MPI within a node)
    fold: float  # fp32 elements/s the server folds into its fp32 accumulator (acc += w * x), all its cores
    fold_narrow: float  # the same for bf16/fp16 updates, widened into fp32 first
    disk_read: float  # bytes/s reading the out-of-core checkpoint
    disk_write: float  # bytes/s writing the next one
    node_memory: float  # bytes of memory per node
    receive_uses_server_core: bool = False  # receiving and folding share the server's cores: their times add
    sources: tuple[str, ...] = ()


# ALCF Polaris (HPE Apollo 6500 Gen10+), published figures and stated assumptions:
POLARIS = Rates(
    name="Polaris node",
    link=25 * GB,  # one Slingshot-11 NIC: 200 Gb/s (each node has two; one rank uses one)
    fold=10e9,  # memory-bound: 12 bytes per fp32 element folded, ~60% of 204.8 GiB/s on 32 cores, rounded down
    fold_narrow=12e9,  # 10 bytes per bf16 element folded, same bandwidth share
    disk_read=6 * GB,  # node-local 2 x 1.6 TB SSD in RAID0 (assumed rates: not published)
    disk_write=4 * GB,
    node_memory=512 * 2**30,
    sources=("ALCF Polaris machine overview (docs.alcf.anl.gov/polaris/hardware-overview/machine-overview): "
             "per node one 32-core AMD EPYC 7543P, 512 GiB DDR4 on 8 channels rated 204.8 GiB/s, four A100, "
             "two 1.6 TB local SSDs in RAID0, two Slingshot 11 adapters",
             "HPE Slingshot 11: 200 Gb/s per adapter",
             "ALCF data storage (docs.alcf.anl.gov/data-management/filesystem-and-storage/data-storage): Grand and "
             "Eagle Lustre, 650 GB/s aggregate each (a node is still bound by its own adapter)"),
)

LUSTRE = replace(POLARIS, name="Polaris node, checkpoint on Lustre (Grand)", disk_read=10 * GB, disk_write=10 * GB,
                 sources=POLARIS.sources + ("assumed: a striped file reaches 10 GB/s from one node, below its "
                                            "25 GB/s adapter and the file system's 650 GB/s",))


@dataclass(frozen=True)
class Estimate:
    """A round's predicted time, split as mpifl's metrics split it, and the server's traffic."""

    dispatch: float
    gather: float  # receiving the updates and folding them (metrics: return + aggregate)
    total: float
    server_out: float  # bytes the server sends
    server_in: float  # bytes the server receives


def round_estimate(model_bytes: float, width: int, clients: int, rates: Rates, *, tree: bool = False,
                   out_of_core: bool = False, chunk_bytes: float = 16 * 2**20) -> Estimate:
    """The predicted synchronous round for ``clients`` participants of a ``model_bytes`` model of ``width``-byte
    elements, sent in ``chunk_bytes`` chunks."""
    elements = model_bytes / width
    fold_rate = rates.fold if width >= 4 else rates.fold_narrow
    chunk = chunk_bytes / rates.link
    if tree:
        levels = math.ceil(math.log2(clients + 1)) if clients else 0
        out, into = min(2, clients) * model_bytes, 4 * elements if clients else 0.0
        dispatch_fill = levels * chunk
        # each rank's own sum (one pass), then the chain: every hop receives, adds and sends 4E bytes
        own = elements / rates.fold
        hop = into / rates.link + elements / rates.fold if rates.receive_uses_server_core else \
            max(into / rates.link, elements / rates.fold)
        gather = own + hop + clients * chunk
    else:
        out, into = clients * model_bytes, clients * model_bytes
        dispatch_fill = chunk
        receive, fold = into / rates.link, clients * elements / fold_rate
        gather = (receive + fold if rates.receive_uses_server_core else max(receive, fold)) + chunk
    dispatch = out / rates.link
    if out_of_core:
        dispatch = max(dispatch, model_bytes / rates.disk_read)
        gather = max(gather, model_bytes / rates.disk_write)
    dispatch += dispatch_fill
    return Estimate(dispatch, gather, dispatch + gather, out, into)


def growth(estimates: dict[int, float]) -> dict[int, float]:
    """Each value divided by the one at the smallest key: how a time grows with N."""
    first = estimates[min(estimates)]
    return {n: t / first for n, t in estimates.items()}
