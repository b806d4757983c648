"""Evaluation: a model × decoder × task, measured against AR of the same model in the same run.

- `evaluate`: `compare`, `sweep` and their tables and records;
- `plots`: accuracy against tokens per forward;
- `roofline`: the SBD paper's roofline model of a block forward, and measured block costs;
- `harness`, `lm_eval_tasks`: the lm-evaluation-harness model and local tasks.
"""
