"""``mpifl compare``: which way is better follows the metric (a loss lower, accuracy higher), runs that differ only
in their seed pool into mean ± std, the tables come as Markdown or LaTeX, and one figure draws every group's curve
with its spread."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import mpifl_here

from mpifl.cli.compare import better_direction, compare_runs

PNG = b"\x89PNG\r\n\x1a\n"


def write_run(folder: Path, strategy: str, seed: int, rounds: int = 5) -> Path:
    """A finished run's directory: eval.loss = base / round + 0.01 x seed, accuracy = 1 - loss."""
    base = {"fedavg": 1.0, "scaffold": 0.5}[strategy]
    folder.mkdir(parents=True)
    records = [{"round": r, "train_loss": 2 * base / r,
                "eval": {"loss": base / r + 0.01 * seed, "accuracy": 1 - base / r - 0.01 * seed}}
               for r in range(1, rounds + 1)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "config.yaml").write_text(f"name: grid\nseed: {seed}\nrounds: {rounds}\n"
                                        f"strategy: {{name: {strategy}}}\noutput: {{dir: {folder}}}\n")
    return folder


@pytest.fixture
def sweep(tmp_path) -> list[str]:
    return [str(write_run(tmp_path / f"seed={s},strategy.name={n}", n, s)) for s in (0, 1, 2)
            for n in ("fedavg", "scaffold")]


def test_a_loss_a_perplexity_a_time_or_a_size_is_better_lower_and_accuracy_higher_unless_told():
    assert [better_direction(m) for m in ("eval.loss", "train_loss", "federated_eval.perplexity", "time.round",
                                          "bytes_sent", "virtual_time", "eval.accuracy",
                                          "federated_eval.personal_accuracy")] == ["lower"] * 6 + ["higher"] * 2
    assert better_direction("eval.loss", "higher") == "higher"


def test_a_privacy_loss_the_ratio_to_the_mpi_floor_and_counts_of_clamped_or_dropped_are_better_lower():
    assert [better_direction(m) for m in ("privacy.epsilon", "exchange.ratio_to_floor", "secagg.clamped",
                                          "secagg.dropped", "num_samples")] == ["lower"] * 4 + ["higher"]


def test_a_list_of_client_ids_or_a_whole_section_is_refused_as_a_metric_naming_what_to_give(sweep, tmp_path):
    run = write_run(tmp_path / "ids", "fedavg", 0)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (run / "metrics.jsonl").write_text("".join(json.dumps({**r, "participants": [0, 3, 5], "num_samples": 90}) + "\n"
                                               for r in records))
    with pytest.raises(SystemExit, match=r"--metric 'participants' lists client ids, which measure nothing"):
        compare_runs([str(run)], "participants")
    with pytest.raises(SystemExit, match=r"--metric 'eval' is a section of the records: name one of its keys "
                                         r"\(eval.accuracy, eval.loss\)"):
        compare_runs([str(run)], "eval")


def test_large_figures_such_as_bytes_are_whole_numbers_with_thousands_separated():
    from mpifl.cli.compare import mean_std

    assert mean_std([280428544.0, 280240123.0]) == "280,334,334 ± 133,234"
    assert mean_std([0.84, 0.86]) == "0.8500 ± 0.0141" and mean_std([12.5], 1) == "12.5"


def test_the_help_names_every_word_that_makes_a_metric_lower_is_better():
    from mpifl.cli import _parser
    from mpifl.cli.compare import LOWER_WORDS

    compare = _parser()._subparsers._group_actions[0].choices["compare"]  # type: ignore[union-attr]
    said = next(a.help for a in compare._actions if a.dest == "better")
    assert all(word in said for word in LOWER_WORDS), said


def test_the_best_loss_is_the_lowest_and_its_target_is_reached_from_above(sweep):
    text, _ = compare_runs(sweep[:1], "eval.loss", target=0.3)
    assert "| rounds to eval.loss <= 0.3 | best (lower) | final |" in text  # no virtual seconds without a clock
    assert "| seed=0,strategy.name=fedavg | fedavg | off | 4 | 0.2000 | 0.2000 |" in text  # 1/4 <= 0.3


def test_runs_that_differ_only_in_their_seed_are_one_row_of_mean_and_std(sweep):
    text, groups = compare_runs(sweep, "eval.loss", target=0.205)
    assert [(label, len(members)) for label, members in groups] == [
        ("strategy.name=fedavg", 3), ("strategy.name=scaffold", 3)]
    # final eval.loss: base / 5 + 0.01 x seed over seeds 0, 1, 2: mean base / 5 + 0.01, sample std 0.01; only
    # seed 0's fedavg gets to 0.205 (at round 5: 0.2), every scaffold at round 3 (1/6 + 0.02 at most)
    assert "| strategy.name=fedavg | 3 | 0,1,2 | 0.2100 ± 0.0100 | 0.2100 ± 0.0100 | 5.0 (1/3 reached) |" in text
    assert "| strategy.name=scaffold | 3 | 0,1,2 | 0.1100 ± 0.0100 | 0.1100 ± 0.0100 | 3.0 ± 0.0 (3/3 reached) |" \
        in text
    accuracy, _ = compare_runs(sweep, "eval.accuracy")
    assert "| strategy.name=fedavg | 3 | 0,1,2 | 0.7900 ± 0.0100 | 0.7900 ± 0.0100 |" in accuracy  # best: highest


def test_the_tables_come_as_latex_for_a_paper(sweep):
    text, _ = compare_runs(sweep, "eval.loss", fmt="latex")
    assert text.count("\\begin{tabular}") == 2
    assert "strategy.name=fedavg & 3 & 0,1,2 & 0.2100 $\\pm$ 0.0100 & 0.2100 $\\pm$ 0.0100 \\\\" in text
    assert "seed=0,strategy.name=fedavg & fedavg & off" in text


def test_one_figure_draws_each_groups_mean_curve_with_its_spread_from_the_command_line(sweep, tmp_path):
    pytest.importorskip("matplotlib")
    figure = tmp_path / "loss.png"
    result = mpifl_here("compare", *sweep, "--metric", "eval.loss", "--plot", str(figure))
    assert result.returncode == 0, result.stderr
    assert "0.2100 ± 0.0100" in result.stdout and f"wrote {figure}" in result.stdout
    assert figure.read_bytes()[:8] == PNG


def test_a_misspelt_metric_is_named_with_the_closest_one(sweep, tmp_path):
    with pytest.raises(SystemExit, match=r"--metric 'eval.los' is in no round of these runs; did you mean "
                                         r"'eval.loss'\?"):
        compare_runs(sweep, "eval.los")
    with pytest.raises(SystemExit, match=r"mpifl compare: .*nope/metrics.jsonl does not exist"):
        compare_runs([sweep[0], str(tmp_path / "nope")])


def test_a_torn_last_record_is_left_out_saying_so_and_a_bad_record_before_it_ends_the_command(sweep, capsys):
    metrics = Path(sweep[0]) / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join(lines[:4]) + "\n" + lines[4][:20])  # a job killed while it appended round 5
    text, _ = compare_runs(sweep[:1], "eval.loss")
    assert "| 0.2500 | 0.2500 |" in text  # the best and final of rounds 1-4
    assert f"{metrics}: line 5 is torn (a job killed while writing it?); reading the rounds before it" in \
        capsys.readouterr().err
    metrics.write_text("\n".join([lines[0], "{oops", *lines[2:]]) + "\n")
    with pytest.raises(SystemExit, match=rf"mpifl compare: {metrics}: line 2 is not JSON \(Expecting property name"):
        compare_runs(sweep[:1], "eval.loss")


def test_a_figure_into_a_folder_that_does_not_exist_is_refused_before_any_work(sweep, tmp_path):
    pytest.importorskip("matplotlib")
    missing = tmp_path / "no" / "loss.png"
    result = mpifl_here("compare", *sweep, "--plot", str(missing))
    assert result.returncode == 1 and not result.stdout
    assert result.stderr.strip() == f"mpifl compare: --plot {missing}: folder '{missing.parent}' does not exist"
    result = mpifl_here("partition", "configs/quickstart.yaml", "--plot", str(missing))
    assert result.returncode == 1 and not result.stdout
    assert result.stderr.strip() == f"mpifl partition: --plot {missing}: folder '{missing.parent}' does not exist"


def test_a_figure_matplotlib_cannot_write_is_refused_in_one_line_naming_the_path(sweep, tmp_path):
    """A suffix matplotlib has no writer for, a folder given for the file, and a file given for its folder: one
    line each, before the table, no traceback."""
    pytest.importorskip("matplotlib")
    afile = tmp_path / "afile"
    afile.write_text("kept")
    said = {
        "out.txt": "matplotlib writes no txt figure; end the name in one of ",
        str(tmp_path): "is a folder: give the figure's file name",
        str(afile / "x.png"): f"folder '{afile}' is a file, not a folder",
    }
    for path, says in said.items():
        result = mpifl_here("compare", *sweep, "--plot", path, cwd=tmp_path)
        assert result.returncode == 1 and not result.stdout and "Traceback" not in result.stderr, result.stderr
        assert result.stderr.startswith(f"mpifl compare: --plot {path}") and says in result.stderr, result.stderr
        assert path != "out.txt" or ".pdf, .pgf, .png" in result.stderr  # the formats it has, named
    assert afile.read_text() == "kept"


def test_a_run_given_twice_is_refused_since_its_seed_would_count_twice(sweep):
    with pytest.raises(SystemExit, match=r"is given twice: its seed would count twice in the mean ± std"):
        compare_runs([sweep[0], sweep[1], sweep[0]])
    with pytest.raises(SystemExit, match=r"is given twice \(as .*\)"):
        compare_runs([sweep[0], sweep[0] + "/"])


def test_two_runs_of_one_config_and_seed_are_a_repeat_not_two_seeds(sweep, tmp_path):
    again = write_run(tmp_path / "again", "fedavg", 0)  # the sweep's seed=0 fedavg run, made a second time
    with pytest.raises(SystemExit, match=r"seed=0,strategy.name=fedavg and .*again have the same config and seed 0: "
                                         r"a repeat of one run, not another seed"):
        compare_runs([*sweep, str(again)], "eval.loss")


def test_a_run_without_rounds_is_named_and_left_out_of_the_means(sweep, tmp_path):
    failed = write_run(tmp_path / "seed=3,strategy.name=fedavg", "fedavg", 3, rounds=0)  # failed before round 1
    text, groups = compare_runs([*sweep, str(failed)], "eval.loss")
    assert "| seed=3,strategy.name=fedavg | fedavg | off | no round recorded it | - |" in text
    assert "seed=3,strategy.name=fedavg: no round recorded eval.loss" in text and "nan" not in text
    assert [len(members) for _, members in groups] == [3, 3]  # the failed run is in no group's mean ± std
    assert "| strategy.name=fedavg | 3 | 0,1,2 |" in text


def test_a_run_directory_without_records_is_compared_as_one_no_round_recorded_and_a_non_run_still_ends_it(sweep,
                                                                                                         tmp_path):
    """A sweep's grid point refused at start-up, or a run killed before round 1, leaves a config.yaml and no
    metrics.jsonl: the other runs are still compared. A path that is no run directory, or a run's records file
    given for its directory, ends the command naming it."""
    unstarted = write_run(tmp_path / "seed=4,strategy.name=fedavg", "fedavg", 4)
    (unstarted / "metrics.jsonl").unlink()
    text, groups = compare_runs([*sweep, str(unstarted)], "eval.loss")
    assert "| seed=4,strategy.name=fedavg | fedavg | off | no round recorded it | - |" in text
    assert [len(members) for _, members in groups] == [3, 3]
    with pytest.raises(SystemExit, match=r"nowhere/metrics.jsonl does not exist \(is .*nowhere a run directory"):
        compare_runs([*sweep, str(tmp_path / "nowhere")])
    records = Path(sweep[0]) / "metrics.jsonl"
    with pytest.raises(SystemExit, match=rf"{records} is a file: give the run directory that holds the run's "
                                         rf"records \({sweep[0]}\)"):
        compare_runs([str(records)])


def compared_with_extras(tmp_path, runs: dict[str, str]) -> str:
    """``compare``'s text of one FedAvg run per entry of ``runs`` (name: YAML added to its config)."""
    for name, extra in runs.items():
        run = write_run(tmp_path / name, "fedavg", 0)
        (run / "config.yaml").write_text((run / "config.yaml").read_text() + extra)
    text, _ = compare_runs([str(tmp_path / name) for name in runs], "eval.loss")
    return text


def test_the_strategy_column_names_the_personalisation_beside_the_strategy(tmp_path):
    runs = {"fedper": "model: {local: ['fc3.*']}\n", "ditto": "train: {ditto_lambda: 0.1}\n",
            "both": "model: {local: ['fc3.*', 'bn.*']}\ntrain: {ditto_lambda: 0.5}\n",
            "apfl": "train: {trainer: 'examples.apfl.apfl:APFLTrainer'}\n"}
    text = compared_with_extras(tmp_path, runs)
    assert "| fedper | fedavg + local [fc3.*] | off |" in text
    assert "| ditto | fedavg + ditto(λ=0.1) | off |" in text
    assert "| both | fedavg + local [fc3.*, bn.*] + ditto(λ=0.5) | off |" in text
    assert "| apfl | fedavg + trainer examples.apfl.apfl:APFLTrainer | off |" in text


def test_the_strategy_column_names_dp_secure_aggregation_and_compression_which_change_the_updates(tmp_path):
    """Ditto with and without central DP, FedPer under secure aggregation, top-k: rows that would otherwise read
    alike (and one run a group: no note about groups, since no groups table is printed)."""
    runs = {"ditto": "train: {ditto_lambda: 0.1}\n",
            "ditto_dp": "train: {ditto_lambda: 0.1}\nprivacy: {mode: central, noise_multiplier: 1.1}\n",
            "fedper_sa": "model: {local: ['fc3.*']}\nsecagg: {enabled: true}\n",
            "topk": "compression: {method: topk, fraction: 0.1}\n", "int8": "compression: {method: int8}\n"}
    text = compared_with_extras(tmp_path, runs)
    assert "| ditto | fedavg + ditto(λ=0.1) | off |" in text
    assert "| ditto_dp | fedavg + ditto(λ=0.1) + DP(central, z=1.1) | off |" in text
    assert "| fedper_sa | fedavg + local [fc3.*] + secagg | off |" in text
    assert "| topk | fedavg + topk(0.1, error feedback) | off |" in text
    assert "| int8 | fedavg + int8 | off |" in text
    assert "groups" not in text


def test_rows_are_labelled_by_the_shortest_path_suffix_that_tells_the_runs_apart(tmp_path):
    ditto = write_run(tmp_path / "sw_ditto" / "seed=0", "fedavg", 0)
    fedper = write_run(tmp_path / "sw_fedper" / "seed=0", "scaffold", 0)
    again = write_run(tmp_path / "sw_fedper" / "seed=1", "scaffold", 1)
    text, _ = compare_runs([str(ditto), str(fedper), str(again)], "eval.loss")
    rows = [line.split(" | ")[0] for line in text.splitlines()[2:5]]
    assert rows == ["| sw_ditto/seed=0", "| sw_fedper/seed=0", "| sw_fedper/seed=1"]
    # from two sweeps, each row says its sweep although the last part alone would tell them apart
    two, _ = compare_runs([str(ditto), str(again)], "eval.loss")
    assert "| sw_ditto/seed=0 | fedavg |" in two and "| sw_fedper/seed=1 | scaffold |" in two
    one, _ = compare_runs([str(fedper), str(again)], "eval.loss")  # one sweep's runs: their own names
    assert "| seed=0 | scaffold |" in one and "| seed=1 | scaffold |" in one


def test_each_group_in_the_figure_has_its_own_line_style_and_a_marker_at_every_point(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    from mpifl.cli.compare import draw_groups

    same = [write_run(tmp_path / f"g{g}" / "seed=0", "fedavg", 0) for g in range(3)]  # three identical curves
    for g, run in enumerate(same):
        (run / "config.yaml").write_text((run / "config.yaml").read_text() + f"train: {{lr: 0.{g + 1}}}\n")
    _, groups = compare_runs([str(r) for r in same], "eval.loss")
    fig, ax = plt.subplots()
    lines = draw_groups(ax, groups)
    plt.close(fig)
    assert len({(line.get_linestyle(), line.get_marker()) for line in lines}) == 3
    assert all(line.get_marker() not in (None, "None", "") for line in lines)
    # an empty group keeps its place: the groups after it are drawn as they are where it has runs
    fig, ax = plt.subplots()
    kept = draw_groups(ax, [("absent", []), *groups[1:]])
    plt.close(fig)
    assert [(ln.get_color(), ln.get_linestyle(), ln.get_marker()) for ln in kept] == \
        [(ln.get_color(), ln.get_linestyle(), ln.get_marker()) for ln in lines[1:]]


def test_a_group_evaluated_in_one_round_only_draws_its_spread_as_an_error_bar_on_that_rounds_own_tick(tmp_path):
    """eval.every = rounds: each seed has one value, so there is no band to shade between rounds; the spread is an
    error bar, and the x axis holds the round's whole number rather than fractions around it."""
    plt = pytest.importorskip("matplotlib.pyplot")
    from mpifl.cli.compare import plot_groups

    runs = []
    for seed in (0, 1):
        run = write_run(tmp_path / f"seed={seed}", "fedavg", seed, rounds=6)
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        for record in records[:-1]:
            del record["eval"]  # evaluated in the last round only
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        runs.append(str(run))
    _, groups = compare_runs(runs, "eval.accuracy")
    drawn = {}
    original = plt.Figure.savefig

    def keep(fig, *args, **kwargs):
        ax = fig.axes[0]
        drawn.update(ticks=list(ax.get_xticks()), bars=[c for c in ax.containers if hasattr(c, "has_yerr")],
                     bands=len(ax.collections))
        return original(fig, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(plt.Figure, "savefig", keep)
        plot_groups(groups, "eval.accuracy", tmp_path / "one.png")
    assert drawn["ticks"] == [6.0]
    assert len(drawn["bars"]) == 1 and drawn["bars"][0].has_yerr
    low, high = drawn["bars"][0].lines[1]  # the caps: mean -/+ the std of 1 - 1/6 - 0.01 seed over seeds 0 and 1
    assert high.get_ydata()[0] - low.get_ydata()[0] == pytest.approx(2 * 0.01 / 2 ** 0.5)


def test_a_spread_across_clients_is_better_lower_and_per_client_keys_stay_out_of_the_hint(tmp_path):
    assert better_direction("federated_eval.accuracy_std") == "lower"
    assert better_direction("federated_eval.accuracy_worst10") == "higher"
    run = write_run(tmp_path / "run", "fedavg", 0)
    record = {"round": 1, "federated_eval": {"accuracy": 0.5, "accuracy_worst10": 0.25,
                                             "accuracy_per_client": {str(c): 0.5 for c in range(100)}}}
    (run / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    text, _ = compare_runs([str(run)], "federated_eval.accuracy_worst10")
    assert "| run | fedavg | off | 0.2500 | 0.2500 |" in text
    with pytest.raises(SystemExit, match=r"did you mean 'federated_eval.accuracy_worst10'") as refused:
        compare_runs([str(run)], "federated_eval.accuracy_worst1")
    assert "per_client" not in str(refused.value)


def test_a_group_is_labelled_by_the_fewest_keys_that_tell_it_apart_and_a_run_short_of_its_rounds_is_named(tmp_path):
    """A recorded config holds what the run filled in itself: a built-in strategy's update and weighting, which a
    plug-in's strategy leaves unset, and train.prox_mu, which is FedProx on FedAvg. The labels name only what tells
    the groups apart, not every key that differs. A run that stopped after 3 of its 5 rounds is named, so its
    'final' is not read as the run's end."""
    groups_of = {"avg": ("fedavg", "{name: fedavg, update: weights, weighting: samples}", 0.0),
                 "prox": ("fedavg", "{name: fedavg, update: weights, weighting: samples}", 0.01),
                 "dyn": ("scaffold", "{name: 'dynreg:build'}", 0.0)}
    runs = []
    for group, (curve, strategy, mu) in groups_of.items():
        for s in (0, 1):
            run = write_run(tmp_path / f"{group}{s}", curve, s)
            (run / "config.yaml").write_text(f"name: grid\nseed: {s}\nrounds: 5\nstrategy: {strategy}\n"
                                             f"train: {{prox_mu: {mu}}}\noutput: {{dir: {run}}}\n")
            runs.append(run)
    stopped = runs[3] / "metrics.jsonl"
    stopped.write_text("".join(stopped.read_text().splitlines(keepends=True)[:3]))
    text, groups = compare_runs([str(r) for r in runs])
    assert [label for label, _ in groups] == ["strategy.name=fedavg,train.prox_mu=0.0",
                                              "strategy.name=fedavg,train.prox_mu=0.01",
                                              "strategy.name=dynreg:build,train.prox_mu=0.0"]
    assert "| prox0 | fedavg + prox(μ=0.01) |" in text
    assert "prox1 (3 of 5): fewer rounds recorded than the config asks" in text


def test_a_key_mpifl_filled_in_from_another_never_labels_a_group_that_the_chosen_key_tells_apart(tmp_path):
    """FedBuff's clock.mode makes strategy.update 'delta' and clock.concurrency its own: the groups differ in those
    as a consequence, and the label names the key that was chosen, clock.mode, not strategy.update."""
    modes = {"sync": "{mode: sync, concurrency: 10}", "fedbuff": "{mode: fedbuff, concurrency: 4, buffer: 2}"}
    runs = []
    for mode, clock in modes.items():
        update = "delta" if mode == "fedbuff" else "weights"
        for s in (0, 1):
            run = write_run(tmp_path / f"{mode}{s}", "fedavg", s)
            (run / "config.yaml").write_text(f"name: grid\nseed: {s}\nrounds: 5\nclock: {clock}\n"
                                             f"strategy: {{name: fedavg, update: {update}, weighting: samples}}\n"
                                             f"output: {{dir: {run}}}\n")
            runs.append(run)
    _, groups = compare_runs([str(r) for r in runs])
    assert [label for label, _ in groups] == ["clock.mode=sync", "clock.mode=fedbuff"]


def test_the_figure_says_one_run_each_where_no_group_pools_seeds(tmp_path, monkeypatch):
    import matplotlib.figure

    from mpifl.cli.compare import plot_groups

    runs = [str(write_run(tmp_path / n, n, 0)) for n in ("fedavg", "scaffold")]
    _, groups = compare_runs(runs)
    titles: list[str] = []
    savefig = matplotlib.figure.Figure.savefig

    def spy(fig, *args, **kwargs):
        titles.append(fig.axes[0].get_title())
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", spy)
    out = plot_groups(groups, "eval.accuracy", tmp_path / "f.png")
    assert out.read_bytes().startswith(PNG) and titles == ["held-out accuracy: one run each"]


def test_a_fault_sweep_is_labelled_by_the_field_of_the_fault_it_varies(tmp_path):
    """A list of sections (``faults``) is compared field by field, so a sweep of ``faults.0.fraction`` is labelled
    by that field, not by the whole list; a run without faults is the 'defaults' group."""
    runs = []
    for fraction in (0.1, 0.3):
        for seed in (0, 1):
            run = write_run(tmp_path / f"f{fraction}" / f"seed={seed}", "fedavg", seed)
            (run / "config.yaml").write_text((run / "config.yaml").read_text() + (
                f"faults: [{{kind: raise, fraction: {fraction}, clients: [], rounds: []}}]\n"))
            runs.append(str(run))
    clean = write_run(tmp_path / "clean" / "seed=0", "fedavg", 0)
    (clean / "config.yaml").write_text((clean / "config.yaml").read_text() + "faults: []\n")
    _, groups = compare_runs([*runs, str(clean)], "eval.loss")
    assert [label for label, _ in groups] == ["faults.0.fraction=0.1", "faults.0.fraction=0.3", "faults=[]"]


def test_a_clean_baseline_beside_attacks_of_two_kinds_is_labelled_as_having_no_faults(tmp_path):
    """A recorded fault holds every field (bits, code, ...); those the baseline lacks only because it has no faults
    are no hidden difference between the groups: the note names only what the attacks themselves differ in."""
    runs = []
    for name, faults in (("scale", "[{kind: scale, clients: [0], factor: -1.0, std: 0.0, bits: 1}]"),
                         ("noise", "[{kind: noise, clients: [0], factor: 1.0, std: 1.0, bits: 1}]"), ("clean", "[]")):
        for seed in (0, 1):
            run = write_run(tmp_path / f"{name}{seed}", "fedavg", seed)
            (run / "config.yaml").write_text((run / "config.yaml").read_text() + f"faults: {faults}\n")
            runs.append(str(run))
    text, groups = compare_runs(runs, "eval.loss")
    assert [label for label, _ in groups] == ["faults.0.kind=scale", "faults.0.kind=noise", "faults=[]"]
    assert "The groups also differ in faults.0.factor, faults.0.std:" in text


def test_a_sweeps_variants_label_its_groups_and_the_note_says_which_settings_they_set(tmp_path):
    """Run directories of ``mpifl sweep --grid attack=@attacks.yaml --grid seed=0,1`` are named
    ``attack=sign_flip,seed=0``: the variant's name is in no config, so the groups are labelled by it, and a plain
    axis beside it by its KEY=VALUE as the directory writes it."""
    runs = []
    for attack, faults in (("clean", "[]"), ("sign_flip", "[{kind: scale, clients: [0], factor: -5.0}]"),
                           ("noise", "[{kind: noise, clients: [0], std: 1.0}]")):
        for strategy in ("fedavg", "scaffold"):
            for seed in (0, 1):
                run = write_run(tmp_path / f"attack={attack},strategy.name={strategy},seed={seed}", strategy, seed)
                (run / "config.yaml").write_text((run / "config.yaml").read_text() + f"faults: {faults}\n")
                runs.append(str(run))
    text, groups = compare_runs(runs, "eval.loss")
    assert [(label, len(members)) for label, members in groups] == [
        ("attack=clean,strategy.name=fedavg", 2), ("attack=clean,strategy.name=scaffold", 2),
        ("attack=sign_flip,strategy.name=fedavg", 2), ("attack=sign_flip,strategy.name=scaffold", 2),
        ("attack=noise,strategy.name=fedavg", 2), ("attack=noise,strategy.name=scaffold", 2)]
    # not faults.0.clients, which the clean runs lack only for having no faults
    assert ("Each group is labelled by its sweep's variants (its run directories' names); the groups differ in "
            "faults.0.factor, faults.0.kind, faults.0.std, strategy.name (each") in text
    # an axis every group shares tells none apart: the attacked runs alone are labelled by the attack only
    fedavg_only = [r for r in runs if "strategy.name=fedavg" in r]
    assert [label for label, _ in compare_runs(fedavg_only, "eval.loss")[1]] == [
        "attack=clean", "attack=sign_flip", "attack=noise"]
    latex, _ = compare_runs(runs, "eval.loss", fmt="latex")  # the notes as comments: the output inputs as it is
    assert "\n% Each group is labelled by its sweep's variants" in latex and "\nEach group" not in latex
    # a sweep of plain axes only (every part of the names a config key): labelled by the settings, as before
    plain = [str(write_run(tmp_path / "plain" / f"rounds={r},seed={s}", "fedavg", s, rounds=r)) for r in (3, 5)
             for s in (0, 1)]
    assert [label for label, _ in compare_runs(plain, "eval.loss")[1]] == ["rounds=3", "rounds=5"]


def test_a_group_that_differs_in_its_strategy_and_one_more_key_is_labelled_by_its_strategy(tmp_path):
    """SCAFFOLD runs made with train.momentum=0 beside FedAvg at the default: the strategy is what a reader names."""
    runs = []
    for strategy, momentum in (("fedavg", 0.9), ("scaffold", 0.0)):
        for seed in (0, 1):
            run = write_run(tmp_path / f"{strategy}{seed}", strategy, seed)
            (run / "config.yaml").write_text((run / "config.yaml").read_text() + f"train: {{momentum: {momentum}}}\n")
            runs.append(str(run))
    text, groups = compare_runs(runs, "eval.loss")
    assert [label for label, _ in groups] == ["strategy.name=fedavg", "strategy.name=scaffold"]
    assert "The groups also differ in train.momentum" in text


def test_groups_given_names_of_their_own_are_labelled_by_them(tmp_path):
    """Runs started with ``name=...`` (one name per group, shared by its seeds) are labelled by those names, not
    by the settings, so a paper's legend reads as the paper does."""
    runs = []
    for name, strategy in (("FedAvg", "fedavg"), ("SCAFFOLD", "scaffold")):
        for seed in (0, 1):
            run = write_run(tmp_path / f"{name}{seed}", strategy, seed)
            (run / "config.yaml").write_text((run / "config.yaml").read_text().replace("name: grid", f"name: {name}"))
            runs.append(str(run))
    text, groups = compare_runs(runs)
    assert [label for label, _ in groups] == ["FedAvg", "SCAFFOLD"]
    renamed = runs[:3]  # one of SCAFFOLD's seeds alone keeps its name: a group of one name still
    assert [label for label, _ in compare_runs(renamed)[1]] == ["FedAvg", "SCAFFOLD"]
    assert [label for label, _ in compare_runs(runs[:2])[1]] == ["FedAvg"]  # the only group keeps its name


def test_latex_cells_escape_braces_and_set_greek_letters_and_plus_minus_in_math_mode():
    from mpifl.cli.compare import latex_cell

    assert latex_cell("fedavg + prox(μ=0.01)") == "fedavg + prox($\\mu$=0.01)"
    assert latex_cell("ditto(λ=0.1) {a_b} 50% ± 1 >= 2 & ~^$#\\") == (
        "ditto($\\lambda$=0.1) \\{a\\_b\\} 50\\% $\\pm$ 1 $\\geq$ 2 \\& \\textasciitilde{}\\textasciicircum{}\\$\\#"
        "\\textbackslash{}")


def test_a_pooled_seed_that_stopped_short_is_marked_with_how_far_it_got(sweep, tmp_path):
    short = write_run(tmp_path / "seed=3,strategy.name=fedavg", "fedavg", 3, rounds=2)
    (short / "config.yaml").write_text((short / "config.yaml").read_text().replace("rounds: 2", "rounds: 5"))
    text, _ = compare_runs([*sweep, str(short)], "eval.loss")
    assert "| strategy.name=fedavg | 4 | 0,1,2,3 (2 of 5) |" in text
    assert "A seed marked (R of N) recorded R of its config's N rounds: its 'final' is round R's" in text
    # --complete-only: the stopped seed stays in the per-run table, out of the group's mean ± std
    text, groups = compare_runs([*sweep, str(short)], "eval.loss", complete_only=True)
    assert "| seed=3,strategy.name=fedavg | fedavg | off |" in text
    assert "seed=3,strategy.name=fedavg: left out of the groups below and of the figure (--complete-only)" in text
    assert "| strategy.name=fedavg | 3 | 0,1,2 |" in text and "(R of N)" not in text
    assert [len(members) for _, members in groups] == [3, 3]


def test_settings_the_groups_differ_in_beyond_their_labels_are_named(tmp_path):
    """Two groups apart in the momentum and the clock: the label names the momentum alone (the fewest keys that
    tell them apart), and a line names the clock too, which a reader would otherwise not see."""
    runs = []
    for momentum, clock in ((0.9, "off"), (0.0, "sync")):
        for seed in (0, 1):
            run = write_run(tmp_path / f"m{momentum}" / f"seed={seed}", "fedavg", seed)
            (run / "config.yaml").write_text((run / "config.yaml").read_text() + (
                f"train: {{momentum: {momentum}}}\nclock: {{mode: {clock}}}\n"))
            runs.append(str(run))
    text, groups = compare_runs(runs, "eval.loss")
    assert [label for label, _ in groups] == ["train.momentum=0.9", "train.momentum=0.0"]
    assert "The groups also differ in clock.mode: each label names only the fewest settings" in text


def test_the_figure_names_what_the_metric_measures_beside_its_key():
    from mpifl.cli.compare import metric_name

    assert metric_name("eval.accuracy") == "held-out accuracy (eval.accuracy)"
    assert metric_name("time.round") == "time.round"


def test_a_metric_recorded_only_as_non_finite_is_said_to_be_non_finite_not_missing(tmp_path):
    """metrics.jsonl writes NaN and Inf as null (a diverged Ditto run's ``federated_eval.personal_loss``): a run
    whose every round has null is non-finite, not a run that never recorded the metric, alone or beside others."""
    diverged = write_run(tmp_path / "diverged", "fedavg", 0, rounds=2)
    (diverged / "metrics.jsonl").write_text("".join(json.dumps({"round": r, "federated_eval": {"personal_loss": None}})
                                                    + "\n" for r in (1, 2)))
    text, _ = compare_runs([str(diverged)], "federated_eval.personal_loss")
    assert "| diverged | fedavg | off | non-finite in every round | - |" in text
    assert ("diverged: federated_eval.personal_loss was non-finite (NaN or Inf, null in metrics.jsonl) in every round "
            "that recorded it") in text and "no round recorded" not in text
    fine = write_run(tmp_path / "fine", "scaffold", 0, rounds=2)
    (fine / "metrics.jsonl").write_text("".join(json.dumps({"round": r, "federated_eval": {"personal_loss": 1 / r}})
                                                + "\n" for r in (1, 2)))
    text, _ = compare_runs([str(diverged), str(fine)], "federated_eval.personal_loss")
    assert "non-finite in every round" in text and "| 0.5000 | 0.5000 |" in text


def write_async_run(folder: Path, seed: int, staleness: list[list[int]], virtual: bool = True) -> Path:
    """An asynchronous run's directory: each step's staleness list, eval.accuracy 0.3 x step, and with ``virtual``
    the virtual clock's time, 10 s a step for seed 0 and 20 s for seed 1."""
    folder.mkdir(parents=True)
    records = [{"round": r, "staleness": s, "eval": {"accuracy": 0.3 * r},
                **({"virtual_time": (10.0 + 10.0 * seed) * r} if virtual else {})}
               for r, s in enumerate(staleness, start=1)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "config.yaml").write_text(f"seed: {seed}\nrounds: {len(staleness)}\nclock: {{mode: fedbuff}}\n"
                                        f"strategy: {{name: fedavg}}\n")
    return folder


def test_a_metric_recorded_as_a_list_per_round_compares_each_rounds_mean_and_says_so(tmp_path):
    runs = [str(write_async_run(tmp_path / f"seed={s}", s, [[0, 0], [1, 2], [3, s]])) for s in (0, 1)]
    text, groups = compare_runs(runs, "staleness")
    assert "| seed=0 | fedavg | fedbuff | 0.0000 | 1.5000 |" in text  # best (lower) round 1's 0, final (3 + 0) / 2
    assert "| all runs | 2 | 0,1 | 0.0000 ± 0.0000 | 1.7500 ± 0.3536 |" in text
    assert "staleness: the mean of each record's list" in text
    assert groups[0][1][0].curve == {1: 0.0, 2: 1.5, 3: 1.5}


def test_the_spread_of_a_fraction_is_shaded_within_zero_and_one():
    import numpy as np
    from matplotlib.figure import Figure

    from mpifl.cli.compare import RunOutcome, draw_groups, fraction_range

    members = [RunOutcome(Path(f"s{s}"), {"seed": s}, {1: 0.5, 2: v}, v, v, None, None)
               for s, v in enumerate((0.99, 0.7, 0.98))]  # round 2: mean 0.89, std 0.16: the band passes 1
    groups = [("all runs", members)]
    assert fraction_range(groups, "eval.accuracy") == (0.0, 1.0)
    assert fraction_range(groups, "eval.loss") is None  # a loss may pass 1
    ax = Figure().subplots()
    draw_groups(ax, groups, fraction_range(groups, "eval.accuracy"))
    band = np.concatenate([p.vertices for p in ax.collections[0].get_paths()])
    assert band[:, 1].max() == pytest.approx(1.0)


def test_the_pooled_table_gives_virtual_seconds_to_the_target_and_the_figure_draws_against_them(tmp_path):
    runs = [str(write_async_run(tmp_path / f"seed={s}", s, [[0]] * 3)) for s in (0, 1)]
    text, groups = compare_runs(runs, target=0.5, x="virtual")  # reached at step 2: 20 s and 40 s
    assert text.endswith("| rounds to eval.accuracy >= 0.5, mean ± std | virtual s to target, mean ± std |\n"
                         "|---|---|---|---|---|---|---|\n"
                         "| all runs | 2 | 0,1 | 0.9000 ± 0.0000 | 0.9000 ± 0.0000 | 2.0 ± 0.0 (2/2 reached) | "
                         "30.0 ± 14.1 |")
    pytest.importorskip("matplotlib")
    figure = tmp_path / "virtual.png"
    result = mpifl_here("compare", *runs, "--plot", str(figure), "--x", "virtual")
    assert result.returncode == 0, result.stderr
    assert figure.read_bytes()[:8] == PNG


def test_a_groups_curve_against_virtual_seconds_holds_each_runs_value_until_its_next():
    from mpifl.cli.compare import RunOutcome, group_curve

    fast, slow = (RunOutcome(Path(f"s{s}"), {"seed": s}, {1: 0.1, 2: 0.2, 3: 0.3}, 0.3, 0.3, None, None,
                             virtual_at={1: t, 2: 2 * t, 3: 3 * t}) for s, t in ((0, 10.0), (1, 20.0)))
    # the span both cover: 20 s (the slow run's first) to 30 s (the fast run's last)
    assert group_curve([fast, slow], "virtual") == ([20.0, 30.0], [[0.2, 0.3], [0.1, 0.1]])


def test_a_figure_against_virtual_seconds_names_the_runs_without_them(tmp_path):
    timed = write_async_run(tmp_path / "timed", 0, [[0]] * 2)
    untimed = write_async_run(tmp_path / "untimed", 1, [[0]] * 2, virtual=False)
    with pytest.raises(SystemExit, match=r"--x virtual draws against the virtual clock's time, which untimed did "
                                         r"not record"):
        compare_runs([str(timed), str(untimed)], x="virtual")
    assert "virtual s to target" not in compare_runs([str(timed), str(untimed)], target=0.5)[0]
