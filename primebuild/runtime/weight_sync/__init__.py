"""Moving new policy weights from the trainer to inference servers.

- ``filesystem``: the trainer publishes ``weights/step_{k:06d}/`` (HF layout) atomically; inference loads it.
- ``broadcast``: trainer rank 0 sends the flat state dict over a torch.distributed group of its own to
  inference workers (gloo on CPU, NCCL on GPU), no disk round-trip.
"""
