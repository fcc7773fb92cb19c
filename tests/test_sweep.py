"""``mpifl sweep``: a grid of one config's runs in one MPI job, each exactly the run ``mpifl run`` would make."""
from __future__ import annotations

import signal

import numpy as np
import pytest
import yaml
from conftest import ROOT, finish, mpifl_here, rounds_logged, run_mpi, spawn_mpi, wait_for, write_config
from reference import reference_run

from mpifl.cli.compare import compare_runs
from mpifl.cli.grid import grid_points, point_dir, run_dir_name
from mpifl.config import ConfigError, load_config
from mpifl.storage.hdf5 import load_tensors

CONFIG = """
seed: 3
rounds: 2
clients: {num_clients: 6, per_round: 4}
data: {dataset: digits, partition: dirichlet, alpha: 0.5}
model: {name: "fl_helpers:tiny_mlp"}
train: {trainer: "fl_helpers:NoiseTrainer", lr: 0.01}
eval: {every: 0}
output: {progress: false}
"""


def overrides_of(grid):
    return [point.overrides for point in grid_points(grid)]


def test_the_grid_is_every_combination_with_the_last_axis_changing_fastest():
    assert overrides_of(["seed=0,1", "strategy.name=fedavg,fedprox"]) == [
        ["seed=0", "strategy.name=fedavg"], ["seed=0", "strategy.name=fedprox"],
        ["seed=1", "strategy.name=fedavg"], ["seed=1", "strategy.name=fedprox"]]
    assert overrides_of([]) == [[]]  # no axis: the config's one run


ATTACKS = """
clean: {}                       # the config as it is
sign_flip:
  faults: [{kind: scale, clients: [0, 1], factor: -5}]
prox: {train: {prox_mu: 0.01, lr: 0.02}, strategy.name: median, clock.mode: 'off'}
"""


def test_a_variants_axis_sets_each_variants_keys_and_names_the_run_by_the_variant(tmp_path):
    """``NAME=@FILE``: one grid value sets several keys, or a whole list, which a comma-split value cannot."""
    (tmp_path / "attacks.yaml").write_text(ATTACKS)
    points = grid_points([f"attack=@{tmp_path / 'attacks.yaml'}", "seed=0,1"])
    assert [point.labels for point in points] == [
        ["attack=clean", "seed=0"], ["attack=clean", "seed=1"], ["attack=sign_flip", "seed=0"],
        ["attack=sign_flip", "seed=1"], ["attack=prox", "seed=0"], ["attack=prox", "seed=1"]]  # the file's order
    assert points[2].overrides == ["faults=[{kind: scale, clients: [0, 1], factor: -5}]", "seed=0"]
    # a nested mapping sets its keys one by one (the config's other train keys stay); other values replace whole
    assert points[4].overrides == ["train.prox_mu=0.01", "train.lr=0.02", "strategy.name=median",
                                   "clock.mode='off'", "seed=0"]
    assert points[4].describe() == ("attack=prox (train.prox_mu=0.01 train.lr=0.02 strategy.name=median "
                                    "clock.mode='off') seed=0")
    assert run_dir_name(points[2].labels) == "attack=sign_flip,seed=0"
    # each override reads back as the value the file holds
    base = {"train": {"batch_size": 7}}
    cfg = load_config(None, data=base, overrides=points[4].overrides)
    assert (cfg.train.prox_mu, cfg.train.lr, cfg.train.batch_size, cfg.clock.mode) == (0.01, 0.02, 7, "off")
    attacked = load_config(None, overrides=["clients.num_clients=4", *points[2].overrides])
    assert [(f.kind, f.clients, f.factor) for f in attacked.faults] == [("scale", [0, 1], -5.0)]
    assert points[0].overrides == ["seed=0"]


@pytest.mark.parametrize("text,message", [
    (None, "the variants file '.*attacks.yaml' does not exist"),
    ("[a, b]", "the top level must map each variant's name to the keys it sets"),
    ("a: [1]", "variant 'a' must be a mapping of config keys"),
    ("a: {b: 1\n", "not valid YAML"),
    ("a: {1: 2}", "variant 'a': a key must be a name, not 1"),
    ("'a,b': {seed: 1}", "a variant's name must be a word without ',' or '=', not 'a,b'"),
    ("true: {seed: 1}", "not True .YAML reads true, false, null and such unquoted as values: quote the name"),
    ("a: {}\nb: {seed: 1}\na: {seed: 2}", "found the key 'a' twice, first on line 1"),
    ("", "holds no variant: write one entry per grid value"),
    ("_common: &c {train: {lr: 0.1}}\n", "holds no variant"),  # an anchor's holder is no variant

])
def test_a_malformed_variants_file_is_a_config_error_naming_the_file_and_the_variant(tmp_path, text, message):
    if text is not None:
        (tmp_path / "attacks.yaml").write_text(text)
    with pytest.raises(ConfigError, match=message) as err:
        grid_points([f"attack=@{tmp_path / 'attacks.yaml'}"])
    assert str(err.value).startswith("--grid 'attack=@")


def test_an_underscored_entry_holds_a_yaml_anchor_and_a_variants_axis_may_not_be_named_like_a_config_key(tmp_path):
    (tmp_path / "v.yaml").write_text("_slow: &slow {train: {lr: 0.01}}\nplain: *slow\n"
                                     "prox: {<<: *slow, train.prox_mu: 0.01}\n")
    points = grid_points([f"method=@{tmp_path / 'v.yaml'}"])
    assert [(p.labels, p.overrides) for p in points] == [
        (["method=plain"], ["train.lr=0.01"]), (["method=prox"], ["train.lr=0.01", "train.prox_mu=0.01"])]
    for name in ("seed", "strategy.name", "faults"):
        with pytest.raises(ConfigError, match=rf"'{name}' is a config key, and a variants axis's name goes into"):
            grid_points([f"{name}=@{tmp_path / 'v.yaml'}"])
    assert len(grid_points([f"strategy=@{tmp_path / 'v.yaml'}"])) == 2  # a section's name is no key: allowed


def test_two_axes_that_set_one_key_are_refused_since_the_directory_would_name_a_value_not_used(tmp_path):
    (tmp_path / "lr.yaml").write_text("fast: {train: {lr: 0.2}}\nslow: {train: {lr: 0.01, momentum: 0.5}}\n")
    (tmp_path / "f.yaml").write_text("clean: {faults: []}\n")
    for grid, key in ((["train.lr=0.05,0.1", f"v=@{tmp_path / 'lr.yaml'}"], "train.lr"),
                      ([f"v=@{tmp_path / 'lr.yaml'}", "train=@" + str(tmp_path / "lr.yaml")], "train.lr"),
                      (["faults.0.factor=1,-1", f"a=@{tmp_path / 'f.yaml'}"], "faults")):
        with pytest.raises(ConfigError, match=rf"both set {key}: a run would take the later axis's value"):
            grid_points(grid)
    with pytest.raises(ConfigError, match="no file follows '@'"):
        grid_points(["v=@"])
    assert len(grid_points([f"v=@{tmp_path / 'lr.yaml'}", "train.batch_size=8,16"])) == 4  # other keys go together


def test_a_dry_run_lists_every_run_and_checks_each_config_without_mpi(tmp_path, capsys):
    """Before a grid goes to a batch queue: each point's directory and keys, each config checked as ``mpifl
    validate`` checks one, a warning all points share said once, and exit status 2 when a point is refused."""
    from mpifl.cli import main

    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    (tmp_path / "strategies.yaml").write_text("plain: {}\nrobust: {strategy: {name: krum, byzantine_clients: 1}}\n"
                                              "typo: {strategy.nmae: fedavg}\n")
    runs = tmp_path / "runs"
    (runs / "s=plain,seed=1").mkdir(parents=True)
    (runs / "s=plain,seed=1" / "metrics.jsonl").write_text("")  # a run there already: refused without --resume
    status = main(["sweep", str(cfg), "faults=[{kind: scale, clients: [0], factor: 1}]", "--grid",
                   f"s=@{tmp_path / 'strategies.yaml'}", "--grid", "seed=1,2", "--runs-dir", str(runs), "--dry-run"])
    out = capsys.readouterr().out
    assert status == 2
    assert out.startswith("warning (every run): faults[0].factor: a scale fault with factor 1 changes nothing")
    assert out.count("factor 1 changes nothing") == 1
    assert (f"run 1 of 6: s=plain seed=1 -> {runs / 's=plain,seed=1'}\n  config error: run directory "
            f"'{runs / 's=plain,seed=1'}' already holds a run that recorded no round") in out and "--runs-dir" in out
    assert (f"run 3 of 6: s=robust (strategy.name=krum strategy.byzantine_clients=1) seed=1 -> "
            f"{runs / 's=robust,seed=1'}\n  valid (2 rounds, 4 of 6 clients per round") in out
    assert "; faults[0]: scale (factor 1) on client 0, rounds 1-end)" in out  # what validate says of faults
    assert "\n  warning: strategy.byzantine_clients: Krum's guarantee needs n >= 2f + 3" in out
    assert "run 5 of 6: s=typo (strategy.nmae=fedavg) seed=1" in out and "unknown key 'strategy.nmae'" in out
    assert out.rstrip().endswith("mpifl sweep --dry-run: 6 runs, run 1,5-6 refused")
    assert sorted(p.name for p in runs.iterdir()) == ["s=plain,seed=1"]  # nothing written


@pytest.mark.parametrize("axes,message", [
    (["seed"], "expected KEY=VALUE1,VALUE2"),
    (["seed=0,,1"], "an empty value"),
    (["seed=0", "seed=1"], "names a key twice: seed"),
])
def test_a_malformed_grid_is_a_config_error_naming_the_axis(axes, message):
    with pytest.raises(ConfigError, match=message):
        grid_points(axes)


def test_the_shipped_variants_files_make_a_byzantine_study_of_the_quick_start_with_no_warning(tmp_path, capsys):
    """configs/variants/: FedAvg and the robust strategies, each with only the keys it reads, against the attacks
    of docs/how-to/faults.md, as that page runs them."""
    from mpifl.cli import main

    variants = ROOT / "configs" / "variants"
    status = main(["sweep", str(ROOT / "configs" / "quickstart.yaml"), "clients.per_round=8", "rounds=5",
                   "--grid", f"strategy=@{variants / 'robust_strategies.yaml'}",
                   "--grid", f"attack=@{variants / 'byzantine_attacks.yaml'}", "--runs-dir", str(tmp_path),
                   "--dry-run"])
    out = capsys.readouterr().out
    assert status == 0 and out.rstrip().endswith("16 runs, every config valid") and "warning" not in out, out
    assert [line.split(" -> ")[1] for line in out.splitlines() if line.startswith("run ")][:5] == [
        str(tmp_path / f"strategy=fedavg,attack={a}") for a in ("clean", "sign_flip", "noise", "label_flip")] + [
        str(tmp_path / "strategy=median,attack=clean")]


def test_a_runs_directory_is_named_by_its_grid_point_and_never_nests():
    assert run_dir_name(["seed=0", "strategy.name=fedavg"]) == "seed=0,strategy.name=fedavg"
    assert run_dir_name(["model.name=pkg/mod:Net"]) == "model.name=pkg_mod.Net"  # no ':' for --logdir_spec
    assert run_dir_name([]) == "run"
    # nothing a shell reads: typed and globbed as written
    assert run_dir_name(["model.local=['5.*']", "seed=0"]) == "model.local=5.x,seed=0"
    assert run_dir_name(['data.kwargs={a: "b c"}']) == "data.kwargs=a._b_c"


def test_two_grid_points_that_would_share_a_directory_are_refused_naming_both():
    with pytest.raises(ConfigError) as err:
        grid_points(["model.local=['5.*'],[\"5.*\"]"])
    assert ("""the points model.local=['5.*'] and model.local=["5.*"] would share the run directory """
            "'model.local=5.x'") in str(err.value)


def test_a_sweep_resumed_from_before_colons_were_replaced_finds_its_runs_under_their_old_names(tmp_path):
    point = ["strategy.name=pkg.mod:Mine", "seed=0"]
    assert point_dir(tmp_path, point) == tmp_path / "strategy.name=pkg.mod.Mine,seed=0"
    (tmp_path / "strategy.name=pkg.mod:Mine,seed=0").mkdir()
    assert point_dir(tmp_path, point) == tmp_path / "strategy.name=pkg.mod:Mine,seed=0"
    bracketed = ["model.local=['5.*']"]  # named before quotes, brackets and wildcards were left out
    assert point_dir(tmp_path, bracketed) == tmp_path / "model.local=5.x"
    (tmp_path / "model.local=['5.*']").mkdir()
    assert point_dir(tmp_path, bracketed) == tmp_path / "model.local=['5.*']"


def test_each_run_of_a_sweep_equals_the_single_process_reference_and_resume_skips_finished_runs(tmp_path, capsys):
    """The second axis is a variants file: its ``equal`` variant sets two keys, each run as that config's."""
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    (tmp_path / "w.yaml").write_text("samples: {}\nequal: {strategy: {weighting: equal}, train.lr: 0.02}\n")
    runs, grid = tmp_path / "runs", ["--grid", "seed=1,2", "--grid", f"w=@{tmp_path / 'w.yaml'}"]
    done = run_mpi(3, "sweep", str(cfg), *grid, "--runs-dir", str(runs))
    assert done.returncode == 0, done.stderr
    assert "mpifl sweep: 4 runs in" in done.stderr
    assert "run 2 of 4: seed=1 w=equal (strategy.weighting=equal train.lr=0.02) -> " in done.stderr
    for seed in (1, 2):
        for weighting, keys in (("samples", []), ("equal", ["strategy.weighting=equal", "train.lr=0.02"])):
            got = load_tensors(runs / f"seed={seed},w={weighting}" / "model.h5")
            expected = reference_run(load_config(None, data=yaml.safe_load(CONFIG), overrides=[f"seed={seed}", *keys]))
            for name, value in expected.items():
                assert np.array_equal(got[name].numpy().view(np.int32), value.view(np.int32)), (seed, keys, name)
    # mpifl compare pools the seeds of each variant into mean ± std, the lowest train loss being the best
    text, groups = compare_runs(sorted(str(p) for p in runs.iterdir()), "train_loss")
    assert [(label, [o.config["seed"] for o in members]) for label, members in groups] == [
        ("w=equal", [1, 2]), ("w=samples", [1, 2])]  # the variants' names, which no config holds
    assert ("labelled by its sweep's variants (its run directories' names); the groups differ in train.lr; and in "
            "strategy.weighting, which mpifl fills in from other keys unless set") in text
    assert all(o.best == min(o.curve.values()) for _, members in groups for o in members)
    assert "| runs (seeds pooled) | n | seeds | best (lower), mean ± std | final, mean ± std |" in text
    # before a resubmission: --dry-run --resume says each run is complete, and refuses a point whose variant changed
    from mpifl.cli import main

    assert main(["sweep", str(cfg), *grid, "--runs-dir", str(runs), "--resume", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("(complete: --resume skips it)") == 4 and out.rstrip().endswith(", every run complete")
    (tmp_path / "w.yaml").write_text("samples: {}\nequal: {strategy: {weighting: equal}, train.lr: 0.03}\n")
    assert main(["sweep", str(cfg), *grid, "--runs-dir", str(runs), "--resume", "--dry-run"]) == 2
    out = capsys.readouterr().out
    assert "config error: cannot resume from" in out and "train.lr: 0.02 in the checkpoint, 0.03 now" in out
    assert out.rstrip().endswith("4 runs, run 2,4 refused")
    (tmp_path / "w.yaml").write_text("samples: {}\nequal: {strategy: {weighting: equal}, train.lr: 0.02}\n")
    again = run_mpi(3, "sweep", str(cfg), *grid, "--runs-dir", str(runs), "--resume")
    assert again.returncode == 0, again.stderr
    assert again.stderr.count("run already complete") == 4
    assert rounds_logged(runs / "seed=1,w=samples") == [1, 2]  # not run twice
    # a finished run whose checkpoints cannot be read: the dry run refuses it as --resume would, keeping its model
    for checkpoint in (runs / "seed=2,w=equal" / "checkpoints").glob("*.h5"):
        checkpoint.write_bytes(b"garbage")
    assert main(["sweep", str(cfg), *grid, "--runs-dir", str(runs), "--resume", "--dry-run"]) == 2
    assert "holds a finished run (model.h5) but no checkpoint that a run of 2 rounds can go on from" in \
        capsys.readouterr().out


def test_a_bad_grid_point_fails_alone_and_the_others_run(tmp_path):
    cfg = write_config(tmp_path / "c.yaml", CONFIG)
    done = run_mpi(3, "sweep", str(cfg), "--grid", "strategy.name=fedavg,nosuch", "--runs-dir", str(tmp_path / "runs"))
    assert done.returncode == 2
    assert "config error in run 2 (strategy.name=nosuch), said above" in done.stderr
    assert done.stderr.count("[rank 0] mpifl: config error: strategy.name") == 1, done.stderr
    assert rounds_logged(tmp_path / "runs" / "strategy.name=fedavg") == [1, 2]
    assert f"mpifl sweep: 2 runs in {tmp_path / 'runs'}: 1 finished, 1 failed (run 2; the config of run 2 was " \
        "refused, said above)" in done.stderr


def test_a_grid_point_whose_split_cannot_be_made_is_refused_alone_and_the_others_run(tmp_path):
    """Only the ranks read the data, so the split is refused after MPI has started: every rank leaves that run
    with its one line and a config error's status (no abort, which would end the whole sweep), and the sweep goes
    on to the next point."""
    cfg = write_config(tmp_path / "c.yaml", CONFIG.replace("partition: dirichlet, alpha: 0.5", "partition: labels"))
    done = run_mpi(3, "sweep", str(cfg), "--grid", "data.classes_per_client=11,2", "--runs-dir",
                   str(tmp_path / "runs"))
    assert done.returncode == 2 and "MPI_Abort" not in done.stderr
    assert done.stderr.count("[rank 0] mpifl: cannot partition the data: data.classes_per_client: 11 classes per "
                             "client, but the training labels have only 10 classes") == 1, done.stderr
    assert "config error in run 1 (data.classes_per_client=11), said above" in done.stderr
    assert rounds_logged(tmp_path / "runs" / "data.classes_per_client=2") == [1, 2]
    assert not (tmp_path / "runs" / "data.classes_per_client=11" / "metrics.jsonl").exists()


def test_the_sweeps_last_line_says_how_many_runs_finished_and_when_none_started():
    """A grid key misspelt fails every run alike: the last line says none started, not "2 runs in DIR"."""
    from mpifl.cli.sweep import sweep_summary

    assert sweep_summary(2, "runs", {}) == "mpifl sweep: 2 runs in runs"
    assert sweep_summary(2, "runs", {1: 2, 2: 2}).startswith("mpifl sweep: none of the 2 runs started: every run "
                                                             "was refused (said above)")
    assert "or run directories that already hold runs (add --resume)" in sweep_summary(2, "runs", {1: 2, 2: 2})
    assert sweep_summary(3, "runs", {1: 1, 3: 2}) == ("mpifl sweep: 3 runs in runs: 1 finished, 2 failed (run 1,3; "
                                                      "the config of run 3 was refused, said above)")


def test_a_sweep_stopped_by_sigterm_exits_3_and_resume_finishes_every_run_as_uninterrupted(tmp_path):
    """SIGTERM (a batch system's walltime) stops the running point at a round's end, as it stops ``mpifl run``,
    and ends the sweep; ``--resume`` then skips the finished point, resumes the stopped one and starts the rest,
    each ending bitwise as the single-process reference."""
    cfg = write_config(tmp_path / "c.yaml", CONFIG.replace("rounds: 2", "rounds: 4") + "checkpoint: {every: 1}\n")
    runs, grid = tmp_path / "runs", ["--grid", "seed=1,2,3"]
    proc = spawn_mpi(3, "sweep", str(cfg), *grid, "--runs-dir", str(runs), env={"FL_HELPERS_SLEEP": "0.3"})
    second = runs / "seed=2"
    wait_for(lambda: (second / "metrics.jsonl").exists() and len(rounds_logged(second)) >= 1, proc, "seed 2, round 1")
    proc.send_signal(signal.SIGTERM)  # mpiexec forwards it to every rank
    code, err = finish(proc)
    assert code == 3, err
    assert "stopped by a signal in run 2 of 3" in err and not (runs / "seed=3").exists()
    # mpifl status on the sweep's folder: each run, then how many are complete
    said = mpifl_here("status", str(runs))
    assert said.returncode == 1 and said.stdout.rstrip().endswith(
        f"{runs}: 1 of 2 runs complete: the sweep's own command with --resume finishes them and starts the grid points "
        "not begun, which are not counted here"), said.stdout
    assert "not complete: stopped on request after round" in said.stdout
    done = run_mpi(3, "sweep", str(cfg), *grid, "--runs-dir", str(runs), "--resume")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("run already complete") == 1
    assert mpifl_here("status", str(runs)).stdout.rstrip().endswith("3 of 3 runs complete")
    for seed in (1, 2, 3):
        assert rounds_logged(runs / f"seed={seed}") == [1, 2, 3, 4]
        got = load_tensors(runs / f"seed={seed}" / "model.h5")
        expected = reference_run(load_config(None, data=yaml.safe_load(cfg.read_text()), overrides=[f"seed={seed}"]))
        for name, value in expected.items():
            assert np.array_equal(got[name].numpy().view(np.int32), value.view(np.int32)), (seed, name)


def test_a_rank_that_leaves_a_sweep_with_0_past_pythons_cleanup_fails_the_sweep_naming_it(tmp_path):
    """Each rank of a sweep runs under the supervisor ``mpifl run``'s ranks have (mpifl.cli.supervisor): a rank that
    leaves through C's ``_exit(0)`` in the first grid point made MPICH end the job with status 0, the later points
    never run, and a batch script took the sweep for a success."""
    faults = "faults: [{kind: exit, code: 0, via: c, ranks: [1], rounds: [2]}]\n"
    cfg = write_config(tmp_path / "c.yaml", CONFIG + faults)
    done = run_mpi(3, "sweep", str(cfg), "--grid", "seed=1,2", "--runs-dir", str(tmp_path / "runs"),
                   fresh=True)  # its own mpiexec: the supervisor runs only where mpifl owns the world
    assert done.returncode != 0
    assert "[rank 1] mpifl: this rank (PID" in done.stderr, done.stderr[-3000:]
    assert "left with exit status 0 before mpifl sweep finished" in done.stderr
    assert not (tmp_path / "runs" / "seed=2").exists()
