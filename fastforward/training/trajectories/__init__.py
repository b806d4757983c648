"""A model's own Jacobi trajectories, one module per job:

- `records`: the record (`Block`, `Trajectory`) and its JSONL file, read back;
- `rollout`: the `jacobi` decoder's run with each block's iterates recorded;
- `writer`: `collect`, the resumable writer of trajectory files, and the part files of a shared collection;
- `shards`: a collection shared by the processes of a launch;
- `sources`: the prompts collected for, from a file or a task, and the collection's settings;
- `dataset`: trajectories served for training (Jacobi Forcing, `training.objectives.jacobi_forcing`).
"""
