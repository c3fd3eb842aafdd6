"""vLLM's OpenAI-compatible server on Model Runner V2, on this CPU (tests/v2_harness.py).

``python tests/v2_server.py <the api_server's arguments>`` runs
``python -m vllm.entrypoints.openai.api_server <arguments>`` with the harness imported first, in
this process and in every process vLLM spawns from it (they re-import this module, not the
server's). ``V2_ASYNC=1``: async scheduling on. A test harness, not a way to serve.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import v2_harness  # noqa: E402, F401

if __name__ == "__main__":
    import runpy

    sys.argv = ["vllm.entrypoints.openai.api_server", *sys.argv[1:]]
    # (this module stays __main__: the processes vLLM spawns re-import it, harness first)
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
