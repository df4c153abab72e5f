"""The verifier's own linear kernel for AVX2/FMA CPUs (cloud/avx2_linear.py): the products of float32 layers, every
row count a pass can have and either thread count; each row's result independent of the rows beside it; and
oneDNN where the kernel does not apply or is turned off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specedge.cloud import avx2_linear
from specedge.cloud.linear import Linear

pytestmark = pytest.mark.skipif(not avx2_linear.available(), reason="no AVX2/FMA CPU or no C++ compiler here")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out_features,in_features", [(16, 8), (960, 576), (576, 1536), (48, 3)])
def test_products_match_float64_for_every_row_count(threads: int, out_features: int, in_features: int):
    torch.manual_seed(out_features + in_features)
    weight = torch.randn(out_features, in_features)
    layer = Linear(weight)
    assert layer.kernel == "avx2"
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in list(range(0, 20)) + [31, 64, 129]:  # every size of the kernel's row groups (6, or 16)
            x = torch.randn(rows, in_features)
            got = layer(x)
            assert got.shape == (rows, out_features) and got.dtype == torch.float32
            want = x.double() @ weight.double().T
            scale = x.abs().double() @ weight.abs().double().T  # the sum's magnitude, which bounds its rounding
            assert ((got.double() - want).abs() <= 1e-6 * in_features * scale + 1e-30).all(), rows
    finally:
        torch.set_num_threads(before)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    """So a node verified in a tree of any size gets the bits a pass of that node alone would."""
    torch.manual_seed(1)
    layer = Linear(torch.randn(192, 576))
    x = torch.randn(17, 576)
    together = layer(x)
    for i in range(17):
        assert torch.equal(together[i], layer(x[i : i + 1])[0])
        assert torch.equal(together[i], layer(x[max(0, i - 5) : i + 1])[-1])


@pytest.mark.skipif(not avx2_linear.available() or avx2_linear.isa() < 2, reason="no AVX-512 on this CPU")
def test_avx512_gives_avx2s_bits_for_every_row_count():
    """Where the CPU has AVX-512 a pass of up to 16 rows reads each weight once; each output still runs the same FMAs
    in the same order, so a verifier's results do not depend on which CPU of a fleet it ran on."""
    torch.manual_seed(3)
    weight = torch.randn(960, 576)
    packed = avx2_linear.pack(weight)
    for rows in list(range(1, 20)) + [33, 64]:
        x = torch.randn(rows, 576)
        assert torch.equal(avx2_linear.matmul(x, packed, instructions=2), avx2_linear.matmul(x, packed, instructions=1))


def test_leading_dimensions_and_non_contiguous_inputs():
    torch.manual_seed(2)
    weight = torch.randn(32, 24)
    layer = Linear(weight)
    x = torch.randn(3, 24, 5).transpose(1, 2)  # [3, 5, 24], not contiguous
    assert torch.allclose(layer(x), x @ weight.T, atol=1e-5)


def test_inputs_of_another_width_are_refused_not_read_past():
    packed = avx2_linear.pack(torch.randn(32, 24))
    with pytest.raises(ValueError, match="12 features for a weight of 24"):
        avx2_linear.matmul(torch.randn(4, 12), packed)


def test_layers_the_kernel_does_not_fit_use_onednn():
    assert Linear(torch.randn(50, 8)).kernel == "onednn"  # outputs not a multiple of the panel
    assert Linear(torch.randn(32, 8, dtype=torch.float64)).kernel == "plain"


def test_turned_off_by_the_environment_the_layers_use_onednn():
    code = "from specedge.cloud.linear import Linear; import torch; print(Linear(torch.randn(32, 8)).kernel)"
    env = {**os.environ, "SPECEDGE_CPU_LINEAR": "onednn"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "onednn"


def test_built_once_into_an_empty_cache_by_processes_started_together(tmp_path):
    """A fresh machine: three processes start at once with nothing built; each gets the kernel, and the cache
    holds one build of it."""
    code = "from specedge.cloud.linear import Linear; import torch; print(Linear(torch.randn(32, 8)).kernel)"
    env = {**os.environ, "SPECEDGE_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    assert [p.communicate(timeout=300)[0].strip() for p in procs] == ["avx2"] * 3
    assert len(list((tmp_path / "kernels").glob("avx2_linear-*.so"))) == 1
    assert not list((tmp_path / "kernels").glob("*.partial"))
