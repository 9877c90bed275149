"""Replicas of `tercomp serve` behind Ray Serve's HTTP proxy (the `serve-ray` extra).

Each replica loads the same saved LM (.tcm, compiled with max_batch) into its own
Engine and serves the same FastAPI app as `tercomp serve` (Ray Serve's FastAPI ingress);
Ray's proxy spreads requests over the replicas. On Kubernetes, KubeRay's RayService
runs the same application (see the README's "Serving" section).

    serve run tercomp.serve.ray_app:build_app model=/models/lm.tcm replicas=2

or from Python:

    >>> from ray import serve
    >>> from tercomp.serve.ray_app import build_app
    >>> serve.run(build_app({"model": "/models/lm.tcm", "replicas": 2}))

Arguments of build_app: `model` (path to the .tcm, readable from every replica's node),
`replicas` (default 1), `name` (the model name clients pass; default the file's
name), `api_key`, `threads` (local-task threads per replica), `max_queue`,
`num_cpus` (CPUs Ray reserves per replica; default `threads` or 1).
"""
from __future__ import annotations

import os

from ray import serve

from ..runtime.loader import load
from ..runtime.scheduler import STEP_TOKENS_PER_SLOT, Engine
from .app import create_app


def _default_name(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


@serve.deployment
@serve.ingress()
class TercompServer:
    """One replica: an Engine over the .tcm at `model` and the app of tercomp.serve.app
    (built by Ray after __init__, through __serve_build_asgi_app__)."""

    def __init__(self, model: str, name: str | None = None, api_key: str | None = None,
                 threads: int | None = None, max_queue: int = 256):
        gen = load(model, threads=threads)
        if not hasattr(gen, "generate"):
            raise ValueError(f"{model} is not a compiled language model (tc.compile_lm)")
        # the step budget of `tercomp serve` (a joining prompt does not stall the streams)
        self.engine = Engine(gen, max_queue=max_queue,
                             step_tokens=STEP_TOKENS_PER_SLOT * getattr(gen, "max_batch", 1))
        self.asgi = create_app(self.engine, name or _default_name(model), api_key=api_key)

    def __serve_build_asgi_app__(self):
        return self.asgi

    def __del__(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


def build_app(args: dict):
    """The Ray Serve application for `serve run tercomp.serve.ray_app:build_app key=value ...`
    (values arrive as strings)."""
    if "model" not in args:
        raise ValueError("build_app needs model=PATH.tcm")
    threads = int(args["threads"]) if args.get("threads") else None
    cpus = float(args.get("num_cpus") or threads or 1)
    return TercompServer.options(
        num_replicas=int(args.get("replicas", 1)), ray_actor_options={"num_cpus": cpus},
    ).bind(str(args["model"]), name=args.get("name"), api_key=args.get("api_key"),
           threads=threads, max_queue=int(args.get("max_queue", 256)))
