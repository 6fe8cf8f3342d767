"""The one GPU benchmark: fp8 vs bf16 GEMMs, engine decode vs `transformers.generate`, trainer MFU.

    bash bench/gpu.sh                          # on the H200: installs carried wheels, runs this, ~3-4 min
    python bench/gpu.py --cpu-smoke            # every section at tiny sizes on CPU (~15 s), for tests

Sections (each guarded: a failure is recorded with its traceback and the next section runs; the JSON is
rewritten after every section, so a run killed by its time limit keeps what it measured):

1. env: versions, device, which fp8 GEMM entry point this torch offers.
2. fp8_check: the block-scaled fast path (`primebuild/kernels/fp8.py`) against its fp32 reference at odd shapes.
3. gemm: TFLOP/s = 2*M*N*K / median time (CUDA events, after warm-up) at LLM shapes, M x N x K with
   x [M, K] and a weight [N, K]: bf16 `torch.mm`; fp8 `torch._scaled_mm` with one scale per tensor and
   with one per row/column; the 128x128/1x128 block-scaled GEMM alone (operands quantised beforehand) and
   end to end (`fp8_block_matmul`: activation quantisation included); and the fallback that dequantises
   the weight to bf16 on every call. Each fp8 row also reports its error relative to the fp32 product of
   the unquantised operands.
4. trainer: one rank, the trainer's own `load_model` + `train_step` (bf16 autocast over fp32 master
   weights, AdamW) on synthetic fixed-length batches, random Qwen3-0.6B shape. MFU = 6 * N * tokens/s /
   989e12, N = parameters without the embedding (the tied LM head is then not counted either), 989e12 =
   H100/H200 SXM dense bf16 peak. Also reported: the same with the LM head and causal attention counted,
   (6 * (N + V * H) + 6 * L * heads * head_dim * S) * tokens/s / 989e12, where 6 * L * heads * head_dim
   * S per token is QK^T and PV over an average causal context of S/2, times 3 for forward + backward.
5. engine: the embedded engine (`primebuild/runtime/inference`) vs `transformers.generate` on the same random bf16
   Qwen3 (Qwen3-0.6B's shape), same random prompts, greedy, exactly `new_tokens` new tokens (EOS
   ignored), tokens/s = batch * new_tokens / wall time of the whole call (prefill included), median of
   `repeats` runs after one warm-up each, the two interleaved. Batch sizes not started by
   `engine_cutoff_s` are skipped (and listed).
6. trainer_large: section 4 for the Qwen3-1.7B shape, only if it starts within `budget_s`.
7. engine_fp8: the embedded engine with FP8 block-scaled weights (`precision: fp8`, primebuild/runtime/inference/weights.py)
   vs bf16 on a random ~1B Qwen3-MoE (32 experts, top-4), greedy, same prompts and token counts as section
   5, the two interleaved: decode tokens/s of each, their ratio, and how many greedy tokens agree.

bench/gpu.sh runs this under a hard time limit of 300 s; the cut-offs keep the whole run inside it.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

STARTED = time.monotonic()  # the time limit of bench/gpu.sh counts from here (give or take imports)
REPO = Path(__file__).resolve().parents[1]
ENGINES = ("torchtitan", "hf")  # the trainer's engines, side by side (runtime/trainer/titan_policy.py, model.py)
PEAK_BF16_FLOPS = 989e12  # H100/H200 SXM dense bf16 (datasheet); MFU's denominator

MODEL_SHAPES = {
    # Qwen3-0.6B and Qwen3-1.7B architectures (random weights); "tiny" for --cpu-smoke
    "qwen3-0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512),
}
MOE_SHAPES = {
    # ~1.05B total, ~0.25B active: Qwen3-0.6B's attention with a Qwen3-MoE block of 32 experts (top-4)
    "qwen3-moe-1b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=16, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=128, vocab_size=151936, num_experts=32,
                         num_experts_per_tok=4, moe_intermediate_size=512, norm_topk_prob=True),
    "tiny-moe": dict(hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=32, vocab_size=512, num_experts=4, num_experts_per_tok=2,
                     moe_intermediate_size=128, norm_topk_prob=True),
}


@dataclass
class Sizes:
    device: str
    gemm_shapes: list[tuple[int, int, int]]  # (M, N, K)
    gemm_warmup: int
    gemm_iters: int
    check_shapes: list[tuple[int, int, int]]
    engine_model: str
    moe_model: str  # section engine_fp8
    batches: list[int]
    prompt_len: int
    new_tokens: int
    repeats: int
    trainer_models: list[str]
    optional_trainer_models: list[str]  # a last section, run only if it starts before `budget_s`
    seq_len: int  # prompt + completion tokens per sample
    samples_per_step: int
    micro_batch_tokens: int
    warmup_steps: int
    timed_steps: int
    budget_s: float  # seconds since start after which optional work (the larger trainer) is skipped
    engine_cutoff_s: float  # seconds since start after which no further engine batch size is started


GPU_SIZES = Sizes(
    device="cuda",
    gemm_shapes=[(8192, 8192, 8192), (4096, 14336, 4096), (16384, 2048, 7168)],
    gemm_warmup=5,
    gemm_iters=20,
    check_shapes=[(512, 4096, 1024), (1, 2048, 7168), (37, 384, 640)],  # aligned first
    engine_model="qwen3-0.6b",
    moe_model="qwen3-moe-1b",
    batches=[1, 16, 64, 256],
    prompt_len=32,
    new_tokens=128,
    repeats=3,
    trainer_models=["qwen3-0.6b"],
    optional_trainer_models=["qwen3-1.7b"],
    seq_len=2048,
    samples_per_step=16,
    micro_batch_tokens=8192,
    warmup_steps=2,
    timed_steps=5,
    budget_s=190,
    engine_cutoff_s=200,
)

SMOKE_SIZES = Sizes(
    device="cpu",
    gemm_shapes=[(64, 256, 256)],
    gemm_warmup=1,
    gemm_iters=2,
    check_shapes=[(5, 128, 256)],
    engine_model="tiny",
    moe_model="tiny-moe",
    batches=[1, 3],
    prompt_len=4,
    new_tokens=4,
    repeats=1,
    trainer_models=["tiny"],
    optional_trainer_models=["tiny"],
    seq_len=32,
    samples_per_step=4,
    micro_batch_tokens=64,
    warmup_steps=1,
    timed_steps=1,
    budget_s=1e9,
    engine_cutoff_s=1e9,
)


# ------------------------------------------------------------------------------------------ plumbing
class Report:
    """Results by section, rewritten to disk after each one (atomic replace)."""

    def __init__(self, path: Path, mode: str):
        self.path = path
        self.start = STARTED
        self.data: dict = {"mode": mode, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "sections": {}}

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def run(self, name: str, fn, *args) -> dict | None:
        print(f"\n=== {name} (t={self.elapsed():.0f}s)", flush=True)
        t0 = time.monotonic()
        entry: dict = {}
        try:
            entry["result"] = fn(*args)
            entry["ok"] = True
        except Exception as error:  # one failed section must not lose the others
            entry["ok"] = False
            entry["error"] = f"{type(error).__name__}: {error}"
            entry["traceback"] = traceback.format_exc()[-4000:]
            print(entry["traceback"], flush=True)
        entry["wall_s"] = round(time.monotonic() - t0, 2)
        self.data["sections"][name] = entry
        self.save()
        free_memory()
        return entry.get("result")

    def save(self) -> None:
        self.data["elapsed_s"] = round(self.elapsed(), 2)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, device: str, warmup: int, iters: int) -> float:
    """Median time of one call: CUDA events around each call on the GPU, a synchronised clock on CPU."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    if device == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if not torch.isfinite(out).all():
        return float("nan")
    return ((out - ref).norm() / ref.norm()).item()


# ------------------------------------------------------------------------------------------ sections
def section_env(sizes: Sizes) -> dict:
    from primebuild.kernels import fp8

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "device": sizes.device,
        "fp8_api_first_tried": fp8.scaled_mm_api(),
    }
    for name in ("transformers", "triton", "pydantic", "safetensors"):
        try:
            info[name] = __import__(name).__version__
        except Exception as error:
            info[name] = f"missing ({type(error).__name__})"
    if sizes.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            capability=list(torch.cuda.get_device_capability(0)),
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
        )
    print(json.dumps(info, indent=1))
    return info


def section_fp8_check(sizes: Sizes) -> dict:
    """Fast path vs fp32 reference, also at odd shapes (M not a multiple of 4, K/128 not one of 4)."""
    from primebuild.kernels import fp8

    device = sizes.device
    rows = []
    for m, n, k in sizes.check_shapes:
        g = torch.Generator(device=device).manual_seed(m + n + k)
        w = torch.randn(n, k, device=device, generator=g) * (0.01 + torch.rand(n, 1, device=device, generator=g))
        x = torch.randn(m, k, device=device, generator=g).to(torch.bfloat16)
        w_q, w_s = fp8.quantize_blockwise(w)
        reference = fp8.fp8_block_matmul_reference(x, w_q, w_s)
        row = {"shape": [m, n, k], "ref_vs_unquantised": rel_err(reference, x.float() @ w.t())}
        if fp8.fast_path_available(device, n, k):
            try:
                out = torch.full((m, n), float("nan"), device=device, dtype=torch.bfloat16)
                out.copy_(fp8.fp8_block_matmul(x, w_q, w_s, backend="scaled_mm"))  # every element written?
                err = rel_err(out, reference)
                row.update(fast_vs_ref=err, api=fp8.scaled_mm_api(), ok=err < 1e-2)
            except Exception as error:
                row.update(ok=False, error=f"{type(error).__name__}: {error}")
        else:
            row["fast"] = "not available on this device"
        rows.append(row)
        print(row, flush=True)
    return {"rows": rows}


def gemm_variants(m: int, n: int, k: int, device: str):
    """(a, w, [(name, fn)]) for one shape: operands built once, random (never zeros)."""
    from primebuild.kernels import fp8

    g = torch.Generator(device=device).manual_seed(m * 7 + n * 3 + k)
    a = torch.randn(m, k, device=device, generator=g, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, generator=g, dtype=torch.bfloat16)
    variants = [("bf16 torch.mm", lambda: torch.mm(a, w.t()))]

    a8, w8 = a.to(fp8.FP8_DTYPE), w.to(fp8.FP8_DTYPE)  # |randn| < 448: no scaling needed
    one = torch.ones((), device=device)
    for fast in (True, False):
        variants.append((f"fp8 tensorwise _scaled_mm fast_accum={fast}", lambda fast=fast: torch._scaled_mm(
            a8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16, use_fast_accum=fast)))
    row_a = a.float().abs().amax(dim=1, keepdim=True) / fp8.FP8_MAX
    col_w = w.float().abs().amax(dim=1, keepdim=True) / fp8.FP8_MAX
    a8r, w8r = (a.float() / row_a).to(fp8.FP8_DTYPE), (w.float() / col_w).to(fp8.FP8_DTYPE)
    scale_w = col_w.t().contiguous()
    variants.append(("fp8 rowwise _scaled_mm fast_accum=True", lambda: torch._scaled_mm(
        a8r, w8r.t(), scale_a=row_a, scale_b=scale_w, out_dtype=torch.bfloat16, use_fast_accum=True)))

    w_q, w_s = fp8.quantize_blockwise(w)
    x_q, x_s = fp8.quantize_activation(a)
    backend = "scaled_mm" if fp8.fast_path_available(device, n, k) else "reference"
    variants.append((f"fp8 block 1x128/128x128 gemm only [{backend}]", lambda: fp8.blockwise_scaled_mm(
        x_q, x_s, w_q, w_s, backend=backend)))
    variants.append((f"fp8 block fp8_block_matmul incl. act quant [{backend}]",
                     lambda: fp8.fp8_block_matmul(a, w_q, w_s, backend=backend)))
    variants.append(("fp8 block weight dequant->bf16 + torch.mm (fallback)", lambda: torch.mm(
        a, fp8.dequantize_blockwise(w_q, w_s, dtype=torch.bfloat16).t())))
    return a, w, variants


def section_gemm(sizes: Sizes) -> dict:
    device = sizes.device
    rows = []
    for m, n, k in sizes.gemm_shapes:
        a, w, variants = gemm_variants(m, n, k, device)
        exact = a.float() @ w.float().t()  # fp32 (TF32 off by default) product of the unquantised operands
        for name, fn in variants:
            row = {"shape": [m, n, k], "variant": name}
            try:
                out = fn()
                row["rel_err_vs_fp32"] = rel_err(out, exact)
                del out
                ms = median_ms(fn, device, sizes.gemm_warmup, sizes.gemm_iters)
                row.update(ms=float(f"{ms:.4g}"), tflops=float(f"{2 * m * n * k / ms / 1e9:.4g}"))
            except Exception as error:  # e.g. a recipe this torch/cuBLAS refuses
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            rows.append(row)
            print(f"{m}x{n}x{k} {name:<58} {row.get('tflops', '-'):>8} TFLOP/s  "
                  f"err {row.get('rel_err_vs_fp32', float('nan')):.2e} {row.get('error', '')}", flush=True)
        del a, w, variants, exact
        free_memory()
    return {"rows": rows}


def build_random_qwen3(folder: Path, shape: str, device: str) -> Path:
    """A random bf16 Qwen3 of the given shape saved as an HF folder (initialised on `device`: fast)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if folder.exists():
        return folder
    config = Qwen3Config(**MODEL_SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(folder)
    del model
    free_memory()
    return folder


def section_engine(sizes: Sizes, workdir: Path, report: Report) -> dict:
    from transformers import AutoModelForCausalLM

    from primebuild.runtime.inference.engine import Engine
    from primebuild.runtime.inference.sampling import SamplingParams

    device = sizes.device
    t0 = time.monotonic()
    folder = build_random_qwen3(workdir / sizes.engine_model, sizes.engine_model, device)
    build_s = time.monotonic() - t0
    vocab = MODEL_SHAPES[sizes.engine_model]["vocab_size"]
    new = sizes.new_tokens
    engine = Engine(folder, max_num_seqs=max(sizes.batches), max_model_len=sizes.prompt_len + new,
                    dtype="bfloat16", device=device)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(device).eval()
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    rows, skipped = [], []
    try:
        for batch in sizes.batches:
            if report.elapsed() > sizes.engine_cutoff_s:  # leave time for the sections after this one
                skipped.append(batch)
                continue
            prompts = torch.randint(10, vocab, (batch, sizes.prompt_len),
                                    generator=torch.Generator().manual_seed(batch)).tolist()
            ids = torch.tensor(prompts, device=device)

            def run_hf(ids=ids):
                with torch.inference_mode():
                    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                      max_new_tokens=new, min_new_tokens=new, eos_token_id=None, pad_token_id=0)
                return out[:, sizes.prompt_len:].tolist()

            def run_engine(prompts=prompts):
                return [choices[0].token_ids for choices in engine.generate(prompts, params)]

            outputs = [run_hf(), run_engine()]  # warm-up
            times: list[list[float]] = [[], []]
            for _ in range(sizes.repeats):
                for i, fn in enumerate((run_hf, run_engine)):
                    sync(device)
                    start = time.perf_counter()
                    outputs[i] = fn()
                    times[i].append(time.perf_counter() - start)
            hf_s, engine_s = statistics.median(times[0]), statistics.median(times[1])
            hf_tokens, engine_tokens = outputs
            assert all(len(t) == new for t in engine_tokens + hf_tokens), "wrong number of new tokens"
            agree = sum(a == b for x, y in zip(hf_tokens, engine_tokens, strict=True)
                        for a, b in zip(x, y, strict=True))
            row = {
                "batch": batch,
                "generate_tok_s": round(batch * new / hf_s, 1),
                "engine_tok_s": round(batch * new / engine_s, 1),
                "speedup": round(hf_s / engine_s, 2),
                "first_token_agreement": sum(x[0] == y[0] for x, y in zip(hf_tokens, engine_tokens, strict=True)) / batch,
                "token_agreement": round(agree / (batch * new), 4),
            }
            rows.append(row)
            print(row, flush=True)
    finally:
        engine.shutdown()  # the model tensors go with this frame; Report.run then empties the cache
    return {"model": sizes.engine_model, "dtype": "bfloat16", "prompt_len": sizes.prompt_len,
            "new_tokens": new, "repeats": sizes.repeats, "build_s": round(build_s, 1), "rows": rows,
            "skipped_batches_over_time": skipped}


def build_random_qwen3_moe(folder: Path, shape: str, device: str) -> Path:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    if folder.exists():
        return folder
    config = Qwen3MoeConfig(**MOE_SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=True,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3MoeForCausalLM(config)
    model.to(torch.bfloat16).save_pretrained(folder)
    del model
    free_memory()
    return folder


def section_engine_fp8(sizes: Sizes, workdir: Path, report: Report) -> dict:
    from primebuild.runtime.inference.engine import Engine
    from primebuild.runtime.inference.sampling import SamplingParams

    device = sizes.device
    folder = build_random_qwen3_moe(workdir / sizes.moe_model, sizes.moe_model, device)
    vocab, new = MOE_SHAPES[sizes.moe_model]["vocab_size"], sizes.new_tokens
    # one engine at a time holds the weights; each batch size runs both, interleaved repeat by repeat
    engines = {name: Engine(folder, max_num_seqs=max(sizes.batches), max_model_len=sizes.prompt_len + new,
                            dtype="bfloat16", device=device, fp8=name == "fp8") for name in ("bf16", "fp8")}
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    rows, skipped = [], []
    try:
        fast = engines["fp8"].forward.weights.layers[0].qkv.fp8.fast
        for batch in sizes.batches:
            if report.elapsed() > sizes.engine_cutoff_s:
                skipped.append(batch)
                continue
            prompts = torch.randint(10, vocab, (batch, sizes.prompt_len),
                                    generator=torch.Generator().manual_seed(batch)).tolist()
            outputs, times = {}, {name: [] for name in engines}
            for name, engine in engines.items():  # warm-up
                outputs[name] = [c[0].token_ids for c in engine.generate(prompts, params)]
            for _ in range(sizes.repeats):
                for name, engine in engines.items():
                    sync(device)
                    start = time.perf_counter()
                    outputs[name] = [c[0].token_ids for c in engine.generate(prompts, params)]
                    times[name].append(time.perf_counter() - start)
            bf16_s, fp8_s = statistics.median(times["bf16"]), statistics.median(times["fp8"])
            agree = sum(a == b for x, y in zip(outputs["bf16"], outputs["fp8"], strict=True)
                        for a, b in zip(x, y, strict=True))
            row = {"batch": batch, "bf16_tok_s": round(batch * new / bf16_s, 1),
                   "fp8_tok_s": round(batch * new / fp8_s, 1), "fp8_over_bf16": round(bf16_s / fp8_s, 2),
                   "token_agreement": round(agree / (batch * new), 4)}
            rows.append(row)
            print(row, flush=True)
    finally:
        for engine in engines.values():
            engine.shutdown()
    return {"model": sizes.moe_model, "fp8_gemm": "cuBLAS block-scaled" if fast else "reference (dequantised)",
            "prompt_len": sizes.prompt_len, "new_tokens": new, "repeats": sizes.repeats, "rows": rows,
            "skipped_batches_over_time": skipped}


def synthetic_batch(step: int, sizes: Sizes, vocab: int):
    """Fixed-length samples (no padding), a quarter prompt, random ids and +-1 advantages."""
    from primebuild.contracts.rollout import RolloutBatch, Sample

    g = torch.Generator().manual_seed(step)
    prompt_len = sizes.seq_len // 4
    completion_len = sizes.seq_len - prompt_len
    samples = []
    for i in range(sizes.samples_per_step):
        ids = torch.randint(10, vocab, (sizes.seq_len,), generator=g).tolist()
        samples.append(Sample(
            prompt_ids=ids[:prompt_len], completion_ids=ids[prompt_len:],
            # a random model is near uniform: log-probs near -log(V) keep importance ratios near 1
            inference_logprobs=(0.1 * torch.randn(completion_len, generator=g) - math.log(vocab)).tolist(),
            advantage=1.0 if i % 2 else -1.0, reward=float(i % 2), policy_version=step - 1,
            env_id="synthetic",
        ))
    return RolloutBatch(step=step, samples=samples, temperature=1.0)


def train_one(sizes: Sizes, shape: str, workdir: Path, engine: str = "torchtitan") -> dict:
    from primebuild.contracts.trainer import TrainerConfig
    from primebuild.runtime.trainer.losses import resolve_loss
    from primebuild.runtime.trainer.main import train_step
    from primebuild.runtime.trainer.model import init_distributed, load_model

    t0 = time.monotonic()
    folder = build_random_qwen3(workdir / shape, shape, sizes.device)
    config = TrainerConfig(model_path=str(folder), run_dir=str(workdir / f"run-{shape}"), max_steps=10**6,
                           precision="bf16", micro_batch_tokens=sizes.micro_batch_tokens,
                           logprob_chunk_tokens=sizes.micro_batch_tokens, lr=1e-6, temperature=1.0,
                           max_completion_tokens=sizes.seq_len, engine=engine)
    env = init_distributed()
    if engine == "torchtitan":
        from primebuild.runtime.trainer.titan_policy import load_titan_model

        model = load_titan_model(config.model_path, env, "bfloat16", config.activation_checkpointing,
                                 config.logprob_chunk_tokens)
    else:
        model = load_model(config.model_path, env, "bfloat16", config.activation_checkpointing,
                           config.logprob_chunk_tokens)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=config.betas, eps=config.eps,
                                  weight_decay=config.weight_decay)
    loss_fn = resolve_loss(config.loss)
    load_s = time.monotonic() - t0
    if sizes.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    cfg = model.config
    vocab, hidden = cfg.vocab_size, cfg.hidden_size
    step_times, losses = [], []
    for step in range(1, sizes.warmup_steps + sizes.timed_steps + 1):
        batch = synthetic_batch(step, sizes, vocab)
        sync(sizes.device)
        start = time.perf_counter()
        stats = train_step(model, optimizer, batch, config, loss_fn, env, step)  # ends in .tolist(): synced
        elapsed = time.perf_counter() - start
        if step > sizes.warmup_steps:
            step_times.append(elapsed)
        losses.append(stats["loss"])
    tokens = sizes.samples_per_step * sizes.seq_len
    step_s = statistics.median(step_times)
    tok_s = tokens / step_s
    n_non_embedding = sum(p.numel() for name, p in model.named_parameters()
                          if "embed" not in name and "lm_head" not in name)
    heads, head_dim, layers = cfg.num_attention_heads, cfg.head_dim, cfg.num_hidden_layers
    flops_6n = 6 * n_non_embedding
    flops_full = 6 * (n_non_embedding + vocab * hidden) + 6 * layers * heads * head_dim * sizes.seq_len
    result = {
        "model": shape,
        "engine": engine,
        "params_non_embedding": n_non_embedding,
        "params_total": sum(p.numel() for p in model.parameters()),
        "tokens_per_step": tokens,
        "seq_len": sizes.seq_len,
        "micro_batch_tokens": sizes.micro_batch_tokens,
        "step_s_median": round(step_s, 4),
        "step_s_all": [round(t, 4) for t in step_times],
        "tokens_per_s": round(tok_s, 1),
        "mfu_6N": float(f"{flops_6n * tok_s / PEAK_BF16_FLOPS:.4g}"),
        "mfu_with_head_and_attention": float(f"{flops_full * tok_s / PEAK_BF16_FLOPS:.4g}"),
        "losses_finite": all(math.isfinite(x) for x in losses),
        "load_s": round(load_s, 1),
    }
    if sizes.device == "cuda":
        result["peak_memory_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    del model, optimizer
    free_memory()
    print(result, flush=True)
    return result


def section_trainer(sizes: Sizes, workdir: Path) -> dict:
    runs = [train_one(sizes, shape, workdir, engine) for shape in sizes.trainer_models for engine in ENGINES]
    return {"peak_flops": PEAK_BF16_FLOPS, "formula": "mfu_6N = 6 * N_non_embedding * tokens/s / 989e12",
            "runs": runs}


def section_trainer_large(sizes: Sizes, workdir: Path, report: Report) -> dict:
    """The larger model, only when the run is still inside its budget (the time limit is hard)."""
    if report.elapsed() > sizes.budget_s:
        return {"runs": [], "skipped": f"over the time budget ({report.elapsed():.0f}s > {sizes.budget_s:.0f}s)"}
    return {"runs": [train_one(sizes, shape, workdir, engine) for shape in sizes.optional_trainer_models
                     for engine in ENGINES]}


# ------------------------------------------------------------------------------------------ summary
def print_summary(data: dict) -> None:
    sections = data["sections"]
    print(f"\n=== summary ({data['elapsed_s']:.0f}s, mode {data['mode']})")
    for name, entry in sections.items():
        print(f"{name:<14} {'ok' if entry['ok'] else 'FAILED: ' + entry['error'][:200]} ({entry['wall_s']}s)")
    gemm = sections.get("gemm", {}).get("result") or {}
    for row in gemm.get("rows", []):
        shape = "x".join(map(str, row["shape"]))
        value = f"{row['tflops']:>7.1f} TFLOP/s err {row['rel_err_vs_fp32']:.1e}" if "tflops" in row else row.get(
            "error", "")[:90]
        print(f"  {shape:<16} {row['variant']:<58} {value}")
    engine = sections.get("engine", {}).get("result") or {}
    if engine.get("skipped_batches_over_time"):
        print(f"  engine batches skipped (time): {engine['skipped_batches_over_time']}")
    for row in engine.get("rows", []):
        print(f"  engine batch {row['batch']:>4}: generate {row['generate_tok_s']:>9.1f} tok/s, engine "
              f"{row['engine_tok_s']:>9.1f} tok/s, x{row['speedup']}, agreement {row['token_agreement']}")
    engine_fp8 = sections.get("engine_fp8", {}).get("result") or {}
    for row in engine_fp8.get("rows", []):
        print(f"  MoE engine batch {row['batch']:>4}: bf16 {row['bf16_tok_s']:>9.1f} tok/s, fp8 {row['fp8_tok_s']:>9.1f} "
              f"tok/s ({engine_fp8['fp8_gemm']}), x{row['fp8_over_bf16']}, agreement {row['token_agreement']}")
    for name in ("trainer", "trainer_large"):
        trainer = sections.get(name, {}).get("result") or {}
        for run in trainer.get("runs", []):
            print(f"  trainer {run['model']} ({run['engine']}): {run['tokens_per_s']:.0f} tok/s, MFU(6N) {run['mfu_6N']:.3f}, "
                  f"MFU(+head+attn) {run['mfu_with_head_and_attention']:.3f}, step {run['step_s_median']}s, "
                  f"peak {run.get('peak_memory_gib', '-')} GiB")
        if trainer.get("skipped"):
            print(f"  {name} skipped: {trainer['skipped']}")


def default_out() -> Path:
    return Path(os.environ["OUT"]) / "gpu_results.json" if os.environ.get("OUT") else Path("gpu_results.json")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-smoke", action="store_true", help="every section at tiny sizes on CPU")
    parser.add_argument("--out", type=Path, default=None, help="results JSON (default $OUT/gpu_results.json)")
    parser.add_argument("--sections", default="env,fp8_check,gemm,trainer,engine,trainer_large,engine_fp8")
    parser.add_argument("--workdir", type=Path, default=None, help="where models are written (default: a temp dir)")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # keep the log (whose tail comes back) short
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    if args.cpu_smoke:
        sizes = SMOKE_SIZES
        torch.set_num_threads(2)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --cpu-smoke for the CPU smoke run", file=sys.stderr)
            return 2
        sizes = GPU_SIZES
    report = Report(args.out or default_out(), "cpu-smoke" if args.cpu_smoke else "gpu")
    report.data["sizes"] = asdict(sizes)
    wanted = set(args.sections.split(","))
    with tempfile.TemporaryDirectory(prefix="pb-gpu-bench-", dir=args.workdir) as tmp:
        workdir = Path(tmp)
        try:
            # The trainer comes before the engine: the engine's run time depends most on the machine's CPU.
            plan = [
                ("env", section_env, (sizes,)),
                ("fp8_check", section_fp8_check, (sizes,)),
                ("gemm", section_gemm, (sizes,)),
                ("trainer", section_trainer, (sizes, workdir)),
                ("engine", section_engine, (sizes, workdir, report)),
                ("trainer_large", section_trainer_large, (sizes, workdir, report)),
                ("engine_fp8", section_engine_fp8, (sizes, workdir, report)),
            ]
            for name, fn, fn_args in plan:
                if name in wanted:
                    report.run(name, fn, *fn_args)
        except KeyboardInterrupt:  # `timeout --signal=INT`: keep what was measured
            report.data["interrupted"] = True
            report.save()
    report.save()
    print_summary(report.data)
    print(f"\nresults: {report.path}")
    return 0 if all(e["ok"] for e in report.data["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
