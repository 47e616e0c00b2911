"""`EngineClient`: the one interface every front end drives an engine through.

Three engines implement it: `LLMEngine` (llm_engine.py, one step loop over one
runner), `ReplicatedEngine` (replicas.py, `dp` whole engines behind a
cache-aware router) and `DisaggregatedEngine` (disaggregated.py, prefill and
decode workers with KV pages moved between them). The offline `LLM`, the
asyncio bridge, the HTTP / gRPC / batch servers, the metrics and the launcher
(serving/entrypoints/) depend on this protocol alone, as vLLM's front ends
depend on its `EngineClient`: nothing there asks an engine whether it has a
feature. What only a composite engine has is still part of the protocol, with
the single engine's natural answer: `replica_stats()` is one row,
`replica_roles` is `["both"]`, `transfer_stats()` is empty.

Threads: requests are added and aborted from any thread; outputs arrive
through each request's `on_output` callback on an engine thread. Either the
caller drives the loop (`step()` / `run_until_idle()`, as `LLM` does) or
`start()` runs it in background threads (the servers); never both.

Failures: a failure inside a step fails only its requests (their callback
gets an output with `finish_reason="error"`); an engine that can no longer
serve reports why through `health()` and refuses requests with
`EngineDeadError`. tests/serving/engine/test_engine_client.py runs the same
scenarios against all three implementations. No jax here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from serving.config import EngineConfig
from serving.types import EngineStats, LoraAdapter, RequestOutput, SamplingParams

OutputCallback = Callable[[RequestOutput], None]


class EngineDeadError(RuntimeError):
  """The engine cannot serve any more (its reason is the message)."""


@runtime_checkable
class EngineClient(Protocol):
  """What a front end may ask of an engine (module doc). Model information first."""

  model_name: str
  """The base model's name (the served name unless the server renames it)."""
  tokenizer: Any
  """The tokenizer requests are encoded and outputs decoded with."""
  config: EngineConfig
  """The `EngineConfig` the engine was built from (for a composite engine, the one asked
  for: its `dp` / worker counts; each member engine has its own)."""
  num_programs: int
  """Compiled step programs, over every member engine (counted at warm-up)."""

  @property
  def max_model_len(self) -> int:
    """Longest prompt + output, in tokens, that a request may have."""
    ...

  @property
  def num_slots(self) -> int:
    """Requests decoded at once, over every engine that decodes (`max_num_seqs` each)."""
    ...

  # ---- requests (any thread) ----

  def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                  on_output: OutputCallback, lora: str | None = None) -> None:
    """Validates and queues a request; its delta outputs go to `on_output` on an engine
    thread, the last with `finish_reason` set.

    `lora` names a loaded adapter (None: the base model). Raises ValueError, saying
    why, for a request the engine cannot serve (empty prompt, token id out of range,
    too long for `max_model_len`, a duplicate id, bad sampling parameters or output
    constraint, an unknown adapter): nothing is queued and the engine serves on.
    Raises `EngineDeadError` once the engine cannot serve.
    """
    ...

  def abort(self, request_id: str) -> None:
    """Ends a request early: its KV pages are freed before the next step and its callback
    gets a final output with `finish_reason="abort"`. Unknown or finished ids are
    ignored."""
    ...

  def check_structured_outputs(self, params: SamplingParams) -> None:
    """Compiles `params.structured_outputs`, if set; ValueError naming the field if it is
    bad or the engine serves no constraints. Slow for a big schema: front ends call it
    in a worker thread, and `add_request` then finds the grammar cached."""
    ...

  # ---- the step loop ----

  def has_unfinished(self) -> bool:
    """True while any request (queued, running or moving between engines) is
    unfinished."""
    ...

  def step(self) -> None:
    """One iteration of the loop in the caller's thread (not while `start`ed)."""
    ...

  def run_until_idle(self) -> None:
    """Steps in the caller's thread until every request has finished."""
    ...

  def start(self) -> None:
    """Runs the step loop in background thread(s) from now on (idempotent)."""
    ...

  @property
  def runs_in_background(self) -> bool:
    """True between `start()` and `shutdown()`: the loop belongs to background threads,
    and the caller must not `step()`."""
    ...

  def shutdown(self, timeout_s: float = 10.0) -> None:
    """Stops the loop (waiting up to `timeout_s` for a step in progress) and releases the
    runners."""
    ...

  def health(self) -> str | None:
    """None while the engine can serve; otherwise why not (dead, loop gone, a step
    running past `step_timeout_s`). Servers poll it and stop when it is not None."""
    ...

  # ---- statistics (any thread) ----

  def stats(self) -> EngineStats:
    """The engine's counters and gauges, as one engine's (summed over members)."""
    ...

  def replica_stats(self) -> list[EngineStats]:
    """Each member engine's own stats, in the order of `replica_roles`; one row for a
    single engine."""
    ...

  @property
  def replica_roles(self) -> list[str]:
    """The role of each `replica_stats` row: "prefill", "decode", or "both" for an
    engine that does both."""
    ...

  def transfer_stats(self) -> dict[str, int]:
    """KV transfer counters by metric name (`kv_transfers_total`, ...); empty for an
    engine that moves no KV between engines."""
    ...

  # ---- the prefix cache (any thread) ----

  def reset_prefix_cache(self) -> int:
    """Forgets every cached prefix on every member engine (vLLM's
    `/reset_prefix_cache`; pages held by running requests stay theirs). -> prefixes
    dropped."""
    ...

  def prefix_cache_hashes(self) -> list[list[bytes]]:
    """The prefix hashes each member engine caches now, in `replica_stats` order (the
    view a KV event subscriber rebuilds, docs/kv_events.md)."""
    ...

  # ---- LoRA adapters (any thread) ----

  def load_lora(self, name: str, path: str) -> LoraAdapter:
    """Reads a PEFT adapter directory and registers it under `name` on every engine that
    serves it. ValueError, saying why, if it cannot be served (LoRA not enabled, the
    name taken or the base model's, a bad adapter)."""
    ...

  def remove_lora(self, name: str) -> None:
    """Unregisters an adapter: new requests cannot name it, running ones finish with it.
    KeyError if none is registered under `name`."""
    ...

  def get_lora(self, name: str) -> LoraAdapter:
    """The registered adapter `name`; ValueError if there is none."""
    ...

  def list_loras(self) -> list[LoraAdapter]:
    """Every registered adapter, in registration order."""
    ...
