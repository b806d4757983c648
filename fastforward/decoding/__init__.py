"""Decoding: one step protocol and one module per decoder.

- `runtime`: `Session` (a batch of rows against one KV cache), `Stats`, `Generation`;
- `policies`: which masked positions to reveal, which drafts to accept;
- `sampling`: greedy and temperature sampling;
- `metrics`: TPF, queries per token, speedup, AUP, defined once;
- `decoders/`: one module per decoder, each registering itself in `decoders.registry`.
"""
