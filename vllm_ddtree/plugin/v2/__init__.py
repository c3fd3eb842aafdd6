"""ddtree on vLLM's Model Runner V2 (``vllm.v1.worker.gpu``), the runner vLLM uses by default.

V2 keeps a request's drafts on the device (``RequestState.draft_tokens``, one row per request
slot) and the scheduler sees placeholders only, so a tree step needs no host round trip: the
drafter writes each request's tree into its slot at the end of a step, the next step's input
preparation reads the same slot. The adapter is three V2 objects, each in its own module:

- :mod:`.speculator`: ``DDTreeSpeculator``, vLLM's DFlash speculator with L mask queries
  whose draft is the optimal tree (``vllm_ddtree.tree.build_tree``) instead of one argmax
  chain, stored per request slot (:mod:`.trees`);
- :mod:`.model_state`: a mixin over the model state vLLM picks for the target (its
  ``ModelState``: the one seam V2 gives a model for inputs, attention metadata and sampling):
  the step's verify trees, the depth positions the target's RoPE reads, the tree masks the
  attention backends read (``cpu_attention.py``, ``cuda_attention.py``);
- :mod:`.verifier`: the rejection sampler for trees: every row sampled by vLLM's own sampler
  at the row's depth position, the lossless walk (``vllm_ddtree.walk``), the K/V compaction of
  the accepted path (``compaction.py``).

The tree logic itself (build, walk, moves, compaction, attention) is the one the V1 runner's
adapter uses; these modules only translate V2's state into it. ``patches.py`` installs them:
``init_speculator`` and the model state's class resolution are the only V2 symbols wrapped.
"""
