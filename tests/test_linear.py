"""The dense-layer function: oneDNN on CPU in fp32 when this torch build passes the check, F.linear elsewhere."""

import pytest
import torch
import torch.nn.functional as F

from tieredkv.kernels import select_kernels
from tieredkv.kernels.linear import FORCE_ENV, onednn_linear, onednn_linear_usable, select_linear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
CPU = torch.device("cpu")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 32, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_onednn_linear_matches_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(160, 96, generator=g)
    b = torch.randn(160, generator=g) if with_bias else None
    with torch.inference_mode():
        got = onednn_linear(x, w, b)
        assert got.shape == (rows, 160)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
        # a strided view and a 3-d input, as the model hands it over
        xt = torch.randn(96, rows, generator=g).t()
        torch.testing.assert_close(onednn_linear(xt, w, b), F.linear(xt, w, b), rtol=1e-5, atol=1e-4)
        x3 = x.view(1, rows, 96)
        torch.testing.assert_close(onednn_linear(x3, w, b), F.linear(x3, w, b), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_cpu_fp32_selects_onednn_and_others_keep_f_linear(monkeypatch):
    monkeypatch.delenv(FORCE_ENV, raising=False)
    assert onednn_linear_usable()
    assert select_linear(CPU, torch.float32) is onednn_linear
    assert select_kernels("auto", CPU, torch.float32).linear is onednn_linear
    assert select_linear(CPU, torch.bfloat16) is F.linear
    assert select_linear(torch.device("cuda"), torch.float32) is F.linear
    monkeypatch.setenv(FORCE_ENV, "torch")
    assert select_linear(CPU, torch.float32) is F.linear
    assert select_kernels("auto", CPU, torch.float32).linear is F.linear


def test_bad_force_value_is_refused(monkeypatch):
    monkeypatch.setenv(FORCE_ENV, "blas")
    with pytest.raises(ValueError, match=FORCE_ENV):
        select_linear(CPU, torch.float32)
    monkeypatch.setenv(FORCE_ENV, "onednn")
    with pytest.raises(ValueError, match="fp32 weights on CPU"):
        select_linear(CPU, torch.bfloat16)
