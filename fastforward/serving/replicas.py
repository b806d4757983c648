"""`fastforward serve --replicas N`: the same app as a Ray Serve deployment of N replicas.

Each replica is a Ray actor that loads the model and runs the app `Server.app()` builds (its own
engine, continuous batching included); Ray Serve's HTTP proxy spreads requests over the replicas,
across the machines of a Ray cluster when one is running (`RAY_ADDRESS`, or `ray start` beforehand),
else on a local instance this command starts. The OpenAI routes, streaming and errors are the app's.
Ray is an optional extra: `pip install 'fastforward[ray]'`.
"""

from __future__ import annotations

import importlib.util
import signal
import threading
from collections.abc import Callable
from typing import Any

from fastforward.errors import FastForwardError

APP_NAME = "fastforward"


def require_ray() -> None:
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise FastForwardError(
            "--replicas runs the server on Ray Serve, which is not installed: pip install 'fastforward[ray]'"
        )


def app_builder(load: dict[str, Any], server: dict[str, Any], compile_warm_up: bool) -> Callable[[], Any]:
    """What each replica runs to make its ASGI app: load the model (`load_model(**load)`), warm the
    compiled steps if asked, and build the server's FastAPI app (`Server(model, **server)`)."""

    def build() -> Any:
        from fastforward.api import build_decoder
        from fastforward.serving.app import Server
        from fastforward.serving.warm_up import load_ready

        decoder = build_decoder(server["decoder"], **server["knobs"]) if compile_warm_up else None
        return Server(load_ready(load, decoder), **server).app()

    return build


def serve_replicas(
    build: Callable[[], Any], replicas: int, host: str, port: int, cpus_per_replica: float | None = None
) -> None:
    """Deploy `replicas` copies of the app `build` makes behind Ray Serve's proxy on host:port, and
    serve until SIGINT or SIGTERM; then shut the deployment down."""
    require_ray()
    import ray
    from ray import serve

    ray.init(ignore_reinit_error=True, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port})
    options = {} if cpus_per_replica is None else {"ray_actor_options": {"num_cpus": cpus_per_replica}}
    deployment = serve.deployment(serve.ingress(build)(), name=APP_NAME, num_replicas=replicas, **options)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.run(deployment.bind(), name=APP_NAME, route_prefix="/")
        print(f"fastforward serve: {replicas} replicas on http://{host}:{port}/v1 (Ray Serve)", flush=True)
        stop.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        serve.shutdown()
        ray.shutdown()
