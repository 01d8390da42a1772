"""The only place that imports vLLM. Patches are applied in one place, ``apply_patches``."""
from __future__ import annotations


def apply_patches() -> None:
    from vllm_ptd.integration.engine_args_patch import EngineArgsPatch
    from vllm_ptd.integration.executor_patch import MultiprocExecutorPatch
    from vllm_ptd.integration.model_runner_patch import GPUModelRunnerPatch
    from vllm_ptd.integration.scheduler_patch import SchedulerPatch

    EngineArgsPatch.apply()
    GPUModelRunnerPatch.apply()
    SchedulerPatch.apply()
    MultiprocExecutorPatch.apply()
