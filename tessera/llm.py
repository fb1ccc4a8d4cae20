"""Offline batch inference: `LLM(model).generate(prompts, params)`, `LLM(model).embed(texts)`."""
from __future__ import annotations

import uuid
from typing import Optional, Sequence, Union

from tqdm import tqdm

from tessera.config import EngineConfig
from tessera.engine.llm_engine import LLMEngine
from tessera.engine.outputs import RequestOutput
from tessera.pooling_params import PoolingParams
from tessera.images import ImageLimits, image_input
from tessera.sampling_params import InvalidRequestError, SamplingParams
from tessera.vision import ImageInput

Prompt = Union[str, list[int]]


class LLM:
    def __init__(self, model: str = "smollm2-135m", loaded=None, **engine_options) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options), loaded=loaded)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Union[Prompt, Sequence[Prompt]],
        sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
        use_tqdm: bool = False,
        lora: Union[None, str, Sequence[Optional[str]]] = None,
        images: Optional[Sequence[Sequence[bytes]]] = None,
    ) -> list[RequestOutput]:
        """Run all prompts through the engine together; results come back in prompt order.
        `lora`: the adapter (a name from `lora_modules` or `add_lora`) each prompt runs through,
        one for all or one per prompt; None is the base model. `images`: per prompt, the encoded
        image files (PNG, JPEG, WebP, GIF) its image tokens stand for, in order (a vision model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError("give one SamplingParams, or one per prompt")
        adapters = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(adapters) != len(prompts):
            raise ValueError("give one adapter, or one per prompt")
        per_prompt = list(images) if images is not None else [[]] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError("give one list of images per prompt")
        batch = uuid.uuid4().hex[:8]
        ids = [f"{batch}-{i}" for i in range(len(prompts))]
        for rid, prompt, p, adapter, files in zip(ids, prompts, params, adapters, per_prompt):
            prepared = self.engine.prepare_request(rid, prompt, p, images=self._images(files))
            prepared.lora_name = adapter
            self.engine.add_prepared(prepared)
        return self._run(ids, "generate", use_tqdm)

    def _images(self, files: Sequence[bytes]) -> Optional[list[ImageInput]]:
        if not files:
            return None
        vision = self.engine.model_config.vision
        if vision is None:
            raise InvalidRequestError("this model does not take images")
        return [image_input(data, vision, ImageLimits(max_images=len(files))) for data in files]

    def add_lora(self, name: str, path: str) -> None:
        """Serve the adapter at `path` (a PEFT folder or a LoRA GGUF) as `name` (needs
        enable_lora=True); raises AdapterError for one that does not fit the model."""
        from tessera.models.adapters import read_adapter

        self.engine.add_lora(read_adapter(name, path, self.engine.model_config, self.engine.config.max_lora_rank))

    def embed(self, inputs: Union[Prompt, Sequence[Prompt]], pooling: Optional[PoolingParams] = None,
              use_tqdm: bool = False) -> list[RequestOutput]:
        """Embed texts (or token-id lists) together, as vLLM's `LLM.embed`; each output's
        `embedding` is its vector, in input order. The model must embed (an encoder such as
        all-minilm-l6-v2, or a decoder given `pooling=` as an engine option)."""
        if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
            inputs = [inputs]  # type: ignore[list-item]
        batch = uuid.uuid4().hex[:8]
        ids = [f"{batch}-{i}" for i in range(len(inputs))]
        for rid, x in zip(ids, inputs):
            self.engine.add_prepared(self.engine.prepare_request(rid, x, SamplingParams(),
                                                                 pooling=pooling or PoolingParams()))
        return self._run(ids, "embed", use_tqdm)

    def _run(self, ids: list[str], what: str, use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request of `ids` has finished; their final outputs in that order."""
        results: dict[str, RequestOutput] = {}
        bar: Optional[tqdm] = tqdm(total=len(ids), desc=what, unit="req") if use_tqdm else None
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        return [results[rid] for rid in ids]
