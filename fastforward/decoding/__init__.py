"""Decoding: one step protocol and one module per decoder.

- `runtime`: `Session` (a batch of rows against one KV cache), `prefilled` (new rows), `Stats`, `Generation`;
- `rows`: `Row` (a request's canvas and status), `Prompt`; `prefill`: the prefill of new rows;
- `steps`: step code decoders share (canvas writes, layouts, draft chains, verification);
- `policies`: which masked positions to reveal, which drafts to accept;
- `sampling`: greedy and temperature sampling, a batch's sampler;
- `metrics`: TPF, queries per token, speedup, AUP, defined once;
- `options`: options as dataclass fields, with their help and bounds, checked on construction;
- `decoders/`: one module per decoder, a dataclass of its options registering itself in `decoders.registry`.
"""
