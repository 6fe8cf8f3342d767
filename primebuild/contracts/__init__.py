"""Typed hand-offs: what the plan compiler writes and what each process reads.

Every class here is one contract between two sides that must not drift apart:

| module         | written by                                 | read by                                                               |
|----------------|--------------------------------------------|-----------------------------------------------------------------------|
| `trainer`      | primebuild/builders/processes.py           | primebuild/runtime/trainer/main.py                                    |
| `orchestrator` | primebuild/builders/processes.py           | primebuild/runtime/orchestrator/main.py                               |
| `inference`    | primebuild/builders/processes.py           | primebuild/runtime/inference/server.py                                |
| `router`       | primebuild/builders/processes.py           | primebuild/runtime/inference/router.py (P/D)                          |
| `sft`          | primebuild/builders/derivations.py         | primebuild/runtime/trainer/env_sft.py, trainer/sft.py (through primebuild/runtime/derivations.py) |
| `plan`         | primebuild/builders/plan.py                | worker, supervisor, run/status/replay/diff                            |
| `run_dir`      | every process of a run, targets            | every process of a run, and the CLI                                   |
| `render`       | the CLI (`render`), the targets            | primebuild/builders/render/ (the cluster artifacts)                   |
| `loss`         | the manifest (`orchestrator.loss`)         | primebuild/runtime/trainer/losses.py (via `trainer`)                  |
| `rollout`      | primebuild/runtime/orchestrator/main.py    | primebuild/runtime/trainer/main.py (file: rollout_file.py)            |
| `run_summary`  | orchestrator, primebuild/runtime/report.py | `run`, `status`, the tests                                            |
| `dtypes`       | primebuild/builders/processes.py           | the trainer and the inference server                                  |

They live in this one light package (pydantic only, no torch) because both sides import them and
`primebuild/builders/` never imports `primebuild/runtime/`. Unknown keys are refused on read, so a field that the compiler
writes and no process consumes cannot exist.
"""
