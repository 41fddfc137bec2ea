"""The kernel interface (kernels/interface.py): every kernels namespace and every operator implementation follow it."""

from __future__ import annotations

import importlib
import inspect

import pytest

import harts.kernels as kernels
from harts.kernels import dispatch, naive
from harts.kernels.interface import OPERATORS, Kernels

#: Each operator's implementations: the reference and the fast versions dispatch picks from.
IMPLEMENTATIONS = {
    "chunk_linear_attention": ("linear_attention.naive", "linear_attention.chunk"),
    "causal_conv1d": ("conv.naive", "conv.fla"),
    "attention": ("attention.naive", "attention.varlen"),
    "moe_experts": ("moe.naive", "moe.grouped"),
}


def _parameters(function) -> list[tuple[str, object, object]]:
    """(name, kind, default) of each parameter, ``self`` left out."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("namespace", [naive, dispatch, dispatch.Dispatch("naive"), dispatch.Dispatch("auto")],
                         ids=["naive", "dispatch-module", "Dispatch-naive", "Dispatch-auto"])
def test_every_namespace_is_a_kernels_namespace(namespace):
    assert isinstance(namespace, Kernels)
    for name, protocol in OPERATORS.items():
        assert _parameters(getattr(namespace, name)) == _parameters(protocol.__call__), name


def test_a_namespace_missing_an_operator_is_not_one():
    class Partial:
        chunk_linear_attention = staticmethod(naive.chunk_linear_attention)

    assert not isinstance(Partial(), Kernels)


@pytest.mark.parametrize("operator, module", [(op, m) for op, modules in IMPLEMENTATIONS.items() for m in modules])
def test_every_implementation_has_its_operators_signature(operator, module):
    implementation = getattr(importlib.import_module(f"{kernels.__name__}.{module}"), operator)
    assert _parameters(implementation) == _parameters(OPERATORS[operator].__call__)


def test_the_operators_are_those_dispatch_exports():
    assert set(OPERATORS) <= set(dispatch.__all__) and set(OPERATORS) <= set(naive.__all__)
