"""The shared vocabulary: what front ends, the engine and the runner exchange.

One module, so that each name is defined once and every layer (runner,
engine, entry points) can import it without importing the others:

- requests: `SamplingParams` (OpenAI / vLLM names) with its
  `StructuredOutputsParams` (constrained output), `RequestOutput`,
  `TokenLogprob`, `FinishReason`;
- the scheduler's view of a request: `Sequence` and its `SequenceStatus`;
- one engine iteration: `StepPlan` (prefill `PrefillChunk`s and a decode
  batch of `DecodeRow`s, decided on the host), `StepResult` (what the runner
  sampled for each sequence, by request id), and how a step fails
  (`StepError` naming the requests at fault, `RunnerDeadError`);
- `LoraAdapter`, an adapter registered with the engine, resident in a
  runner *LoRA slot* while requests use it;
- `EngineStats`, the counters that metrics and health read.

Words used throughout: a *position* is the index of a token in a sequence's
prompt + output; the KV of position p lives at *KV index*
`pages[p // page_size] * page_size + p % page_size` of the page pool; a
*decode slot* is a running sequence's row in the runner's per-request device
state (last sampled token, penalty counters).
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Literal

FinishReason = Literal["stop", "length", "abort", "error"]

# The most top-n logprobs a request may ask for (OpenAI allows 20).
MAX_LOGPROBS = 20
# Integer fields travel to the device as int32.
INT32_MAX = 2**31 - 1
# Seeds are unsigned 64-bit (the gRPC field is uint64): the two 32-bit words of the
# sampling key (serving/runner/sampling/tensors.py), so distinct seeds never collide.
SEED_MAX = 2**64 - 1
# Beyond these, sampling is indistinguishable from the limit (and stays finite in float32).
MAX_TEMPERATURE = 1e4
MAX_REPETITION_PENALTY = 1e4


def _int_in(name: str, value, low: int, high: int) -> None:
  if isinstance(value, bool) or not isinstance(value, int):
    raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
  if not low <= value <= high:
    raise ValueError(f"{name} must be in [{low}, {high}], got {_short(value)}")


def _float_in(name: str, value, low: float, high: float, *, low_open: bool = False) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise ValueError(f"{name} must be a number, got {type(value).__name__}")
  if not math.isfinite(value):
    raise ValueError(f"{name} must be finite, got {value}")
  if not (low < value if low_open else low <= value) or value > high:
    bracket = "(" if low_open else "["
    raise ValueError(f"{name} must be in {bracket}{low}, {high}], got {_short(value)}")


def _short(value) -> str:
  if isinstance(value, int) and abs(value) > 10**30:  # repr of a huge int is slow or refused
    return f"an integer of {value.bit_length()} bits"
  return repr(value)


# Bounds on a constraint's size (the grammar is compiled per request on the host).
MAX_GRAMMAR_CHARS = 200_000
MAX_CHOICES = 1024
MAX_SCHEMA_DEPTH = 64


def _json_size(value: Any, name: str) -> int:
  """Characters a JSON value takes, about; walked without recursion. ValueError if it is
  not JSON, nests deeper than MAX_SCHEMA_DEPTH or exceeds MAX_GRAMMAR_CHARS."""
  size, stack = 0, [(value, 0)]
  while stack:
    v, depth = stack.pop()
    if depth > MAX_SCHEMA_DEPTH:
      raise ValueError(f"{name} nests deeper than {MAX_SCHEMA_DEPTH} levels")
    if isinstance(v, dict):
      if any(not isinstance(k, str) for k in v):
        raise ValueError(f"{name} must be JSON: object keys are strings")
      size += 2 + sum(len(k) + 4 for k in v)
      stack += [(x, depth + 1) for x in v.values()]
    elif isinstance(v, list):
      size += 2 + len(v)
      stack += [(x, depth + 1) for x in v]
    elif isinstance(v, str):
      size += len(v) + 2
    elif v is None or isinstance(v, (bool, int, float)):
      size += 8
    else:
      raise ValueError(f"{name} must be JSON, got a {type(v).__name__}")
    if size > MAX_GRAMMAR_CHARS:
      raise ValueError(f"{name} exceeds {MAX_GRAMMAR_CHARS} characters")
  return size


@dataclasses.dataclass
class StructuredOutputsParams:
  """A constraint on the output, as vLLM's `structured_outputs`: set exactly one of

  - `json`: a JSON schema (a dict, or its JSON text): the output is a JSON value
    that validates against it;
  - `json_object`: True: the output is some JSON object (OpenAI's JSON mode);
  - `regex`: the output matches the regular expression (Rust `regex` syntax);
  - `choice`: the output is exactly one of these strings;
  - `grammar`: the output is in the language of this Lark grammar (llguidance's
    dialect: docs/structured_output.md), whose start rule is `start`.

  `validate` checks types and sizes only; whether the schema, regex or grammar
  compiles is checked by serving/structured_output before the engine takes it.
  """

  json: str | dict | None = None
  regex: str | None = None
  choice: list[str] | None = None
  grammar: str | None = None
  json_object: bool | None = None

  def validate(self) -> None:
    """Raises ValueError naming the field (`structured_outputs.<kind>`)."""
    given = [k for k in ("json", "regex", "choice", "grammar", "json_object")
             if getattr(self, k) not in (None, False)]
    if len(given) != 1:
      raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar "
                       f"and json_object (got {', '.join(given) or 'none'})")
    kind = given[0]
    value = getattr(self, kind)
    name = f"structured_outputs.{kind}"
    if kind == "json_object" and value is not True:
      raise ValueError(f"{name} must be a boolean")
    if kind == "json":
      if not isinstance(value, (str, dict)):
        raise ValueError(f"{name} must be a JSON schema (an object or its JSON text)")
      if isinstance(value, str) and len(value) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{name} exceeds {MAX_GRAMMAR_CHARS} characters")
      if isinstance(value, dict):
        _json_size(value, name)
    if kind in ("regex", "grammar"):
      if not isinstance(value, str) or not value:
        raise ValueError(f"{name} must be a non-empty string")
      if len(value) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{name} exceeds {MAX_GRAMMAR_CHARS} characters")
    if kind == "choice":
      if (not isinstance(value, list) or not value
          or any(not isinstance(c, str) or not c for c in value)):
        raise ValueError(f"{name} must be a non-empty list of non-empty strings")
      if len(value) > MAX_CHOICES or sum(map(len, value)) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{name} has more than {MAX_CHOICES} choices or "
                         f"{MAX_GRAMMAR_CHARS} characters")

  @property
  def kind(self) -> str:
    """Which constraint is set: "json", "regex", "choice", "grammar" or "json_object"."""
    return next(k for k in ("json", "regex", "choice", "grammar", "json_object")
                if getattr(self, k) not in (None, False))

  @classmethod
  def coerce(cls, value: Any) -> StructuredOutputsParams | None:
    """None, an instance, or a dict of the same fields (unknown keys refused)."""
    if value is None or isinstance(value, cls):
      return value
    if not isinstance(value, dict):
      raise ValueError("structured_outputs must be an object with one of json, regex, choice, "
                       "grammar, json_object")
    unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
      raise ValueError(f"structured_outputs: unknown field(s) {', '.join(map(str, unknown))}")
    return cls(**value)


@dataclasses.dataclass
class SamplingParams:
  """Per-request sampling options with the OpenAI / vLLM names.

  `temperature == 0` means greedy. `top_k <= 0` (or -1) disables top-k;
  `top_p == 1` disables nucleus sampling; `min_p == 0` disables min-p.
  `logprobs=None` returns no logprobs; `logprobs=n` returns the sampled
  token's logprob plus the top `n` alternatives (0 <= n <= 20). `seed`: any integer
  in [0, 2^64) (`SEED_MAX`); None: the engine picks one.
  """

  max_tokens: int | None = 16
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = -1
  min_p: float = 0.0
  repetition_penalty: float = 1.0
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  seed: int | None = None
  stop: str | list[str] | None = None
  stop_token_ids: list[int] | None = None
  ignore_eos: bool = False
  logprobs: int | None = None
  include_stop_str_in_output: bool = False
  skip_special_tokens: bool = True
  structured_outputs: StructuredOutputsParams | None = None

  def __post_init__(self):
    self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
    if isinstance(self.stop, str):
      self.stop = [self.stop]
    self.stop = list(self.stop or [])
    self.stop_token_ids = list(self.stop_token_ids or [])
    self.validate()

  def validate(self) -> None:
    """Raises ValueError naming the first invalid field (types, ranges, finiteness)."""
    if self.max_tokens is not None:
      _int_in("max_tokens", self.max_tokens, 1, INT32_MAX)
    _float_in("temperature", self.temperature, 0.0, MAX_TEMPERATURE)
    _float_in("top_p", self.top_p, 0.0, 1.0, low_open=True)
    _int_in("top_k", self.top_k, -1, INT32_MAX)
    if self.top_k == 0:
      self.top_k = -1
    _float_in("min_p", self.min_p, 0.0, 1.0)
    _float_in("repetition_penalty", self.repetition_penalty, 0.0, MAX_REPETITION_PENALTY,
              low_open=True)
    _float_in("presence_penalty", self.presence_penalty, -2.0, 2.0)
    _float_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
    if self.logprobs is not None:
      _int_in("logprobs", self.logprobs, 0, MAX_LOGPROBS)
    if self.seed is not None:
      _int_in("seed", self.seed, 0, SEED_MAX)
    if any(not isinstance(s, str) or not s for s in self.stop):
      raise ValueError("stop strings must be non-empty strings")
    for t in self.stop_token_ids:
      _int_in("stop_token_ids", t, 0, INT32_MAX)
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be a boolean")
    if self.structured_outputs is not None:
      if not isinstance(self.structured_outputs, StructuredOutputsParams):
        raise ValueError("structured_outputs must be a StructuredOutputsParams")
      self.structured_outputs.validate()

  @property
  def greedy(self) -> bool:
    return self.temperature == 0.0


@dataclasses.dataclass
class TokenLogprob:
  """Logprob of one generated token and its top alternatives."""

  token_id: int
  logprob: float
  top: list[tuple[int, float]]  # (token_id, logprob), best first


@dataclasses.dataclass
class RequestOutput:
  """What the engine reports for a request: cumulative, or a delta when streaming.

  `text` / `token_ids` are the generated completion (not the prompt).
  `finish_reason` is None while the request runs.
  """

  request_id: str
  prompt_token_ids: list[int]
  text: str
  token_ids: list[int]
  finish_reason: FinishReason | None = None
  logprobs: list[TokenLogprob] | None = None
  stop_reason: str | int | None = None
  error: str | None = None

  @property
  def finished(self) -> bool:
    return self.finish_reason is not None

  @property
  def num_prompt_tokens(self) -> int:
    return len(self.prompt_token_ids)


# ---- LoRA adapters --------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class LoraAdapter:
  """A LoRA adapter registered with the engine.

  `lora_id` is unique per registration (a re-load under the same name gets a
  new one): it identifies the adapter in a device slot and keys its prefix-cache
  pages. `weights` is what the runner installs (checkpoints.lora.LoraWeights
  for the model runner); the engine never looks inside.
  """

  name: str
  lora_id: int
  path: str
  rank: int
  weights: Any = dataclasses.field(repr=False, default=None)


# ---- the scheduler's view of a request --------------------------------------


class SequenceStatus(enum.Enum):
  WAITING = 1
  RUNNING = 2
  FINISHED = 3


@dataclasses.dataclass(frozen=True)
class WindowGroup:
  """A hybrid model's sliding-window layers as a KV page group of their own (a runner's
  `window_group`): page ids [1, num_pages) apart from the full-attention pages', of
  which a sequence holds only those its window still reads (docs/engine.md, "Hybrid
  attention")."""

  window: int  # keys a query sees: its own position and window - 1 before it
  num_pages: int  # pages of the group, page 0 (the dummy page) included


@dataclasses.dataclass(eq=False)
class Sequence:
  """One request as the scheduler and runner see it (host state only).

  `num_computed` counts positions whose KV is written or being written by an
  in-flight step; `pending` counts tokens sampled by in-flight steps that
  have not reached `output_ids` yet (the next decode reads them on the
  device). `pages[i]` holds positions `[i * page_size, (i + 1) * page_size)`;
  `page_hashes[i]` is the prefix hash of page i once its KV is known written.
  A hybrid model's sliding-window layers keep their own pages (`WindowGroup`):
  `window_pages[i]` holds the same positions in that group, 0 (the dummy page)
  where the window has passed them and they were released.
  """

  request_id: str
  prompt_ids: list[int]
  params: SamplingParams
  eos_ids: frozenset[int] = frozenset()
  seed: int = 0
  output_ids: list[int] = dataclasses.field(default_factory=list)
  status: SequenceStatus = SequenceStatus.WAITING
  pages: list[int] = dataclasses.field(default_factory=list)
  page_hashes: list[bytes] = dataclasses.field(default_factory=list)
  window_pages: list[int] = dataclasses.field(default_factory=list)
  num_computed: int = 0
  pending: int = 0
  decode_slot: int | None = None
  finish_reason: FinishReason | None = None
  stop_reason: str | int | None = None  # the stop string or stop token id that ended it
  admit_order: int = 0
  lora: LoraAdapter | None = None
  lora_slot: int | None = None  # the runner slot holding `lora` while running
  # The output constraint's state (serving.structured_output.Grammar), None if unconstrained.
  grammar: Any = dataclasses.field(default=None, repr=False)
  # The device's `last_tokens[decode_slot]` holds output_ids[-1]: it was sampled while the
  # sequence held its slot (a readmitted sequence's slot holds another's token).
  token_on_device: bool = False
  # Tiered prefix cache (serving/engine/kv_offload.py): the pages admission found in an
  # offload tier, reloaded by the step that admits it; `offload_failed` once such a
  # reload failed (its next admission recomputes that prefix instead).
  kv_reload: KVReload | None = dataclasses.field(default=None, repr=False)
  offload_failed: bool = False
  # Until when (time.monotonic()) its admission waits for its disk pages to be read
  # ahead; set when it first asks, cleared when it is admitted.
  prefetch_deadline: float | None = None

  @property
  def cache_salt(self) -> bytes | None:
    """Root of the sequence's prefix hashes: KV computed under an adapter is its own."""
    return None if self.lora is None else b"lora:%d" % self.lora.lora_id

  @property
  def num_tokens(self) -> int:
    """Known tokens plus pending ones."""
    return len(self.prompt_ids) + len(self.output_ids) + self.pending

  @property
  def num_known(self) -> int:
    """Tokens whose ids the host knows (prompt + output)."""
    return len(self.prompt_ids) + len(self.output_ids)

  @property
  def num_generated(self) -> int:
    return len(self.output_ids) + self.pending

  @property
  def in_prefill(self) -> bool:
    """Still has known tokens whose KV is not computed."""
    return self.num_computed < self.num_known

  def token_ids(self) -> list[int]:
    return self.prompt_ids + self.output_ids


# ---- one engine iteration ------------------------------------------------------


@dataclasses.dataclass
class PrefillChunk:
  """Prefill of a sequence's known positions [start, end)."""

  seq: Sequence
  start: int
  end: int
  sample: bool  # the chunk ends at the last known token: sample the next one
  admission: int = 0  # seq.admit_order when planned (a later admission owns other pages)


@dataclasses.dataclass
class KVReload:
  """Pages a step writes from an offload tier before it computes anything: `pages[i]`
  takes `arrays[i]` (one page's KV as stored: [k, v], every layer). They continue the
  sequence's cached prefix; its prefill starts after them, and their hashes are
  published with the step's other full pages once it completed. Admission makes one
  (maybe with no pages) for every lookup in the tiers; the tiers count its hits and
  misses once it is admitted."""

  seq: Sequence
  pages: list[int]
  arrays: list[list[Any]]
  tiers: list[str]  # where each page was found: "host" or "disk"
  missed: tuple[str, ...] = ()  # the tiers asked for the page after them, in vain


@dataclasses.dataclass
class DecodeRow:
  """One decode token: the input token at `position` was sampled by an earlier step
  (it is on the device, maybe not yet on the host); the step samples the next one.

  In a speculative step the row also verifies `num_drafts` proposed tokens at
  the positions after it: `drafts` when the host proposed them (n-gram,
  suffix), empty when the runner's draft model proposes them on the device.

  In a multi-step decode (`StepPlan.decode_steps` > 1) the row runs
  `num_steps` decode iterations in one device call, each taking the token
  the previous one sampled: it writes KV at `position` .. `position +
  num_steps - 1` and samples `num_steps` tokens.
  """

  seq: Sequence
  position: int
  drafts: list[int] = dataclasses.field(default_factory=list)
  num_drafts: int = 0
  num_steps: int = 1


@dataclasses.dataclass
class StepPlan:
  """What one step runs: adapters to install first, prefill chunks, then one decode batch
  (a speculative one when `speculative`).

  `lora_loads` are (slot, adapter) pairs the runner writes into its LoRA
  slots before anything of the step runs.
  """

  prefills: list[PrefillChunk]
  decodes: list[DecodeRow]
  lora_loads: list[tuple[int, LoraAdapter]] = dataclasses.field(default_factory=list)
  # The decode batch verifies drafts (DecodeRow.num_drafts) in one speculative call.
  speculative: bool = False
  # Decode iterations of the decode batch's one device call (every row's num_steps).
  decode_steps: int = 1
  # Offload-tier hits of the sequences it admits, written before the step runs.
  kv_reloads: list[KVReload] = dataclasses.field(default_factory=list)

  @property
  def empty(self) -> bool:
    return not self.prefills and not self.decodes

  @property
  def sequences(self) -> list[Sequence]:
    """Every sequence the step touches (each appears once)."""
    return [c.seq for c in self.prefills] + [r.seq for r in self.decodes]

  @property
  def sampled(self) -> list[Sequence]:
    """Sequences the step samples a token for: final prefill chunks, then decodes."""
    return [c.seq for c in self.prefills if c.sample] + [r.seq for r in self.decodes]

  @property
  def constrained(self) -> list[str]:
    """Request ids of sampled sequences with an output constraint (`Sequence.grammar`):
    the runner samples the step only once the engine brings their token masks."""
    return [s.request_id for s in self.sampled if s.grammar is not None]


@dataclasses.dataclass
class SampledToken:
  """A token the runner sampled for one sequence, with its logprobs if asked for."""

  token_id: int
  logprob: TokenLogprob | None = None


@dataclasses.dataclass
class StepResult:
  """The runner's answer to a `StepPlan`: the tokens each sampled request produced, in
  order: one, or for a speculative row its kept drafts and the token drawn after them.
  `num_drafts` holds the drafts a speculative row verified (the metrics' proposals)."""

  tokens: dict[str, list[SampledToken]]
  num_drafts: dict[str, int] = dataclasses.field(default_factory=dict)


class StepError(RuntimeError):
  """A step failed because of some of its requests (`request_ids`)."""

  def __init__(self, message: str, request_ids: list[str]):
    super().__init__(message)
    self.request_ids = list(request_ids)


class RunnerDeadError(RuntimeError):
  """The runner's device state is lost: nothing can run any more."""


# ---- counters ------------------------------------------------------------------


@dataclasses.dataclass
class SpecDecodeCounters:
  """Speculative decoding totals since start (vLLM's spec_decode metric names)."""

  num_drafts: int = 0  # decode rows that verified at least one draft
  num_draft_tokens: int = 0  # drafts verified
  num_accepted_tokens: int = 0  # drafts kept
  accepted_per_pos: list[int] = dataclasses.field(default_factory=list)  # kept at position i

  def record(self, proposed: int, kept: int) -> None:
    if proposed <= 0:
      return
    self.num_drafts += 1
    self.num_draft_tokens += proposed
    self.num_accepted_tokens += kept
    if len(self.accepted_per_pos) < proposed:
      self.accepted_per_pos.extend([0] * (proposed - len(self.accepted_per_pos)))
    for i in range(kept):
      self.accepted_per_pos[i] += 1


@dataclasses.dataclass
class KVTierStats:
  """One offload tier's counters (host memory or disk; serving/engine/kv_offload.py)."""

  hits: int = 0  # pages a prefix lookup found here
  misses: int = 0  # pages a prefix lookup asked for and did not find here
  pages_stored: int = 0  # pages written into the tier
  bytes_stored: int = 0  # their bytes
  used_bytes: int = 0  # bytes the tier holds now
  capacity_bytes: int = 0
  disabled: bool = False  # the disk tier after a failed write


@dataclasses.dataclass
class KVOffloadStats:
  """The tiered prefix cache's counters: per tier, and the device transfers."""

  host: KVTierStats = dataclasses.field(default_factory=KVTierStats)
  disk: KVTierStats | None = None  # None: no disk tier
  pages_offloaded: int = 0  # device pages copied to the host
  offload_seconds: float = 0.0  # from gather dispatch to the copy landing, summed per chunk
  offload_chunks: int = 0
  pages_reloaded: int = 0  # tier pages written into device pages
  reload_seconds: float = 0.0  # host time of the reload transfers, summed per step
  reload_steps: int = 0
  reload_failures: int = 0  # sequences that recomputed a prefix after a failed reload
  pages_prefetched: int = 0  # disk pages read ahead of admission by the reader thread
  prefetch_misses: int = 0  # disk pages a request recomputed: read late, failed or not read


@dataclasses.dataclass
class EngineStats:
  """Engine counters at one moment (read by metrics, health and benchmarks)."""

  num_running: int
  num_waiting: int
  kv_cache_usage: float
  num_pages_total: int
  num_pages_free: int
  num_preemptions_total: int
  prompt_tokens_total: int
  generation_tokens_total: int
  prefix_cache_queries_total: int
  prefix_cache_hits_total: int
  prefill_tokens_computed_total: int
  lora_running: dict[str, int] = dataclasses.field(default_factory=dict)  # adapter -> running
  lora_waiting: dict[str, int] = dataclasses.field(default_factory=dict)  # adapter -> waiting
  lora_swaps_total: int = 0  # adapters written into a runner slot
  max_lora: int = 0  # adapters a batch can hold (runner LoRA slots; 0: LoRA off)
  page_size: int = 0  # tokens per KV page (the prefix cache's block size)
  # KV-event batches dropped because the publisher's queue was full (serving/engine/
  # kv_events.py; one publisher per process: every engine reports its total)
  kv_events_dropped_total: int = 0
  spec_decode: SpecDecodeCounters = dataclasses.field(default_factory=SpecDecodeCounters)
  kv_offload: KVOffloadStats | None = None  # the tiered prefix cache, when on
