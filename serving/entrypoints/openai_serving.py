"""OpenAI completions / chat completions on top of `AsyncEngine`, transport-free.

Shared by the HTTP server (JSON and SSE) and the batch runner (JSON lines).
One request becomes `len(prompts) * n` engine requests ("choices"):
  1. `prepare_*` validates the request against the `RequestLimits` before any
     work, applies the chat template, tokenizes and checks lengths against
     `max_model_len` (APIError 4xx on bad input). It is CPU work: the servers
     run it in a worker thread, off the event loop.
  2. `submit` admits every choice or none (more choices than the server can
     ever hold -> 400, queue limit -> 429, draining or engine unavailable ->
     503, engine ValueError -> 400); a failure aborts the choices admitted.
  3. `merge()` interleaves the choices' deltas; leaving it early (client gone,
     task cancelled) aborts every unfinished choice, freeing its KV pages.
  4. `run` returns the final JSON body; `chunks` yields the streaming chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from serving.engine.client import EngineDeadError
from serving.engine.kv_events import wire_hash
from serving.engine.kv_transfer import Offer
from serving.entrypoints import tool_calls
from serving.entrypoints.async_engine import (
  AsyncEngine,
  EngineUnavailableError,
  RequestStream,
  ServerBusyError,
  ServerDrainingError,
)
from serving.entrypoints.kv_connector import KVConnector
from serving.entrypoints.limits import LimitError, RequestLimits
from serving.entrypoints.openai_protocol import (
  APIError,
  ChatCompletionRequest,
  CompletionRequest,
  DetokenizeRequest,
  KVTransferParams,
  LoadLoraAdapterRequest,
  TokenizeRequest,
  UnloadLoraAdapterRequest,
  constraint_param,
)
from serving.types import RequestOutput, SamplingParams, StructuredOutputsParams


@dataclasses.dataclass
class Choice:
  """One engine request of an API request, accumulated from its deltas."""

  index: int
  prompt_ids: list[int]
  params: SamplingParams
  sample_index: int = 0  # which of the n samples of its prompt (usage counts a prompt once)
  text: str = ""
  token_ids: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[Any] = dataclasses.field(default_factory=list)
  finish_reason: str | None = None
  error: str | None = None
  sent_role: bool = False
  tool_parser: tool_calls.ToolCallStreamParser | None = None  # streaming chat with tools


@dataclasses.dataclass
class Job:
  """A prepared API request: its id, kind and choices."""

  id: str
  kind: str  # "completion" | "chat"
  model: str
  choices: list[Choice]
  num_logprobs: int | None
  lora: str | None = None  # the LoRA adapter `model` names (None: the base model)
  tools: list[tool_calls.ToolSpec] | None = None  # parse tool calls from the output (chat)
  kv_params: KVTransferParams | None = None  # prefill / decode across servers (kv_connector)
  kv_pages: list[int] = dataclasses.field(default_factory=list)  # pulled, held until submitted
  kv_offer: Offer | None = None  # a prefill leg's pages, pinned at its first output
  created: int = dataclasses.field(default_factory=lambda: int(time.time()))

  def usage(self) -> dict[str, int]:
    prompt = sum(len(c.prompt_ids) for c in self.choices if c.sample_index == 0)
    completion = sum(len(c.token_ids) for c in self.choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


class OpenAIServing:
  """Turns OpenAI request models into engine requests and responses."""

  def __init__(self, engine: AsyncEngine, model_names: list[str],
               limits: RequestLimits | None = None, allow_runtime_lora: bool = False,
               kv: KVConnector | None = None):
    self.engine = engine
    self.kv = kv  # --kv_role prefill / decode: this server's end of the transfer
    self.model_names = model_names
    self.allow_runtime_lora = allow_runtime_lora
    self.limits = limits or RequestLimits()
    self.tokenizer = engine.tokenizer

  # 1. Preparation ------------------------------------------------------------

  def precheck(self, body: dict[str, Any]) -> None:
    """Cheap size checks of a parsed body's lists, before model validation (which costs
    about a second for a million-item list): APIError 400 naming the field."""
    limits, max_len = self.limits, self.engine.max_model_len
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
      self._check_context(len(prompt))
    elif isinstance(prompt, list):
      with _limit_errors():
        limits.check_counts(len(prompt), 1)
    bounds = {"messages": (max_len, "messages"), "stop": (limits.max_stop, "stop strings"),
              "tools": (tool_calls.MAX_TOOLS, "tools"),
              "stop_token_ids": (limits.max_stop_token_ids, "stop_token_ids"),
              "tokens": (limits.max_input_chars, "tokens")}
    for field, (bound, what) in bounds.items():
      value = body.get(field)
      if isinstance(value, list) and len(value) > bound:
        raise APIError(400, f"{len(value)} {what} exceed the limit of {bound}", param=field,
                       code="limit_exceeded")

  def models(self) -> dict[str, Any]:
    """The served model's names, then each LoRA adapter with the base as its parent."""
    created = int(time.time())
    base = self.model_names[0]
    data = [{"id": name, "object": "model", "created": created, "owned_by": "xlaserve",
             "root": name, "parent": None, "max_model_len": self.engine.max_model_len}
            for name in self.model_names]
    data += [{"id": a.name, "object": "model", "created": created, "owned_by": "xlaserve",
              "root": a.path, "parent": base, "max_model_len": self.engine.max_model_len}
             for a in self.engine.engine.list_loras()]
    return {"object": "list", "data": data}

  def check_model(self, name: str | None) -> str | None:
    """The LoRA adapter `name` selects (None: the base model, also when `name` is None,
    a request that names no model); 404 if it names neither."""
    if name is None or name in self.model_names:
      return None
    if any(a.name == name for a in self.engine.engine.list_loras()):
      return name
    raise APIError(404, f"The model `{name}` does not exist.", param="model",
                   code="model_not_found")

  def served_name(self, req) -> str:
    """The model name a response reports: the request's, or the served model's first name."""
    return req.model if req.model is not None else self.model_names[0]

  # LoRA adapters at run time (the server allows it: --allow_runtime_lora) -----

  def _check_runtime_lora(self) -> None:
    if not self.allow_runtime_lora:
      raise APIError(403, "loading and unloading LoRA adapters at run time is disabled on this "
                     "server (start it with --allow_runtime_lora)", code="lora_updates_disabled")

  def load_lora_adapter(self, req: LoadLoraAdapterRequest) -> str:
    """Reads, validates and registers an adapter (file I/O: call it in a worker thread)."""
    self._check_runtime_lora()
    if req.lora_name in self.model_names:
      raise APIError(400, f"`{req.lora_name}` is the base model's name", param="lora_name")
    try:
      self.engine.engine.load_lora(req.lora_name, req.lora_path)
    except ValueError as e:
      raise APIError(400, f"cannot load LoRA adapter `{req.lora_name}`: {e}",
                     param="lora_path") from None
    return f"Success: LoRA adapter '{req.lora_name}' added successfully."

  def unload_lora_adapter(self, req: UnloadLoraAdapterRequest) -> str:
    self._check_runtime_lora()
    try:
      self.engine.engine.remove_lora(req.lora_name)
    except KeyError:
      raise APIError(404, f"The lora adapter '{req.lora_name}' cannot be found.",
                     param="lora_name", code="model_not_found") from None
    return f"Success: LoRA adapter '{req.lora_name}' removed successfully."

  # The prefix cache (docs/kv_events.md) -----------------------------------------

  def reset_prefix_cache(self) -> int:
    """vLLM's /reset_prefix_cache: every engine forgets its cached prefixes (subscribers
    get AllBlocksCleared). Blocks until the engines did it: call it in a worker thread."""
    try:
      return self.engine.engine.reset_prefix_cache()
    except (EngineDeadError, TimeoutError) as e:
      raise APIError(503, str(e) or "the engine did not answer in step_timeout_s",
                     type="server_error", code="engine_unavailable") from None

  def prefix_cache(self) -> dict[str, Any]:
    """The prefix hashes each engine caches now, as KV events name them (`wire_hash`):
    what a subscriber to the events rebuilds. Call it in a worker thread."""
    try:
      views = self.engine.engine.prefix_cache_hashes()
    except (EngineDeadError, TimeoutError) as e:
      raise APIError(503, str(e) or "the engine did not answer in step_timeout_s",
                     type="server_error", code="engine_unavailable") from None
    return {"engines": [{"data_parallel_rank": rank, "block_hashes": sorted(map(wire_hash, hs))}
                        for rank, hs in enumerate(views)]}

  def prepare_completion(self, req: CompletionRequest) -> Job:
    lora = self.check_model(req.model)
    req.check_supported()
    with _limit_errors():
      self.limits.check_counts(len(req.prompts()), req.n)
    structured = self.output_constraint(req)
    prompts = [self.tokenize_prompt(p, add_special_tokens=True) for p in req.prompts()]
    choices = []
    for ids in prompts:
      max_tokens = self.resolve_max_tokens(ids, req.max_tokens, 16)
      for i in range(req.n):
        params = self.checked(req.sampling_params(max_tokens, req.logprobs, i, structured))
        choices.append(Choice(len(choices), ids, params, i))
    return self._with_kv(Job(f"cmpl-{uuid.uuid4().hex}", "completion", self.served_name(req),
                             choices, req.logprobs, lora), req)

  def prepare_chat(self, req: ChatCompletionRequest) -> Job:
    lora = self.check_model(req.model)
    req.check_supported()
    with _limit_errors():
      self.limits.check_counts(1, req.n)
    tools, tool_choice = self.tool_options(req)
    native = tool_calls.template_supports_tools(getattr(self.tokenizer, "chat_template", None))
    offered = tools if tool_choice != "none" else []
    try:
      messages = tool_calls.prepare_messages(req.message_dicts(), offered, native)
    except tool_calls.ToolError as e:
      raise APIError(400, str(e), param=e.param or "messages") from None
    text = self.render_chat(messages, req.add_generation_prompt, req.chat_template_kwargs,
                            tools=[t.to_openai() for t in offered] if native and offered else None)
    ids = self.tokenize_prompt(text, add_special_tokens=False)
    max_tokens = self.resolve_max_tokens(ids, req.requested_max_tokens(), None)
    n_lp = req.num_logprobs()
    forced = tool_choice not in ("none", "auto")  # "required" or a named function
    if forced and req.structured_outputs_params()[0] is not None:
      raise APIError(400, "tool_choice \"required\" or a named function cannot be combined "
                     "with response_format / structured_outputs", param="tool_choice")
    structured = self.output_constraint(req)
    if forced:
      parallel = req.parallel_tool_calls is not False and tool_choice == "required"
      structured = StructuredOutputsParams(
          grammar=tool_calls.tool_grammar(tools, tool_choice, parallel))
      self._check_constraint(structured, "tools")
    choices = [Choice(i, ids, self.checked(req.sampling_params(max_tokens, n_lp, i, structured)),
                      i) for i in range(req.n)]
    return self._with_kv(Job(f"chatcmpl-{uuid.uuid4().hex}", "chat", self.served_name(req),
                             choices, n_lp, lora,
                             tools=offered if tool_choice != "none" else None), req)

  def _with_kv(self, job: Job, req: CompletionRequest | ChatCompletionRequest) -> Job:
    """`job` with the request's kv_transfer_params where this server acts on them: one
    completion of one prompt, the base model, and a prefill leg is not streamed."""
    params = req.kv_transfer_params
    if self.kv is None or not (self.kv.offers_for(params) or self.kv.pulls_for(params)):
      return job
    if len(job.choices) != 1 or job.lora is not None:
      raise APIError(400, "kv_transfer_params need a single completion (one prompt, n=1) of "
                     "the base model", param="kv_transfer_params")
    if self.kv.offers_for(params) and req.stream:
      raise APIError(400, "a prefill leg (do_remote_decode) is not streamed",
                     param="kv_transfer_params")
    job.kv_params = params
    return job

  def pull_kv(self, job: Job) -> None:
    """A decode leg's pages, pulled from the prefill server into this pool (blocking:
    a worker thread); held for the job until `release_kv`."""
    if job.kv_params is not None and self.kv.pulls_for(job.kv_params):
      job.kv_pages = self.kv.pull(job.kv_params, job.choices[0].prompt_ids)

  def release_kv(self, job: Job) -> None:
    """Drops the job's hold on pulled pages if `submit` has not taken them over (a job
    that is never submitted)."""
    pages, job.kv_pages = job.kv_pages, []
    if pages:
      self.kv.release(pages)

  def _unpin_kv(self, job: Job) -> None:
    """Releases a failed prefill leg's offer (nobody will pull it)."""
    offer, job.kv_offer = job.kv_offer, None
    if offer is not None:
      self.kv.unpin(offer)

  def tool_options(self, req: ChatCompletionRequest) -> tuple[list[tool_calls.ToolSpec], str]:
    """The request's validated tools and tool_choice ("none", "auto", "required" or a
    function name); APIError 400 naming the field."""
    if req.tools is not None:
      with _limit_errors():
        self.limits.check_text(json.dumps(req.tools), "tools")
    try:
      tools = tool_calls.parse_tools(req.tools)
      return tools, tool_calls.parse_tool_choice(req.tool_choice, tools)
    except tool_calls.ToolError as e:
      raise APIError(400, str(e), param=e.param or "tools") from None

  def output_constraint(self, req: CompletionRequest | ChatCompletionRequest
                        ) -> StructuredOutputsParams | None:
    """The request's output constraint, compiled once here (a worker thread) so the
    engine finds it cached; APIError 400 naming the field it came from if it is bad."""
    spec, source = req.structured_outputs_params()
    if spec is None:
      return None
    self._check_constraint(spec, constraint_param(source, spec.kind))
    return spec

  def _check_constraint(self, spec: StructuredOutputsParams, param: str) -> None:
    try:
      self.engine.engine.check_structured_outputs(SamplingParams(structured_outputs=spec))
    except ValueError as e:
      message = str(e).replace(f"structured_outputs.{spec.kind}", param, 1)
      raise APIError(400, message, param=param, code="invalid_value") from None

  def checked(self, params: SamplingParams) -> SamplingParams:
    """`params` if they are within the limits (APIError 400 naming the field otherwise)."""
    with _limit_errors():
      self.limits.check_sampling(params)
    return params

  def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                  template_kwargs: dict[str, Any] | None = None,
                  tools: list[dict[str, Any]] | None = None) -> str:
    """The chat template applied to `messages` (APIError 400 if it fails).

    Request `chat_template_kwargs` are data for the template; a template of the
    client's own (`chat_template`) runs only if the operator allows it, and
    `tools` / `documents` are not accepted through them (`tools` comes from the
    request's validated `tools`, for templates that render them).
    """
    kwargs = dict(template_kwargs or {})
    if "chat_template" in kwargs and not self.limits.allow_request_chat_template:
      raise APIError(400, "a request may not bring its own chat template (the server was "
                     "started without --allow_request_chat_template)",
                     param="chat_template_kwargs.chat_template")
    for key in ("tools", "documents"):
      if key in kwargs:
        raise APIError(400, f"{key} cannot be passed through chat_template_kwargs",
                       param=f"chat_template_kwargs.{key}")
    with _limit_errors():
      self.limits.check_text("".join(str(m.get("content") or "") for m in messages), "messages")
    if tools is not None:
      kwargs["tools"] = tools
    try:
      return self.tokenizer.apply_chat_template(
          messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001 -- template errors come from the client's input
      raise APIError(400, f"chat template could not be applied: {e}", param="messages") from e

  def tokenize_prompt(self, prompt: str | list[int], add_special_tokens: bool) -> list[int]:
    if isinstance(prompt, str):
      try:
        prompt.encode("utf-8")
      except UnicodeEncodeError:
        raise APIError(400, "prompt is not valid UTF-8 (lone surrogate)", param="prompt") from None
      with _limit_errors():
        self.limits.check_text(prompt, "prompt")
      ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens) if prompt else []
    else:
      ids = list(prompt)
      vocab = self.tokenizer.vocab_size
      if any(not 0 <= t < vocab for t in ids):
        raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    if not ids:
      raise APIError(400, "prompt must not be empty", param="prompt")
    self._check_context(len(ids))
    return ids

  def _check_context(self, num_tokens: int) -> None:
    limit = self.engine.max_model_len
    if num_tokens >= limit:
      raise APIError(400, f"This model's maximum context length is {limit} tokens; the prompt "
                     f"has {num_tokens} tokens.", param="prompt", code="context_length_exceeded")

  def resolve_max_tokens(self, ids: list[int], requested: int | None, default: int | None) -> int:
    room = self.engine.max_model_len - len(ids)
    if requested is None:
      return min(default, room) if default is not None else room
    if requested > room:
      raise APIError(400, f"max_tokens={requested} is too large: the prompt has {len(ids)} "
                     f"tokens and max_model_len is {self.engine.max_model_len}, leaving "
                     f"{room}.", param="max_tokens", code="context_length_exceeded")
    return requested

  def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
    self.check_model(req.model)
    req.check()
    if req.messages is not None:
      text = self.render_chat([{"role": m.role, "content": m.text()} for m in req.messages],
                              req.add_generation_prompt)
      add_special = False
    else:
      text, add_special = req.prompt, req.add_special_tokens
    with _limit_errors():
      self.limits.check_text(text, "prompt")
    ids = self.tokenizer.encode(text, add_special_tokens=add_special)
    return {"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len}

  def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
    self.check_model(req.model)
    vocab = self.tokenizer.vocab_size
    if len(req.tokens) > self.limits.max_input_chars:
      raise APIError(400, f"{len(req.tokens)} tokens exceed the limit of "
                     f"{self.limits.max_input_chars}", param="tokens")
    if any(not 0 <= t < vocab for t in req.tokens):
      raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
    return {"prompt": self.tokenizer.decode(req.tokens)}

  # 2-3. Submission and streaming ---------------------------------------------

  def submit(self, job: Job) -> list[RequestStream]:
    """Admits every choice of `job` or none; maps admission errors to APIError."""
    capacity = self.engine.capacity
    if capacity is not None and len(job.choices) > capacity:
      raise APIError(400, f"the request asks for {len(job.choices)} completions but the server "
                     f"holds at most {capacity} requests at once", param="n")
    streams: list[RequestStream] = []
    held, job.kv_pages = job.kv_pages, []  # pulled pages: held until the request's first output
    try:
      for c in job.choices:
        hook = self.kv.release_at_first_output(held) if held else None
        if job.kv_params is not None and self.kv.offers_for(job.kv_params):
          hook = self.kv.pin_at_first_output(c.prompt_ids,
                                             lambda offer: setattr(job, "kv_offer", offer))
        streams.append(self.engine.submit(c.prompt_ids, c.params, f"{job.id}-{c.index}",
                                          lora=job.lora, on_first_output=hook))
        held = []  # the request releases them
    except (ServerBusyError, ServerDrainingError, EngineUnavailableError, ValueError) as e:
      for s in streams:
        s.abort()
      raise admission_error(e) from None
    except BaseException:
      for s in streams:
        s.abort()
      raise
    finally:
      if held:  # never admitted
        self.kv.release(held)
    return streams

  async def merge(self, job: Job, streams: list[RequestStream]
                  ) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Yields (choice, delta) as deltas arrive, accumulating them into the choice."""
    queue: asyncio.Queue[tuple[int, RequestOutput]] = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
      async for out in stream:
        queue.put_nowait((i, out))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
      remaining = len(streams)
      while remaining:
        i, out = await queue.get()
        choice = job.choices[i]
        choice.text += out.text
        choice.token_ids += out.token_ids
        choice.logprobs += out.logprobs or []
        if out.finished:
          remaining -= 1
          choice.finish_reason, choice.error = out.finish_reason, out.error
        yield choice, out
    finally:
      for t in tasks:
        t.cancel()
      for s in streams:
        s.abort()

  # 4. Responses ---------------------------------------------------------------

  async def run(self, job: Job) -> dict[str, Any]:
    """Runs a prepared job to completion and returns the response body."""
    streams = self.submit(job)
    try:
      async with contextlib.aclosing(self.merge(job, streams)) as deltas:
        async for _ in deltas:
          pass
    except BaseException:  # the client went away: nobody will pull a prefill leg's pages
      self._unpin_kv(job)
      raise
    if any(c.finish_reason in ("error", "abort") for c in job.choices):
      self._unpin_kv(job)
    for c in job.choices:
      if c.finish_reason == "error":
        raise APIError(500, f"generation failed: {c.error}", type="server_error")
      if c.finish_reason == "abort":  # the server gave up on it (drain deadline)
        raise APIError(503, "the server stopped before the request finished; retry",
                       type="server_error", code="server_draining")
    if job.kind == "chat":
      choices = [self._chat_choice(job, c) for c in job.choices]
      obj = "chat.completion"
    else:
      choices = [{"index": c.index, "text": c.text, "logprobs": self._completion_logprobs(
          c.logprobs, job), "finish_reason": c.finish_reason} for c in job.choices]
      obj = "text_completion"
    body = {"id": job.id, "object": obj, "created": job.created, "model": job.model,
            "choices": choices, "usage": job.usage()}
    if job.kv_params is not None and self.kv.offers_for(job.kv_params):
      body["kv_transfer_params"] = self.kv.params(job.kv_offer)
    return body

  async def chunks(self, job: Job, streams: list[RequestStream], include_usage: bool,
                   continuous_usage: bool = False) -> AsyncIterator[dict[str, Any]]:
    """Yields the streaming chunk objects of an admitted job."""
    obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
    head = {"id": job.id, "object": obj, "created": job.created, "model": job.model}
    async with contextlib.aclosing(self.merge(job, streams)) as deltas:
      async for choice, out in deltas:
        yield self._chunk(job, head, choice, out, include_usage, continuous_usage)
    if include_usage:
      yield {**head, "choices": [], "usage": job.usage()}

  def _chat_choice(self, job: Job, c: Choice) -> dict[str, Any]:
    """A finished chat choice; with tools, calls in the output become `tool_calls`."""
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    finish = c.finish_reason
    if job.tools is not None:
      content, calls = tool_calls.parse_tool_calls(c.text, job.tools)
      message["content"] = content
      if calls:
        message["tool_calls"] = calls
        finish = "tool_calls" if finish == "stop" else finish
    return {"index": c.index, "message": message,
            "logprobs": self._chat_logprobs(c.logprobs, job), "finish_reason": finish}

  def _chat_delta(self, job: Job, choice: Choice, out: RequestOutput) -> tuple[dict, str | None]:
    """A streamed chat delta and finish reason; with tools, through the choice's parser."""
    if job.tools is None:
      return {"content": out.text}, out.finish_reason
    if choice.tool_parser is None:
      choice.tool_parser = tool_calls.ToolCallStreamParser(job.tools)
    delta = choice.tool_parser.feed(out.text)
    finish = out.finish_reason
    if finish is not None:
      rest = choice.tool_parser.finish()
      for key, value in rest.items():
        delta[key] = (delta.get(key) or ([] if key == "tool_calls" else "")) + value
      if finish == "stop" and choice.tool_parser.calls:
        finish = "tool_calls"
    return delta, finish

  def _chunk(self, job: Job, head: dict[str, Any], choice: Choice, out: RequestOutput,
             include_usage: bool, continuous_usage: bool) -> dict[str, Any]:
    if out.finish_reason == "error":
      return {"error": APIError(500, f"generation failed: {out.error}",
                                type="server_error").body()["error"]}
    finish = out.finish_reason
    if job.kind == "chat":
      delta, finish = self._chat_delta(job, choice, out)
      if not choice.sent_role:
        delta["role"], choice.sent_role = "assistant", True
      c = {"index": choice.index, "delta": delta,
           "logprobs": self._chat_logprobs(out.logprobs, job)}
    else:
      offset = len(choice.text) - len(out.text)
      c = {"index": choice.index, "text": out.text,
           "logprobs": self._completion_logprobs(out.logprobs, job, offset)}
    c["finish_reason"] = finish
    chunk = {**head, "choices": [c]}
    if include_usage:
      chunk["usage"] = job.usage() if continuous_usage else None
    return chunk

  def _token_str(self, token_id: int) -> str:
    return self.tokenizer.decode([token_id])

  def _completion_logprobs(self, lps: list[Any] | None, job: Job,
                           offset: int = 0) -> dict[str, Any] | None:
    if job.num_logprobs is None:
      return None
    tokens = [self._token_str(lp.token_id) for lp in lps or []]
    offsets, pos = [], offset
    for t in tokens:
      offsets.append(pos)
      pos += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps or []],
            "top_logprobs": [{self._token_str(t): v for t, v in lp.top} for lp in lps or []],
            "text_offset": offsets}

  def _chat_logprobs(self, lps: list[Any] | None, job: Job) -> dict[str, Any] | None:
    if job.num_logprobs is None:
      return None

    def entry(token_id: int, logprob: float) -> dict[str, Any]:
      s = self._token_str(token_id)
      return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(lp.token_id, lp.logprob),
                         "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps or []]}


def admission_error(e: Exception) -> APIError:
  """The APIError for a refused admission (queue full, draining, engine ValueError)."""
  if isinstance(e, ServerBusyError):
    return APIError(429, str(e), type="rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": str(e.retry_after_s)})
  if isinstance(e, ServerDrainingError):
    return APIError(503, str(e), type="server_error", code="server_draining")
  if isinstance(e, EngineUnavailableError):
    return APIError(503, str(e), type="server_error", code="engine_unavailable")
  if isinstance(e, LimitError):
    return APIError(400, str(e), param=e.param, code="limit_exceeded")
  return APIError(400, str(e), code="invalid_value")


@contextlib.contextmanager
def _limit_errors():
  """LimitError -> APIError 400 naming the field."""
  try:
    yield
  except LimitError as e:
    raise admission_error(e) from None
