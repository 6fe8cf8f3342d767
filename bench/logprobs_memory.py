"""Peak memory of the trainer's per-token log-probs: chunked (primebuild/kernels/logprobs.py) vs the plain way.

    .venv/bin/python bench/logprobs_memory.py [--tokens 4096] [--vocab 32768] [--hidden 1024] [--chunk 1024]

Both compute log softmax(h @ W.T)[target] for `tokens` rows and backpropagate into h and W, in fp32 on
the CPU. Each variant runs in a fresh process; its peak resident memory (ru_maxrss) minus what the
process held once its inputs existed is the memory the computation itself needed. The plain way holds
the [tokens x vocab] fp32 logits, their log-softmax and the gradient of both; the chunked one holds one
[chunk x vocab] block at a time, forward and backward.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

MIB = 1024 * 1024


def child(variant: str, tokens: int, vocab: int, hidden: int, chunk: int) -> dict:
    import time

    import torch

    from primebuild.kernels.logprobs import chunked_token_logprobs

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g, requires_grad=True)
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    started = time.perf_counter()
    if variant == "plain":
        lp = torch.log_softmax(h @ w.T, dim=-1).gather(-1, targets[:, None]).squeeze(-1)
    else:
        lp, _ = chunked_token_logprobs(h, w, targets, 1.0, chunk)
    lp.sum().backward()
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"variant": variant, "peak_mib": (peak - base) / MIB, "seconds": seconds,
            "checksum": float(lp.sum()), "grad": float(h.grad.abs().sum())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.tokens, args.vocab, args.hidden, args.chunk)
    if args.child:
        print(json.dumps(child(args.child, *shape)))
        return
    results = []
    for variant in ("plain", "chunked"):
        out = subprocess.run([sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens), "--vocab",
                              str(args.vocab), "--hidden", str(args.hidden), "--chunk", str(args.chunk)],
                             check=True, capture_output=True, text=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    plain, chunked = results
    logits = args.tokens * args.vocab * 4 / MIB
    print(f"tokens {args.tokens}, vocab {args.vocab}, hidden {args.hidden}, chunk {args.chunk}; "
          f"one fp32 [tokens x vocab] logits tensor = {logits:.0f} MiB")
    print("| way | peak MiB above inputs | x logits tensor | s (fwd+bwd) |")
    print("|---|---:|---:|---:|")
    for r in results:
        print(f"| {r['variant']} | {r['peak_mib']:.0f} | {r['peak_mib'] / logits:.2f} | {r['seconds']:.2f} |")
    print(f"chunked / plain peak: {chunked['peak_mib'] / plain['peak_mib']:.3f}; "
          f"same log-probs: {abs(plain['checksum'] - chunked['checksum']) < 1e-2 * abs(plain['checksum'])}")


if __name__ == "__main__":
    main()
