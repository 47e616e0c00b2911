"""The seam between the host engine and the device: the `Runner` interface.

The engine decides *what* runs (a `StepPlan` from the scheduler); a runner
decides *how*: it turns the plan into fixed-shape device arrays, dispatches
the jitted steps and reports what was sampled. `serving.runner.model_runner.ModelRunner`
is the real one; `serving.engine.fake_runner.FakeRunner` computes tokens by
hand with no jax, for scheduler, engine and front-end tests. Multi-host
lock-step and the benchmark's step timer wrap a runner through this same
interface.

Contract:
  * `execute(plan=...)` is called right after `schedule()` and must read
    everything it needs from the plan and its sequences before returning
    (the scheduler mutates them for the next step). It may return before the
    device finishes (asynchronous dispatch); the engine overlaps host work
    for the next step with it.
  * A plan whose `constrained` list is not empty samples those requests only
    when the engine calls `sample(handle=..., masks=...)` with their token
    masks (request id -> packed int32 bitmask row, serving/structured_output):
    `execute` dispatches the forward passes and returns; the engine computes
    the masks meanwhile. It calls `sample` exactly once for such a step,
    before `fetch`.
  * `fetch(handle=...)` blocks until that step is done and returns a
    `StepResult` with one `SampledToken` per `plan.sampled` sequence.
    Handles are fetched in the order they were executed.
  * Either may raise. `StepError.request_ids` names the requests that caused
    the failure when the runner can tell (the engine then fails only those);
    any other exception fails every request of that step. A runner that can
    no longer run anything raises `RunnerDeadError`: the engine stops.
  * With the tiered prefix cache (`kv_offload_host_gb`, serving/engine/kv_offload.py)
    the engine also calls `kv_page_specs()`, `gather_pages(pages)` (not waited for)
    and `import_pages(pages, k, v)` between steps, as `ModelRunner` and `FakeRunner`
    provide them.
"""

from __future__ import annotations

from typing import Any, Protocol

from serving.types import RunnerDeadError, StepError, StepPlan, StepResult, WindowGroup

__all__ = ["Runner", "RunnerDeadError", "StepError"]


class Runner(Protocol):
  """What `LLMEngine` needs from the device side (see module doc)."""

  num_pages: int  # KV pages the runner's cache holds, page 0 (the padding page) included
  # A hybrid model's sliding-window layers' own page group (None: every layer uses the
  # `num_pages` pages; docs/engine.md, "Hybrid attention").
  window_group: WindowGroup | None
  # Linear-attention layers: each running sequence's states sit in its decode slot
  # (serving/runner/state_cache.py); the engine then serves no prefix-cache hits.
  state_slots: bool
  vocab_size: int  # token ids a prompt may hold: [0, vocab_size)

  def warm_up(self) -> int:
    """Compiles (or loads) every program serving can run; returns how many."""
    ...

  def execute(self, *, plan: StepPlan) -> Any:
    """Dispatches one step; returns a handle for `fetch`."""
    ...

  def sample(self, *, handle: Any, masks: dict[str, Any]) -> None:
    """Samples an executed step's rows once the constrained ones' token masks are known."""
    ...

  def fetch(self, *, handle: Any) -> StepResult:
    """Waits for an executed step and returns its sampled tokens."""
    ...

  def close(self) -> None:
    """Releases what the runner holds beyond memory (e.g. multi-host followers)."""
    ...
