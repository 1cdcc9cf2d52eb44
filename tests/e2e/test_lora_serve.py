"""LoRA adapters served by `diptych serve` on real processes, through the official
openai client, fp32 greedy, with adapters `peft` makes here for SmolLM2-135M:

- disaggregated (every prompt prefilled by the prefill worker, which reads the adapter
  the message names) and aggregated: two adapters and the base model give the text the
  engine gives offline, each request named by its `model`;
- an adapter loaded through `POST /v1/load_lora_adapter` while requests stream, and one
  unloaded: running streams finish, a new request for it gets OpenAI's 404
  (`model_not_found`), a bad directory is refused with the worker's reason;
- paging: 2 device slots for 8 adapters in rotation, 16 requests at once: all finish,
  the waits for a slot counted per adapter.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from benchmarks.lora_adapters import SPECS, make_adapters, shape_model
from tests.e2e.serving import Server

pytestmark = pytest.mark.slow

PROMPTS = ["Write a short poem about the sea.", "Explain how a bicycle works."]
MAX_TOKENS = 16
BASE = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_adapters(shape_model(), tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def offline(adapters: dict[str, Path]) -> dict[str | None, list[str]]:
    """Each model's greedy chat texts from the engine in this process."""
    from engine.config import EngineConfig
    from engine.llm import LLM
    from protocol.lora import AdapterRef
    from protocol.sampling import SamplingParams

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    config = EngineConfig(dtype="float32", num_blocks=128, enable_lora=True, max_loras=4)
    out: dict[str | None, list[str]] = {}
    with LLM.from_config(config) as llm:
        prompts = [llm.tokenizer.apply_chat_template(c) for c in chats]
        for name in (None, "ad-qv8", "ad-all16"):
            lora = None if name is None else AdapterRef(name, str(adapters[name]))
            out[name] = [r.text for r in llm.generate(prompts, params, lora=lora)]
    return out


def _chat(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, extra_body={"ignore_eos": True},
    )  # fmt: skip
    text = ""
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    return text


def _served(client: openai.OpenAI) -> dict[str | None, list[str]]:
    return {
        name: [_chat(client, name or BASE, p) for p in PROMPTS]
        for name in (None, "ad-qv8", "ad-all16")
    }


def _load(server: Server, name: str, path: str) -> httpx.Response:
    body = {"lora_name": name, "lora_path": path}
    return httpx.post(server.url + "/v1/load_lora_adapter", json=body, timeout=120)


def _client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def disaggregated(adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
                  ) -> Iterator[Server]:  # fmt: skip
    server = Server(
        tmp_path_factory.mktemp("lora-disagg"),
        "--dtype", "float32", "--num-blocks", "256", "--prefill-workers", "1",
        "--decode-workers", "1", "--min-remote-prefill-tokens", "1", "--no-prefill-affinity",
        "--max-loras", "2", "--lora-modules", f"ad-qv8={adapters['ad-qv8']}",
    )  # fmt: skip
    yield server
    assert server.stop() == 0


def test_disaggregated_adapters_give_the_offline_text(
    disaggregated: Server, adapters: dict[str, Path], offline: dict[str | None, list[str]]
) -> None:
    client = _client(disaggregated)
    ids = [m.id for m in client.models.list().data]
    assert ids == [BASE, "ad-qv8"]
    # the second adapter arrives through the load endpoint
    r = _load(disaggregated, "ad-all16", str(adapters["ad-all16"]))
    assert r.status_code == 200, r.text
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {BASE, "ad-qv8", "ad-all16"}
    assert cards["ad-all16"].model_extra["parent"] == BASE
    assert _served(client) == offline
    assert len({t for texts in offline.values() for t in texts}) == 6  # they differ
    decode, prefill = disaggregated.metrics("decode-0"), disaggregated.metrics("prefill-0")
    remote = decode['diptych_worker_remote_prefills_finished_total{result="ok"}']
    assert remote >= 3 * len(PROMPTS)  # every prompt, the adapters' too, prefilled remotely
    for name, probe in (("ad-qv8", 0), ("ad-all16", 1)):  # (the load's one-token check)
        key = f'diptych_worker_lora_requests_total{{adapter="{name}"}}'
        assert decode[key] == prefill[key] == len(PROMPTS) + probe
    assert decode["diptych_worker_kv_used_blocks"] == 0.0


def test_load_and_unload_while_requests_run(
    disaggregated: Server, adapters: dict[str, Path]
) -> None:
    client = _client(disaggregated)
    texts: list[str] = []
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            texts.append(_chat(client, "ad-qv8", PROMPTS[0], max_tokens=48))
        except BaseException as e:
            errors.append(e)

    runs = [threading.Thread(target=stream) for _ in range(3)]
    for t in runs:
        t.start()
    url = disaggregated.url
    r = _load(disaggregated, "ad-v8", str(adapters["ad-v8"]))
    assert r.status_code == 200, r.text
    assert _chat(client, "ad-v8", PROMPTS[1])
    # taken names, bad directories and unknown adapters are refused in OpenAI's shape
    again = _load(disaggregated, "ad-v8", str(adapters["ad-v8"]))
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = _load(disaggregated, "nowhere", "/nonexistent/adapter")
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "ad-v8"})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError) as info:
        _chat(client, "ad-v8", PROMPTS[1])
    err: Any = info.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model"
    gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "ad-v8"})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "invalid_request_error"
    # the adapter being served while all this happened: untouched
    r = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "ad-qv8"})
    assert r.status_code == 200
    for t in runs:
        t.join(120)
    assert not errors and len(texts) == 3 and len(set(texts)) == 1
    assert [m.id for m in client.models.list().data] == [BASE, "ad-all16"]


@pytest.fixture(scope="module")
def aggregated(adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[Server]:  # fmt: skip
    modules = [
        arg for name, path in adapters.items() for arg in ("--lora-modules", f"{name}={path}")
    ]
    server = Server(
        tmp_path_factory.mktemp("lora-agg"),
        "--dtype", "float32", "--num-blocks", "512", "--prefill-workers", "0",
        "--decode-workers", "1", "--max-loras", "2", "--max-cpu-loras", "4", *modules,
    )  # fmt: skip
    yield server
    assert server.stop() == 0


def test_aggregated_adapters_give_the_offline_text(
    aggregated: Server, offline: dict[str | None, list[str]]
) -> None:
    assert _served(_client(aggregated)) == offline


def test_two_slots_serve_eight_adapters_in_rotation(aggregated: Server) -> None:
    client = _client(aggregated)
    names = [s.name for s in SPECS] * 2
    results: list[str | BaseException | None] = [None] * len(names)

    def run(i: int) -> None:
        try:
            results[i] = _chat(client, names[i], PROMPTS[i % 2])
        except BaseException as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(names))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert all(isinstance(r, str) and r for r in results), results
    # the same adapter and prompt: the same text, whatever it waited for
    for i in range(len(SPECS)):
        assert results[i] == results[i + len(SPECS)]
    m = aggregated.metrics("decode-0")
    waits = sum(v for k, v in m.items() if k.startswith("diptych_worker_lora_slot_waits_total"))
    loads = sum(v for k, v in m.items() if k.startswith("diptych_worker_lora_loads_total"))
    assert waits >= len(SPECS) - 2 and loads >= len(SPECS)
    assert sum(v for k, v in m.items() if k.startswith("diptych_worker_lora_resident")) <= 2
    assert m["diptych_worker_kv_used_blocks"] == 0.0
