"""primebuild: declarative, reproducible async RL for LLMs."""

__version__ = "0.1.0"
