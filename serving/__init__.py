"""xlaserve serving: the engine, scheduler, model code and front ends.

The notebook / batch API is `LLM` and `SamplingParams` (docs/api.md); the
package layout is in docs/structure.md.
"""

from serving.types import RequestOutput, SamplingParams, TokenLogprob

__all__ = ["LLM", "RequestOutput", "SamplingParams", "TokenLogprob"]


def __getattr__(name):
  # LLM pulls in jax and the engine; import it lazily so light modules
  # (types, protocol models) stay cheap to import.
  if name == "LLM":
    from serving.entrypoints.llm import LLM
    return LLM
  raise AttributeError(name)
