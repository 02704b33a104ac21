"""oneDNN linears (streamrl.models.onednn) compute what `F.linear` computes, gradients included."""

import copy
import os

import pytest
import torch
from torch import nn

from streamrl.models.onednn import (
    OneDnnLinear,
    onednn_linear_usable,
    prefers_onednn,
    resolve_onednn,
    use_onednn_linears,
)

pytestmark = pytest.mark.skipif(
    not onednn_linear_usable("cpu", torch.float32), reason="this PyTorch build has no oneDNN"
)


@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_gradients_match_f_linear(bias):
    torch.manual_seed(0)
    plain = nn.Linear(48, 80, bias=bias)
    fast = copy.deepcopy(plain)
    assert use_onednn_linears(fast) == 1 and isinstance(fast, OneDnnLinear)
    x = torch.randn(3, 7, 48)
    x_plain, x_fast = x.clone().requires_grad_(), x.clone().requires_grad_()
    # A non-contiguous upstream gradient (a slice, then a transpose), as log-prob gathers give.
    upstream = torch.randn(80, 7, 3).permute(2, 1, 0)
    out_plain, out_fast = plain(x_plain), fast(x_fast)
    torch.testing.assert_close(out_fast, out_plain, rtol=1e-5, atol=1e-5)
    out_plain.backward(upstream)
    out_fast.backward(upstream)
    torch.testing.assert_close(x_fast.grad, x_plain.grad, rtol=1e-5, atol=1e-5)
    for p_fast, p_plain in zip(fast.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p_fast.grad, p_plain.grad, rtol=1e-5, atol=1e-5)


def test_tied_weights_accumulate_both_gradients():
    torch.manual_seed(0)
    embed = nn.Embedding(20, 16)
    head = nn.Linear(16, 20, bias=False)
    head.weight = embed.weight
    ids = torch.tensor([[1, 5, 7, 19]])
    plain_loss = head(embed(ids)).logsumexp(-1).sum()
    plain_loss.backward()
    expected = embed.weight.grad.clone()
    embed.weight.grad = None
    use_onednn_linears(head)
    head(embed(ids)).logsumexp(-1).sum().backward()
    torch.testing.assert_close(embed.weight.grad, expected, rtol=1e-5, atol=1e-6)


def test_other_dtypes_empty_batches_and_subclasses_fall_back():
    layer = nn.Linear(8, 4)
    use_onednn_linears(layer)
    assert layer(torch.zeros(0, 8)).shape == (0, 4)
    assert layer.double()(torch.randn(2, 8, dtype=torch.float64)).dtype == torch.float64

    class Custom(nn.Linear):
        pass

    model = nn.Sequential(Custom(8, 8), nn.Linear(8, 8, dtype=torch.bfloat16))
    assert use_onednn_linears(model) == 0
    assert type(model[0]) is Custom


def test_a_switched_model_keeps_its_state_dict_and_trains_the_same():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 4))
    fast = copy.deepcopy(plain)
    assert use_onednn_linears(fast) == 2
    assert fast.state_dict().keys() == plain.state_dict().keys()
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    for model in (plain, fast):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(5):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    for p_fast, p_plain in zip(fast.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(p_fast, p_plain, rtol=1e-5, atol=1e-6)


def test_onednn_kernel_caches_are_bounded_unless_the_user_says_otherwise():
    import subprocess
    import sys

    code = (
        "import os, streamrl.models.onednn; "
        "print(os.environ['LRU_CACHE_CAPACITY'], os.environ['ONEDNN_PRIMITIVE_CACHE_CAPACITY'])"
    )
    env = {k: v for k, v in os.environ.items() if not k.endswith("CACHE_CAPACITY")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["256", "256"], out.stderr
    env["LRU_CACHE_CAPACITY"] = "7"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.split() == ["7", "256"], out.stderr


@pytest.mark.parametrize(
    ("vendor", "flags", "expected"),
    [
        ("AuthenticAMD", "fpu sse2 avx2 avx512f avx512bw", True),  # MKL runs AVX2 here
        ("GenuineIntel", "fpu sse2 avx2 avx512f avx512bw", False),  # MKL runs AVX-512 itself
        ("AuthenticAMD", "fpu sse2 avx2 fma", False),  # no AVX-512: about equal, keep MKL
    ],
)
def test_auto_picks_onednn_only_where_mkl_leaves_avx512_unused(vendor, flags, expected) -> None:
    cpu = f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: {flags}\n"
    assert prefers_onednn(f"{cpu}\n{cpu.replace(': 0', ': 1')}") is expected
    assert resolve_onednn(True) and not resolve_onednn(False)
