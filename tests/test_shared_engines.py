"""Two gateways in front of the same two engines: one swaps weights, the other follows the
versions the engines report. Each engine loads a version once, and both gateways label tokens
with the version that sampled them."""

from __future__ import annotations

import json

import httpx
import openai
import torch

from flywheel.bus import WEIGHTS_SUBJECT, WeightUpdate
from flywheel.config import load_config
from flywheel.models import WeightStore, load_model
from flywheel.serve.engine.server import create_engine_app
from flywheel.serve.loop import ServeLoop

from bus_reading import recorded_turns
from factories import RunningApp, make_engine
from waiting import until

WAIT_S = 60


async def test_a_following_gateway_learns_versions_without_loading_them_again(nats_url, bus, tmp_path):
    engines = [make_engine(), make_engine()]
    apps = [RunningApp(create_engine_app(e, "tiny", "tiny")) for e in engines]
    urls = [await app.__aenter__() for app in apps]
    loops = []
    try:
        for name, swaps in (("a", "true"), ("b", "false")):
            config = load_config(None, [f"run_dir={tmp_path / name}", "serve.port=0", f"serve.engine_urls={json.dumps(urls)}",
                                        f"serve.swap_weights={swaps}"])
            loops.append(ServeLoop(config, nats_url))
            await loops[-1].start()
        swapper, follower = loops
        model, _ = load_model("tiny")
        with torch.no_grad():
            model.lm_head.weight.mul_(1.5)
        path = WeightStore(tmp_path / "store").publish(model, 2)
        await bus.publish(WEIGHTS_SUBJECT, WeightUpdate(id="w2", version=2, path=str(path), step=2))
        await until(lambda: swapper.stats()["swaps"] == 1 and follower.pool.weight_version == 2)
        assert [e.stats["weight_updates"] for e in engines] == [1, 1]  # loaded once, not once per gateway
        assert follower.stats()["swaps"] == 0 and [e.weight_version for e in follower.pool.engines] == [2, 2]

        client = openai.AsyncOpenAI(base_url=f"{follower.url}/v1", api_key="x", max_retries=0)
        stream = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                      max_tokens=4, stream=True, extra_headers={"X-Session-Id": "after"})
        assert [c async for c in stream][-1].system_fingerprint == "flywheel-v2"
        recorded = await recorded_turns(bus, 1)
        assert recorded[-1].session_id == "after" and set(recorded[-1].output_versions) == {2}
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"{follower.url}/metrics")).text
        assert all(f'flywheel_engine_weight_version{{engine="{url.rstrip("/")}"}} 2.0' in metrics for url in urls)
    finally:
        for loop in loops:
            await loop.stop()
        for app, engine in zip(apps, engines):
            await app.__aexit__()
            engine.stop()
