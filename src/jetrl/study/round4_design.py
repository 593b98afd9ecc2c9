"""The fourth round of the precision study, as data: its parts, their study settings, their order.

This module is part of the round's pre-registration (docs/study/round4/prereg.md): the runner
(`experiments/round4.py`) refuses to start while it, the pre-registration or the analysis code
(`jetrl.study.prereg4`) is uncommitted, or once any of them has changed since the first run.

Each part is a precision study (`jetrl.study.StudyConfig`) given as the changes from
`StudyConfig()` that build it, one per warm start, and a list of jobs. A job is one RL run
(warm start, length, arm, seed) and runs in the order below; with several workers, each takes
the next job not done and not claimed (`jetrl.study.round4`).
"""

from __future__ import annotations

# The RL runs' settings shared by the tiny-model parts: the third round's (GRPO, 30 steps of 16
# prompts x 8 samples, temperature 0.5, lr 5e-5, evaluations at steps 10, 20 and 30 on 256
# held-out problems x 4 samples, each scored in the run's rollout precision and in bf16), with the
# PPO ratio's old log-probs from the differentiated forward (same_forward: the ratio starts at
# exactly 1) unless an arm says otherwise.
TINY_RL = {
  "eval.every": 10,
  "quiet_runs": True,
  "update.old_logp": "same_forward",
  "corrected": (),
}

# The warm start of the third round (300 SFT steps alternating lengths 3 and 9, answer noise
# 0.5), with its seed: 0 is the third round's; 1 and 2 are two more warm starts.
WARM_L9 = {"sft.mix": True, "sft.lengths": (3, 9), "sft.steps": 300}
WARM_SEEDS = (0, 1, 2)

# Primary: non-inferiority of jet to bf16 with the ratio starting at 1; bf16 with recomputed
# old log-probs (the paper's baseline) beside them. 9 RL seeds on each of 3 warm starts.
PRIMARY_SEEDS = tuple(range(9))
PRIMARY = {
  **TINY_RL,
  **WARM_L9,
  "lengths": (9,),
  "recipes": ("bf16", "jet"),
  "recomputed": ("bf16",),
  "seeds": PRIMARY_SEEDS,
}

# Mismatch alone: the exact training step fixed, four rollouts of rising mismatch (the bitwise
# one, jet's = fp8_rollout's E4M3 blockwise, bf16, E5M2 blockwise), on the first warm start.
CROSSOVER_SEEDS = tuple(range(10))
CROSSOVER = {
  **TINY_RL,
  **WARM_L9,
  "lengths": (9,),
  "recipes": (
    "jet_exact",
    "jet_exact_train",
    "jet_exact_train_bf16_rollout",
    "jet_exact_train_e5m2_rollout",
  ),
  "seeds": CROSSOVER_SEEDS,
}

# Length: the primary comparison and fp8_rollout at length 20 (about 430 generated tokens), from
# a warm start that saw lengths 3, 9 and 20; run only if that warm start passes the feasibility
# gate (held-out accuracy at length 20 of at least LENGTH_GATE), else reported as not run.
LENGTH_SEEDS = tuple(range(6))
LENGTH_GATE = 0.05
LENGTH = {
  **TINY_RL,
  "sft.mix": True,
  "sft.lengths": (20, 3, 9),
  "sft.steps": 400,
  "lengths": (20,),
  "recipes": ("bf16", "jet", "fp8_rollout"),
  "seeds": LENGTH_SEEDS,
}

# A real model: SmolLM2-135M-Instruct, LoRA rank 16 on the frozen base, chat_arithmetic, the
# setting of experiments/lora_arithmetic.py (24 steps; greedy held-out accuracy before and after).
SMOLLM2_SEEDS = (0, 1, 2)
SMOLLM2_RECIPES = ("bf16", "jet", "fp8_rollout")

# The order the parts run in (each part's jobs: seed-major, then warm start, then arm).
PARTS = ("primary", "crossover", "smollm2", "length")
