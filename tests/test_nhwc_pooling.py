"""model.nhwc_pooling: CPU max pooling of NCHW activations runs PyTorch's channels-last kernel between two layout
copies, and its backward PyTorch's NCHW kernel on the indices found. Pooling only selects, so the values, the
indices and the gradients are bit for bit PyTorch's own, ties and overlapping windows included (the first maximum
in the window wins in both kernels); only the time differs."""
from __future__ import annotations

import copy
import itertools
import pickle

import torch
from torch import nn

from mpifl.config import ModelConfig
from mpifl.learning.models import NHWCMaxPool2d, build_model, use_nhwc_pooling

SETTINGS = [dict(kernel_size=k, stride=s, padding=p, dilation=d, ceil_mode=c)
            for k, s, p, d, c in itertools.product((2, 3, (2, 3)), (None, 1, 2), (0, 1), (1, 2), (False, True))
            if p <= (k if isinstance(k, int) else min(k)) // 2]


def pooled_and_grad(module: nn.Module, x: torch.Tensor, upstream_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_()
    out = module(x)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(upstream_seed)).to(out.dtype)
    out.backward(upstream)
    return out.detach(), x.grad


def test_pooling_and_its_gradient_are_bitwise_pytorchs_own_ties_included():
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, (4, 5, 11, 9), generator=generator).float()  # three levels: ties in every window
    for i, setting in enumerate(SETTINGS):
        plain = nn.MaxPool2d(**setting)
        fast = use_nhwc_pooling(nn.Sequential(copy.deepcopy(plain)))[0]
        assert type(fast) is NHWCMaxPool2d
        expected, fast_result = pooled_and_grad(plain, x, i), pooled_and_grad(fast, x, i)
        for want, got in zip(expected, fast_result):
            assert got.is_contiguous() and torch.equal(want, got), setting


def test_narrow_dtypes_pool_and_accumulate_overlapping_gradients_bitwise_as_pytorch_does():
    generator = torch.Generator().manual_seed(1)
    x = torch.randint(0, 3, (4, 5, 11, 9), generator=generator).float()
    for dtype in (torch.bfloat16, torch.float16):
        for setting in (dict(kernel_size=2), dict(kernel_size=3, stride=1), dict(kernel_size=3, stride=2)):
            plain = nn.MaxPool2d(**setting)
            fast = use_nhwc_pooling(nn.Sequential(copy.deepcopy(plain)))[0]
            expected, fast_result = pooled_and_grad(plain, x.to(dtype), 7), pooled_and_grad(fast, x.to(dtype), 7)
            for want, got in zip(expected, fast_result):
                assert got.dtype == dtype and torch.equal(want, got), (dtype, setting)


def test_inputs_it_does_not_speed_up_take_pytorchs_own_path_unchanged():
    fast = use_nhwc_pooling(nn.Sequential(nn.MaxPool2d(2)))[0]
    nhwc = torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
    assert fast(nhwc).is_contiguous(memory_format=torch.channels_last)  # an NHWC chain stays NHWC
    unbatched = torch.randn(3, 8, 8)
    assert torch.equal(fast(unbatched), nn.functional.max_pool2d(unbatched, 2))
    with_indices = use_nhwc_pooling(nn.Sequential(nn.MaxPool2d(2, return_indices=True)))[0]
    x = torch.randn(2, 3, 8, 8)
    for got, want in zip(with_indices(x), nn.functional.max_pool2d(x, 2, return_indices=True)):
        assert torch.equal(got, want)


def test_the_swap_changes_only_the_class_state_pickling_and_copies_alike():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(4 * 13 * 13, 3))
    state = copy.deepcopy(model.state_dict())
    use_nhwc_pooling(model)
    assert isinstance(model[2], nn.MaxPool2d) and model.state_dict().keys() == state.keys()
    clone = pickle.loads(pickle.dumps(model))
    assert type(clone[2]) is NHWCMaxPool2d and type(copy.deepcopy(model)[2]) is NHWCMaxPool2d


def test_training_a_pooling_cnn_gives_bitwise_the_weights_of_pytorchs_own_pooling():
    def trained(nhwc_pooling: bool) -> list[torch.Tensor]:
        model = build_model(ModelConfig(name="plugin_helpers:pooling_cnn", nhwc_pooling=nhwc_pooling), seed=3)
        assert any(type(m) is NHWCMaxPool2d for m in model.modules()) == nhwc_pooling
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        generator = torch.Generator().manual_seed(1)
        for _ in range(20):
            x, y = torch.randn(8, 1, 28, 28, generator=generator), torch.randint(0, 10, (8,), generator=generator)
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        return [p.detach().clone() for p in model.parameters()]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert all(torch.equal(a, b) for a, b in zip(trained(True), trained(False)))
    finally:
        torch.set_num_threads(threads)
