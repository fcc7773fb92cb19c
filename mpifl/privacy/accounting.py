"""Epsilon at delta after some rounds, from Google's dp-accounting (``pip install 'mpifl[dp]'``).

- Central DP, fixed-size sampling (k of N without replacement): replace-one adjacency, so one
  client's change moves the sum by up to 2C, and the Gaussian's multiplier against that
  sensitivity is z / 2: ``SampledWithoutReplacementDpEvent(N, k, GaussianDpEvent(z / 2))``,
  RDP accountant (Wang, Balle and Kasiviswanathan 2019).
- Central DP, Poisson sampling (each client with q = k / N): add-or-remove adjacency,
  sensitivity C: ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``, RDP or PLD accountant.
- Local DP: each client's own release is a Gaussian mechanism on its clipped update. Its neighbouring
  inputs are any two of its datasets (replace: the client's output is always released, so there is no
  add-or-remove to hide behind), whose clipped updates can be 2C apart, so the multiplier against that
  sensitivity is z / 2, as in the central fixed-sampling case: ``GaussianDpEvent(z / 2)``, composed over every
  round the client could take part in (all of them, the worst case): no amplification.
"""
from __future__ import annotations

import importlib.util
import logging
from types import ModuleType
from typing import TYPE_CHECKING

from mpifl.config import PrivacyConfig
from mpifl.errors import MissingExtra
from mpifl.logs import log

if TYPE_CHECKING:  # the 'dp' extra: imported only when epsilon is counted
    import dp_accounting

DP_EXTRA = "privacy accounting needs Google's dp-accounting: pip install 'mpifl[dp]'"


def accounting_problem(mode: str) -> str | None:
    """Why a run with ``privacy.mode`` cannot count its epsilon here (dp-accounting not installed), or None."""
    if mode == "off" or importlib.util.find_spec("dp_accounting") is not None:
        return None
    return f"privacy.mode {mode!r}: {DP_EXTRA}"


class _ConvergenceNotes(logging.Filter):
    """dp-accounting's RDP accountant logs ``_compute_log_a_frac failed to converge`` (through absl, as
    WARNING) for some orders with Poisson sampling, several times per epsilon: not the user's concern, and
    alarming in a job log. Drop those records and say it once, in mpifl's words."""

    def __init__(self) -> None:
        super().__init__()
        self.told = False

    def filter(self, record: logging.LogRecord) -> bool:
        if "failed to converge" not in record.getMessage():
            return True
        if not self.told:
            self.told = True
            log("privacy: dp-accounting's RDP series did not converge at some orders (its own warning, shown once); "
                "epsilon comes from the orders that did")  # its rank when launched ([rank 0]), none in validate
        return False


_NOTES = _ConvergenceNotes()
logging.getLogger("absl").addFilter(_NOTES)


def _dp_accounting() -> ModuleType:
    try:
        import dp_accounting
    except ImportError:
        raise MissingExtra(DP_EXTRA) from None
    return dp_accounting


def round_event(cfg: PrivacyConfig, num_clients: int, per_round: int) -> dp_accounting.DpEvent:
    """The dp-accounting event of one round."""
    dp = _dp_accounting()
    gaussian = dp.GaussianDpEvent
    if cfg.mode == "local":
        return gaussian(cfg.noise_multiplier / 2)
    if cfg.sampling == "poisson":
        return dp.PoissonSampledDpEvent(per_round / num_clients, gaussian(cfg.noise_multiplier))
    return dp.SampledWithoutReplacementDpEvent(num_clients, per_round, gaussian(cfg.noise_multiplier / 2))


def epsilon(cfg: PrivacyConfig, rounds: int, num_clients: int, per_round: int) -> float:
    """Epsilon at ``cfg.delta`` after ``rounds`` rounds (0 rounds: 0)."""
    if rounds == 0 or cfg.noise_multiplier == 0:
        return 0.0 if rounds == 0 else float("inf")
    dp = _dp_accounting()
    if cfg.accountant == "pld":
        accountant = dp.pld.PLDAccountant()
    else:
        fixed = cfg.mode == "central" and cfg.sampling == "fixed"
        relation = dp.NeighboringRelation.REPLACE_ONE if fixed else dp.NeighboringRelation.ADD_OR_REMOVE_ONE
        accountant = dp.rdp.RdpAccountant(neighboring_relation=relation)
    accountant.compose(dp.SelfComposedDpEvent(round_event(cfg, num_clients, per_round), rounds))
    return float(accountant.get_epsilon(cfg.delta))


def budget_problem(cfg: PrivacyConfig, num_clients: int, per_round: int) -> str | None:
    """Why ``privacy.epsilon_budget`` leaves no round to run (round 1 alone would pass it), or None: said before
    MPI starts, where the server would otherwise stop at round 0 and a resume could never go further."""
    if cfg.mode == "off" or cfg.epsilon_budget is None:
        return None
    first = epsilon(cfg, 1, num_clients, per_round)
    if first <= cfg.epsilon_budget:
        return None
    return (f"privacy.epsilon_budget: round 1 alone would take epsilon to {first:.3f} at delta {cfg.delta:g}, past "
            f"the budget {cfg.epsilon_budget:g}, so no round could run: raise privacy.noise_multiplier or the budget")
