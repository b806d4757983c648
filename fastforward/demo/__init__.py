"""`fastforward demo`: every method's claim on shipped checkpoints, in minutes.

- `checkpoints/`: the shipped models (NTP, SBD, MultiTF, SetDLM, Jacobi Forcing), each with its provenance;
- `showcase`: evaluates them in one table and plot;
- `zoo`: the recipe that trains them again (`--retrain`);
- `pipeline`: the few-minute train-and-evaluate pipeline (`--quick`) and the demo's settings.
"""
