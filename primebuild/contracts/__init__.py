"""Typed hand-offs: what the plan compiler writes and what each process reads.

Every class here is one contract between two sides that must not drift apart:

| module          | written by                         | read by                                  |
|-----------------|------------------------------------|------------------------------------------|
| `trainer`       | builders/processes.py              | runtime/trainer/main.py                  |
| `orchestrator`  | builders/processes.py              | runtime/orchestrator/main.py             |
| `inference`     | builders/processes.py              | runtime/inference/server.py              |
| `router`        | builders/processes.py              | runtime/inference/router.py (P/D)        |
| `sft`           | builders/derivations.py            | runtime/sft.py (through runtime/derivations.py) |
| `plan`          | builders/plan.py                   | worker, supervisor, run/status/replay/diff |
| `run_dir`       | every process of a run, targets    | every process of a run, and the CLI      |
| `render`        | the CLI (`render`), the targets    | builders/render/ (the cluster artifacts) |
| `loss`          | the manifest (`orchestrator.loss`) | runtime/trainer/losses.py (via `trainer`) |
| `rollout`       | runtime/orchestrator/main.py       | runtime/trainer/main.py (file: rollout_file.py) |
| `run_summary`   | orchestrator, runtime/report.py    | `run`, `status`, the tests               |
| `dtypes`        | builders/processes.py              | the trainer and the inference server     |

They live in this one light package (pydantic only, no torch) because both sides import them and
`builders/` never imports `runtime/`. Unknown keys are refused on read, so a field that the compiler
writes and no process consumes cannot exist.
"""
