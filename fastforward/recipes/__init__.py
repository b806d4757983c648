"""Recipes: whole pipelines a user runs on their own data with one command (`fastforward recipe ...`).

A recipe chains stages that each write their result into a work folder and are skipped once done, so
rerunning the same command resumes it: data → (SFT) → targets → training → evaluation on a dev split
held out from the data → a preset folder that carries its decoding defaults and its provenance.
"""
