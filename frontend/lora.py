"""The LoRA adapters clients may name: the registry behind a request's `model`, the
`/v1/models` cards and vLLM's load and unload endpoints.

Adapters come from `--lora-modules name=path` at start and from
`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` (behind the API key, like every
route but health and metrics). A load is checked on a decode worker before it is
accepted: a one-token request for the adapter runs there, so a directory the workers
cannot read, or an adapter of another model or of a rank past theirs, is refused with
the worker's reason (400) instead of failing the first client. `POST
/v1/unload_lora_adapter {"lora_name"}` removes it: requests already running finish with
it, new ones get a 404 (`model_not_found`). Workers read an adapter from its directory
on demand (each request carries the name and path), so a worker that joins later
serves it too.
"""

from __future__ import annotations

import json
from typing import Any

from frontend.errors import BadRequest, ModelNotFound
from protocol.errors import InvalidInput
from protocol.lora import AdapterRef


class LoraRegistry:
    def __init__(self, modules: tuple[str, ...] = ()) -> None:
        self._adapters: dict[str, AdapterRef] = {}
        for spec in modules:
            name, sep, path = spec.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules takes name=path, got {spec!r}")
            self.add(AdapterRef(name.strip(), path.strip()))

    def __len__(self) -> int:
        return len(self._adapters)

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def add(self, ref: AdapterRef) -> None:
        if ref.name in self._adapters:
            raise BadRequest(
                f"The lora adapter '{ref.name}' has already been loaded. If you want to load "
                "the adapter in place, unload it first.", param="lora_name",
            )  # fmt: skip
        self._adapters[ref.name] = ref

    def remove(self, name: str) -> AdapterRef:
        ref = self._adapters.pop(name, None)
        if ref is None:
            raise _not_loaded(name)
        return ref

    def resolve(self, model: str) -> AdapterRef:
        """The adapter a request's `model` names; 404 (model_not_found) if none."""
        ref = self._adapters.get(model)
        if ref is None:
            raise ModelNotFound(model)
        return ref

    def cards(self, parent: str, created: int) -> list[dict[str, Any]]:
        """`/v1/models` entries: each adapter, its base model as `parent`."""
        return [
            {"id": ref.name, "object": "model", "created": created, "owned_by": "diptych",
             "root": ref.path, "parent": parent}
            for ref in self._adapters.values()
        ]  # fmt: skip


def _not_loaded(name: str) -> ModelNotFound:
    err = ModelNotFound(name)
    err.message = f"The lora adapter '{name}' cannot be found."
    err.param = "lora_name"
    return err


def load_request(body: bytes) -> AdapterRef:
    """The adapter a load request names (400 for a malformed body)."""
    data = _object(body)
    name, path = data.get("lora_name"), data.get("lora_path")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise BadRequest("both 'lora_name' and 'lora_path' must be provided", param="lora_name")
    try:
        return AdapterRef(name, path)
    except InvalidInput as e:
        raise BadRequest(str(e), param="lora_name") from None


def unload_request(body: bytes) -> str:
    name = _object(body).get("lora_name")
    if not isinstance(name, str) or not name:
        raise BadRequest("'lora_name' must be provided", param="lora_name")
    return name


def _object(body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body or b"{}")
    except ValueError as e:
        raise BadRequest(f"the body is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    return data
