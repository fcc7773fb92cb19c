"""``mpifl inspect`` and ``mpifl export``: checkpoints for people and for other tools."""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import h5py
import yaml

from mpifl.errors import CheckpointError
from mpifl.storage.checkpointer import kept_per_client, residual_files, residuals_dir, withheld_ranks
from mpifl.storage.comparison import Result, Section, compare, digest, model_group, vector_clients, vector_files
from mpifl.storage.hdf5 import Checkpoint
from mpifl.storage.integrity import GROUP as INTEGRITY
from mpifl.storage.integrity import RecordedChecksums, recorded_checksums
from mpifl.units import MIB, range_list
from mpifl.wire.spec import CONTROL, is_control

if TYPE_CHECKING:
    import torch

    from mpifl.config import Config

Entry = tuple[str, tuple, str, int]  # a checkpoint tensor's name, shape, dtype and bytes (Checkpoint.entries)


def inspect(path: str, verify: bool = False) -> int:
    """Print a checkpoint's round, tensors, config and versions; with ``verify``, check every checksum first, and
    that every file of the clients' vectors it goes with opens. A run directory stands for its result (its
    ``model.h5``, else its newest checkpoint), as in ``mpifl diff``."""
    path = str(Result.at(path).model) if Path(path).is_dir() else path
    with Checkpoint(path) as ckpt:
        if verify:  # a failure raises CheckpointError: exit 2 with the tensor named
            checked = ckpt.verify()
            print(f"{ckpt.path}: verified: {checked} chunks match their CRC32 checksums" if checked else
                  f"{ckpt.path}: readable, but written before mpifl checkpoints carried checksums: nothing to verify")
            opened = _verify_vector_files(ckpt)
            if opened:
                print(f"{residuals_dir(ckpt.path)}: its {opened} file(s) of clients' vectors open (they carry no "
                      "checksums of their own)")
        attrs = dict(ckpt.file.attrs)
        entries = ckpt.entries()
        print(f"{ckpt.path}: round {ckpt.round}, spec {ckpt.spec_hash}, created {attrs.get('created', '?')}")
        print("versions: " + ", ".join(f"{k[8:]} {v}" for k, v in sorted(attrs.items()) if k.startswith("version_")))
        _print_tensors(entries)
        state = list(ckpt.file["server_state"]) if "server_state" in ckpt.file else []
        print(f"server state: {', '.join(state) or '(none)'}")
        files = residual_files(ckpt)
        if files is not None:  # what a resume needs beside this file
            silent = withheld_ranks(ckpt)
            lacks = f", none of rank(s) {silent} (silent as it was saved)" if silent else ""
            missing = sum(not f.is_file() for f in files)
            gone = "" if not missing else ", all missing" if missing == len(files) else f", {missing} missing"
            print(f"per client: {kept_per_client(ckpt)}, kept by the client ranks, in {residuals_dir(ckpt.path)} "
                  f"({len(files)} rank file(s){gone}{lacks})")
            own = own_models_hint(ckpt) if not missing else None
            if own:
                print(own)
        print(f"metrics: {len(ckpt.metrics())} rounds")
        print(f"digest: {digest(Result.at(path))} (SHA-256 of its tensors and clients' vectors; mpifl diff compares "
              "two results)")
        print("config:\n  " + ckpt.config.strip().replace("\n", "\n  "))
    return 0


def diff(a: str, b: str) -> int:
    """Print whether two results hold the same bits (``mpifl.storage.comparison``); 0 when they do, else 1. Both
    are read once, side by side, for the comparison and the digests, and each side's bytes are checked against its
    checksums as they pass (a corrupt file is no result to compare: exit 2, naming what changed, before anything is
    printed)."""
    sides = [(label, Result.at(path), path) for label, path in (("a", a), ("b", b))]
    recorded = [recorded_checksums_of(result.model) for _, result, _ in sides]
    try:
        found = compare(sides[0][1], sides[1][1], (recorded[0], recorded[1]))
    except CheckpointError as err:  # a side's bytes failed their checksums, or could not be read
        raise CheckpointError(f"diff: {err}; not compared") from None
    except ValueError as err:  # not results of one config
        raise CheckpointError(f"diff: {err}") from None
    verified = [f"checksums verified ({r.chunks} chunks)" if r else "no checksums to verify" for r in recorded]
    described = [_described(result.model) for _, result, _ in sides]
    for (label, result, path), checked, code, (round_, spec, _, _) in zip(sides, verified, found.digests, described,
                                                                          strict=True):
        vectors = f" and the clients' vectors of {result.vectors.name}" if result.vectors else ""
        what = f" (round {round_}, spec {spec})" if round_ is not None else ""
        print(f"{label}: {path}: {result.model.name}{what}{vectors}; digest {code}; {checked}")
    for line in setup_differences(described[0], described[1]):
        print(line)
    controls = described[0][3]
    of_them = f" ({controls} of them the server control {CONTROL}.*, not the model's)" if controls else ""
    _print_section(f"model: {found.model.compared} tensors in both{of_them}, {found.model.elements:,} elements",
                   found.model)
    if found.server_state.compared or not found.server_state.equal:
        _print_section(f"server state: {found.server_state.compared} vectors in both", found.server_state)
    first, second = sides[0][1], sides[1][1]
    one_side = None if found.clients is not None or not (first.vectors or second.vectors) else \
        ("a" if first.vectors else "b")
    if found.clients is None:
        print("clients' vectors: not compared (kept by " + (f"{one_side} only" if one_side else "neither") + ")")
    else:
        _print_section(f"clients' vectors: {found.clients.compared} clients in both", found.clients)
    if not found.bitwise_equal:
        print("they differ")
    elif one_side:  # equal as far as compared: the last line says how far
        print(f"bitwise equal as far as compared: the clients' vectors were not, {one_side} alone keeping them (a "
              "model.h5 away from its run directory has none: diff two run directories, or two checkpoints)")
    else:
        print("bitwise equal")
    return 0 if found.bitwise_equal else 1


Described = tuple[int | None, str, str, int]  # a result's round, spec hash, config YAML, server-control tensors


def _described(path: Path) -> Described:
    """What ``diff`` says of a side beside its bits: its round, its model's layout (spec hash), its config, and how
    many of its tensors are the server control section; for an HDF5 file of tensors that is no mpifl checkpoint
    (``model_group`` reads those too), the count alone."""
    try:
        with Checkpoint(path) as ckpt:
            controls = sum(is_control(name) for name, *_ in ckpt.entries())
            return ckpt.round, ckpt.spec_hash, ckpt.config, controls
    except CheckpointError:
        with model_group(path) as group:
            return None, "", "", sum(is_control(name) for name in group)


def setup_differences(a: Described, b: Described, shown: int = 12) -> list[str]:
    """Lines saying how the two sides' rounds, model layouts and configs differ (nothing where they agree): what
    a differing result is read against. Config keys are compared flattened (``clients.per_round``); ``name``
    and ``output.*`` change no result and are left out."""
    lines: list[str] = []
    if a[0] is None or b[0] is None:  # a side that is no checkpoint says none of these
        return lines
    if a[0] != b[0]:
        lines.append(f"rounds: a is round {a[0]}, b round {b[0]}")
    if a[1] != b[1]:
        lines.append(f"model layouts differ: spec {a[1]} against {b[1]}")
    flat = [_flattened(yaml.safe_load(side[2]) or {}) for side in (a, b)]
    keys = sorted(k for k in set(flat[0]) | set(flat[1]) if flat[0].get(k, "(unset)") != flat[1].get(k, "(unset)")
                  and k != "name" and not k.startswith("output."))
    if keys:
        pairs = [f"{k} {flat[0].get(k, '(unset)')!r} -> {flat[1].get(k, '(unset)')!r}" for k in keys[:shown]]
        more = f"; {len(keys) - shown} more" if len(keys) > shown else ""
        lines.append(f"configs differ in {len(keys)} key(s): " + "; ".join(pairs) + more)
    return lines


def _flattened(config: dict, prefix: str = "") -> dict[str, object]:
    """A nested config as dotted keys to leaf values."""
    out: dict[str, object] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(_flattened(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _verify_vector_files(ckpt: Checkpoint) -> int:
    """How many files of clients' vectors the checkpoint lists, each found and opened by ``vector_clients``
    (CheckpointError naming those missing, or the first unreadable)."""
    if residual_files(ckpt) is None:
        return 0
    checkpoint = residuals_dir(ckpt.path).with_suffix(".h5")  # model.h5's are its final checkpoint's
    vector_clients(checkpoint)
    return len(vector_files(checkpoint))


def recorded_checksums_of(path: Path) -> RecordedChecksums | None:
    """``path``'s CRC32s, its metadata, spec and metrics checked (what ``Checkpoint.verify`` checks before the
    tensors); None for a file without an integrity record (not written by mpifl's checkpointer)."""
    with model_group(path) as group:  # CheckpointError naming a file that is no checkpoint
        recorded = INTEGRITY in group.file
    if not recorded:
        return None
    with Checkpoint(path) as ckpt:
        try:
            ckpt.metrics_readable()
            return recorded_checksums(ckpt)
        except CheckpointError as err:
            raise CheckpointError(f"diff: {err}; not compared") from None


def _print_section(heading: str, part: Section) -> None:
    """One part of ``diff``'s report: its verdict, each difference, and what only one side has."""
    verdict = f"{len(part.differences)} of them differ" if part.differences else "bitwise equal"
    print(f"{heading}: {verdict}")
    for change in part.differences:
        print(f"  {change.line()}")
    for side, names in (("a", part.only_in_a), ("b", part.only_in_b)):
        if names:
            print(f"  only in {side}: {', '.join(names)}")


def own_models_hint(ckpt: Checkpoint) -> str | None:
    """How to get one client's own model out (``mpifl export --client``), where the checkpoint's run kept models
    of the clients' own that export can join: the global model alone is not what such a client uses."""
    from mpifl.config import ConfigError, load_config

    try:
        cfg = load_config(None, data=yaml.safe_load(ckpt.config) or {})
        state = cfg.client_state()
    except (ConfigError, yaml.YAMLError):
        return None
    if state is None or not (state.local or state.personal):
        return None
    what = "personal model (Ditto)" if state.personal else "model (the global tensors with its model.local ones)"
    have = vector_clients(residuals_dir(ckpt.path).with_suffix(".h5"))
    if not have:
        return None
    ids = range_list(have)
    return (f"each client's own {what}: mpifl export {ckpt.path} OUT --client ID (ID one of {ids}, the "
            f"{len(have)} of {cfg.clients.num_clients} clients that have trained)")


def _print_tensors(entries: list[Entry]) -> None:
    """The model's tensors (count, MiB, one line each), then the ``CONTROL`` section apart: SCAFFOLD's server c (or
    a plug-in's summed streams) is the server's state, which ``/model`` holds beside the weights and export leaves
    out, so counting it with the model would double a SCAFFOLD model's tensors."""
    model = [e for e in entries if not is_control(e[0])]
    control = [e for e in entries if is_control(e[0])]
    width = max((len(n) for n, *_ in entries), default=4)
    extra = f" (+{len(control)} server control, {_mib(control)} MiB: SCAFFOLD's c, not the model's)" if control else ""
    print(f"tensors: {len(model)}, {_mib(model)} MiB{extra}")
    for heading, listed in (("", model), (f"server control ({CONTROL}.*; mpifl export leaves it out):", control)):
        if heading and listed:
            print(heading)
        for name, shape, dtype, nbytes in listed:
            print(f"  {name:<{width}}  {str(list(shape)):<18} {dtype:<9} {nbytes:>12,d} B")


def _mib(entries: list[Entry]) -> str:
    """The entries' bytes in MiB, as inspect prints them."""
    return f"{sum(n for *_, n in entries) / MIB:.2f}"


def umask_mode(mode: int = 0o666) -> int:
    """``mode`` less the process's umask: the permissions ``open`` gives a new file (0644 under umask 022)."""
    mask = os.umask(0)
    os.umask(mask)
    return mode & ~mask


def export(path: str, out: str, client: int | None = None) -> int:
    """Write the checkpoint's model to a safetensors file (needs the 'hf' extra); never over a checkpoint, and
    never from one whose checksums fail (``Checkpoint.verify``, as ``inspect --verify`` and resume check them):
    a flipped byte would otherwise leave mpifl as a model that loads without a word. With ``client``, the model
    that logical client uses: its Ditto personal model, or the global tensors with its own model.local ones
    (mpifl.cli.client_model)."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        raise SystemExit("mpifl export needs safetensors: pip install 'mpifl[hf]' "
                         "(or pip install safetensors)") from None
    path = str(Result.at(path).model) if Path(path).is_dir() else path  # a run directory: its result, as diff
    target = Path(out)
    if target.is_dir():
        raise CheckpointError(f"export: {out} is a folder: name the .safetensors file to write in it")
    if target.exists() and (target.resolve() == Path(path).resolve() or h5py.is_hdf5(target)):
        raise CheckpointError(f"export: {out} is an HDF5 file (the checkpoint itself?); refusing to overwrite it "
                              "with safetensors: name a .safetensors file")
    if not target.parent.is_dir():
        raise CheckpointError(f"export: folder {str(target.parent)!r} does not exist")
    with Checkpoint(path) as ckpt:
        try:  # before anything is written; the tensors are then read again, from the page cache
            ckpt.verify()
        except CheckpointError as err:
            raise CheckpointError(f"export: {err}; nothing written") from None
        meta = {"format": "pt", "mpifl_round": str(ckpt.round), "mpifl_spec_hash": ckpt.spec_hash}
        if client is None:
            tensors = model_tensors(ckpt.tensors())
        else:
            from mpifl.cli.client_model import client_tensors

            own, which = client_tensors(ckpt, client)
            tensors = model_tensors(own)
            meta.update(mpifl_client=str(client), mpifl_client_model=which)
        config = ckpt.config
    lora = _lora_config(config)
    if lora is not None:  # peft's adapter file names each tensor without its adapter ('default')
        tensors = {peft_saved_name(k): v for k, v in tensors.items()}
    tmp = target.with_name(target.name + ".tmp")
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=meta)
        os.chmod(tmp, umask_mode())  # safetensors creates it 0600: collaborators on a project file system read it too
        os.replace(tmp, target)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise CheckpointError(f"export: could not write {out}: {err}") from None
    whose = "" if client is None else f" of client {client}'s model ({meta['mpifl_client_model']})"
    print(f"wrote {len(tensors)} tensors{whose} to {out}")
    tokenizer = run_tokenizer(Path(path))
    _write_transformers_config(config, target.parent, tokenizer)
    if lora is not None:
        _write_adapter_config(lora, target.parent)
    if tokenizer is not None:
        _write_tokenizer(tokenizer, target.parent)
    return 0


def model_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's own tensors (or adapters) among a checkpoint's ``/model``: without the ``CONTROL`` section
    (SCAFFOLD's server c, a plug-in's summed streams), which is the server's and which a loader of the export
    would refuse as unexpected keys. Other server state (FedDyn's h, server optimizer moments, a plug-in
    strategy's vectors) lives under ``/server_state``, which export never reads."""
    return {name: t for name, t in tensors.items() if not is_control(name)}


def run_tokenizer(checkpoint: Path) -> Path | None:
    """The tokenizer.json of the run a checkpoint belongs to (``<run dir>/model.h5`` or
    ``<run dir>/checkpoints/ckpt-*.h5``), if the run kept one (a text dataset's)."""
    from mpifl.storage.rundir import TOKENIZER

    for folder in (checkpoint.parent, checkpoint.parent.parent):
        if (folder / TOKENIZER).is_file():
            return folder / TOKENIZER
    return None


def _write_tokenizer(source: Path, folder: Path) -> None:
    """Beside the weights, the run's tokenizer as transformers saves a fast tokenizer (tokenizer.json,
    tokenizer_config.json, special_tokens_map.json), so ``AutoTokenizer.from_pretrained(folder)`` gives the token ids
    the model was trained on."""
    from transformers import PreTrainedTokenizerFast

    from mpifl.learning.text import EOS

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(source), eos_token=EOS, bos_token=EOS)  # as config.json
    tokenizer.save_pretrained(str(folder))
    print(f"wrote the run's tokenizer ({source}) to {folder}: tokenizer.json, tokenizer_config.json")


LORA_ADAPTER = "default"  # the adapter name peft gives the one adapter mpifl adds, inside every adapter tensor's name


def peft_saved_name(name: str) -> str:
    """A LoRA tensor's name as peft's ``save_pretrained`` writes it: without the adapter name
    (``...q_proj.lora_A.default.weight`` is saved as ``...q_proj.lora_A.weight``)."""
    return name.replace(f".{LORA_ADAPTER}.", ".") if ".lora_" in name else name


def _model_config(config_yaml: str) -> Config | None:
    """The checkpoint's config, when its model is a transformers one (only the model section: nothing else is
    needed to describe it), else None."""
    from mpifl.config import load_config

    raw = yaml.safe_load(config_yaml) or {}
    if (raw.get("model") or {}).get("name") != "transformers":
        return None
    return load_config(None, data={"model": raw["model"], "train": {"trainer": "none"}, "eval": {"every": 0}})


def _lora_config(config_yaml: str) -> Config | None:
    """The checkpoint's config when it holds a transformers model's LoRA adapters, else None."""
    cfg = _model_config(config_yaml)
    return cfg if cfg is not None and cfg.model.lora.r else None


def _write_adapter_config(cfg: Config, folder: Path) -> None:
    """Beside a LoRA run's adapters, the adapter_config.json that peft's ``LoraConfig.save_pretrained`` writes, so
    that ``PeftModel.from_pretrained(base, folder)`` loads them onto the base model that config.json describes."""
    from mpifl.learning.hf import lora_config

    lora = lora_config(cfg.model.lora)
    lora.base_model_name_or_path = cfg.model.transformers.path  # a local folder where the run had one, else unknown
    lora.save_pretrained(str(folder))
    print(f"wrote {folder / 'adapter_config.json'}")


def _write_transformers_config(config_yaml: str, folder: Path, tokenizer: Path | None) -> None:
    """The transformers config.json beside the weights. For a whole model the folder then loads with
    ``model.transformers.path`` + ``pretrained: true`` (and with transformers' ``from_pretrained``); beside LoRA
    adapters it describes the base model they adapt (built from it, the adapters load with peft). With the run's
    ``tokenizer``, its special-token ids replace the architecture's, which ``generate()`` would otherwise stop on
    (or never meet)."""
    cfg = _model_config(config_yaml)
    if cfg is None:
        return
    trainable_only = cfg.model.trainable and cfg.model.exchange == "trainable"
    if trainable_only:
        return  # a checkpoint of its trainable tensors only: not a model to load
    from mpifl.learning.hf import transformers_config
    from mpifl.learning.text import load_tokenizer, special_token_ids

    hf_config = transformers_config(cfg.model)
    if tokenizer is not None:
        hf_config.update(special_token_ids(load_tokenizer(str(tokenizer)), hf_config.pad_token_id is not None))
    hf_config.save_pretrained(folder)
    print(f"wrote {folder / 'config.json'}")
