"""Training: the trainer, its data, and one module per objective.

- `trainer`: `train` (accelerate, resumable) and `TrainConfig`;
- `run_dir`: a run's directory: its lock, record, metrics, checkpoints with manifests and final model;
- `data`: JSONL records → packed rows with a loss mask;
- `objectives/`: NTP, SBD, MultiTF, SetDLM and Jacobi Forcing, each a layout and a loss, registered by name;
- `trajectories/`: a model's own Jacobi trajectories, recorded from the `jacobi` decoder into JSONL and served;
- `rounds`: progressive Jacobi Forcing, rounds of collection and training;
- `lora`: a LoRA run's PEFT layers, added before training and taken off if the run fails.
"""
