"""The warm local engine (`fastforward engine start`): one process that keeps a model loaded and its
steps compiled, and answers `fastforward generate` over a unix socket exactly as `generate` answers in
its own process, without the seconds of importing torch and loading the model.

- `spec`: what an engine serves (model, adapter, precision, device) and its key, free of torch;
- `flags`: `generate`'s flags as data, which the engine publishes so that the client parses its command
  line as `generate` would, free of torch;
- `protocol`: the typed request a client sends, and the JSON lines on the socket;
- `folder`: where each engine lives (`$FASTFORWARD_HOME/engines/<key>`) and whether it is alive;
- `server`: the engine process; `client`: `generate`'s side; `control`: `engine start|status|stop`.

It lives beside `cli` (the same layer): the engine prints what `generate` prints by `generate`'s own
functions, and `generate` is its client.
"""
