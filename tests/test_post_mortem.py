"""`mpifl status`: from the run directory alone, how far a run got and which rank went quiet first."""
from __future__ import annotations

import json

from mpifl.storage.rundir import note_rank, post_mortem


def run_dir_with(tmp_path, rounds_recorded: int, notes: list[tuple[int, str, int, float]]):
    run = tmp_path / "run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("rounds: 6\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"round": r}) + "\n" for r in range(1, rounds_recorded + 1)))
    for rank, state, round_, when in notes:
        note_rank(run, rank, state, round_)
        path = run / "ranks" / f"rank{rank:05d}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "time": when}))
    return run


def test_a_complete_run_says_so_and_nothing_else(tmp_path):
    run = run_dir_with(tmp_path, 6, [(0, "finished", 6, 10.0), (1, "finished", 6, 10.0)])
    assert post_mortem(run) == (True, [f"{run}: 6 of 6 rounds recorded; no checkpoint", "complete"])


def test_a_rank_a_round_behind_the_others_is_named_as_the_first_to_go_quiet(tmp_path):
    run = run_dir_with(tmp_path, 2, [(0, "round", 3, 50.0), (1, "round", 3, 50.0), (2, "round", 2, 49.9)])
    complete, lines = post_mortem(run)
    assert not complete and "rank 2 went quiet first" in lines[-1]
    assert "  rank 2: last heard of at" in "\n".join(lines) and "in round 2" in "\n".join(lines)


def test_a_failed_rank_is_named_and_ranks_killed_together_are_not_blamed(tmp_path):
    failed = run_dir_with(tmp_path / "a", 1, [(0, "failed", 2, 5.0), (1, "round", 2, 5.0)])
    assert "rank 0 failed" in post_mortem(failed)[1][-1]
    together = run_dir_with(tmp_path / "b", 1, [(0, "round", 2, 5.0), (1, "round", 2, 5.5)])
    assert "stopped together" in post_mortem(together)[1][-1]


def test_a_run_stopped_on_request_says_so_and_blames_no_rank(tmp_path):
    run = run_dir_with(tmp_path, 3, [(0, "interrupted", 3, 5.0), (1, "finished", 3, 5.0), (2, "finished", 3, 5.0)])
    complete, lines = post_mortem(run)
    assert not complete
    assert lines[-1] == ("not complete: stopped on request after round 3 (SIGTERM: by hand, or a scheduler's signal "
                         "before its time limit), as the rounds on disk show; continue with --resume")
    assert "did not finish" not in "\n".join(lines)


def test_a_run_whose_privacy_budget_is_spent_before_its_last_round_is_complete_and_says_why(tmp_path):
    run = run_dir_with(tmp_path, 2, [(0, "finished", 2, 5.0), (1, "finished", 2, 5.0)])
    (run / "config.yaml").write_text("rounds: 6\nprivacy: {mode: central, epsilon_budget: 5.2}\n")
    records = [{"round": 1, "privacy": {"epsilon": 4.9}},
               {"round": 2, "privacy": {"epsilon": 5.131, "budget_spent": True}}]  # as the server marks it
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert post_mortem(run) == (True, [f"{run}: 2 of 6 rounds recorded; no checkpoint",
                                       "complete: privacy.epsilon_budget 5.2 spent after round 2 of 6 "
                                       "(epsilon 5.131)"])
    (run / "metrics.jsonl").write_text(json.dumps(records[0]) + "\n")  # a round short of the budget's stop
    assert not post_mortem(run)[0]


def test_status_of_a_folder_that_is_no_run_says_which_without_calling_it_a_config_error(tmp_path):
    from conftest import mpifl_here

    missing, plain = mpifl_here("status", str(tmp_path / "nothere")), mpifl_here("status", str(tmp_path))
    assert (missing.returncode, missing.stderr) == (1, f"mpifl status: {tmp_path / 'nothere'} does not exist\n")
    assert plain.stderr == f"mpifl status: {tmp_path} is not an mpifl run directory (no config.yaml)\n"
