"""fgrpo: online reinforcement learning (Flow-GRPO) for flow-matching image generators."""

__version__ = "0.1.0"
