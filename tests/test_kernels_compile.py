"""The kernels compile for an H100 (sm_90) without a GPU, and compile into the code we expect.

The interpreter tests prove the math, not that the GPU compiler accepts the kernels. Triton's
NVIDIA backend (with its bundled ptxas) runs on the CPU: this compiles the production
configuration (Qwen3-8B heads, bf16) the way the JIT would specialise it (unit strides as
constants, pointers and other strides divisible by 16) and checks for Hopper tensor-core dots
(wgmma), software-pipelined K/V loads (cp.async) and the barrier of compact_kv. With a GPU,
the native tests of the other kernel test files compile for real, so this file skips.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")


def _nvidia_backend_available() -> bool:
    try:
        from triton.backends.nvidia import compiler as nv

        return os.path.exists(nv.get_ptxas(90).path)
    except Exception:
        return False


pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() or not _nvidia_backend_available(),
    reason="with CUDA the native kernel tests compile for real; without the NVIDIA backend "
    "(ptxas) nothing can be compiled",
)


# Runs in a fresh interpreter without TRITON_INTERPRET: in this process the kernels may
# already be interpreter functions (the other kernel test files), which cannot be compiled.
_COMPILE = r"""
import json, sys
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from vllm_ddtree.kernels.compact_kv_kernel import compact_kv_kernel
from vllm_ddtree.kernels.tree_attention_kernel import combine_splits_kernel, tree_attention_kernel


def spill_bytes(k):
    # bytes a thread spills to local memory (ptxas -v on the kernel's PTX): spills made a
    # compaction tile 100x slower on an H200
    import re, subprocess, tempfile
    from triton.backends.nvidia import compiler as nv

    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(k.asm["ptx"])
        res = subprocess.run([nv.get_ptxas(90).path, "-v", "--gpu-name", "sm_90a", f"{tmp}/k.ptx",
                              "-o", f"{tmp}/k.cubin"], capture_output=True, text=True, check=True)
    return sum(int(n) for n in re.findall(r"(\d+) bytes spill (?:stores|loads)", res.stderr))


def compile_(fn, types, constexprs):
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = types.get(name, "i32")
        if name.endswith("_ptr") or name.startswith("stride") or name == "block_size":
            attrs[(i,)] = [["tt.divisibility", 16]]  # as the JIT specialises aligned values
    src = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": 4, "num_stages": 2})


report = {}
types = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "out_ptr": "*bf16",
         "block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
         "tree_mask_ptr": "*i32", "has_tree_ptr": "*i8", "qk_scale": "fp32",
         "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32"}
# the launcher's tiles for 32 query / 8 kv heads, head_dim 128 (group 4 -> 16 tokens x 4)
constexprs = dict(HEAD_DIM=128, HEAD_DIM_PAD=128, GROUP=4, GROUP_PAD=4, BLOCK_Q=16,
                  BLOCK_N=64, UPCAST=False, DOT_PRECISION="tf32")
for name in ("stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_btn", "stride_mw"):
    constexprs[name] = 1  # the JIT specialises unit strides
for split in (False, True):
    k = compile_(tree_attention_kernel, types, dict(constexprs, SPLIT=split))
    report[f"attn_wgmma_{split}"] = k.asm["ttgir"].count("ttng.warp_group_dot ")
    report[f"attn_async_copies_{split}"] = k.asm["ttgir"].count("async_copy_global_to_local")
    report[f"attn_shared_{split}"] = k.metadata.shared
    report[f"attn_spills_{split}"] = spill_bytes(k)
types = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": "*bf16",
         "query_start_loc_ptr": "*i32"}
k = compile_(combine_splits_kernel, types, dict(HEAD_DIM=128, HEAD_DIM_PAD=128, stride_od=1))
report["combine_compiled"] = "st.global" in k.asm["ptx"]
types = {"cache_ptrs_ptr": "*i64", "src_slots_ptr": "*i64", "dst_slots_ptr": "*i64"}
report["compact_barrier"] = []
report["compact_spills"] = []
for block_s, block_e in ((64, 32), (16, 128)):  # one group; groups of L = 15
    constexprs = dict(HEAD_DIM=128, NUM_ELEMS=1024, ELEM_TY=tl.int16, BLOCK_S=block_s,
                      BLOCK_E=block_e, stride_d=1)
    k = compile_(compact_kv_kernel, types, constexprs)
    report["compact_barrier"].append("bar.sync" in k.asm["ptx"])
    report["compact_spills"].append(spill_bytes(k))
from vllm_ddtree.kernels.verify_steps_kernel import (
    build_tree_kernel, finish_verify_kernel, walk_kernel)

types = {name: "*i64" for name in build_tree_kernel.arg_names if name.endswith("_ptr")}
types.update(values_ptr="*fp32", ranked_lp_ptr="*fp32", scores_ptr="*fp32", mask_ptr="*i32")
report["build_tree_spills"] = []
for width, block_w in ((16, 16), (256, 16)):  # B = 16 and 256, L = 15, K = B, 8 warps
    k = triton.compile(ASTSource(build_tree_kernel, {
        name: ("constexpr" if name in ("DEPTH", "K", "B", "BLOCK_K", "BLOCK_L", "BLOCK_B",
                                       "BLOCK_W", "HAS_BUDGETS") else types.get(name, "i32"))
        for name in build_tree_kernel.arg_names}, dict(
            DEPTH=15, K=width, B=width, BLOCK_K=max(16, width), BLOCK_L=16,
            BLOCK_B=2 * width if width > 16 else 32, BLOCK_W=block_w, HAS_BUDGETS=True)),
        target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    report["build_tree_spills"].append(spill_bytes(k))

types = {name: "*i64" for name in walk_kernel.arg_names if name.endswith("_ptr")}
types.update(mask_ptr="*i32", emitted_ptr="*i32")
k = compile_(walk_kernel, types, dict(DEPTH=15, BLOCK_B=256, BLOCK_L=16, EMIT=True))
report["walk_spills"] = spill_bytes(k)
types = {name: "*i64" for name in finish_verify_kernel.arg_names if name.endswith("_ptr")}
k = compile_(finish_verify_kernel, types, dict(DEPTH=15, BLOCK_L=16, BLOCK_T=256))
report["finish_verify_atomic"] = "atom" in k.asm["ptx"] or "red." in k.asm["ptx"]
report["finish_verify_spills"] = spill_bytes(k)
print("REPORT" + json.dumps(report))
"""


@pytest.fixture(scope="module")
def report():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    line = [x for x in res.stdout.splitlines() if x.startswith("REPORT")][-1]
    return json.loads(line[len("REPORT"):])


@pytest.mark.parametrize("split", [False, True])
def test_tree_attention_compiles_for_sm90_with_wgmma_and_pipelined_loads(report, split):
    assert report[f"attn_wgmma_{split}"] >= 4, "expected wgmma for QK^T and PV in both phases"
    assert report[f"attn_async_copies_{split}"] > 0, "K/V loads are no longer software-pipelined"
    assert report[f"attn_shared_{split}"] <= 228 * 1024
    assert report[f"attn_spills_{split}"] == 0, "registers spill to local memory"


def test_split_merge_compiles_for_sm90(report):
    assert report["combine_compiled"]


def test_compact_kv_compiles_for_sm90_with_a_barrier(report):
    assert report["compact_barrier"] == [True, True], "loads and stores of a tile must be separated"
    assert report["compact_spills"] == [0, 0], "registers spill to local memory"


def test_verify_step_kernels_compile_for_sm90(report):
    """The tree build at B = 16 and 256 (L = 15), the walk at B = 256 and finish_verify (its
    moved-slot count an atomic add)."""
    assert report["build_tree_spills"] == [0, 0], "the tree build spills registers"
    assert report["walk_spills"] == 0 and report["finish_verify_spills"] == 0
    assert report["finish_verify_atomic"]
