"""FP8 block quantisation: error bounds, the matmul against fp32, and the cuBLAS operand layouts.

Tolerances (e4m3 keeps 3 mantissa bits):
- round trip, per element: |w - deq(q)| <= |w| * 2^-4 (half a step of a normal e4m3 number)
  + scale * 2^-10 (half a subnormal step); relative Frobenius error on Gaussian data ~0.027, bound 0.03;
- W8A8 matmul vs the unquantised fp32 product: ~0.037 relative, bound 0.045;
- fast path vs the fp32 reference on the same quantised operands: bf16 output rounding, bound 1e-2.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from primebuild.kernels import fp8
from primebuild.kernels.fp8 import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    dequantize_activation,
    dequantize_blockwise,
    fast_path_available,
    fp8_block_matmul,
    fp8_block_matmul_reference,
    quantize_activation,
    quantize_blockwise,
    scaled_mm_operands,
)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def weight(n: int, k: int, seed: int) -> torch.Tensor:
    """Gaussian rows with varied magnitudes (so blocks get different scales), fresh per seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g) * (0.01 + 3 * torch.rand(n, 1, generator=g))


def expand(scales: torch.Tensor, n: int, k: int) -> torch.Tensor:
    return scales.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shape", [(256, 512), (384, 640), (130, 200), (1, 7)])
def test_round_trip_error_bound(shape, seed):
    n, k = shape
    w = weight(n, k, seed)
    q, scales = quantize_blockwise(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and q.is_contiguous()
    assert scales.dtype == torch.float32 and scales.shape == (-(-n // BLOCK), -(-k // BLOCK))
    back = dequantize_blockwise(q, scales)
    bound = w.abs() * 2**-4 + expand(scales, n, k) * 2**-10
    assert ((back - w).abs() <= bound * (1 + 1e-6)).all()
    if n * k > 1000:
        assert rel(back, w) < 0.03


def test_scales_follow_block_amax():
    w = weight(256, 384, 7)
    q, scales = quantize_blockwise(w)
    for i in range(2):
        for j in range(3):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            assert scales[i, j].item() == pytest.approx(block.abs().max().item() / FP8_MAX, rel=1e-6)
            # the largest element of each block lands exactly on +-448
            assert q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float().abs().max() == FP8_MAX


def test_zero_block_and_extremes_stay_finite():
    w = torch.zeros(256, 256)
    w[128:, 128:] = torch.linspace(-1e4, 1e4, 128 * 128).view(128, 128)
    q, scales = quantize_blockwise(w)
    back = dequantize_blockwise(q, scales)
    assert torch.isfinite(q.float()).all() and torch.isfinite(back).all()
    assert (back[:128] == 0).all() and (back[:, :128] == 0).all()
    assert back.abs().max().item() == pytest.approx(1e4, rel=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_activation_tiles_round_trip(seed):
    g = torch.Generator().manual_seed(100 + seed)
    x = torch.randn(3, 5, 300, generator=g) * torch.rand(3, 5, 1, generator=g)
    q, scales = quantize_activation(x)
    assert q.shape == x.shape and scales.shape == (3, 5, 3)
    back = dequantize_activation(q, scales)
    bound = x.abs() * 2**-4 + scales.repeat_interleave(BLOCK, -1)[..., :300] * 2**-10
    assert ((back - x).abs() <= bound * (1 + 1e-6)).all()
    # each 1x128 tile has its own scale
    assert scales[0, 0, 1].item() == pytest.approx(x[0, 0, 128:256].abs().max().item() / FP8_MAX, rel=1e-6)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("m,n,k", [(37, 384, 640), (64, 256, 1024), (1, 128, 128)])
def test_matmul_vs_fp32(m, n, k, seed):
    w = weight(n, k, seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed + 10))
    q, scales = quantize_blockwise(w)
    y = fp8_block_matmul_reference(x, q, scales)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    assert rel(y, x @ w.t()) < 0.045
    # auto on CPU is the reference; leading dims and the output dtype follow x
    x16 = x.to(torch.bfloat16)
    y16 = fp8_block_matmul(x16.view(1, m, k), q, scales)
    assert y16.dtype == torch.bfloat16 and y16.shape == (1, m, n)
    assert rel(y16[0].float(), fp8_block_matmul_reference(x16, q, scales)) < 1e-2


def _emulate_cublas(a, b, scale_a, scale_b, m):
    """What cuBLAS computes from the laid-out operands: per 128-deep K slice, an fp32 product of the fp8
    values scaled by scale_a[row, slice] * scale_b[slice, column block]. Reads the scales through their
    views exactly as laid out, so a wrong layout gives a wrong answer here."""
    k = a.shape[1]
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.float64)
    for s in range(k // BLOCK):
        part = a[:, s * BLOCK : (s + 1) * BLOCK].double() @ b[s * BLOCK : (s + 1) * BLOCK].double()
        col_scale = scale_b[s].double().repeat_interleave(BLOCK)
        out += part * scale_a[:, s, None].double() * col_scale[None, :]
    return out[:m]


@pytest.mark.parametrize("padded_k", [True, False])
@pytest.mark.parametrize("m,n,k", [(37, 384, 640), (64, 256, 1024), (5, 128, 384)])
def test_cublas_operand_layout_computes_the_reference(m, n, k, padded_k):
    w = weight(n, k, m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    w_q, w_s = quantize_blockwise(w)
    x_q, x_s = quantize_activation(x)
    a, b, sa, sb, rows = scaled_mm_operands(x_q, x_s, w_q, w_s, padded_k=padded_k)
    assert rows == m and a.shape[0] % 4 == 0
    assert sa.stride() == (1, a.shape[0])  # outer-dim-major activation scales
    assert b.stride() == (1, k)  # column-major [K, N] view of the [N, K] weight
    if padded_k:
        assert sb.shape[0] % 4 == 0 and sb.stride() == (1, sb.shape[0])
    emulated = _emulate_cublas(a, b, sa, sb, rows)
    assert rel(emulated, fp8_block_matmul_reference(x, w_q, w_s)) < 1e-6


@pytest.mark.parametrize("api", ["F.scaled_mm", "torch._scaled_mm"])
@pytest.mark.parametrize("m,n,k", [(37, 384, 640), (64, 256, 1024)])
def test_fast_path_calls_pass_torch_layout_checks(api, m, n, k):
    """torch's meta kernels hold the shape and stride rules of the CUDA kernels: make the fast path's
    real calls on meta tensors."""
    if api == "F.scaled_mm" and not hasattr(F, "ScalingType"):
        pytest.skip("this torch has no F.scaled_mm")
    x_q = torch.empty(m, k, dtype=FP8_DTYPE, device="meta")
    x_s = torch.empty(m, k // BLOCK, device="meta")
    w_q = torch.empty(n, k, dtype=FP8_DTYPE, device="meta")
    w_s = torch.empty(n // BLOCK, k // BLOCK, device="meta")
    y = fp8._APIS[api](x_q, x_s, w_q, w_s)
    assert y.shape == (m, n) and y.dtype == torch.bfloat16


def test_refused_fast_path_names_every_entry_point_tried():
    """On CPU torch has no block-scaled GEMM: an explicit scaled_mm backend must say so, not compute junk."""
    x_q, x_s = quantize_activation(torch.randn(8, 256))
    w_q, w_s = quantize_blockwise(weight(128, 256, 0))
    with pytest.raises(RuntimeError, match="block-scaled fp8 GEMM refused") as refused:
        fp8.blockwise_scaled_mm(x_q, x_s, w_q, w_s, backend="scaled_mm")
    assert "torch._scaled_mm" in str(refused.value)
    assert not fast_path_available("cpu", 128, 256)
    auto = fp8.blockwise_scaled_mm(x_q, x_s, w_q, w_s, out_dtype=torch.float32)  # auto: the reference here
    assert rel(auto, dequantize_activation(x_q, x_s) @ dequantize_blockwise(w_q, w_s).t()) < 1e-6


def test_bad_inputs_are_refused():
    q, s = quantize_blockwise(weight(128, 256, 0))
    with pytest.raises(ValueError, match="backend"):
        fp8_block_matmul(torch.randn(2, 256), q, s, backend="triton")
    with pytest.raises(ValueError, match="K="):
        fp8_block_matmul(torch.randn(2, 128), q, s)
    with pytest.raises(ValueError, match="2-D"):
        quantize_blockwise(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="divisible"):
        x_q, x_s = quantize_activation(torch.randn(2, 200))
        w_q, w_s = quantize_blockwise(weight(128, 200, 0))
        scaled_mm_operands(x_q, x_s, w_q, w_s, padded_k=True)


def needs_hopper() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the block-scaled fp8 GEMM needs compute capability >= 9.0")


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("m,n,k", [(37, 384, 640), (256, 1024, 2048), (1, 2048, 7168)])
def test_gpu_fast_path_matches_reference(m, n, k, seed):
    needs_hopper()
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    q, scales = quantize_blockwise(w)
    out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
    out.copy_(fp8_block_matmul(x, q, scales, backend="scaled_mm"))
    assert torch.isfinite(out).all()
    assert rel(out.float(), fp8_block_matmul_reference(x, q, scales)) < 1e-2
    assert rel(out.float(), x.float() @ w.t()) < 0.045


@pytest.mark.gpu
def test_gpu_auto_uses_fast_path_for_fp32_inputs_too():
    needs_hopper()
    x = torch.randn(96, 1024, device="cuda")
    w_q, w_s = quantize_blockwise(torch.randn(512, 1024, device="cuda"))
    y = fp8_block_matmul(x, w_q, w_s)  # fp32 in, fp32 out (cast from the GEMM's bf16)
    assert y.dtype == torch.float32
    assert rel(y, fp8_block_matmul_reference(x, w_q, w_s)) < 1e-2
    assert fast_path_available(x.device, 512, 1024)  # not switched off by a refusal


@pytest.mark.parametrize("k", [128, 384, 200])
def test_fake_quantized_activation_is_the_round_trip_bit_for_bit(k):
    """The CPU path's one-call rounding equals dequantize(quantize(x)), outlier and all-zero tiles included."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(7, k, generator=g) * torch.logspace(-6, 4, k)
    x[2] = 0.0  # all-zero tiles
    x[3, 5] = 1e30  # an outlier flattens its own tile only
    want = fp8.dequantize_activation(*fp8.quantize_activation(x), dtype=torch.float32)
    got = fp8.fake_quantize_activation(x)
    assert torch.equal(got, want) and torch.isfinite(got).all() and not got[2].any()


def test_block_weight_matmul_is_the_reference_and_close_to_fp32():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(33, 256, generator=g), torch.randn(384, 256, generator=g)
    weight = fp8.BlockFp8Weight(w)
    assert not weight.fast  # CPU: the reference function with the weight dequantised once
    got = weight.matmul(x)
    assert torch.equal(got, fp8.fp8_block_matmul_reference(x, weight.q, weight.scales))
    assert rel(got, x @ w.T) < 0.045  # e4m3 on both operands: ~2.6% each, as test_matmul_vs_fp32
