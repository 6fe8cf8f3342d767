"""primebuild: declarative, reproducible async RL for LLMs."""

from primebuild.gc_tuning import collect_rarely

__version__ = "0.1.0"

collect_rarely()  # first thing in every primebuild process, before it imports torch (gc_tuning.py says why)
