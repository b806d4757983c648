"""Training: the trainer, its data, and one module per objective.

- `trainer`: `train` (accelerate, resumable run directories, atomic checkpoints) and `TrainConfig`;
- `data`: JSONL records → packed rows with a loss mask;
- `objectives/`: NTP, SBD, MultiTF, SetDLM and Jacobi Forcing, each a layout and a loss;
- `jacobi_trajectories`, `trajectories`: a model's own Jacobi trajectories, collected to JSONL;
- `rounds`: progressive Jacobi Forcing, rounds of collection and training;
- `lora`: a LoRA run's PEFT layers, added before training and taken off if the run fails.
"""
