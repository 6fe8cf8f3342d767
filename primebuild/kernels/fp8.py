"""FP8 (e4m3) block quantisation: the DeepSeek-V3 / GLM-5 checkpoint convention, and its matmul.

Convention (what those checkpoints store beside each fp8 weight as ``weight_scale_inv``):

- weights [N, K] are cut into 128 x 128 blocks; each block b gets one fp32 scale s_b = amax(|w_b|) / 448
  and stores q = round_to_e4m3(w / s_b), so that w ~= q * s_b. Scales are [ceil(N/128), ceil(K/128)].
- activations [..., K] are cut into 1 x 128 tiles along K (one scale per token per 128 channels),
  quantised the same way at run time: scales [..., ceil(K/128)].
- ``fp8_block_matmul(x, w_q, w_s)`` = quantise x per tile, then y = deq(x) @ deq(w).T accumulated in fp32,
  returned in x's dtype. Every backend computes this one function; they differ only in rounding order.

Backends of ``blockwise_scaled_mm`` (the product of already-quantised operands):

- ``"reference"``: dequantise both operands to fp32 and call one fp32 matmul. Any device; the ground
  truth the tests compare against.
- ``"scaled_mm"``: cuBLAS's block-scaled fp8 GEMM (CUDA >= 12.9, Hopper or newer) through PyTorch:
  ``torch.nn.functional.scaled_mm`` with (BlockWise1x128, BlockWise128x128) recipes where this torch has
  it, else ``torch._scaled_mm``, which infers the same recipe from the scale shapes. The fp8 tensor cores
  multiply 128-deep K slices and the scales are applied to the fp32 partial sums of each slice, so
  nothing is dequantised in memory. cuBLAS wants the scales in particular layouts (see
  ``scaled_mm_operands``) and refuses "fast accumulation" with block scales, so sums stay fp32. It
  writes bf16 only (with block scales); another ``out_dtype`` is a cast of that.
- ``"auto"``: ``scaled_mm`` on a CUDA device of compute capability >= 9.0 when N and K are multiples of
  128, else ``reference``. If the fast call refuses a weight shape (an older torch, cuBLAS or driver), a
  warning is logged and that shape uses the reference from then on in this process.

No Triton kernel here: cuBLAS's kernel is what vLLM/SGLang fall back to and beats a first Triton
version; a Triton one could not be run or checked on the CPU-only machines where the tests run.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
BLOCK = 128
# A block of zeros gets this scale instead of 0, so that q = w / s stays 0 rather than NaN.
_MIN_AMAX = 1e-12

# (device type, N, K) -> why the fast GEMM refused that weight shape; "auto" then uses the reference for it.
_FAST_REFUSED: dict[tuple[str, int, int], str] = {}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _to_fp8(scaled: torch.Tensor) -> torch.Tensor:
    # Clamp first: fp32 division can land a hair above 448, and the cast is not saturating everywhere.
    return scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_blockwise(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A 2-D weight [N, K] -> (q [N, K] float8_e4m3fn, scales [ceil(N/block), ceil(K/block)] float32)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_blockwise expects a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    nb, kb = _ceil_div(n, block), _ceil_div(k, block)
    padded = F.pad(w.float(), (0, kb * block - k, 0, nb * block - n))
    blocks = padded.view(nb, block, kb, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_(min=_MIN_AMAX)
    scales = amax / FP8_MAX
    q = _to_fp8(blocks / scales[:, None, :, None]).view(nb * block, kb * block)[:n, :k]
    return q.contiguous(), scales


def dequantize_blockwise(
    q: torch.Tensor, scales: torch.Tensor, block: int = BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of ``quantize_blockwise``: q * scale of its block, as ``dtype``."""
    n, k = q.shape
    if scales.shape != (_ceil_div(n, block), _ceil_div(k, block)):
        raise ValueError(f"scales {tuple(scales.shape)} do not fit a {n}x{k} weight in {block}-blocks")
    full = scales.float().repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (q.float() * full).to(dtype)


def quantize_activation(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations [..., K] -> (q [..., K] fp8, scales [..., ceil(K/block)] fp32): 1 x block tiles."""
    k = x.shape[-1]
    kb = _ceil_div(k, block)
    tiles = F.pad(x.float(), (0, kb * block - k)).view(*x.shape[:-1], kb, block)
    scales = tiles.abs().amax(dim=-1).clamp_(min=_MIN_AMAX) / FP8_MAX
    q = _to_fp8(tiles / scales[..., None]).view(*x.shape[:-1], kb * block)[..., :k]
    return q.contiguous(), scales


def dequantize_activation(
    q: torch.Tensor, scales: torch.Tensor, block: int = BLOCK, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    k = q.shape[-1]
    return (q.float() * scales.float().repeat_interleave(block, -1)[..., :k]).to(dtype)


def fake_quantize_activation(x: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """dequantize_activation(*quantize_activation(x)) in x's dtype, bit for bit, in fewer calls: what
    the reference GEMM multiplies. A CPU has no fp8 GEMM, so FP8 on a CPU is this rounding of the
    activations times a weight dequantised once (``BlockFp8Weight``): the same function as the GPU's
    scaled GEMM up to the order of the fp32 sums, at fp32 matmul speed plus ~7 elementwise calls."""
    k = x.shape[-1]
    if k % block:
        return dequantize_activation(*quantize_activation(x, block), block, x.dtype)
    tiles = x.float().view(*x.shape[:-1], k // block, block)
    scales = tiles.abs().amax(dim=-1, keepdim=True).clamp_(min=_MIN_AMAX) / FP8_MAX
    q = _to_fp8(tiles / scales)
    return (q.float() * scales).view(x.shape).to(x.dtype)


class BlockFp8Weight:
    """A weight [N, K] quantised once into the block format, multiplied the fastest way its device has.

    On a GPU with the block-scaled GEMM (``fast``): activations are quantised per call and cuBLAS
    multiplies the fp8 operands (``fp8_block_matmul``). Elsewhere: the weight is dequantised once
    (``dequantised``, exact: e4m3 value times its fp32 block scale, in fp32) and each call multiplies
    ``fake_quantize_activation(x)`` by it in fp32 (``matmul``) -- the reference function without
    dequantising the weight on every call (measured on the 2-core CPU: 1.2-2.5 ms -> 0.3-0.6 ms for
    64 x 128 x 384; the CPU's own ``torch._scaled_mm`` refuses block scales, and 128-deep rowwise
    ``_scaled_mm`` slices were slower than the reference)."""

    __slots__ = ("q", "scales", "fast", "dequantised")

    def __init__(self, weight: torch.Tensor, parts: tuple[int, ...] | None = None):
        """`parts`: the row counts of the checkpoint weights fused into `weight` (q|k|v, gate|up); each is
        quantised on its own blocks, as an FP8 checkpoint stores it, so a fused matmul computes exactly
        what the separate ones would. The fused scales stay a valid block format (and the fast GEMM
        usable) when every part's rows are a multiple of the block."""
        n, k = weight.shape
        parts = parts or (n,)
        if sum(parts) != n:
            raise ValueError(f"parts {parts} do not add up to the weight's {n} rows")
        self._hold([quantize_blockwise(w) for w in weight.split(list(parts))], weight.dtype)

    @classmethod
    def from_blocks(cls, quantised: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> BlockFp8Weight:
        """A weight that arrived already quantised (FP8 on the wire): each part's (q, scales), the pairs
        `__init__` would have computed from a weight of `dtype`."""
        weight = cls.__new__(cls)
        weight._hold(quantised, dtype)
        return weight

    def _hold(self, quantised: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> None:
        self.q = torch.cat([q for q, _ in quantised])
        n, k = self.q.shape
        aligned = all(q.shape[0] % BLOCK == 0 for q, _ in quantised[:-1])
        self.scales = torch.cat([sc for _, sc in quantised]) if aligned else None
        self.fast = aligned and fast_path_available(self.q.device, n, k)
        dtype = dtype if dtype == torch.float64 else torch.float32
        self.dequantised = torch.cat([dequantize_blockwise(q, sc, dtype=dtype) for q, sc in quantised])

    def matmul(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [..., K] @ w.T in FP8 (x quantised per 1x128 tile) -> [..., N] in ``out_dtype`` (default x's)."""
        out_dtype = out_dtype or x.dtype
        if self.fast:
            return fp8_block_matmul(x, self.q, self.scales, out_dtype=out_dtype)
        return (fake_quantize_activation(x).to(self.dequantised.dtype) @ self.dequantised.T).to(out_dtype)


# ------------------------------------------------------------------------------------------ the GEMM
def scaled_mm_operands(
    x_q: torch.Tensor, x_scales: torch.Tensor, w_q: torch.Tensor, w_scales: torch.Tensor, *, padded_k: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Lay the operands out as cuBLAS's block-scaled GEMM wants them; returns (a, b, scale_a, scale_b, M).

    - a = x_q [M', K] row-major, M' = M rounded up to 4 (zero rows): the activation scales are read
      column-major ("outer-dim-major", stride [1, M']) and their leading dimension must be 16-byte aligned.
    - b = w_q.t(): [K, N] column-major, a view of the stored [N, K] weight.
    - scale_a: [M', K/128] with stride [1, M'].
    - scale_b: [K/128, N/128], the transposed view of w_scales [N/128, K/128]; with ``padded_k`` (the
      ``F.scaled_mm`` API) w_scales is first padded to a multiple of 4 K-blocks, so scale_b is
      [round_up(K/128, 4), N/128] with stride [1, round_up(K/128, 4)]. ``torch._scaled_mm`` infers the
      recipe from exact shapes and wants it unpadded.
    """
    m, k = x_q.shape
    n = w_q.shape[0]
    if k % BLOCK or n % BLOCK:
        raise ValueError(f"the block-scaled GEMM needs N and K divisible by {BLOCK}, got N={n}, K={k}")
    pad_m = -m % 4
    if pad_m:
        x_q = torch.cat([x_q, x_q.new_zeros(pad_m, k)])
        x_scales = torch.cat([x_scales, x_scales.new_ones(pad_m, x_scales.shape[1])])
    scale_a = x_scales.float().t().contiguous().t()
    kb = k // BLOCK
    w_s = w_scales.float()
    if padded_k and kb % 4:
        w_s = F.pad(w_s, (0, 4 - kb % 4), value=1.0)
    return x_q, w_q.t(), scale_a, w_s.contiguous().t(), m


def _scaled_mm_cuda(x_q, x_scales, w_q, w_scales, out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS block-scaled GEMM: the newer ``F.scaled_mm`` API first, then ``torch._scaled_mm``.

    Block scaling writes bf16 only; any other ``out_dtype`` is a cast of that."""
    y = _scaled_mm_bf16(x_q, x_scales, w_q, w_scales)
    return y if out_dtype == torch.bfloat16 else y.to(out_dtype)


def _call_f_scaled_mm(x_q, x_scales, w_q, w_scales) -> torch.Tensor:
    a, b, sa, sb, m = scaled_mm_operands(x_q, x_scales, w_q, w_scales, padded_k=True)
    st = F.ScalingType
    return F.scaled_mm(a, b, sa, st.BlockWise1x128, sb, st.BlockWise128x128, output_dtype=torch.bfloat16)[:m]


def _call_torch_scaled_mm(x_q, x_scales, w_q, w_scales) -> torch.Tensor:
    a, b, sa, sb, m = scaled_mm_operands(x_q, x_scales, w_q, w_scales, padded_k=False)
    return torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)[:m]


_APIS = {"F.scaled_mm": _call_f_scaled_mm, "torch._scaled_mm": _call_torch_scaled_mm}
_working_api: list[str] = []  # the entry point that this process found to work (tried once, then kept)


def scaled_mm_api() -> str:
    """The PyTorch entry point the fast path uses (or would try first), for benchmark reports."""
    if _working_api:
        return _working_api[0]
    return "F.scaled_mm" if hasattr(F, "scaled_mm") and hasattr(F, "ScalingType") else "torch._scaled_mm"


def _scaled_mm_bf16(x_q, x_scales, w_q, w_scales) -> torch.Tensor:
    """Try the entry point that worked before first, then the others; remember the one that works."""
    names = [name for name in _APIS if name != "F.scaled_mm" or hasattr(F, "ScalingType")]
    names.sort(key=lambda name: name not in _working_api)
    errors = []
    for name in names:
        try:
            y = _APIS[name](x_q, x_scales, w_q, w_scales)
        except (RuntimeError, ValueError, TypeError) as err:
            errors.append(f"{name}: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
            continue
        _working_api[:] = [name]
        return y
    raise RuntimeError("block-scaled fp8 GEMM refused: " + " | ".join(errors))


def fast_path_available(device: torch.device | str, n: int, k: int) -> bool:
    device = torch.device(device)
    if device.type != "cuda" or n % BLOCK or k % BLOCK or (device.type, n, k) in _FAST_REFUSED:
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def blockwise_scaled_mm(
    x_q: torch.Tensor,
    x_scales: torch.Tensor,
    w_q: torch.Tensor,
    w_scales: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    backend: str = "auto",
) -> torch.Tensor:
    """deq(x_q) [M, K] @ deq(w_q).T [K, N] -> [M, N] in ``out_dtype``, from already-quantised operands."""
    if backend not in ("auto", "reference", "scaled_mm"):
        raise ValueError(f"backend must be 'auto', 'reference' or 'scaled_mm', not {backend!r}")
    n, k = w_q.shape
    if x_q.shape[-1] != k:
        raise ValueError(f"x has K={x_q.shape[-1]}, the weight has K={k}")
    explicit = backend == "scaled_mm"
    if explicit or (backend == "auto" and fast_path_available(x_q.device, n, k)):
        try:
            return _scaled_mm_cuda(x_q, x_scales, w_q, w_scales, out_dtype)
        except RuntimeError as err:
            if explicit:
                raise
            _FAST_REFUSED[(x_q.device.type, n, k)] = str(err)
            log.warning("%s; weights of shape %dx%d use the fp32 reference from now on", err, n, k)
    x = dequantize_activation(x_q, x_scales)
    w = dequantize_blockwise(w_q, w_scales)
    return (x @ w.t()).to(out_dtype)


def fp8_block_matmul(
    x: torch.Tensor,
    w_q: torch.Tensor,
    w_scales: torch.Tensor,
    *,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """y = x @ w.T for an fp8 block-quantised weight: x [..., K] is quantised per 1x128 tile, the product
    accumulates in fp32, and y [..., N] comes back in ``out_dtype`` (default: x's dtype)."""
    lead = x.shape[:-1]
    x_q, x_scales = quantize_activation(x.reshape(-1, x.shape[-1]))
    y = blockwise_scaled_mm(
        x_q, x_scales, w_q, w_scales, out_dtype=out_dtype or x.dtype, backend=backend
    )
    return y.view(*lead, w_q.shape[0])


def fp8_block_matmul_reference(x: torch.Tensor, w_q: torch.Tensor, w_scales: torch.Tensor) -> torch.Tensor:
    """The same function in plain fp32 torch, returned as fp32 (what the tests compare against)."""
    return fp8_block_matmul(x.float(), w_q, w_scales, out_dtype=torch.float32, backend="reference")
