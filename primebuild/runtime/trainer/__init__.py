"""The RL trainer: packing a rollout batch into micro-batches (batch.py), losses (losses.py), and the
trainer process (main.py: ``run_trainer(TrainerConfig)``, ``python -m primebuild.runtime.trainer.main``).
The batch's file is primebuild/runtime/rollout_file.py, the advantages primebuild/runtime/orchestrator/advantages.py."""
