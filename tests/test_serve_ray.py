"""tercomp.serve.ray_app: two replicas of the server behind Ray Serve's HTTP proxy on a
local Ray head (127.0.0.1); their answers equal a single-stream generator's. Skipped
where ray[serve] is not installed (it is not in the test extra: pip install
'tercomp[serve-ray]')."""
import concurrent.futures as cf

import pytest

pytest.importorskip("ray.serve")
# Run on its own (`python -m pytest -m slow tests/test_serve_ray.py`): it passes alone, but
# inside the whole suite on the 2-core dev machine Ray's proxy actor was killed before it
# started (twice, not diagnosed); CI has no ray and skips it either way.
pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")

import ray  # noqa: E402
from ray import serve  # noqa: E402

import tercomp as tc  # noqa: E402
from test_serve import MAX_SEQ, bench, expected, tiny_lm  # noqa: E402
from tercomp.serve.ray_app import build_app  # noqa: E402


@pytest.fixture(scope="module")
def proxy(tmp_path_factory):
    lm = tiny_lm()
    path = str(tmp_path_factory.mktemp("ray") / "tiny.tcm")
    tc.compile_lm(lm, max_seq=MAX_SEQ, max_batch=4).save(path)
    port = bench.free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1",
             log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app({"model": path, "replicas": "2", "num_cpus": "0.5", "threads": "1"}),
                  name="tercomp", route_prefix="/")
        yield tc.compile_lm(lm, max_seq=MAX_SEQ), f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_answer_through_the_proxy(proxy):
    ref, base = proxy
    replicas = serve.status().applications["tercomp"].deployments["TercompServer"].replica_states
    assert replicas.get("RUNNING") == 2
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
    prompts = [[3 + i, 40 + i, 100 + 2 * i] for i in range(12)]

    def ask(p):
        return client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0)

    with cf.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, prompts))
    for p, r in zip(prompts, answers):
        assert r.choices[0].model_extra["token_ids"] == expected(ref, p, 12)[0]
    streamed = client.completions.create(model="tiny", prompt="hello world", max_tokens=12,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == \
        expected(ref, ref.encode("hello world"), 12)[1]
