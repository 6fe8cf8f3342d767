"""Where new policies come from, seen from the orchestrator: the two weight-sync modes.

filesystem: the trainer publishes `weights/step_k/` (STABLE marker); a server loads it by path.
broadcast:  the trainer announces each step over a torch.distributed group of its own; the orchestrator
            asks the servers what was announced (`/health` `received_version`) and tells them when to
            load it, which is when its bytes cross, into every server at once. No weight folder is
            written. The trainer announces step k+1 only once every server loaded step k, so whoever
            waits for a newer step must first load the announced one (`loads_to_advance`). A restarted
            server rejoins the group and is admitted at the trainer's next update; it loads that update
            with the others (`announced_to`), never alone.
Either way the swap itself is the same choreography: pause -> update_weights -> resume.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from primebuild.contracts.run_dir import RunDir
from primebuild.runtime.orchestrator.client import InferenceClient
from primebuild.runtime.weight_sync.filesystem import latest_stable, remove_steps, stable_steps, step_folder

ANNOUNCED_WAIT_S = 5.0  # a member of the group hears an announcement within ms; a loaded host, within seconds


class FilesystemWeights:
    loads_to_advance = False  # the trainer publishes every step whether or not a server loads it

    def __init__(self, weights_dir: Path, keep: int):
        self.weights_dir = weights_dir
        self.keep = keep

    async def latest(self, clients: list[InferenceClient]) -> int:
        found = latest_stable(self.weights_dir)
        return 0 if found is None else found[0]

    async def load(self, client: InferenceClient, version: int) -> None:
        await client.update_weights({"path": str(step_folder(self.weights_dir, version)), "version": version})

    def retire(self, served: int) -> None:
        """Every server serves `served` now: folders older than it, beyond the newest `keep`, are read by
        nobody (a restarted server is given the newest) and go. The trainer never deletes them."""
        steps = stable_steps(self.weights_dir)
        newest = set(steps[-self.keep:])
        remove_steps(self.weights_dir, [s for s in steps if s < served and s not in newest])


class BroadcastWeights:
    loads_to_advance = True  # the trainer's send of step k+1 waits until every server loaded step k

    async def latest(self, clients: list[InferenceClient]) -> int:
        """The newest version every server has received (a swap needs all of them to have it)."""
        received = await asyncio.gather(*(c.received_version() for c in clients))
        return min(received)

    async def load(self, client: InferenceClient, version: int) -> None:
        await client.update_weights({"source": "broadcast", "version": version})

    async def announced_to(self, client: InferenceClient, version: int, wait_s: float = ANNOUNCED_WAIT_S) -> bool:
        """Was `client`'s server (one not taking requests: restarted, or joining) announced `version` itself?
        It was within moments when the trainer admitted it to the group it announced `version` to. One
        announced a newer step joined a later group: it loads that step in that step's round, with the
        members it was announced to (loading it now, alone, would wait for them while they finish this round)."""
        deadline = asyncio.get_running_loop().time() + wait_s
        while (received := await client.received_version()) < version:
            if asyncio.get_running_loop().time() > deadline:
                return False
            await asyncio.sleep(0.1)
        return received == version

    async def newest_announced(self, clients: list[InferenceClient]) -> int:
        """The newest step announced to any of `clients` that answers (-1: none answers): the trainer's
        pending update when every server is set aside."""
        answers = await asyncio.gather(*(c.received_version() for c in clients), return_exceptions=True)
        return max((a for a in answers if isinstance(a, int)), default=-1)

    def retire(self, served: int) -> None:
        """Nothing on disk: the servers hold what they were sent."""


def weight_source(mode: str, run: RunDir, keep: int) -> FilesystemWeights | BroadcastWeights:
    if mode == "broadcast":
        return BroadcastWeights()
    return FilesystemWeights(run.weights, keep)
