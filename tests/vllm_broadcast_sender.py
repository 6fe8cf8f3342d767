"""The trainer side of a weight broadcast, as a process of its own: rank 0 of the weight group sends
the weights of an HF folder as one step, then closes the group (or, with `hold`, keeps it open until
killed, as a trainer that dies would). Used by tests/test_vllm_server.py, test_vllm_parallel.py,
test_vllm_pd.py.

    python tests/vllm_broadcast_sender.py INIT_METHOD WORLD_SIZE STEP FOLDER [hold] [BUCKET_MB]

BUCKET_MB: small buckets give a send a half-way point for the stall injection (broadcast.STALL_ENV).
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM

from primebuild.runtime.weight_sync.broadcast import BroadcastSender


def main(init_method: str, world_size: int, step: int, folder: str, hold: bool = False,
         bucket_mb: float | None = None) -> None:
    # the full state dict, as the trainer's full_state_dict gives it (a tied lm_head included)
    state = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    sizing = {} if bucket_mb is None else {"bucket_mb": bucket_mb}
    sender = BroadcastSender(init_method, world_size, backend="gloo", timeout_s=120, **sizing)  # waits for receivers
    print("joined", flush=True)
    sender.send(state, step)
    print(f"sent {step}", flush=True)
    if hold:
        sys.stdin.read()  # until the test kills this process (or closes its stdin)
    sender.close()


if __name__ == "__main__":
    options = sys.argv[5:]
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], hold="hold" in options,
         bucket_mb=next((float(o) for o in options if o != "hold"), None))
