"""Forward passes of the supported model families, built from a transformers model's weights."""

from specedge.cloud.models.gemma3 import Gemma3Runner
from specedge.cloud.models.llama import LlamaRunner

RUNNERS = {"llama": LlamaRunner, "gemma3_text": Gemma3Runner}


def build_runner(hf_model) -> LlamaRunner | Gemma3Runner:
    model_type = hf_model.config.model_type
    if model_type not in RUNNERS:
        raise NotImplementedError(f"model type {model_type!r} is not supported; supported: {sorted(RUNNERS)}")
    return RUNNERS[model_type](hf_model)
