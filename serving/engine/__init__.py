"""The host side: the engine loop, scheduler, page allocator and output processing.

No module here touches a device: the engine drives one through the `Runner`
interface (runner_api.py), and the scheduler and allocator are plain Python.
Front ends drive an engine through `EngineClient` (client.py), which
`LLMEngine`, `ReplicatedEngine` (replicas.py) and `DisaggregatedEngine`
(disaggregated.py) implement.
"""

from serving.engine.client import EngineClient, EngineDeadError
from serving.engine.llm_engine import LLMEngine
from serving.engine.runner_api import Runner, RunnerDeadError, StepError

__all__ = ["EngineClient", "EngineDeadError", "LLMEngine", "Runner", "RunnerDeadError",
           "StepError"]
