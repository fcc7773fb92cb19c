"""Differential privacy, in process: element-addressed noise, clipping over the whole update, and
epsilon exactly as Google's dp-accounting computes it."""
from __future__ import annotations

import math
import sys

import pytest
import torch
from conftest import ROOT

from mpifl.config import ConfigError, load_config
from mpifl.planning.federation import poisson_sample
from mpifl.privacy.accounting import epsilon
from mpifl.privacy.dp import ClientPrivacy, ServerPrivacy, sum_noise_multiplier
from mpifl.privacy.noise import BLOCK, ElementNoise

dp = pytest.importorskip("dp_accounting")


def privacy(**kw):
    base = {"strategy": {"update": "delta", "weighting": "equal"}, "clients": {"num_clients": 1000, "per_round": 20}}
    return load_config(None, data={**base, "privacy": kw}).privacy


@pytest.mark.parametrize("chunk", [997, 4096, BLOCK - 3, 3 * BLOCK])
def test_noise_depends_on_the_element_never_on_the_chunking(chunk):
    total = 2 * BLOCK + 5000
    whole = torch.zeros(total)
    ElementNoise(11, 0, 3).add(whole, 0, 1.0)
    pieces, noise = torch.zeros(total), ElementNoise(11, 0, 3)
    for first in range(0, total, chunk):
        noise.add(pieces[first:first + chunk], first, 1.0)
    assert torch.equal(whole, pieces)
    assert abs(float(whole.mean())) < 0.01 and float(whole.std()) == pytest.approx(1.0, abs=0.01)
    other = torch.zeros(total)
    ElementNoise(11, 0, 4).add(other, 0, 1.0)  # another round: other noise
    assert not torch.equal(whole, other)


def test_a_client_update_is_clipped_to_the_bound_over_all_its_chunks():
    chunks = [torch.full((30,), 1.0), torch.full((70,), -2.0)]  # norm sqrt(30 + 280)
    report = ClientPrivacy(privacy(mode="central"), 0).apply(chunks, [0, 30], 1.5, round_=1, client=3)
    assert report == {"update_norm": pytest.approx(math.sqrt(310)), "clip_within": False}
    assert math.sqrt(sum(float(c.pow(2).sum()) for c in chunks)) == pytest.approx(1.5, rel=1e-6)
    small = [torch.full((4,), 0.1)]
    assert ClientPrivacy(privacy(mode="central"), 0).apply(small, [0], 1.5, 1, 3)["clip_within"]
    assert torch.equal(small[0], torch.full((4,), 0.1))  # within the bound: untouched


def test_local_dp_noises_each_client_differently_and_reproducibly():
    def noised(client):
        x = [torch.zeros(1000)]
        ClientPrivacy(privacy(mode="local", noise_multiplier=2.0), 5).apply(x, [0], 0.5, 2, client)
        return x[0]
    assert torch.equal(noised(1), noised(1)) and not torch.equal(noised(1), noised(2))
    assert float(noised(1).std()) == pytest.approx(1.0, rel=0.1)  # z x C = 2 x 0.5


@pytest.mark.parametrize("settings,event", [
    ({"mode": "central", "noise_multiplier": 1.1},
     lambda: dp.SampledWithoutReplacementDpEvent(1000, 20, dp.GaussianDpEvent(0.55))),
    ({"mode": "central", "noise_multiplier": 1.1, "sampling": "poisson"},
     lambda: dp.PoissonSampledDpEvent(0.02, dp.GaussianDpEvent(1.1))),
    ({"mode": "central", "noise_multiplier": 0.9, "sampling": "poisson", "accountant": "pld"},
     lambda: dp.PoissonSampledDpEvent(0.02, dp.GaussianDpEvent(0.9))),
    # local DP: any two of a client's datasets give clipped updates up to 2C apart, so the multiplier is z / 2
    ({"mode": "local", "noise_multiplier": 4.0}, lambda: dp.GaussianDpEvent(2.0)),
])
def test_epsilon_is_what_dp_accounting_computes_for_the_same_mechanism(settings, event):
    cfg = privacy(**settings, delta=1e-6)
    if cfg.accountant == "pld":
        direct = dp.pld.PLDAccountant()
    else:
        fixed = cfg.mode == "central" and cfg.sampling == "fixed"
        direct = dp.rdp.RdpAccountant(neighboring_relation=dp.NeighboringRelation.REPLACE_ONE if fixed
                                      else dp.NeighboringRelation.ADD_OR_REMOVE_ONE)
    direct.compose(dp.SelfComposedDpEvent(event(), 50))
    assert epsilon(cfg, 50, 1000, 20) == direct.get_epsilon(1e-6)
    assert epsilon(cfg, 0, 1000, 20) == 0.0 and epsilon(cfg, 10, 1000, 20) < epsilon(cfg, 50, 1000, 20)


def test_adaptive_clipping_follows_the_clipped_fraction_and_resumes_from_the_record():
    from mpifl.wire.protocol import UpdateMeta

    cfg = privacy(mode="central", noise_multiplier=1.0, adaptive_clip=True, count_noise=5.0, clip=1.0)
    server = ServerPrivacy(cfg, 0, 1000, 20, [])
    everyone_within = {c: UpdateMeta(c, 1, 0.0, {"clip_within": True}) for c in range(20)}
    record = server.after_round(1, everyone_within)
    assert record["clip"] == 1.0 and record["next_clip"] < 1.0 and server.clip == record["next_clip"]
    resumed = ServerPrivacy(cfg, 0, 1000, 20, [{"round": 1, "privacy": record}])
    assert resumed.clip == record["next_clip"]
    assert sum_noise_multiplier(cfg, 20) == pytest.approx((1.0 - 0.01) ** -0.5)


def test_one_client_more_or_less_moves_the_noised_clip_count_by_half_as_the_budget_split_assumes():
    """z_sum = (z^-2 - (2 sigma_b)^-2)^(-1/2) accounts the count as a Gaussian of sensitivity 1/2 (Andrew et al.
    2021): each client adds its bit less 1/2, as TF Privacy's QuantileEstimatorQuery does. A plain count moved by 1,
    and Poisson runs reported epsilon 7.41 where 11.17 was spent (q 0.5, sigma_b 1, 4 rounds)."""
    from mpifl.wire.protocol import UpdateMeta

    cfg = privacy(mode="central", noise_multiplier=1e-12, adaptive_clip=True, count_noise=1e-9, clip=1.0,
                  clip_lr=1.0, target_quantile=0.5)

    def share(within: int, outside: int) -> float:  # the share within the bound the next clip follows
        server = ServerPrivacy(cfg, 0, 1000, 10, [])
        metas = {c: UpdateMeta(c, 1, 0.0, {"clip_within": c < within}) for c in range(within + outside)}
        return 0.5 - math.log(server.after_round(1, metas)["next_clip"])  # clip_lr 1: log C' = -(b - 1/2)

    base = share(6, 4)  # 10 participants, the expected 10: b is the plain share, 0.6
    assert base == pytest.approx(0.6)
    assert abs(share(7, 4) - base) == pytest.approx(0.05) and abs(share(6, 5) - base) == pytest.approx(0.05)
    assert share(20, 0) == pytest.approx(1.0) and share(0, 20) == pytest.approx(0.0)  # clipped to [0, 1]


def test_poisson_sampling_takes_each_client_independently():
    counts = [len(poisson_sample(3, r, 1000, 0.02)) for r in range(1, 201)]
    assert min(counts) < 20 < max(counts) and sum(counts) / 200 == pytest.approx(20, rel=0.1)
    assert poisson_sample(3, 7, 1000, 0.02) == poisson_sample(3, 7, 1000, 0.02)


def test_privacy_settings_that_would_break_the_guarantee_are_refused():
    with pytest.raises(ConfigError, match="strategy.weighting: privacy.mode 'central' needs 'equal'"):
        load_config(None, data={"strategy": {"weighting": "samples"}, "privacy": {"mode": "central"}})
    with pytest.raises(ConfigError, match="strategy.update: privacy.mode 'local' needs 'delta'"):
        load_config(None, data={"strategy": {"update": "weights"}, "privacy": {"mode": "local"}})
    with pytest.raises(ConfigError, match="'pld' accounts Poisson sampling"):
        privacy(mode="central", accountant="pld")


@pytest.mark.parametrize("dropped", [(), (2,), (0, 3)])
def test_pairwise_masks_cancel_and_dropped_clients_masks_are_removed_exactly(dropped):
    from mpifl.config import SecAggConfig
    from mpifl.privacy.secagg import SecureAggregation
    from mpifl.wire.protocol import UpdateMeta

    secure, cohort, rng = SecureAggregation(SecAggConfig(enabled=True), 9), (0, 2, 3, 5), torch.Generator()
    updates = {c: torch.randn(5000, generator=rng.manual_seed(c)) for c in cohort}
    total, plain = torch.zeros(5000).view(torch.int32), torch.zeros(5000, dtype=torch.int32)
    for c in cohort:
        masked = updates[c].clone()
        secure.mask([masked[:1234], masked[1234:]], [0, 1234], 2.0, cohort, round_=4, client=c)
        if c not in dropped:
            total.add_(masked.view(torch.int32))
            plain.add_(torch.round(updates[c] * 2.0 * 2 ** 16).to(torch.int32))
    acc = total.view(torch.float32)
    metas = {c: UpdateMeta(c, 1, 0.0, {}, "dropped" if c in dropped else None) for c in cohort}
    unmask = secure.unmask(4, cohort)
    unmask(acc[:3000], 0, metas)  # another chunking on the server
    unmask(acc[3000:], 3000, metas)
    assert torch.equal(acc, plain.to(torch.float32) / 2 ** 16)


def test_dp_on_a_model_with_batchnorm_statistics_says_they_are_noised_and_how_to_keep_them_out(capfd):
    from mpifl.roles.build_server import warn_statistics as _warn_statistics
    from mpifl.wire.spec import layout

    spec = layout([("0.weight", (4,), "float32"), ("1.running_mean", (4,), "float32"),
                   ("1.running_var", (4,), "float32")], statistics={"1.running_mean", "1.running_var"})
    central = ["privacy.mode=central", "strategy.update=delta", "strategy.weighting=equal"]
    _warn_statistics(load_config(None, central), spec)
    said = capfd.readouterr().err
    assert "statistics (1.running_mean and 1 more) are clipped and noised" in said and "model.local" in said
    _warn_statistics(load_config(None, []), spec)  # no DP: nothing to say
    _warn_statistics(load_config(None, central), layout([("0.weight", (4,), "float32")]))
    assert capfd.readouterr().err == ""



def test_without_dp_accounting_validation_names_privacy_mode_and_the_extra(monkeypatch, capsys):
    """Where the dp extra is missing, `mpifl validate` says so before MPI starts; the run used to abort after."""
    from mpifl.cli import main

    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # as if not installed
    assert main(["validate", str(ROOT / "configs" / "quickstart.yaml"), "privacy.mode=central"]) == 2
    assert ("mpifl: config error: privacy.mode 'central': privacy accounting needs Google's dp-accounting: "
            "pip install 'mpifl[dp]'") in capsys.readouterr().err


def test_without_transformers_a_transformers_config_says_which_extra_in_one_line(monkeypatch, capsys):
    from mpifl.cli import main

    monkeypatch.setitem(sys.modules, "transformers", None)
    assert main(["validate", str(ROOT / "configs" / "llama3.1-70b.yaml")]) == 2
    err = capsys.readouterr().err
    assert "mpifl: model.name='transformers' needs the 'hf' extra: pip install 'mpifl[hf]'" in err
    assert "Traceback" not in err


def test_a_budget_that_round_1_alone_would_pass_is_refused_before_mpi_starts(capsys):
    """The server would stop at round 0 and ask for a resume that could never go further."""
    from mpifl.cli import main

    quickstart = str(ROOT / "configs" / "quickstart.yaml")
    dp = ["privacy.mode=central", "privacy.noise_multiplier=0.3"]
    assert main(["validate", quickstart, *dp, "privacy.epsilon_budget=2"]) == 2
    assert ("config error: privacy.epsilon_budget: round 1 alone would take epsilon to 53.878 at delta 1e-05, past "
            "the budget 2, so no round could run: raise privacy.noise_multiplier or the budget"
            in capsys.readouterr().err)
    assert main(["validate", quickstart, *dp, "privacy.epsilon_budget=60"]) == 0


def test_a_record_is_strict_json_and_an_unbounded_epsilon_is_null(tmp_path):
    """Without noise epsilon is infinite; Python's json would write Infinity, which strict readers refuse."""
    import json
    import math

    from mpifl.metrics import JsonLines

    sink = JsonLines(tmp_path / "metrics.jsonl")
    sink.write({"round": 1, "privacy": {"epsilon": math.inf, "delta": 1e-5}, "losses": [0.5, math.nan]})
    line = (tmp_path / "metrics.jsonl").read_text()
    assert "Infinity" not in line and "NaN" not in line

    def strict(constant: str) -> None:
        raise ValueError(f"not RFC 8259 JSON: {constant}")

    assert json.loads(line, parse_constant=strict) == {"round": 1, "privacy": {"epsilon": None, "delta": 1e-5},
                                                        "losses": [0.5, None]}


def test_the_accountants_convergence_note_names_no_rank_outside_an_mpi_launch(capfd, monkeypatch):
    """``mpifl validate`` runs without MPI, and its budget check may reach dp-accounting's convergence warning: the
    note it gives in mpifl's words had '[rank 0]' before it there; under a launcher it keeps its rank."""
    import logging

    from mpifl.logs import RANK_VARIABLES
    from mpifl.privacy.accounting import _ConvergenceNotes

    record = logging.LogRecord("absl", logging.WARNING, __file__, 1, "_compute_log_a_frac failed to converge", (),
                               None)
    for var in RANK_VARIABLES:
        monkeypatch.delenv(var, raising=False)
    assert _ConvergenceNotes().filter(record) is False
    assert capfd.readouterr().err.startswith("privacy: dp-accounting's RDP series did not converge")
    monkeypatch.setenv("PMI_RANK", "0")
    assert _ConvergenceNotes().filter(record) is False
    assert capfd.readouterr().err.startswith("[rank 0] privacy: dp-accounting's")
