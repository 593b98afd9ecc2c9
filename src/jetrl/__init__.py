"""jetrl: RL for LLM reasoning with one unified FP8 precision flow (Jet-RL) in JAX."""

__version__ = "0.1.0"
