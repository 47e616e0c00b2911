"""The device side: jitted pure steps over the paged KV cache, and their runner.

`ModelRunner` (model_runner.py) implements the engine's `Runner` interface
(serving/engine/runner_api.py): it turns a host `StepPlan` into fixed-shape
arrays (inputs.py), dispatches the jitted steps (steps.py) and returns a
typed `StepResult`. Beside it: the KV page pool (kv_cache.py), the attention
backend switch (attention.py), on-device sampling (sampling/), the on-disk
executable store (executable_store.py) and multi-host lock-step
(multihost.py). The runner never makes policy: the scheduler decides.
"""
