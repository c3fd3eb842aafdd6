"""vllm-ddtree: DDTree speculative decoding (optimal draft trees from a DFlash drafter) for vLLM.

The core (``tree``, ``walk``, ``sampling``) and the kernels import torch only; ``register`` is
vLLM's plugin entry point (``vllm.general_plugins``) and is the only way vLLM internals are
touched (see ``vllm_ddtree.plugin.patches``).
"""

__version__ = "0.1.0"


def register() -> None:
    """vLLM plugin entry point: idempotent, safe to call in every vLLM process."""
    from vllm_ddtree.plugin.patches import install

    install()
