"""The RL trainer: batch contract (batch.py), losses (losses.py), advantages (advantages.py), and the
trainer process (main.py: ``run_trainer(TrainerConfig)``, ``python -m primebuild.runtime.trainer.main``)."""
