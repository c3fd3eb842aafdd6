"""The standalone transformers engine: DDTree / DFlash chain / plain decoding, batch size 1.

- :mod:`.drafter`: the DFlash drafter in plain torch (z-lab's checkpoint format).
- :mod:`.engine`: :func:`generate` (draft -> tree -> verify -> commit) on HF ``transformers``.
- :mod:`.corpus`, :mod:`.evaluate`: the stdlib corpus of the tiny pair and tau measurement.

Example::

    from vllm_ddtree.hf import generate, load_pair
    target, drafter, tok = load_pair("vllm_ddtree/assets/tiny_pair/target",
                                     "vllm_ddtree/assets/tiny_pair/drafter")
    res = generate(target, drafter, tok("def main():")["input_ids"], method="ddtree", budget=64)
    print(tok.decode(res.output_ids), res.tau)
"""

from .drafter import DFlashDrafter, DrafterCache, DrafterConfig
from .engine import METHODS, GenerationResult, generate
from .evaluate import load_pair, measure_tau

__all__ = ["DFlashDrafter", "DrafterCache", "DrafterConfig", "METHODS", "GenerationResult", "generate",
           "load_pair", "measure_tau"]
