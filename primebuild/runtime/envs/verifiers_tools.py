"""Which tools a verifiers taskset declares, found without loading its data or torch.

    python -m primebuild.runtime.envs.verifiers_tools TASKSET_ID ARGS_JSON

`primebuild plan` runs this in a child process (primebuild/builders/environments.py), so that neither verifiers nor
the taskset's package is imported into the planner. It prints one JSON object:

- {"tools": [names]}: the toolsets of the taskset class and of the Task type it declares, read from their
  `toolsets(config)` classmethods as verifiers' Env reads them before any rollout; primebuild's own turn
  loop drives none of them, so the plan refuses them unless `args.harness` names the verifiers harness that
  plays the taskset (primebuild/runtime/envs/verifiers_agents.py);
- {"unknown": reason}: the package cannot be looked at here (it imports torch, which a plan never loads,
  or its config does not validate); the orchestrator still checks every task class when it loads.

A task class that only `load()` reveals (a taskset that yields a subclass of its declared Task type) is
seen by the orchestrator's check, not by this one.
"""

from __future__ import annotations

import importlib.abc
import json
import sys

from primebuild.builders.environments import ADAPTER_ARGS


class _NoTorch(importlib.abc.MetaPathFinder):
    """Refuse `import torch` (and its submodules): a package that needs it is not looked at at plan time."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is not imported at plan time", name=name)
        return None


def declared_tools(taskset_id: str, args: dict) -> dict:
    sys.meta_path.insert(0, _NoTorch())
    try:
        from pydantic import ValidationError
        from verifiers.v1.utils.loaders import taskset_class, taskset_config_type
    except ImportError as e:
        return {"unknown": f"verifiers cannot be imported without torch ({e})"}
    try:
        cls = taskset_class(taskset_id)
        config = taskset_config_type(taskset_id).model_validate(
            {**{k: v for k, v in args.items() if k not in ADAPTER_ARGS}, "id": taskset_id})
    except ImportError as e:
        return {"unknown": f"its package cannot be imported without torch ({e})"}
    except (ValidationError, TypeError, ValueError, AttributeError) as e:
        return {"unknown": f"its config cannot be read ({type(e).__name__})"}
    tools = [*cls.toolsets(config), *cls.task_type().toolsets(config.task)]
    return {"tools": [type(t).__name__ for t in tools]}


if __name__ == "__main__":
    print(json.dumps(declared_tools(sys.argv[1], json.loads(sys.argv[2]))))
