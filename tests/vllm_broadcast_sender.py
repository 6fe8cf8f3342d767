"""The trainer side of a weight broadcast, as a process of its own: rank 0 of the weight group sends
the weights of an HF folder as one step, then closes the group (or, with `hold`, keeps it open until
killed, as a trainer that dies would). Used by tests/test_vllm_server.py, test_vllm_parallel.py,
test_vllm_pd.py.

    python tests/vllm_broadcast_sender.py INIT_METHOD WORLD_SIZE STEP FOLDER [hold]
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM

from primebuild.runtime.weight_sync.broadcast import BroadcastSender


def main(init_method: str, world_size: int, step: int, folder: str, hold: bool = False) -> None:
    # the full state dict, as the trainer's full_state_dict gives it (a tied lm_head included)
    state = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    sender = BroadcastSender(init_method, world_size, backend="gloo", timeout_s=120)  # waits for receivers
    print("joined", flush=True)
    sender.send(state, step)
    print(f"sent {step}", flush=True)
    if hold:
        sys.stdin.read()  # until the test kills this process (or closes its stdin)
    sender.close()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], hold=sys.argv[5:] == ["hold"])
