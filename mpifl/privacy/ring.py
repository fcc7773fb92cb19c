"""Secure aggregation's fixed point in the ring Z_(2^32): which values a client's update may hold unclamped.

A client of weight w (its sample count under strategy.weighting=samples, else 1) in a cohort of
n sends q = round(w * x * 2^f) for each value x of its update (f = secagg.fraction_bits), clamped
to +-floor((2^31 - 1) / n) so that the n values' sum cannot wrap modulo 2^32. So x is exact (to
2^-f / w) only within +-floor((2^31 - 1) / n) / (w * 2^f), about 2^(31 - f) / (n w). One source for
that number: the encoder's clamp (``clamp_limit``), the server's warning and the record's range
(``value_range``), the advice (``fitting_fraction_bits``) and the check before a run
(``range_problem``) all read it here; torch-free, for the records and the checks.
"""
from __future__ import annotations

import dataclasses
import math

from mpifl.config import SecAggConfig

RING_LIMIT = 2 ** 31 - 1  # the largest int32: a cohort's sum of clamped values stays within +-RING_LIMIT


def clamp_limit(cohort: int) -> int:
    """The largest |q| one member of a cohort of ``cohort`` may send: the members' sum cannot wrap modulo 2^32."""
    return RING_LIMIT // max(1, cohort)


def value_range(fraction_bits: int, cohort: int, weight: float) -> float:
    """The largest |x| a client of weight ``weight`` > 0 sends unclamped, round(weight * x * 2^f) <= clamp_limit
    (at the very edge, fp32's rounding of the product may clamp a value a few ulps inside)."""
    return clamp_limit(cohort) / (weight * 2.0 ** fraction_bits)


def fitting_fraction_bits(cohort: int, weight: float, largest: float) -> int:
    """The most fraction bits f whose ``value_range(f, cohort, weight)`` holds ``largest`` > 0 (below 1: no
    secagg.fraction_bits does); what the warning and the check before a run advise."""
    bits = math.floor(math.log2(clamp_limit(cohort) / (weight * largest)))
    while value_range(bits, cohort, weight) < largest:  # log2's last bit must not decide it: value_range does
        bits -= 1
    while value_range(bits + 1, cohort, weight) >= largest:
        bits += 1
    return bits


def most_fraction_bits() -> int:
    """The largest secagg.fraction_bits the schema takes (its ``max``): advice never goes past it."""
    return int(next(f for f in dataclasses.fields(SecAggConfig) if f.name == "fraction_bits").metadata["max"])


def advisable_fraction_bits(cohort: int, weight: float, largest: float) -> int:
    """``fitting_fraction_bits`` within the schema's range: what a record and a warning may advise."""
    return min(fitting_fraction_bits(cohort, weight, largest), most_fraction_bits())


def range_problem(cfg: SecAggConfig, cohort: int, weight: float, whose: str, *,
                  at_least: bool = False) -> str | None:
    """Why ``secagg.fraction_bits`` cannot hold values of ``secagg.min_range`` for a cohort of ``cohort`` whose
    heaviest client weighs ``weight`` (``whose``: where that weight comes from, for the message), or None.
    ``at_least``: ``weight`` is only a floor (the data not read yet), so the advised fraction_bits is a ceiling
    that the real largest client lowers, and the advice says where the real figure comes from."""
    if not cfg.enabled or cfg.min_range <= 0 or weight <= 0:
        return None
    bound = value_range(cfg.fraction_bits, cohort, weight)
    if bound >= cfg.min_range:
        return None
    fit = fitting_fraction_bits(cohort, weight, cfg.min_range)
    advice = (f"set secagg.fraction_bits to {fit} or less (±{value_range(fit, cohort, weight):.4g})" if fit >= 1
              else "no secagg.fraction_bits can: weigh clients equally (strategy.weighting=equal) or sample fewer "
                   "clients per round")
    if at_least and fit >= 1:
        advice += (" at the very most: the largest client's sample count lowers it, and `mpifl validate`, which "
                   "reads the data, gives the figure")
    return (f"secagg.fraction_bits: {cfg.fraction_bits} holds values only within ±{bound:.4g} = (2^31 - 1) / "
            f"({cohort} x {weight:g} x 2^{cfg.fraction_bits}) for a cohort of {cohort} (clients.per_round) whose "
            f"largest client weight is {weight:g} ({whose}), below secagg.min_range={cfg.min_range:g}: larger "
            f"values would be clamped, silently changing the model; {advice}, or lower secagg.min_range if the "
            "updates are surely smaller")
