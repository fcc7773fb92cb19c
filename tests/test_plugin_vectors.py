"""The check of the vectors a plug-in trainer hands back (mpifl.roles.client_state.vector_problem): each declared
vector there, a flat fp32 tensor of its declared size, else one sentence naming the trainer, the vector, and what
was found against what was declared. Never reshaped or cast (tests/test_mpi_plugin_vectors.py: what a client that
fails it does to the run)."""
from __future__ import annotations

import pytest
import torch

from mpifl.roles.client_state import vector_problem

DECLARED = {"h": 7, "alpha": 1}  # names to elements, in declaration order


def handed_back(**changed) -> dict[str, object]:
    """Vectors as mpifl handed them over (flat fp32 zeros of their declared sizes), with ``changed`` put in."""
    return {**{name: torch.zeros(n) for name, n in DECLARED.items()}, **changed}


def test_vectors_as_declared_pass_whatever_their_values():
    assert vector_problem("pkg.T", handed_back(h=torch.full((7,), float("nan"))), DECLARED) is None  # NaN: keep()'s


@pytest.mark.parametrize(("value", "found"), [
    (torch.zeros(10), "shape (10,) where (7,) was declared"),
    (torch.zeros(7, 1), "shape (7, 1) where (7,) was declared"),  # the right elements, another shape: not reshaped
    (torch.zeros(()), "shape () where (7,) was declared"),
    (torch.zeros(7, dtype=torch.float64), "dtype float64 where float32 was declared"),  # not cast
    (torch.zeros(7, dtype=torch.bfloat16), "dtype bfloat16 where float32 was declared"),
    (torch.zeros(3, dtype=torch.float64), "shape (3,) and dtype float64 where (7,) and float32 were declared"),
])
def test_a_vector_of_another_shape_or_dtype_is_named_with_what_was_declared(value, found):
    assert vector_problem("my_pkg.MyTrainer", handed_back(h=value), DECLARED) == (
        f"trainer my_pkg.MyTrainer left client vector 'h' with {found}")


def test_the_first_vector_not_as_declared_is_named_in_declaration_order():
    state = handed_back(alpha=torch.zeros(2), h=torch.zeros(1))
    assert "client vector 'h' with shape (1,)" in vector_problem("pkg.T", state, DECLARED)


def test_a_vector_taken_away_added_or_replaced_by_something_else_is_named():
    state = handed_back()
    del state["alpha"]
    assert vector_problem("pkg.T", state, DECLARED) == (
        "trainer pkg.T left no client vector 'alpha' (it was declared; change it in place)")
    assert vector_problem("pkg.T", handed_back(beta=torch.zeros(1)), DECLARED) == (
        "trainer pkg.T left client vector 'beta', which its client_state does not declare (it declares 'h', 'alpha')")
    assert vector_problem("pkg.T", handed_back(h=[0.0] * 7), DECLARED) == (
        "trainer pkg.T left client vector 'h' as a list, not a torch.Tensor")
