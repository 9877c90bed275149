"""`tercomp serve`: an OpenAI-compatible HTTP server over the batched generator.

    tercomp.serve.app        create_app(engine, model_name, api_key=None) -> FastAPI
    tercomp.serve.protocol   the request bodies (pydantic) and OpenAI's error body
    tercomp.serve.text       detokenization and stop strings
    tercomp.serve.metrics    /metrics (Prometheus)
    tercomp.serve.ray_app    the same app as a Ray Serve deployment (replicas)

Needs the `serve` extra: pip install 'tercomp[serve]' (fastapi, uvicorn,
prometheus-client).
"""
