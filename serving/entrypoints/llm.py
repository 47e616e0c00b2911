"""`LLM`: the Python API for notebooks and batch jobs (vLLM-style).

    llm = LLM("smollm2-135m-instruct")
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=16))

    llm = LLM("smollm2-135m-instruct", lora_modules={"sql": "/adapters/sql"})
    llm.generate(["SELECT"], SamplingParams(max_tokens=16), lora="sql")

`generate` submits every prompt to the engine and steps the engine loop in
the calling thread until all are done (continuous batching across prompts).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence

from checkpoints.presets import engine_defaults
from serving.config import EngineConfig, default_max_loras, expected_platform, merge_engine_options
from serving.engine import EngineClient
from serving.entrypoints.engine_builder import build_engine
from serving.types import RequestOutput, SamplingParams, TokenLogprob


class LLM:
  """Loads a model once and serves batched generate / chat calls."""

  def __init__(self, model: str = "smollm2-135m-instruct", *, engine: EngineClient | None = None,
               lora_modules: Mapping[str, str] | None = None, **engine_kwargs):
    """`engine_kwargs` override the preset's engine defaults (configs/<preset>.json).

    `engine`: serve an engine built elsewhere instead (then `model` is unused): any
    `EngineClient` not started in the background (`LLM` steps it itself).
    `lora_modules`: {name: PEFT adapter directory}, each requested by
    `generate(..., lora=name)`; LoRA slots (`max_loras`) default to one per
    adapter, at most 4.
    """
    if engine is None:
      options = merge_engine_options(engine_defaults(model), engine_kwargs, expected_platform())
      if lora_modules and not options.get("max_loras"):
        options["max_loras"] = default_max_loras(len(lora_modules))
      engine = build_engine(model, EngineConfig.of(**options), lora_modules=lora_modules)
    else:
      for name, path in (lora_modules or {}).items():
        engine.load_lora(name, path)
    self.engine = engine
    self._ids = itertools.count()

  def get_tokenizer(self):
    return self.engine.tokenizer

  def generate(self, prompts: str | list[int] | Sequence[str | list[int]],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
               use_tqdm: bool = False, lora: str | None = None) -> list[RequestOutput]:
    """Generates for each prompt (text or token ids); outputs in prompt order.

    `lora` names a loaded adapter (`lora_modules`, `load_lora`); None: the base model.
    """
    self._check_not_in_background()
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
      prompts = [prompts]
    params = sampling_params or SamplingParams()
    params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    if len(params_list) != len(prompts):
      raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
    results: dict[str, RequestOutput] = {}
    order = []
    for prompt, p in zip(prompts, params_list, strict=True):
      rid = f"llm-{next(self._ids)}"
      order.append(rid)
      self.engine.add_request(rid, prompt, p, _Accumulator(rid, results), lora=lora)
    self.engine.run_until_idle()
    return [results[rid] for rid in order]

  def _check_not_in_background(self) -> None:
    """`LLM` steps the engine in the caller's thread: not one a background loop owns."""
    if self.engine.runs_in_background:
      raise RuntimeError("the engine runs in a background thread; use its async front end")

  def load_lora(self, name: str, path: str) -> None:
    """Loads a PEFT adapter directory under `name` (ValueError saying why it cannot)."""
    self.engine.load_lora(name, path)

  def chat(self, messages: list[dict] | list[list[dict]],
           sampling_params: SamplingParams | None = None, lora: str | None = None,
           **template_kwargs):
    """Applies the chat template, then generates; one conversation or a list of them."""
    single = bool(messages) and isinstance(messages[0], dict)
    conversations = [messages] if single else messages
    tok = self.engine.tokenizer
    prompts = [tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False,
                                       **template_kwargs) for c in conversations]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    outs = self.generate(ids, sampling_params, lora=lora)
    return outs

  def stream(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
             lora: str | None = None) -> Iterator[RequestOutput]:
    """Yields delta outputs of one request as the engine produces them."""
    self._check_not_in_background()
    deltas: list[RequestOutput] = []
    rid = f"llm-{next(self._ids)}"
    self.engine.add_request(rid, prompt, sampling_params or SamplingParams(), deltas.append,
                            lora=lora)
    while True:
      while not deltas and self.engine.has_unfinished():
        self.engine.step()
      if not deltas:
        return
      out = deltas.pop(0)
      yield out
      if out.finished:
        return


class _Accumulator:
  """Callback merging delta outputs into one cumulative RequestOutput."""

  def __init__(self, rid: str, results: dict[str, RequestOutput]):
    self.rid, self.results = rid, results
    self.logprobs: list[TokenLogprob] = []

  def __call__(self, delta: RequestOutput) -> None:
    cur = self.results.get(self.rid)
    if cur is None:
      cur = RequestOutput(request_id=self.rid, prompt_token_ids=delta.prompt_token_ids, text="",
                          token_ids=[])
      self.results[self.rid] = cur
    cur.text += delta.text
    cur.token_ids = cur.token_ids + delta.token_ids
    if delta.logprobs is not None:
      self.logprobs.extend(delta.logprobs)
      cur.logprobs = self.logprobs
    cur.finish_reason = delta.finish_reason
    cur.stop_reason = delta.stop_reason
    cur.error = delta.error
