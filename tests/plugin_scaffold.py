"""The shipped client-half example (examples/client_half/scaffold.py) beside builders the suite needs that no user
should copy: one that declares SCAFFOLD's client half but builds a plain mean, and client halves with a mistake each,
all refused before MPI starts or named by the rank that runs them."""
from __future__ import annotations

from examples.client_half.scaffold import CAPABILITIES, Controls, Leader, Member
from mpifl.api import ClientAlgorithm, Replace, Strategy, WeightedMean


def mismatched(cfg):
    """Declares SCAFFOLD's client half on the builder, but builds a plain mean: refused before MPI starts."""
    return Strategy(cfg, WeightedMean(cfg), Replace(cfg))


mismatched.capabilities = CAPABILITIES


# Client halves with a mistake each, and a strategy naming each: refused before MPI (a builder or method that cannot
# take mpifl's call), or, where only running it tells (training returns no context manager), named by the rank
def _naming(rule: str):
    import dataclasses

    from examples.client_half import scaffold as example

    capabilities = dataclasses.replace(example.CAPABILITIES, client_rule=f"plugin_scaffold:{rule}")

    def build(cfg):
        return example.Average(cfg, example.Mean(cfg), Replace(cfg), capabilities=capabilities)

    build.capabilities = capabilities
    return build


class LeaderWithoutCfg(Leader):
    def __init__(self, work, store):
        raise AssertionError("never built: refused before MPI")


class UpdateWithoutWeight(Leader):
    def update(self, client, global_bytes, steps):
        raise AssertionError("never called: refused before MPI")


class TrainingWithoutContext(Leader):
    def training(self, client, global_bytes):  # forgot @contextlib.contextmanager
        return None


class MemberWithoutCfg(Member):
    def __init__(self, work):
        raise AssertionError("never built: refused before MPI")


LEADER_WITHOUT_CFG = ClientAlgorithm(state="c_i", leader=LeaderWithoutCfg, member=Member, streams=Controls)
UPDATE_WITHOUT_WEIGHT = ClientAlgorithm(state="c_i", leader=UpdateWithoutWeight, member=Member, streams=Controls)
TRAINING_WITHOUT_CONTEXT = ClientAlgorithm(state="c_i", leader=TrainingWithoutContext, member=Member,
                                           streams=Controls)
MEMBER_WITHOUT_CFG = ClientAlgorithm(state="c_i", leader=Leader, member=MemberWithoutCfg, streams=Controls)
leader_without_cfg = _naming("LEADER_WITHOUT_CFG")
update_without_weight = _naming("UPDATE_WITHOUT_WEIGHT")
training_without_context = _naming("TRAINING_WITHOUT_CONTEXT")
member_without_cfg = _naming("MEMBER_WITHOUT_CFG")
