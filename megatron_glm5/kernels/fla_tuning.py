"""How much of FLA's Triton autotuning runs: every ``fla`` autotuner can be cut to a few of its configs.

FLA tunes each kernel for every new shape key by compiling and timing all of its configs; for a script or test run
on shapes no earlier run tuned, that takes minutes on an H200 before the first result. The tiling a config picks
changes only the order of rounding, not what is computed, so correctness runs (GPU tests, bf16 parity) may trim the
lists; benchmarks must not. ``GLM5_FLA_TUNE_CONFIGS=N`` (N >= 1) in the environment asks for the trim through
:func:`limit_fla_autotuning_from_env`.
"""

from __future__ import annotations

import os
import sys

ENV_VAR = "GLM5_FLA_TUNE_CONFIGS"


def limit_fla_autotuning(max_configs: int) -> int:
    """Keep at most ``max_configs`` configs (evenly spread over each list) in every Triton autotuner of FLA's
    KDA op and modules (imported here first). Returns how many autotuners were trimmed; ``max_configs <= 0``
    leaves them alone. Needs triton and fla."""
    if max_configs <= 0:
        return 0
    import fla.modules  # noqa: F401  (the kernels our layers use: conv, norms, l2norm)
    import fla.ops.kda  # noqa: F401
    from triton.runtime.autotuner import Autotuner

    trimmed = 0
    seen = set()
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for obj in list(vars(module).values()):
            while obj is not None and id(obj) not in seen:  # Heuristics and Autotuner wrap each other via .fn
                seen.add(id(obj))
                if isinstance(obj, Autotuner) and len(obj.configs) > max_configs:
                    step = len(obj.configs) / max_configs
                    obj.configs = [obj.configs[int(i * step)] for i in range(max_configs)]
                    trimmed += 1
                obj = getattr(obj, "fn", None)
    return trimmed


def limit_fla_autotuning_from_env() -> int:
    """:func:`limit_fla_autotuning` with ``$GLM5_FLA_TUNE_CONFIGS`` (unset or 0: no trim). A value that is not a
    non-negative integer raises ``ValueError`` naming the variable."""
    raw = os.environ.get(ENV_VAR, "").strip()
    if not raw:
        return 0
    if not raw.isdigit():
        raise ValueError(f"{ENV_VAR} must be a non-negative integer, got {raw!r}")
    return limit_fla_autotuning(int(raw))
