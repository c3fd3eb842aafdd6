// Fused CPU kernels of vllm-ddtree: one op per stage of a verify step that the torch path runs
// as tens of small ops (each a fixed cost on the CPU, a launch on a GPU).
//
// Each op has a torch twin in the package, which is its oracle in tests/test_native.py:
//   build_tree     <- vllm_ddtree.tree (vectorised build) and reference_build_tree (heap)
//   first_nodes    <- build_tree's per-request budgets (torch path)
//   walk           <- vllm_ddtree.walk (vectorised walk)
//   finish_verify  <- TreeState.finish_verify (torch)
//   copy_slots_    <- vllm_ddtree.plugin.cpu_attention.copy_cpu_slots
//   store_trees_, gather_trees, reindex_trees_ <- TreeState's proposal store (torch path)
//   tree_attention_info <- vllm_ddtree.plugin.cpu_attention.tree_attention_info
//   tree_attention_ <- cpu_attention.tree_rows_attention over the layout's gathers
//   auto_budgets, calibration_observe_ <- vllm_ddtree.budget (auto's budget function)
//   tree_log_factors, calibrate_lists, tree_calibration_observe_ <- vllm_ddtree.calibration
//   context_complete <- TreeState.context_complete (torch path)
//   argmax_rows    <- torch.argmax (vllm_ddtree.sampling.argmax_rows)
//   top_k_         <- torch.topk (vllm_ddtree.tree._top_log_probs)
//   top_log_probs_ <- log-softmax then torch.topk (vllm_ddtree.tree._top_log_probs)
// Built on first use by vllm_ddtree.kernels.native (torch.utils.cpp_extension, cached).
#include <torch/library.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/softmax.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <queue>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define DDTREE_AVX2 1  // the tree attention's AVX2 path, chosen at run time (cpu_has_avx2)
#endif

namespace {

using at::Tensor;

void check_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "ddtree native op: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), "ddtree native op: ", name, " must be contiguous");
}

// One heap entry of DDTree's best-first search: the prefix extending `parent` (-1 = the root)
// with the rank-`rank` token of depth `depth`. Popped in the order of the key
// (-score, depth, parent, rank), the tie-break of vllm_ddtree.tree.
struct Entry {
  float score;
  int64_t depth;
  int64_t parent;
  int64_t rank;
};

struct Later {  // std::priority_queue pops the largest: "largest" = the latest in key order
  bool operator()(const Entry& a, const Entry& b) const {
    if (a.score != b.score) return a.score < b.score;
    if (a.depth != b.depth) return a.depth > b.depth;
    if (a.parent != b.parent) return a.parent > b.parent;
    return a.rank > b.rank;
  }
};

// Node i of a tree (field pointers at node 0, mask rows at the root's row) becomes padding:
// token -1, parent -1, depth 0, score -inf, mask row {root, itself}.
void set_padding(int64_t* tokens, int64_t* parents, int64_t* depths, float* scores,
                 uint32_t* rows, int64_t W, int64_t i) {
  tokens[i] = -1;
  parents[i] = -1;
  depths[i] = 0;
  scores[i] = -std::numeric_limits<float>::infinity();
  uint32_t* row = rows + (i + 1) * W;
  std::memset(row, 0, sizeof(uint32_t) * W);
  row[0] = 1u;
  row[(i + 1) / 32] |= 1u << ((i + 1) % 32);
}

// values/ids: [R, L, k] top-k log-probabilities and token ids in any order (torch.topk's);
// each (request, depth) row is ranked by (value desc, id asc) first. Returns the tree of the
// `budget` most probable prefixes (fewer when fewer have probability > 0), padded to
// `max_budget` nodes: token -1, parent -1, depth 0, score -inf, mask row {root, itself}.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> build_tree(
    const Tensor& values, const Tensor& ids, int64_t budget, int64_t max_budget) {
  check_cpu(values, "values");
  check_cpu(ids, "ids");
  TORCH_CHECK(values.dim() == 3 && values.scalar_type() == at::kFloat,
              "build_tree: values must be float32 [R, L, k]");
  TORCH_CHECK(ids.sizes() == values.sizes() && ids.scalar_type() == at::kLong,
              "build_tree: ids must be int64 with the shape of values");
  TORCH_CHECK(0 <= budget && budget <= max_budget && max_budget >= 1,
              "build_tree: need 0 <= budget <= max_budget, max_budget >= 1");
  const int64_t R = values.size(0), L = values.size(1), K = values.size(2);
  const int64_t B = max_budget, W = (B + 1 + 31) / 32;
  auto long_opts = ids.options();
  Tensor tokens = at::empty({R, B}, long_opts);
  Tensor parents = at::empty({R, B}, long_opts);
  Tensor depths = at::empty({R, B}, long_opts);
  Tensor scores = at::empty({R, B}, values.options());
  Tensor num_nodes = at::empty({R}, long_opts);
  Tensor mask = at::empty({R, B + 1, W}, values.options().dtype(at::kInt));
  const float* val = values.data_ptr<float>();
  const int64_t* tok = ids.data_ptr<int64_t>();
  int64_t* out_tok = tokens.data_ptr<int64_t>();
  int64_t* out_par = parents.data_ptr<int64_t>();
  int64_t* out_dep = depths.data_ptr<int64_t>();
  float* out_score = scores.data_ptr<float>();
  int64_t* out_num = num_nodes.data_ptr<int64_t>();
  uint32_t* out_mask = reinterpret_cast<uint32_t*>(mask.data_ptr<int32_t>());
  const float neg_inf = -std::numeric_limits<float>::infinity();

  std::vector<int64_t> order(K);
  std::vector<float> lp(L * K);      // ranked log-probabilities of one request
  std::vector<int64_t> lt(L * K);    // their token ids
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t d = 0; d < L; ++d) {
      const float* v = val + (r * L + d) * K;
      const int64_t* t = tok + (r * L + d) * K;
      for (int64_t j = 0; j < K; ++j) order[j] = j;
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        if (v[a] != v[b]) return v[a] > v[b];
        return t[a] < t[b];
      });
      for (int64_t j = 0; j < K; ++j) {
        lp[d * K + j] = v[order[j]];
        lt[d * K + j] = t[order[j]];
      }
    }
    int64_t* rt = out_tok + r * B;
    int64_t* rp = out_par + r * B;
    int64_t* rd = out_dep + r * B;
    float* rs = out_score + r * B;
    uint32_t* rm = out_mask + r * (B + 1) * W;
    std::memset(rm, 0, sizeof(uint32_t) * (B + 1) * W);
    rm[0] = 1u;  // the root's row: the root
    int64_t n = 0;
    std::priority_queue<Entry, std::vector<Entry>, Later> heap;
    if (K > 0 && budget > 0) heap.push(Entry{lp[0], 1, -1, 0});
    while (!heap.empty() && n < budget) {
      Entry e = heap.top();
      heap.pop();
      if (e.score == neg_inf) break;  // every remaining prefix has probability zero
      rt[n] = lt[(e.depth - 1) * K + e.rank];
      rp[n] = e.parent;
      rd[n] = e.depth;
      rs[n] = e.score;
      uint32_t* row = rm + (n + 1) * W;
      const uint32_t* above = rm + (e.parent + 1) * W;  // the parent's row (the root's: -1)
      for (int64_t w = 0; w < W; ++w) row[w] = above[w];
      row[(n + 1) / 32] |= 1u << ((n + 1) % 32);
      if (e.rank + 1 < K) {  // the next sibling: same parent, next rank
        float s = lp[(e.depth - 1) * K + e.rank + 1];
        if (e.parent >= 0) s = rs[e.parent] + s;
        heap.push(Entry{s, e.depth, e.parent, e.rank + 1});
      }
      if (e.depth < L) heap.push(Entry{e.score + lp[e.depth * K], e.depth + 1, n, 0});
      ++n;
    }
    out_num[r] = n;
    for (int64_t i = n; i < B; ++i) set_padding(rt, rp, rd, rs, rm, W, i);
  }
  return {tokens, parents, depths, scores, num_nodes, mask};
}

// Cuts each request's tree (build_tree's fields) to its first budgets[r] nodes, in place (a
// subtree: parents precede their children); the rest becomes padding.
void keep_first_nodes(Tensor* fields, const Tensor& budgets) {
  check_cpu(budgets, "budgets");
  TORCH_CHECK(budgets.scalar_type() == at::kLong, "first_nodes: budgets must be int64");
  const int64_t R = fields[0].size(0), B = fields[0].size(1), W = fields[5].size(2);
  TORCH_CHECK(budgets.numel() == R, "first_nodes: one budget per request");
  const int64_t* bud = budgets.data_ptr<int64_t>();
  int64_t* rt = fields[0].data_ptr<int64_t>();
  int64_t* rp = fields[1].data_ptr<int64_t>();
  int64_t* rd = fields[2].data_ptr<int64_t>();
  float* rs = fields[3].data_ptr<float>();
  int64_t* num = fields[4].data_ptr<int64_t>();
  uint32_t* rm = reinterpret_cast<uint32_t*>(fields[5].data_ptr<int32_t>());
  for (int64_t r = 0; r < R; ++r) {
    const int64_t keep = std::max<int64_t>(0, std::min(bud[r], num[r]));
    for (int64_t i = keep; i < num[r]; ++i) {
      set_padding(rt + r * B, rp + r * B, rd + r * B, rs + r * B, rm + r * (B + 1) * W, W, i);
    }
    num[r] = keep;
  }
}

// The trees of the first budgets[r] nodes of request r, the rest padding: new tensors (the
// inputs are what a budget function saw).
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> first_nodes(
    const Tensor& tokens_in, const Tensor& parents_in, const Tensor& depths_in,
    const Tensor& scores_in, const Tensor& num_nodes_in, const Tensor& mask_in,
    const Tensor& budgets) {
  const Tensor* inputs[] = {&tokens_in, &parents_in, &depths_in, &scores_in, &num_nodes_in,
                            &mask_in};
  Tensor outputs[6];
  for (int i = 0; i < 6; ++i) {
    check_cpu(*inputs[i], "tree");
    outputs[i] = at::empty(inputs[i]->sizes(), inputs[i]->options());
    std::memcpy(outputs[i].data_ptr(), inputs[i]->data_ptr(),
                inputs[i]->numel() * inputs[i]->element_size());
  }
  keep_first_nodes(outputs, budgets);
  return {outputs[0], outputs[1], outputs[2], outputs[3], outputs[4], outputs[5]};
}

// The walk: from the root, move to the child whose token is the target's sample at the current
// row, while there is one (nodes are in an order where parents precede their children;
// siblings carry distinct tokens). sampled: [R, B + 1] int64, row 0 = the root.
// Also returns vLLM's layout of the emitted tokens, [R, out_width] int32: the output tokens,
// then -1.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> walk(const Tensor& tokens,
                                                                const Tensor& parents,
                                                                const Tensor& sampled,
                                                                int64_t max_depth,
                                                                int64_t out_width) {
  for (auto* t : {&tokens, &parents, &sampled}) {  // rows may be strided (a tree's first nodes)
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 2 && t->stride(1) == 1,
                "walk: tokens, parents and sampled must be CPU [R, *] with contiguous rows");
  }
  TORCH_CHECK(sampled.scalar_type() == at::kLong && tokens.scalar_type() == at::kLong &&
                  parents.scalar_type() == at::kLong,
              "walk: tokens, parents and sampled must be int64");
  const int64_t R = tokens.size(0), B = tokens.size(1), L = max_depth;
  TORCH_CHECK(sampled.size(0) == R && sampled.size(1) == B + 1, "walk: sampled must be [R, B + 1]");
  auto opts = tokens.options();
  Tensor accepted_nodes = at::empty({R, L}, opts);
  Tensor num_accepted = at::empty({R}, opts);
  Tensor bonus = at::empty({R}, opts);
  Tensor output_tokens = at::empty({R, L + 1}, opts);
  Tensor accepted_rows = at::empty({R, L + 1}, opts);
  Tensor emitted = at::empty({R, out_width}, opts.dtype(at::kInt));
  int32_t* em = emitted.data_ptr<int32_t>();
  const int64_t* tk = tokens.data_ptr<int64_t>();
  const int64_t* pa = parents.data_ptr<int64_t>();
  const int64_t* sa = sampled.data_ptr<int64_t>();
  int64_t* an = accepted_nodes.data_ptr<int64_t>();
  int64_t* na = num_accepted.data_ptr<int64_t>();
  int64_t* bo = bonus.data_ptr<int64_t>();
  int64_t* ot = output_tokens.data_ptr<int64_t>();
  int64_t* ar = accepted_rows.data_ptr<int64_t>();
  const int64_t st = tokens.stride(0), sp = parents.stride(0), ss = sampled.stride(0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t* t = tk + r * st;
    const int64_t* p = pa + r * sp;
    const int64_t* y = sa + r * ss;
    int64_t* rows = ar + r * (L + 1);
    int64_t current = -1, n = 0;
    rows[0] = 0;
    for (int64_t k = 0; k < B && n < L; ++k) {
      TORCH_CHECK(p[k] < k, "walk: node ", k, " has parent ", p[k],
                  ": parents must precede their children");
      if (p[k] == current && t[k] == y[current + 1]) {
        current = k;
        rows[++n] = k + 1;
      }
    }
    na[r] = n;
    for (int64_t j = 0; j <= L; ++j) {
      const bool kept = j <= n;
      if (j > 0) an[r * L + j - 1] = kept ? rows[j] - 1 : -1;
      ot[r * (L + 1) + j] = kept ? y[rows[j]] : -1;
      if (!kept) rows[j] = -1;
    }
    bo[r] = y[rows[n]];
    for (int64_t j = 0; j < out_width; ++j) {
      em[r * out_width + j] = j <= L ? static_cast<int32_t>(ot[r * (L + 1) + j]) : -1;
    }
  }
  return {accepted_nodes, num_accepted, bonus, output_tokens, accepted_rows, emitted};
}

// TreeState.finish_verify: accepted node rows (within each request's block) -> the K/V moves
// (src, dst flat rows, -1 where nothing moves), the drafter's hidden-state gather index [T]
// (dst row reads src row, the identity elsewhere), and the number of moved slots added to
// `moved` (a 0-dim int64 counter).
std::tuple<Tensor, Tensor, Tensor> finish_verify(const Tensor& accepted_rows,
                                                 const Tensor& starts, int64_t num_tokens,
                                                 Tensor moved) {
  check_cpu(accepted_rows, "accepted_rows");
  check_cpu(starts, "starts");
  check_cpu(moved, "moved");
  TORCH_CHECK(accepted_rows.scalar_type() == at::kLong && starts.scalar_type() == at::kLong &&
                  moved.scalar_type() == at::kLong,
              "finish_verify: int64 tensors expected");
  const int64_t R = accepted_rows.size(0), L = accepted_rows.size(1) - 1;
  TORCH_CHECK(starts.numel() == R, "finish_verify: one start per request");
  auto opts = accepted_rows.options();
  Tensor src = at::empty({R * L}, opts);
  Tensor dst = at::empty({R * L}, opts);
  Tensor gather = at::empty({num_tokens}, opts);
  const int64_t* rows = accepted_rows.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  int64_t* s = src.data_ptr<int64_t>();
  int64_t* d = dst.data_ptr<int64_t>();
  int64_t* g = gather.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_tokens; ++i) g[i] = i;
  int64_t count = 0;
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t j = 1; j <= L; ++j) {
      const int64_t row = rows[r * (L + 1) + j], k = r * L + j - 1;
      s[k] = d[k] = -1;
      if (row < 0) continue;
      const int64_t from = st[r] + row, to = st[r] + j;
      TORCH_CHECK(0 <= to && to < num_tokens && 0 <= from && from < num_tokens,
                  "finish_verify: row out of range");
      g[to] = from;
      if (from != to) {
        s[k] = from;
        d[k] = to;
        ++count;
      }
    }
  }
  *moved.data_ptr<int64_t>() += count;
  return {src, dst, gather};
}

// The proposal store (TreeState.proposals): buffers nodes [C + 1, 3, B] int64 (token,
// parent, depth), scores [C + 1, B] float32 and mask [C + 1, B + 1, W] int32, one row per
// request slot (row C: the empty tree).

void check_store(const Tensor& nodes, const Tensor& scores, const Tensor& mask) {
  check_cpu(nodes, "nodes buffer");
  check_cpu(scores, "scores buffer");
  check_cpu(mask, "mask buffer");
  TORCH_CHECK(nodes.dim() == 3 && nodes.size(1) == 3 && nodes.scalar_type() == at::kLong &&
                  scores.scalar_type() == at::kFloat && mask.scalar_type() == at::kInt &&
                  scores.size(0) == nodes.size(0) && mask.size(0) == nodes.size(0) &&
                  scores.size(1) == nodes.size(2) && mask.size(1) == nodes.size(2) + 1,
              "ddtree store: buffers of unexpected shapes or dtypes");
}

// Write the trees of one proposal (row r of each field) into store rows slots[r]; returns
// the parents and depths as int16 [R, 2, B] (the host copy clip_drafts reads).
Tensor store_trees_(Tensor nodes, Tensor scores, Tensor mask, const Tensor& slots,
                    const Tensor& tokens, const Tensor& parents, const Tensor& depths,
                    const Tensor& tree_scores, const Tensor& tree_mask) {
  check_store(nodes, scores, mask);
  for (auto* t : {&slots, &tokens, &parents, &depths, &tree_scores, &tree_mask}) {
    check_cpu(*t, "tree");
  }
  const int64_t R = tokens.size(0), B = nodes.size(2), W = mask.size(2);
  const int64_t C1 = nodes.size(0);
  TORCH_CHECK(tokens.size(1) == B && tree_mask.size(1) == B + 1 && tree_mask.size(2) == W &&
                  slots.numel() == R && slots.scalar_type() == at::kLong,
              "store_trees_: trees must have the store's width");
  Tensor host = at::empty({R, 2, B}, tokens.options().dtype(at::kShort));
  int16_t* h = host.data_ptr<int16_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t* fields[3] = {tokens.data_ptr<int64_t>(), parents.data_ptr<int64_t>(),
                              depths.data_ptr<int64_t>()};
  int64_t* nb = nodes.data_ptr<int64_t>();
  float* sb = scores.data_ptr<float>();
  int32_t* mb = mask.data_ptr<int32_t>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t slot = sl[r];
    TORCH_CHECK(0 <= slot && slot < C1, "store_trees_: slot out of range");
    for (int f = 0; f < 3; ++f) {
      std::memcpy(nb + (slot * 3 + f) * B, fields[f] + r * B, sizeof(int64_t) * B);
    }
    for (int64_t i = 0; i < B; ++i) {
      h[(r * 2) * B + i] = static_cast<int16_t>(fields[1][r * B + i]);
      h[(r * 2 + 1) * B + i] = static_cast<int16_t>(fields[2][r * B + i]);
    }
    std::memcpy(sb + slot * B, tree_scores.data_ptr<float>() + r * B, sizeof(float) * B);
    std::memcpy(mb + slot * (B + 1) * W, tree_mask.data_ptr<int32_t>() + r * (B + 1) * W,
                sizeof(int32_t) * (B + 1) * W);
  }
  return host;
}

// The verify trees of an exact step: store rows slots[r] as a batch (tokens, parents, depths,
// scores, mask), and, for each index t of token_index (request r, query row i encoded as
// r * (B + 1) + i; i = 0 for the root and rows without a node), the position shift of that
// token: depth(node i - 1) - i for a node row, 0 otherwise.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gather_trees(
    const Tensor& nodes, const Tensor& scores, const Tensor& mask, const Tensor& slots,
    const Tensor& token_index) {
  check_store(nodes, scores, mask);
  check_cpu(slots, "slots");
  check_cpu(token_index, "token_index");
  const int64_t R = slots.numel(), B = nodes.size(2), W = mask.size(2), C1 = nodes.size(0);
  auto opts = nodes.options();
  Tensor tokens = at::empty({R, B}, opts);
  Tensor parents = at::empty({R, B}, opts);
  Tensor depths = at::empty({R, B}, opts);
  Tensor out_scores = at::empty({R, B}, scores.options());
  Tensor out_mask = at::empty({R, B + 1, W}, mask.options());
  const int64_t T = token_index.numel();
  Tensor shift = at::empty({T}, opts);
  const int64_t* sl = slots.data_ptr<int64_t>();
  int64_t* outs[3] = {tokens.data_ptr<int64_t>(), parents.data_ptr<int64_t>(),
                      depths.data_ptr<int64_t>()};
  const int64_t* nb = nodes.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t slot = sl[r];
    TORCH_CHECK(0 <= slot && slot < C1, "gather_trees: slot out of range");
    for (int f = 0; f < 3; ++f) {
      std::memcpy(outs[f] + r * B, nb + (slot * 3 + f) * B, sizeof(int64_t) * B);
    }
    std::memcpy(out_scores.data_ptr<float>() + r * B, scores.data_ptr<float>() + slot * B,
                sizeof(float) * B);
    std::memcpy(out_mask.data_ptr<int32_t>() + r * (B + 1) * W,
                mask.data_ptr<int32_t>() + slot * (B + 1) * W, sizeof(int32_t) * (B + 1) * W);
  }
  const int64_t* ti = token_index.data_ptr<int64_t>();
  int64_t* sh = shift.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    const int64_t r = ti[t] / (B + 1), i = ti[t] % (B + 1);
    TORCH_CHECK(0 <= r && r < R, "gather_trees: token index out of range");
    sh[t] = i == 0 ? 0 : outs[2][r * B + i - 1] - i;
  }
  return {tokens, parents, depths, out_scores, out_mask, shift};
}

// Re-index proposals clipped near their end (TreeState._reindex_proposals): plan [K, 1 + B]
// int64 per clipped request: its slot, then the old index of each kept node in order (-1
// past the kept ones). Kept nodes move to the front (a subtree: ancestors come first), their
// parents renumbered and their ancestor rows rebuilt; the rest become padding.
void reindex_trees_(Tensor nodes, Tensor scores, Tensor mask, const Tensor& plan) {
  check_store(nodes, scores, mask);
  check_cpu(plan, "plan");
  const int64_t B = nodes.size(2), W = mask.size(2), C1 = nodes.size(0);
  TORCH_CHECK(plan.dim() == 2 && plan.size(1) == B + 1 && plan.scalar_type() == at::kLong,
              "reindex_trees_: plan must be int64 [K, 1 + B]");
  const int64_t* pl = plan.data_ptr<int64_t>();
  int64_t* nb = nodes.data_ptr<int64_t>();
  float* sb = scores.data_ptr<float>();
  uint32_t* mb = reinterpret_cast<uint32_t*>(mask.data_ptr<int32_t>());
  std::vector<int64_t> old_nodes(3 * B), renumber(B);
  std::vector<float> old_scores(B);
  for (int64_t q = 0; q < plan.size(0); ++q) {
    const int64_t slot = pl[q * (B + 1)];
    const int64_t* keep = pl + q * (B + 1) + 1;
    TORCH_CHECK(0 <= slot && slot < C1, "reindex_trees_: slot out of range");
    int64_t* tok = nb + slot * 3 * B;
    int64_t* par = tok + B;
    int64_t* dep = par + B;
    float* sc = sb + slot * B;
    uint32_t* rows = mb + slot * (B + 1) * W;
    std::memcpy(old_nodes.data(), tok, sizeof(int64_t) * 3 * B);
    std::memcpy(old_scores.data(), sc, sizeof(float) * B);
    std::fill(renumber.begin(), renumber.end(), -1);
    for (int64_t j = 0; j < B; ++j) {
      const int64_t old = keep[j];
      if (old < 0) {
        set_padding(tok, par, dep, sc, rows, W, j);
        continue;
      }
      TORCH_CHECK(old < B, "reindex_trees_: node index out of range");
      renumber[old] = j;
      const int64_t old_parent = old_nodes[B + old];
      const int64_t parent = old_parent < 0 ? -1 : renumber[old_parent];
      TORCH_CHECK(old_parent < 0 || parent >= 0,
                  "reindex_trees_: a kept node's parent must be kept before it");
      tok[j] = old_nodes[old];
      par[j] = parent;
      dep[j] = old_nodes[2 * B + old];
      sc[j] = old_scores[old];
      uint32_t* row = rows + (j + 1) * W;
      const uint32_t* above = rows + (parent + 1) * W;  // written already: parent < j
      for (int64_t w = 0; w < W; ++w) row[w] = above[w];
      row[(j + 1) / 32] |= 1u << ((j + 1) % 32);
    }
  }
}

// The tree rows of a verify step on vLLM's CPU attention backend (cpu_attention.py's
// tree_attention_info, whose TreeAttentionInfo this returns): requests [n, 4] int64 rows
// (request row r, first query row, m nodes, sequence length after the step); ancestor_mask
// [R, B + 1, W] packed rows of the step's trees; block_table [>= R, max_blocks] (int32 or
// int64). Row i <= m of request n (the root, then its nodes) is query row start + i and sees
// the committed context (positions < seq - m - 1) and, in the span, itself and its ancestors
// (ancestor row i: the root's holds only the root); padding rows see position 0.
std::tuple<Tensor, Tensor, Tensor, Tensor> tree_attention_info(const Tensor& requests,
                                                               const Tensor& ancestor_mask,
                                                               const Tensor& block_table,
                                                               int64_t block_size) {
  check_cpu(requests, "requests");
  check_cpu(ancestor_mask, "ancestor_mask");
  TORCH_CHECK(block_table.device().is_cpu() && block_table.dim() == 2 &&
                  block_table.stride(1) == 1,
              "tree_attention_info: block_table must be a CPU [R, blocks] table");
  TORCH_CHECK(requests.dim() == 2 && requests.size(1) == 4 &&
                  requests.scalar_type() == at::kLong,
              "tree_attention_info: requests must be int64 [n, 4]");
  const int64_t n = requests.size(0), B = ancestor_mask.size(1) - 1, W = ancestor_mask.size(2);
  const int64_t* req = requests.data_ptr<int64_t>();
  int64_t b = 0, s = 0;
  for (int64_t q = 0; q < n; ++q) {
    b = std::max(b, req[q * 4 + 2] + 1);  // the root row and m node rows
    s = std::max(s, req[q * 4 + 3]);
  }
  auto long_opts = requests.options();
  Tensor rows = at::empty({n, b}, long_opts);
  Tensor valid = at::empty({n, b}, long_opts.dtype(at::kBool));
  Tensor slots = at::empty({n, s}, long_opts);
  Tensor mask = at::empty({n, b, s}, long_opts.dtype(at::kBool));
  int64_t* ro = rows.data_ptr<int64_t>();
  bool* va = valid.data_ptr<bool>();
  int64_t* sl = slots.data_ptr<int64_t>();
  bool* ma = mask.data_ptr<bool>();
  const uint32_t* am = reinterpret_cast<const uint32_t*>(ancestor_mask.data_ptr<int32_t>());
  const int64_t bt_stride = block_table.stride(0), num_blocks = block_table.size(1);
  const bool bt32 = block_table.scalar_type() == at::kInt;
  TORCH_CHECK(bt32 || block_table.scalar_type() == at::kLong,
              "tree_attention_info: block_table must be int32 or int64");
  for (int64_t q = 0; q < n; ++q) {
    const int64_t r = req[q * 4], start = req[q * 4 + 1], m = req[q * 4 + 2];
    const int64_t seq = req[q * 4 + 3], ctx = seq - m - 1;
    TORCH_CHECK(0 <= r && r < ancestor_mask.size(0) && r < block_table.size(0) && m <= B &&
                    ctx >= 0 && (seq + block_size - 1) / block_size <= num_blocks,
                "tree_attention_info: request out of range");
    for (int64_t pos = 0; pos < s; ++pos) {
      int64_t slot = 0;
      if (pos < seq) {
        const int64_t at = r * bt_stride + pos / block_size;
        const int64_t block = bt32 ? block_table.data_ptr<int32_t>()[at]
                                   : block_table.data_ptr<int64_t>()[at];
        slot = block * block_size + pos % block_size;
      }
      sl[q * s + pos] = slot;
    }
    for (int64_t i = 0; i < b; ++i) {
      const bool real = i <= m;
      ro[q * b + i] = real ? start + i : 0;
      va[q * b + i] = real;
      bool* row = ma + (q * b + i) * s;
      if (!real) {
        std::memset(row, 0, s);
        row[0] = true;  // a padding row sees one position: no all-masked softmax
        continue;
      }
      const uint32_t* bits = am + (r * (B + 1) + i) * W;
      for (int64_t pos = 0; pos < s; ++pos) {
        const int64_t rel = pos - ctx;
        row[pos] = rel < 0 || (rel <= m && ((bits[rel / 32] >> (rel % 32)) & 1u));
      }
    }
  }
  return {rows, valid, slots, mask};
}

// TreeState.context_complete on the CPU: [R] bool, whether every position p < num_computed[r]
// of request r (slot block_table[r, p / block_size] * block_size + p % block_size) was last
// written by a drafter context pass (valid [num_slots] bool); block_table [>= R, max_blocks]
// int32 or int64.
Tensor context_complete(const Tensor& valid, const Tensor& block_table,
                        at::IntArrayRef num_computed, int64_t block_size) {
  check_cpu(valid, "context_valid");
  TORCH_CHECK(valid.scalar_type() == at::kBool, "context_complete: valid must be bool");
  TORCH_CHECK(block_table.device().is_cpu() && block_table.dim() == 2 &&
                  block_table.stride(1) == 1 &&
                  (block_table.scalar_type() == at::kInt ||
                   block_table.scalar_type() == at::kLong),
              "context_complete: block_table must be a CPU int32/int64 [R, blocks] table");
  const int64_t R = static_cast<int64_t>(num_computed.size());
  TORCH_CHECK(R <= block_table.size(0) && block_size > 0,
              "context_complete: request out of range");
  const bool* va = valid.data_ptr<bool>();
  const int64_t num_slots = valid.numel(), stride = block_table.stride(0);
  const bool bt32 = block_table.scalar_type() == at::kInt;
  Tensor out = at::empty({R}, valid.options());
  bool* ok = out.data_ptr<bool>();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = num_computed[r];
    TORCH_CHECK(n >= 0 && (n + block_size - 1) / block_size <= block_table.size(1),
                "context_complete: more computed positions than the block table holds");
    ok[r] = true;
    for (int64_t p = 0; p < n && ok[r]; ++p) {
      const int64_t at = r * stride + p / block_size;
      const int64_t block = bt32 ? block_table.data_ptr<int32_t>()[at]
                                 : block_table.data_ptr<int64_t>()[at];
      const int64_t slot = block * block_size + p % block_size;
      TORCH_CHECK(0 <= slot && slot < num_slots, "context_complete: slot out of range");
      ok[r] = va[slot];
    }
  }
  return out;
}

// The calibration's score bin of a path log-probability s: min(floor(-s), bins - 1)
// (vllm_ddtree.budget.score_bins; -inf in the last bin)
inline int64_t score_bin(float s, int64_t bins) {
  const float f = std::floor(-s);
  if (!(f < static_cast<float>(bins - 1))) return bins - 1;
  return f <= 0.0f ? 0 : static_cast<int64_t>(f);
}

// auto's budget function (vllm_ddtree.budget: Calibration.factors, node_gains, auto_budgets)
// for one drafting step. scores/depths: [R, B] of the full-width trees; predicted/observed:
// [2, L, bins] float64, the calibration per depth and score bin (row 0 greedy, row 1 sampled);
// sampled, complete: [R] bool (complete: empty = every request); xs/ys: the verify cost curve
// (float64); on_overhead: seconds a drafting step takes beyond the model (added to every
// tree's time); plain_time: the step time of plain decoding, its overhead included (<= 0: the
// measured rates decide whether to draft, the model only sizes the trees; > 0: a tree of at
// least one node competes with it, since a step without nodes is plain decoding's);
// node_cost: [R] float64 seconds each node of a request adds beyond its verify row (the
// scheduler's grammar work), limit: [R] int64 the most nodes a request can send (both empty:
// none); tie: > 0 takes the largest tree whose rate is within tie (a share) of the best one's,
// among the prefixes of nodes with a gain (0: the best). Returns the per-request budgets [R]
// int64.
Tensor auto_budgets(const Tensor& scores, const Tensor& depths, const Tensor& predicted,
                    const Tensor& observed, double prior, const Tensor& sampled,
                    const Tensor& complete, const Tensor& xs, const Tensor& ys,
                    double draft_time, double on_overhead, double plain_time,
                    const Tensor& node_cost, const Tensor& limit, double tie) {
  for (auto* t : {&scores, &depths, &predicted, &observed, &sampled, &complete, &xs, &ys,
                  &node_cost, &limit}) {
    check_cpu(*t, "auto_budgets input");
  }
  TORCH_CHECK(node_cost.numel() == 0 || (node_cost.scalar_type() == at::kDouble &&
                                         limit.scalar_type() == at::kLong &&
                                         node_cost.numel() == scores.size(0) &&
                                         limit.numel() == scores.size(0)),
              "auto_budgets: node_cost and limit must be [R] float64 and int64");
  TORCH_CHECK(scores.scalar_type() == at::kFloat && depths.scalar_type() == at::kLong &&
                  predicted.scalar_type() == at::kDouble &&
                  observed.scalar_type() == at::kDouble && sampled.scalar_type() == at::kBool &&
                  xs.scalar_type() == at::kDouble && ys.scalar_type() == at::kDouble,
              "auto_budgets: unexpected dtypes");
  TORCH_CHECK(predicted.dim() == 3 && observed.sizes() == predicted.sizes(),
              "auto_budgets: predicted and observed must be [2, L, bins]");
  const int64_t R = scores.size(0), B = scores.size(1), L = predicted.size(1);
  const int64_t bins = predicted.size(2), N = R * B, P = xs.numel();
  const float* sc = scores.data_ptr<float>();
  const int64_t* dp = depths.data_ptr<int64_t>();
  const double* pr = predicted.data_ptr<double>();
  const double* ob = observed.data_ptr<double>();
  const bool* smp = sampled.data_ptr<bool>();
  const bool* cpl = complete.numel() ? complete.data_ptr<bool>() : nullptr;
  const double* x = xs.data_ptr<double>();
  const double* y = ys.data_ptr<double>();
  const double* nc = node_cost.numel() ? node_cost.data_ptr<double>() : nullptr;
  const int64_t* lim = node_cost.numel() ? limit.data_ptr<int64_t>() : nullptr;
  double y_min = y[0];
  for (int64_t i = 1; i < P; ++i) y_min = std::min(y_min, y[i]);
  std::vector<double> gains(N);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t kind = smp[r] ? 1 : 0;
    for (int64_t i = 0; i < B; ++i) {
      const int64_t d = dp[r * B + i];
      double g = 0.0;
      if (d > 0) {
        const int64_t cell = ((kind * L + std::min<int64_t>(d, L) - 1) * bins +
                              score_bin(sc[r * B + i], bins));
        const double c = (ob[cell] + prior) / (pr[cell] + prior);
        g = c * std::exp(static_cast<double>(sc[r * B + i]));
      }
      if (cpl != nullptr && !cpl[r]) g = 0.0;  // no drafter context: no nodes
      if (lim != nullptr && i >= lim[r]) g = 0.0;  // beyond what the request can send
      gains[r * B + i] = g;
    }
  }
  const auto verify_time = [&](double n) {
    if (P == 1) return y[0];
    int64_t seg = std::upper_bound(x, x + P, n) - x - 1;
    seg = std::min<int64_t>(std::max<int64_t>(seg, 0), P - 2);
    const double t = y[seg] + (y[seg + 1] - y[seg]) * (n - x[seg]) / (x[seg + 1] - x[seg]);
    return std::max(t, y_min * 1e-3);
  };
  const auto step_time = [&](int64_t k) {
    return verify_time(static_cast<double>(R + k)) + draft_time + on_overhead;
  };
  // the nodes ranked by key, best first; the best prefix of that order (or, with tie > 0, the
  // largest one whose rate is within tie of the best): (k, the best rate)
  std::vector<int64_t> order(N);
  std::vector<double> rates(N + 1);
  const auto best_prefix = [&](const std::vector<double>& keys, std::vector<int64_t>& ranked) {
    for (int64_t i = 0; i < N; ++i) ranked[i] = i;
    std::stable_sort(ranked.begin(), ranked.end(),
                     [&](int64_t a, int64_t b) { return keys[a] > keys[b]; });
    double taken = 0.0, extra = 0.0, best_rate = -1.0;
    int64_t keep = 0;
    for (int64_t k = 0; k <= N; ++k) {
      if (k > 0) {
        taken += gains[ranked[k - 1]];
        if (nc != nullptr) extra += nc[ranked[k - 1] / B];
      }
      rates[k] = -1.0;
      if (k == 0 && plain_time > 0 && N > 0) continue;  // no nodes is plain decoding's step
      rates[k] = (static_cast<double>(R) + taken) / (step_time(k) + extra);
      if (rates[k] > best_rate) {  // the first of equal maxima, as torch.argmax
        best_rate = rates[k];
        keep = k;
      }
    }
    if (tie > 0.0) {  // the largest prefix within `tie` of the best rate, over nodes that have
      // a gain (none of a request without drafter context, past its limit, or padding)
      int64_t first_without = 0;
      while (first_without < N && gains[ranked[first_without]] > 0.0) ++first_without;
      for (int64_t k = first_without; k > keep; --k) {
        if (rates[k] >= (1.0 - tie) * best_rate) {
          keep = k;
          break;
        }
      }
    }
    return std::make_pair(keep, best_rate);
  };
  int64_t keep;
  double best_rate;
  if (nc == nullptr || N == 0) {
    std::tie(keep, best_rate) = best_prefix(gains, order);
  } else {
    // gain per cost (a node's row costs the step curve's mean slope), then one Dinkelbach
    // step: g - rate * cost at the first ranking's best rate; the better one wins
    const double slope = std::max((step_time(N) - step_time(0)) / N, 1e-12);
    std::vector<double> keys(N);
    for (int64_t i = 0; i < N; ++i) keys[i] = gains[i] * slope / (slope + nc[i / B]);
    std::tie(keep, best_rate) = best_prefix(keys, order);
    for (int64_t i = 0; i < N; ++i) keys[i] = gains[i] - best_rate * nc[i / B];
    std::vector<int64_t> order2(N);
    const auto [keep2, rate2] = best_prefix(keys, order2);
    if (rate2 > best_rate) {
      keep = keep2;
      best_rate = rate2;
      order.swap(order2);
    }
  }
  if (plain_time > 0 && !(best_rate > static_cast<double>(R) / plain_time)) keep = 0;
  Tensor budgets = at::empty({R}, depths.options());
  int64_t* bu = budgets.data_ptr<int64_t>();
  std::fill(bu, bu + R, 0);
  for (int64_t k = 0; k < keep; ++k) ++bu[order[k] / B];
  return budgets;
}

// Calibration.observe for one verify step, in place: predicted/observed [2, L, bins] float64
// decay, then each counted request's real nodes add exp(score) to the predicted sum of their
// (depth, score bin) cell and its accepted nodes (accepted_nodes [R, L'], -1 padded) one to
// the observed sum.
void calibration_observe_(Tensor predicted, Tensor observed, const Tensor& scores,
                          const Tensor& depths, const Tensor& accepted_nodes,
                          const Tensor& counted, const Tensor& sampled, double decay) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{
           &predicted, &observed, &scores, &depths, &accepted_nodes, &counted, &sampled}) {
    check_cpu(*t, "calibration input");
  }
  TORCH_CHECK(predicted.scalar_type() == at::kDouble && observed.scalar_type() == at::kDouble &&
                  predicted.dim() == 3 && observed.sizes() == predicted.sizes() &&
                  scores.scalar_type() == at::kFloat && depths.scalar_type() == at::kLong &&
                  accepted_nodes.scalar_type() == at::kLong && accepted_nodes.dim() == 2 &&
                  accepted_nodes.size(0) == scores.size(0) &&
                  counted.scalar_type() == at::kBool && sampled.scalar_type() == at::kBool,
              "calibration_observe_: unexpected dtypes or shapes");
  const int64_t R = scores.size(0), B = scores.size(1), L = predicted.size(1);
  const int64_t bins = predicted.size(2), A = accepted_nodes.size(1);
  double* pr = predicted.data_ptr<double>();
  double* ob = observed.data_ptr<double>();
  for (int64_t i = 0; i < 2 * L * bins; ++i) {
    pr[i] *= decay;
    ob[i] *= decay;
  }
  const float* sc = scores.data_ptr<float>();
  const int64_t* dp = depths.data_ptr<int64_t>();
  const int64_t* an = accepted_nodes.data_ptr<int64_t>();
  const bool* cn = counted.data_ptr<bool>();
  const bool* smp = sampled.data_ptr<bool>();
  const auto cell = [&](int64_t r, int64_t i) {
    const int64_t d = std::min<int64_t>(dp[r * B + i], L);
    return ((smp[r] ? 1 : 0) * L + d - 1) * bins + score_bin(sc[r * B + i], bins);
  };
  for (int64_t r = 0; r < R; ++r) {
    if (!cn[r]) continue;
    for (int64_t i = 0; i < B; ++i) {
      if (dp[r * B + i] > 0) pr[cell(r, i)] += std::exp(static_cast<double>(sc[r * B + i]));
    }
    for (int64_t j = 0; j < A; ++j) {
      const int64_t i = an[r * A + j];
      if (0 <= i && i < B && dp[r * B + i] > 0) ob[cell(r, i)] += 1.0;
    }
  }
}

// The trees' calibration (vllm_ddtree/calibration.py), kind 0 greedy / 1 sampled, cells
// TOP_RANKS + 1 = 4. tree_log_factors: [R, L, C] float32 log c of each request's kind, c =
// (observed + prior) / (predicted + prior) (TreeCalibration.log_factors).
Tensor tree_log_factors(const Tensor& observed, const Tensor& predicted, double prior,
                        const Tensor& sampled) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&observed, &predicted, &sampled}) {
    check_cpu(*t, "calibration input");
  }
  TORCH_CHECK(observed.scalar_type() == at::kDouble && observed.dim() == 3 &&
                  observed.size(0) == 2 && predicted.sizes() == observed.sizes() &&
                  predicted.scalar_type() == at::kDouble && sampled.scalar_type() == at::kBool &&
                  sampled.dim() == 1,
              "tree_log_factors: unexpected dtypes or shapes");
  const int64_t R = sampled.size(0), L = observed.size(1), C = observed.size(2);
  Tensor out = at::empty({R, L, C}, observed.options().dtype(at::kFloat));
  const double* ob = observed.data_ptr<double>();
  const double* pr = predicted.data_ptr<double>();
  const bool* smp = sampled.data_ptr<bool>();
  float* o = out.data_ptr<float>();
  // both kinds' rows, computed once: kinds[k * L * C ...] is kind k's
  std::vector<float> kinds(2 * L * C);
  for (int64_t j = 0; j < 2 * L * C; ++j) {
    kinds[j] = static_cast<float>(std::log((ob[j] + prior) / (pr[j] + prior)));
  }
  for (int64_t r = 0; r < R; ++r) {
    std::memcpy(o + r * L * C, kinds.data() + (smp[r] ? L * C : 0), sizeof(float) * L * C);
  }
  return out;
}

// calibrate_lists: [R, L, k] log-probabilities and ids (any order) -> the calibrated lists
// (calibrated_values: v + log c of the rank's cell, capped at 0, running min along the ranks,
// ranked again by (value desc, id asc)) and the drafter's tops (draft_tops: the first C - 1
// ranked ids, -1 past k, their probabilities and the rest's mass).
std::tuple<Tensor, Tensor, Tensor, Tensor> calibrate_lists(const Tensor& values,
                                                           const Tensor& ids,
                                                           const Tensor& log_factors) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&values, &ids, &log_factors}) {
    check_cpu(*t, "calibrate_lists input");
  }
  TORCH_CHECK(values.dim() == 3 && values.scalar_type() == at::kFloat &&
                  ids.sizes() == values.sizes() && ids.scalar_type() == at::kLong &&
                  log_factors.scalar_type() == at::kFloat && log_factors.dim() == 3 &&
                  log_factors.size(0) == values.size(0) &&
                  log_factors.size(1) == values.size(1),
              "calibrate_lists: unexpected dtypes or shapes");
  const int64_t R = values.size(0), L = values.size(1), K = values.size(2);
  const int64_t C = log_factors.size(2), top = C - 1;
  Tensor out_values = at::empty({R, L, K}, values.options());
  Tensor out_ids = at::empty({R, L, K}, ids.options());
  Tensor top_ids = at::empty({R, L, top}, ids.options());
  Tensor top_probs = at::empty({R, L, C}, values.options());
  const float* val = values.data_ptr<float>();
  const int64_t* tok = ids.data_ptr<int64_t>();
  const float* lf = log_factors.data_ptr<float>();
  float* ov = out_values.data_ptr<float>();
  int64_t* oi = out_ids.data_ptr<int64_t>();
  int64_t* ti = top_ids.data_ptr<int64_t>();
  float* tp = top_probs.data_ptr<float>();
  at::parallel_for(0, R * L, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> order(K), again(K);
    std::vector<float> cal(K);
    for (int64_t row = begin; row < end; ++row) {
      const float* v = val + row * K;
      const int64_t* t = tok + row * K;
      for (int64_t j = 0; j < K; ++j) order[j] = j;
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
        if (v[a] != v[b]) return v[a] > v[b];
        return t[a] < t[b];
      });
      float sum = 0.f;
      for (int64_t j = 0; j < top; ++j) {
        const bool in = j < K;
        ti[row * top + j] = in ? t[order[j]] : -1;
        const float q = in ? std::exp(v[order[j]]) : 0.f;
        tp[row * C + j] = q;
        sum += q;
      }
      tp[row * C + top] = std::max(1.f - sum, 0.f);
      float best = 0.f;
      for (int64_t j = 0; j < K; ++j) {
        const float x = std::min(v[order[j]] + lf[row * C + std::min(j, top)], 0.f);
        best = std::min(best, x);
        cal[j] = best;
      }
      // ranked again by (value desc, id asc): ties (a cap, a held value) go by token id
      for (int64_t j = 0; j < K; ++j) again[j] = j;
      std::sort(again.begin(), again.end(), [&](int64_t a, int64_t b) {
        if (cal[a] != cal[b]) return cal[a] > cal[b];
        return t[order[a]] < t[order[b]];
      });
      for (int64_t j = 0; j < K; ++j) {
        ov[row * K + j] = cal[again[j]];
        oi[row * K + j] = t[order[again[j]]];
      }
    }
  });
  return {out_values, out_ids, top_ids, top_probs};
}

// tree_calibration_observe_: TreeCalibration.observe in one op. Both sums decay; for each
// counted request, every depth d < min(W, L) with d <= num_accepted counts the cell of the
// target's token (output_tokens[r, d]) among the tops, and adds the tops' probabilities.
void tree_calibration_observe_(Tensor observed, Tensor predicted, const Tensor& top_ids,
                               const Tensor& top_probs, const Tensor& output_tokens,
                               const Tensor& num_accepted, const Tensor& counted,
                               const Tensor& sampled, double decay) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{
           &observed, &predicted, &top_ids, &top_probs, &output_tokens, &num_accepted, &counted,
           &sampled}) {
    check_cpu(*t, "calibration input");
  }
  TORCH_CHECK(observed.scalar_type() == at::kDouble && observed.dim() == 3 &&
                  predicted.sizes() == observed.sizes() &&
                  predicted.scalar_type() == at::kDouble && top_ids.dim() == 3 &&
                  top_ids.scalar_type() == at::kLong && top_probs.dim() == 3 &&
                  top_probs.scalar_type() == at::kFloat &&
                  top_probs.size(2) == observed.size(2) &&
                  top_ids.size(2) == observed.size(2) - 1 &&
                  output_tokens.scalar_type() == at::kLong && output_tokens.dim() == 2 &&
                  num_accepted.scalar_type() == at::kLong && counted.scalar_type() == at::kBool &&
                  sampled.scalar_type() == at::kBool,
              "tree_calibration_observe_: unexpected dtypes or shapes");
  const int64_t R = top_ids.size(0), D = top_ids.size(1), C = observed.size(2), top = C - 1;
  const int64_t L = observed.size(1), W = output_tokens.size(1);
  TORCH_CHECK(D == L, "tree_calibration_observe_: the tops' depth is not the calibration's");
  double* ob = observed.data_ptr<double>();
  double* pr = predicted.data_ptr<double>();
  for (int64_t i = 0; i < 2 * L * C; ++i) {
    ob[i] *= decay;
    pr[i] *= decay;
  }
  const int64_t* ti = top_ids.data_ptr<int64_t>();
  const float* tp = top_probs.data_ptr<float>();
  const int64_t* out = output_tokens.data_ptr<int64_t>();
  const int64_t* acc = num_accepted.data_ptr<int64_t>();
  const bool* cn = counted.data_ptr<bool>();
  const bool* smp = sampled.data_ptr<bool>();
  const int64_t width = std::min(W, L);
  for (int64_t r = 0; r < R; ++r) {
    if (!cn[r]) continue;
    const int64_t kind = smp[r] ? 1 : 0;
    for (int64_t d = 0; d < width && d <= acc[r]; ++d) {
      const int64_t target = out[r * W + d];
      int64_t cell = top;
      for (int64_t j = 0; j < top; ++j) {
        if (ti[(r * D + d) * top + j] == target) {
          cell = j;
          break;
        }
      }
      double* o = ob + (kind * L + d) * C;
      double* p = pr + (kind * L + d) * C;
      o[cell] += 1.0;
      for (int64_t c = 0; c < C; ++c) p[c] += static_cast<double>(tp[(r * D + d) * C + c]);
    }
  }
}

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

// Per request r of a tree-attention batch (mask [n, b, s]): one past the last position any of
// its b rows sees, at least `at_least`: the positions its K/V gather needs.
std::vector<int64_t> seen_positions(const bool* mask, int64_t n, int64_t b, int64_t s,
                                    int64_t at_least) {
  std::vector<int64_t> used(n, at_least);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t i = 0; i < b; ++i) {
      for (int64_t pos = s - 1; pos >= used[r]; --pos) {
        if (mask[(r * b + i) * s + pos]) {
          used[r] = pos + 1;
          break;
        }
      }
    }
  }
  return used;
}

// The tree rows' attention (each request's root and node rows) with ATen's kernels, for CPUs
// without AVX2 (tree_attention_avx2 serves the others), batched over (request, KV head): K and
// V of the positions any row of the request sees are gathered in float32 from the paged cache
// through the layout's offsets ([n * Hkv, U, D], zero past the request's last seen position),
// the rows' queries in float32 ([n * Hkv, b * group, D]: row i, head g * group + j at
// i * group + j; zero for padding rows) and the mask as an additive bias (0 or -inf; 0 on
// padding rows); then one GEMM with the bias, a softmax and one GEMM for all requests.
template <typename T>
void tree_attention_impl(Tensor& output, const Tensor& query, const Tensor& flat,
                         const int64_t* offsets, int64_t slot_stride, int64_t block_size,
                         const Tensor& rows, const Tensor& valid, const Tensor& slots,
                         const Tensor& mask, float scale, bool bf16_probs) {
  const int64_t n = rows.size(0), b = rows.size(1), s = slots.size(1);
  const int64_t H = query.size(1), D = query.size(2), Hkv = slot_stride / (2 * D);
  const int64_t group = H / Hkv, Q = b * group;
  if (n == 0 || b == 0) return;
  const bool* ma = mask.data_ptr<bool>();
  const std::vector<int64_t> used = seen_positions(ma, n, b, s, 0);
  const int64_t U = std::max<int64_t>(1, *std::max_element(used.begin(), used.end()));
  const auto f32 = query.options().dtype(at::kFloat);
  Tensor keys = at::empty({n * Hkv, U, D}, f32), values = at::empty({n * Hkv, U, D}, f32);
  Tensor queries = at::empty({n * Hkv, Q, D}, f32), bias = at::empty({n * Hkv, Q, U}, f32);
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  float* qp = queries.data_ptr<float>();
  float* bp = bias.data_ptr<float>();
  const T* q = query.data_ptr<T>();
  const T* cache = flat.data_ptr<T>();
  const int64_t qs0 = query.stride(0), qs1 = query.stride(1);
  const int64_t* ro = rows.data_ptr<int64_t>();
  const bool* va = valid.data_ptr<bool>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const float hidden = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / Hkv, g = task % Hkv;
      float* kt = kp + task * U * D;
      float* vt = vp + task * U * D;
      for (int64_t pos = 0; pos < used[r]; ++pos) {
        const int64_t slot = sl[r * s + pos];
        const int64_t* off = offsets + (slot % block_size) * slot_stride;
        const T* base = cache + slot * slot_stride;
        for (int64_t d = 0; d < D; ++d) {
          kt[pos * D + d] = to_float(base[off[g * D + d]]);
          vt[pos * D + d] = to_float(base[off[(Hkv + g) * D + d]]);
        }
      }
      std::fill(kt + used[r] * D, kt + U * D, 0.0f);  // weight 0, but never 0 * garbage
      std::fill(vt + used[r] * D, vt + U * D, 0.0f);
      for (int64_t i = 0; i < b; ++i) {
        const bool row_valid = va[r * b + i];
        const bool* row_mask = ma + (r * b + i) * s;
        for (int64_t j = 0; j < group; ++j) {
          float* qt = qp + (task * Q + i * group + j) * D;
          float* bt = bp + (task * Q + i * group + j) * U;
          if (!row_valid) {
            std::fill(qt, qt + D, 0.0f);
            std::fill(bt, bt + U, 0.0f);
            continue;
          }
          const T* qh = q + ro[r * b + i] * qs0 + (g * group + j) * qs1;
          for (int64_t d = 0; d < D; ++d) qt[d] = to_float(qh[d]);
          for (int64_t pos = 0; pos < U; ++pos) bt[pos] = row_mask[pos] ? 0.0f : hidden;
        }
      }
    }
  });
  Tensor scores = at::baddbmm(bias, queries, keys.transpose(1, 2), 1.0, scale);
  Tensor acc;
  if (bf16_probs) {  // vLLM's amx kernel: unnormalised probabilities rounded to bf16
    scores.sub_(std::get<0>(scores.max(-1, true))).exp_();
    Tensor total = scores.sum(-1, true);
    acc = at::bmm(scores.to(at::kBFloat16).to(at::kFloat), values).div_(total);
  } else {
    acc = at::bmm(at::softmax(scores, -1), values);
  }
  const float* ap = acc.data_ptr<float>();
  T* out = output.data_ptr<T>();
  const int64_t os0 = output.stride(0), os1 = output.stride(1);
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t g = 0; g < Hkv; ++g) {
      for (int64_t i = 0; i < b; ++i) {
        if (!va[r * b + i]) continue;
        for (int64_t j = 0; j < group; ++j) {
          const float* src = ap + ((r * Hkv + g) * Q + i * group + j) * D;
          T* oh = out + ro[r * b + i] * os0 + (g * group + j) * os1;
          for (int64_t d = 0; d < D; ++d) oh[d] = static_cast<T>(src[d]);
        }
      }
    }
  }
}

#ifdef DDTREE_AVX2
bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}

// The tree rows' attention as one fused loop per (request, K/V head) in AVX2 and FMA
// intrinsics: what tree_attention_impl computes with ATen's batched GEMMs, whose fixed costs
// dominate at a verify step's sizes (benchmarks/cpu_tree_attention.py: ~35 us against ~65 us
// for one request of 16 nodes over ~100 positions, 2 threads). Compiled for AVX2 and FMA
// whatever the build flags; run only where the CPU has both (cpu_has_avx2). Loops written in
// plain C++ were 2-3x slower than ATen here (the compiler kept neither the accumulators in
// registers nor the reductions vectorised).
#pragma GCC push_options
#pragma GCC target("avx2,fma")

// exp of 8 floats (Cephes' single-precision polynomial, ~1 ulp); arguments are clamped to
// [-87.3, 0], so 2^n stays a normal float (every caller passes a score less its row's max)
inline __m256 exp_avx2(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

inline float hmax_avx2(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

inline float hsum_avx2(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  m = _mm_add_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

// float32 -> the nearest bfloat16 (ties to even), back in float32: what .to(bfloat16) does to
// finite values (the probabilities rounded here are in [0, 1])
inline __m256 round_bf16_avx2(__m256 x) {
  const __m256i bits = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(int(0xFFFF0000u))));
}

struct TreeAttentionArgs {
  int64_t n, b, s, H, D, Hkv, group, slot_stride, block_size, qs0, qs1, os0, os1;
  const int64_t* offsets;
  const int64_t* rows;
  const bool* valid;
  const int64_t* slots;
  const bool* mask;
  const int64_t* used;  // per request: the positions any of its rows sees
  float scale;
  bool bf16_probs;
};

constexpr int64_t kTile = 64;  // positions per K tile: [D, 64] float32 stays in L1

// 64 scores of one query vector against a K tile ([D, 64], transposed): 8 accumulators
inline void tile_scores_avx2(const float* q, const float* kt, int64_t D, const float* bias,
                             float* out) {
  __m256 s[8];
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) s[k] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 qd = _mm256_broadcast_ss(q + d);
    const float* k = kt + d * kTile;
#pragma GCC unroll 8
    for (int e = 0; e < 8; ++e) s[e] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k + 8 * e), s[e]);
  }
#pragma GCC unroll 8
  for (int e = 0; e < 8; ++e)
    _mm256_storeu_ps(out + 8 * e, _mm256_add_ps(s[e], _mm256_loadu_ps(bias + 8 * e)));
}

// acc[0, 8 W) += sum over the tile's n positions of p[u] * v[u, 0, 8 W) (rows of stride D);
// two sets of accumulators (even and odd positions) keep the FMAs independent
template <int W>
inline void tile_weighted_sum_avx2(const float* p, const float* v, int64_t n, int64_t D,
                                   float* acc) {
  __m256 x[W], y[W];
#pragma GCC unroll 8
  for (int k = 0; k < W; ++k) x[k] = _mm256_loadu_ps(acc + 8 * k), y[k] = _mm256_setzero_ps();
  int64_t u = 0;
  for (; u + 2 <= n; u += 2) {
    const __m256 p0 = _mm256_broadcast_ss(p + u), p1 = _mm256_broadcast_ss(p + u + 1);
    const float* v0 = v + u * D;
#pragma GCC unroll 8
    for (int k = 0; k < W; ++k) {
      x[k] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v0 + 8 * k), x[k]);
      y[k] = _mm256_fmadd_ps(p1, _mm256_loadu_ps(v0 + D + 8 * k), y[k]);
    }
  }
  if (u < n) {
    const __m256 p0 = _mm256_broadcast_ss(p + u);
#pragma GCC unroll 8
    for (int k = 0; k < W; ++k)
      x[k] = _mm256_fmadd_ps(p0, _mm256_loadu_ps(v + u * D + 8 * k), x[k]);
  }
#pragma GCC unroll 8
  for (int k = 0; k < W; ++k) _mm256_storeu_ps(acc + 8 * k, _mm256_add_ps(x[k], y[k]));
}

// One (request r, K/V head g), exact softmax in three passes over the U positions its rows
// see, tiled so that each K or V tile is read from the cache once for all the group's query
// vectors of all its rows: (1) per 64-position tile, K gathered (transposed) and V gathered in
// float32, every query vector's scores plus its row's mask (0 or -inf); (2) per query vector,
// the max, exp(score - max) (hidden positions exactly 0) and their sum (before the optional
// bf16 rounding, as vLLM's amx kernel sums); (3) per V tile, the weighted sums; then each
// query vector's sum / total is written to its row's output head.
template <typename T>
void tree_attention_task_avx2(const TreeAttentionArgs& a, const T* query, const T* cache,
                              T* output, int64_t r, int64_t g) {
  const int64_t D = a.D, U = a.used[r], Up = (U + kTile - 1) / kTile * kTile;
  const int64_t group = a.group, nq_max = a.b * group;
  thread_local std::vector<float> scratch;
  thread_local std::vector<int64_t> vectors;  // (row i, head j) of each real query vector
  scratch.resize(static_cast<size_t>(nq_max * (D + Up + D) + Up * D + D * kTile +
                                     a.b * kTile));
  float* qf = scratch.data();        // [nq, D] scaled queries
  float* sc = qf + nq_max * D;       // [nq, Up] scores, then weights
  float* acc = sc + nq_max * Up;     // [nq, D] weighted sums of V
  float* vt = acc + nq_max * D;      // [Up, D] V (zero past U)
  float* kt = vt + Up * D;           // [D, 64] the K tile
  float* bias = kt + D * kTile;      // [b, 64] the rows' masks over the tile
  vectors.clear();
  for (int64_t i = 0; i < a.b; ++i) {
    if (!a.valid[r * a.b + i]) continue;
    const T* qrow = query + a.rows[r * a.b + i] * a.qs0;
    for (int64_t j = 0; j < group; ++j) {
      float* qv = qf + static_cast<int64_t>(vectors.size()) * D;
      const T* qh = qrow + (g * group + j) * a.qs1;
      for (int64_t d = 0; d < D; ++d) qv[d] = to_float(qh[d]) * a.scale;
      vectors.push_back(i * group + j);
    }
  }
  const int64_t nq = static_cast<int64_t>(vectors.size());
  std::fill(acc, acc + nq * D, 0.0f);
  const float hidden = -std::numeric_limits<float>::infinity();
  const __m256 neg_inf = _mm256_set1_ps(hidden), zero = _mm256_setzero_ps();
  for (int64_t t = 0; t < Up; t += kTile) {  // (1) scores
    const int64_t n = std::min(kTile, U - t);
    for (int64_t u = 0; u < n; ++u) {
      const int64_t slot = a.slots[r * a.s + t + u];
      const int64_t* off = a.offsets + (slot % a.block_size) * a.slot_stride;
      const T* base = cache + slot * a.slot_stride;
      float* vrow = vt + (t + u) * D;
      for (int64_t d = 0; d < D; ++d) {
        kt[d * kTile + u] = to_float(base[off[g * D + d]]);
        vrow[d] = to_float(base[off[(a.Hkv + g) * D + d]]);
      }
    }
    for (int64_t d = 0; d < D; ++d) std::fill(kt + d * kTile + n, kt + (d + 1) * kTile, 0.0f);
    std::fill(vt + (t + n) * D, vt + (t + kTile) * D, 0.0f);
    for (int64_t i = 0; i < a.b; ++i) {
      if (!a.valid[r * a.b + i]) continue;
      const bool* row_mask = a.mask + (r * a.b + i) * a.s + t;
      float* bi = bias + i * kTile;
      int64_t u = 0;
      for (; u + 8 <= n; u += 8) {  // 8 mask bytes at a time
        const __m256i seen = _mm256_cvtepu8_epi32(
            _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row_mask + u)));
        const __m256 hide = _mm256_castsi256_ps(_mm256_cmpeq_epi32(seen, _mm256_setzero_si256()));
        _mm256_storeu_ps(bi + u, _mm256_and_ps(hide, neg_inf));
      }
      for (; u < kTile; ++u) bi[u] = u < n && row_mask[u] ? 0.0f : hidden;
    }
    for (int64_t v = 0; v < nq; ++v)
      tile_scores_avx2(qf + v * D, kt, D, bias + (vectors[v] / group) * kTile, sc + v * Up + t);
  }
  std::vector<float> total(nq);
  for (int64_t v = 0; v < nq; ++v) {  // (2) weights
    float* sv = sc + v * Up;
    __m256 mx = neg_inf;
    for (int64_t c = 0; c < Up; c += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sv + c));
    const __m256 top = _mm256_set1_ps(hmax_avx2(mx));  // finite: the row sees itself
    __m256 sum = zero;
    for (int64_t c = 0; c < Up; c += 8) {
      const __m256 x = _mm256_loadu_ps(sv + c);
      __m256 p = _mm256_and_ps(exp_avx2(_mm256_sub_ps(x, top)),
                               _mm256_cmp_ps(x, neg_inf, _CMP_NEQ_OQ));
      sum = _mm256_add_ps(sum, p);
      if (a.bf16_probs) p = round_bf16_avx2(p);  // vLLM's amx kernel weighs V in bf16
      _mm256_storeu_ps(sv + c, p);
    }
    total[v] = hsum_avx2(sum);
  }
  for (int64_t t = 0; t < U; t += kTile) {  // (3) weighted sums of V, tile by tile
    const int64_t n = std::min(kTile, U - t);
    for (int64_t v = 0; v < nq; ++v) {
      const float* p = sc + v * Up + t;
      float* av = acc + v * D;
      int64_t d0 = 0;
      for (; d0 + 32 <= D; d0 += 32) tile_weighted_sum_avx2<4>(p, vt + t * D + d0, n, D, av + d0);
      for (; d0 < D; d0 += 8) tile_weighted_sum_avx2<1>(p, vt + t * D + d0, n, D, av + d0);
    }
  }
  for (int64_t v = 0; v < nq; ++v) {
    const int64_t i = vectors[v] / group, j = vectors[v] % group;
    T* oh = output + a.rows[r * a.b + i] * a.os0 + (g * group + j) * a.os1;
    const float inv = 1.0f / total[v];
    const float* av = acc + v * D;
    for (int64_t d = 0; d < D; ++d) oh[d] = static_cast<T>(av[d] * inv);
  }
  if (scratch.size() > (size_t{1} << 24)) {  // keep at most 64 MiB per thread between calls
    scratch.clear();
    scratch.shrink_to_fit();
  }
}

// The index of a row's largest value, the first one among equal values (torch.argmax's rule);
// -1 when the row holds a NaN (the caller then takes the first NaN, as torch.argmax does)
inline int64_t argmax_row_avx2(const float* x, int64_t V) {
  if (V < 8) return -2;  // too short for a vector: the scalar loop
  __m256 best = _mm256_loadu_ps(x);
  __m256i best_at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), at = best_at;
  __m256 unordered = _mm256_cmp_ps(best, best, _CMP_UNORD_Q);
  const __m256i step = _mm256_set1_epi32(8);
  int64_t i = 8;
  for (; i + 8 <= V; i += 8) {  // per lane: its first largest value (strictly greater wins)
    const __m256 v = _mm256_loadu_ps(x + i);
    at = _mm256_add_epi32(at, step);
    const __m256 greater = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
    best = _mm256_blendv_ps(best, v, greater);
    best_at = _mm256_blendv_epi8(best_at, at, _mm256_castps_si256(greater));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  if (_mm256_movemask_ps(unordered)) return -1;
  alignas(32) float values[8];
  alignas(32) int32_t where[8];
  _mm256_store_ps(values, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(where), best_at);
  float top = values[0];
  int64_t arg = where[0];
  for (int lane = 1; lane < 8; ++lane) {  // equal values: the lowest index
    if (values[lane] > top || (values[lane] == top && where[lane] < arg)) {
      top = values[lane];
      arg = where[lane];
    }
  }
  for (; i < V; ++i) {  // the tail, after every lane's indices
    if (std::isnan(x[i])) return -1;
    if (x[i] > top) top = x[i], arg = i;
  }
  return arg;
}

// The first index in [i, V) whose value is not <= bar (larger, or NaN), or V: top_k_'s scan
// skips the values that cannot enter its heap 8 at a time
inline int64_t skip_not_above_avx2(const float* row, int64_t i, int64_t V, float bar) {
  const __m256 b = _mm256_set1_ps(bar);
  for (; i + 8 <= V; i += 8) {
    const int passed = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), b,
                                                        _CMP_NLE_UQ));
    if (passed) return i + __builtin_ctz(passed);
  }
  for (; i < V; ++i)
    if (!(row[i] <= bar)) return i;
  return V;
}

// sum over row[0, V) of exp(x / t - top) (x / t rounded to float32 first, as the torch path's
// division is; t == 1: no division), every exponent <= 0 (top: the row's largest x / t):
// top_log_probs_'s softmax denominator in one pass
inline float sum_exp_avx2(const float* row, int64_t V, float t, float top) {
  const __m256 tv = _mm256_set1_ps(t), mv = _mm256_set1_ps(top);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  if (t == 1.0f) {
    for (; i + 8 <= V; i += 8)
      acc = _mm256_add_ps(acc, exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(row + i), mv)));
  } else {
    for (; i + 8 <= V; i += 8)
      acc = _mm256_add_ps(
          acc, exp_avx2(_mm256_sub_ps(_mm256_div_ps(_mm256_loadu_ps(row + i), tv), mv)));
  }
  float sum = hsum_avx2(acc);
  for (; i < V; ++i) sum += std::exp((t == 1.0f ? row[i] : row[i] / t) - top);
  return sum;
}

#pragma GCC pop_options

template <typename T>
void tree_attention_avx2(Tensor& output, const Tensor& query, const Tensor& flat,
                         const int64_t* offsets, int64_t slot_stride, int64_t block_size,
                         const Tensor& rows, const Tensor& valid, const Tensor& slots,
                         const Tensor& mask, float scale, bool bf16_probs) {
  TreeAttentionArgs a;
  a.n = rows.size(0), a.b = rows.size(1), a.s = slots.size(1);
  a.H = query.size(1), a.D = query.size(2), a.Hkv = slot_stride / (2 * a.D);
  a.group = a.H / a.Hkv, a.slot_stride = slot_stride, a.block_size = block_size;
  a.qs0 = query.stride(0), a.qs1 = query.stride(1);
  a.os0 = output.stride(0), a.os1 = output.stride(1);
  a.offsets = offsets, a.rows = rows.data_ptr<int64_t>(), a.valid = valid.data_ptr<bool>();
  a.slots = slots.data_ptr<int64_t>(), a.mask = mask.data_ptr<bool>();
  a.scale = scale, a.bf16_probs = bf16_probs;
  if (a.n == 0 || a.b == 0) return;
  const std::vector<int64_t> used = seen_positions(a.mask, a.n, a.b, a.s, 1);
  a.used = used.data();
  const T* q = query.data_ptr<T>();
  const T* cache = flat.data_ptr<T>();
  T* out = output.data_ptr<T>();
  at::parallel_for(0, a.n * a.Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task)
      tree_attention_task_avx2<T>(a, q, cache, out, task / a.Hkv, task % a.Hkv);
  });
}
#endif

// The tree rows of a verify step on vLLM's CPU backend (DDTreeCPUImpl): for each real row (a
// request's root or one of its nodes), attention over the positions its mask shows (the
// committed context, then itself and its ancestors), K/V read from the paged cache through the
// layout's offsets; written into output [T, H, D] at the row (other rows are left alone).
// bf16_probs: the unnormalised probabilities are rounded to bfloat16 before they weigh V
// (vLLM's amx kernel does). vectorized: the AVX2 loop (tree_attention_avx2) where the CPU has
// AVX2 and FMA and the head size is a multiple of 8; else, or when false (the tests compare
// both), the ATen path (tree_attention_impl).
void tree_attention_(Tensor output, const Tensor& query, const Tensor& flat,
                     const Tensor& offsets, int64_t slot_stride, const Tensor& rows,
                     const Tensor& valid, const Tensor& slots, const Tensor& mask,
                     double scale, bool bf16_probs, bool vectorized) {
  for (auto* t : {&offsets, &rows, &valid, &slots, &mask, &flat}) check_cpu(*t, "attention");
  TORCH_CHECK(output.device().is_cpu() && query.device().is_cpu() && output.dim() == 3 &&
                  query.dim() == 3 && output.stride(2) == 1 && query.stride(2) == 1 &&
                  output.size(1) == query.size(1) && output.size(2) == query.size(2),
              "tree_attention_: output and query must be CPU [T, H, D] with contiguous heads");
  const int64_t num_rows = std::min(output.size(0), query.size(0));
  for (int64_t i = 0; i < rows.numel(); ++i) {
    TORCH_CHECK(0 <= rows.data_ptr<int64_t>()[i] && rows.data_ptr<int64_t>()[i] < num_rows,
                "tree_attention_: a tree row is out of range");
  }
  TORCH_CHECK(query.scalar_type() == flat.scalar_type() &&
                  output.scalar_type() == flat.scalar_type(),
              "tree_attention_: query, output and cache must share a dtype");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.numel() % slot_stride == 0 &&
                  slot_stride % (2 * query.size(2)) == 0 &&
                  query.size(1) % (slot_stride / (2 * query.size(2))) == 0,
              "tree_attention_: offsets must be the layout's [bs, 2, Hkv, D] table");
  const int64_t block_size = offsets.numel() / slot_stride;
  const int64_t* off = offsets.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
#ifdef DDTREE_AVX2
  if (vectorized && cpu_has_avx2() && query.size(2) % 8 == 0) {
    switch (flat.scalar_type()) {
      case at::kFloat:
        return tree_attention_avx2<float>(output, query, flat, off, slot_stride, block_size,
                                          rows, valid, slots, mask, sc, bf16_probs);
      case at::kBFloat16:
        return tree_attention_avx2<c10::BFloat16>(output, query, flat, off, slot_stride,
                                                  block_size, rows, valid, slots, mask, sc,
                                                  bf16_probs);
      case at::kHalf:
        return tree_attention_avx2<c10::Half>(output, query, flat, off, slot_stride, block_size,
                                              rows, valid, slots, mask, sc, bf16_probs);
      default:
        TORCH_CHECK(false, "tree_attention_: unsupported dtype ", flat.scalar_type());
    }
  }
#endif
  switch (flat.scalar_type()) {
    case at::kFloat:
      tree_attention_impl<float>(output, query, flat, off, slot_stride, block_size, rows, valid,
                                 slots, mask, sc, bf16_probs);
      break;
    case at::kBFloat16:
      tree_attention_impl<c10::BFloat16>(output, query, flat, off, slot_stride, block_size, rows,
                                         valid, slots, mask, sc, bf16_probs);
      break;
    case at::kHalf:
      tree_attention_impl<c10::Half>(output, query, flat, off, slot_stride, block_size, rows,
                                     valid, slots, mask, sc, bf16_probs);
      break;
    default:
      TORCH_CHECK(false, "tree_attention_: unsupported dtype ", flat.scalar_type());
  }
}


// torch.argmax(logits, dim=-1) of float32 rows [N, V] (rows may be strided, elements
// contiguous): the first index of each row's largest value, the first NaN where a row has one.
// One vectorised pass per row (AVX2 where the CPU has it), rows in parallel; ATen's argmax took
// ~40 us over [17, 4096] here, most of it fixed cost.
Tensor argmax_rows(const Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 &&
                  logits.scalar_type() == at::kFloat && logits.stride(1) == 1 &&
                  logits.size(1) > 0,
              "argmax_rows: logits must be CPU float32 [N, V > 0] with contiguous rows");
  const int64_t N = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  Tensor out = at::empty({N}, logits.options().dtype(at::kLong));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * stride;
      int64_t arg = -2;
#ifdef DDTREE_AVX2
      if (cpu_has_avx2()) arg = argmax_row_avx2(row, V);
#endif
      if (arg < 0) {  // no AVX2, a short row, or a NaN: the scalar loop
        arg = 0;
        for (int64_t i = 0; i < V; ++i) {
          if (std::isnan(row[i])) {
            arg = i;
            break;
          }
          if (row[i] > row[arg]) arg = i;
        }
      }
      o[r] = arg;
    }
  });
  return out;
}

using TopItem = std::pair<float, int64_t>;

// a before b: a larger value (NaN the largest), then a lower id
inline bool top_before(const TopItem& a, const TopItem& b) {
  const bool an = std::isnan(a.first), bn = std::isnan(b.first);
  if (an != bn) return an;
  if (!an && a.first != b.first) return a.first > b.first;
  return a.second < b.second;
}

// The k largest of row[0, V) into heap, in the order (value desc, id asc): one pass with a
// k-entry heap whose last-ranked entry is the bar to pass (after the first entries almost
// every value fails one comparison, skipped 8 at a time with AVX2)
void row_top(const float* row, int64_t V, int64_t k, std::vector<TopItem>& heap, bool avx2) {
  heap.clear();
  for (int64_t i = 0; i < k; ++i) heap.emplace_back(row[i], i);
  std::make_heap(heap.begin(), heap.end(), top_before);  // its front: the last-ranked entry
  for (int64_t i = k; i < V; ++i) {
    const float bar = heap.front().first;
#ifdef DDTREE_AVX2
    if (avx2) {
      i = skip_not_above_avx2(row, i, V, bar);
      if (i == V) break;
    }
#endif
    const float v = row[i];
    // ids grow: a later entry passes only with a larger value (or a NaN past a number)
    if (v > bar || (std::isnan(v) && !std::isnan(bar))) {
      std::pop_heap(heap.begin(), heap.end(), top_before);
      heap.back() = TopItem(v, i);
      std::push_heap(heap.begin(), heap.end(), top_before);
    }
  }
  std::sort_heap(heap.begin(), heap.end(), top_before);
}

// torch.topk(scores, k, dim=-1) of float32 rows [N, V] into values [N, k] (float32) and ids
// [N, k] (int64), in the order (value desc, id asc), NaN the largest value (as in torch.topk).
// One pass per row (row_top, for the top k + 1); torch.topk took ~55 us for [7, 4096], k = 16
// here. Returns true when a row has more values equal to its k-th than the top k holds (a tie
// across the boundary: the (k + 1)-th equals the k-th): which of them torch.topk keeps is its
// own choice, so the caller runs torch.topk instead (this op keeps the lowest ids).
bool top_k_(Tensor values, Tensor ids, const Tensor& scores) {
  check_cpu(scores, "scores");
  check_cpu(values, "values");
  check_cpu(ids, "ids");
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat,
              "top_k_: scores must be float32 [N, V]");
  const int64_t N = scores.size(0), V = scores.size(1);
  TORCH_CHECK(values.dim() == 2 && values.size(0) == N && values.scalar_type() == at::kFloat &&
                  ids.sizes() == values.sizes() && ids.scalar_type() == at::kLong,
              "top_k_: values (float32) and ids (int64) must be [N, k]");
  const int64_t k = values.size(1);
  TORCH_CHECK(0 < k && k <= V, "top_k_: need 0 < k <= V, got k = ", k, ", V = ", V);
  const float* x = scores.data_ptr<float>();
  float* vo = values.data_ptr<float>();
  int64_t* io = ids.data_ptr<int64_t>();
  std::atomic<bool> tied{false};
  bool avx2 = false;
#ifdef DDTREE_AVX2
  avx2 = cpu_has_avx2();
#endif
  const int64_t K = std::min(k + 1, V);  // the (k + 1)-th: a tie across the boundary
  at::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
    std::vector<TopItem> heap;
    heap.reserve(K);
    for (int64_t r = begin; r < end; ++r) {
      row_top(x + r * V, V, K, heap, avx2);
      for (int64_t j = 0; j < k; ++j) {
        vo[r * k + j] = heap[j].first;
        io[r * k + j] = heap[j].second;
      }
      if (K > k) {
        const float last = heap[k - 1].first, next = heap[k].first;
        if (std::isnan(last) ? std::isnan(next) : next == last) tied = true;
      }
    }
  });
  return tied.load();
}

// The top-k log-probabilities of softmax(logits / temperature) per row, in one pass over
// each row for the top k + 1 logits and one for the softmax's denominator (AVX2): the torch
// path (vllm_ddtree.tree._top_log_probs) divides, takes the log-softmax, then the top k, four
// passes and a vocabulary-sized temporary, ~135 us a step for [7, 4096] in place. values
// [N, k] float32 and ids [N, k] int64 in the order (value desc, id asc); each value is
// (x / t - top) - log(sum) as ATen's log-softmax computes it, the sum with this file's exp
// (~1 ulp; ATen's differs in the last bits, so the values equal the torch path's to ~1e-6, not
// bit for bit). Returns true, having written nothing the caller may use, where it declines:
// no AVX2, a row with a NaN or no finite logit (or whose largest overflows when divided by the
// temperature), or a tie of the k-th value with the next (which of the tied ones torch.topk
// keeps is its own choice); the caller then runs the torch path. temperature > 0.
bool top_log_probs_(Tensor values, Tensor ids, const Tensor& logits, double temperature) {
  check_cpu(values, "values");
  check_cpu(ids, "ids");
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 &&
                  logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "top_log_probs_: logits must be CPU float32 [N, V] with contiguous rows");
  const int64_t N = logits.size(0), V = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(values.dim() == 2 && values.size(0) == N && values.scalar_type() == at::kFloat &&
                  ids.sizes() == values.sizes() && ids.scalar_type() == at::kLong,
              "top_log_probs_: values (float32) and ids (int64) must be [N, k]");
  const int64_t k = values.size(1);
  TORCH_CHECK(0 < k && k <= V, "top_log_probs_: need 0 < k <= V, got k = ", k, ", V = ", V);
  TORCH_CHECK(temperature > 0.0, "top_log_probs_: temperature must be > 0, got ", temperature);
#ifdef DDTREE_AVX2
  if (!cpu_has_avx2()) return true;
  const float t = static_cast<float>(temperature);
  const float* x = logits.data_ptr<float>();
  float* vo = values.data_ptr<float>();
  int64_t* io = ids.data_ptr<int64_t>();
  const int64_t K = std::min(k + 1, V);  // the (k + 1)-th: a tie across the boundary
  std::atomic<bool> declined{false};
  // tasks of at least ~16k logits: [7, 4096] in two (in place 66 us a step for the whole
  // function against 71 on one thread), a large vocabulary's rows one a task
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / V), [&](int64_t begin, int64_t end) {
    std::vector<TopItem> heap;
    heap.reserve(K);
    for (int64_t r = begin; r < end && !declined.load(std::memory_order_relaxed); ++r) {
      const float* row = x + r * stride;
      row_top(row, V, K, heap, true);
      // NaN sorts first; -inf: no finite logit; +inf, or a division that overflows
      const float top = t == 1.0f ? heap[0].first : heap[0].first / t;
      if (!std::isfinite(top)) {
        declined = true;
        return;
      }
      const float log_sum = std::log(sum_exp_avx2(row, V, t, top));
      const auto value = [&](float v) { return ((t == 1.0f ? v : v / t) - top) - log_sum; };
      for (int64_t j = 0; j < k; ++j) {
        vo[r * k + j] = value(heap[j].first);
        io[r * k + j] = heap[j].second;
      }
      if (K > k && value(heap[k].first) == vo[r * k + k - 1]) {
        declined = true;
        return;
      }
    }
  });
  return declined.load();
#else
  return true;
#endif
}

template <typename T>
void copy_elements(std::vector<Tensor>& flats, const int64_t* offsets, int64_t slot_stride,
                   int64_t block_size, const std::vector<std::pair<int64_t, int64_t>>& pairs) {
  // all sources are read before any write: overlapping moves (a chain shifting down) are safe
  std::vector<T> staged(pairs.size() * slot_stride);
  for (auto& flat : flats) {
    T* data = reinterpret_cast<T*>(flat.data_ptr());
    for (size_t n = 0; n < pairs.size(); ++n) {
      const int64_t slot = pairs[n].first;
      const int64_t* off = offsets + (slot % block_size) * slot_stride;
      T* out = staged.data() + n * slot_stride;
      for (int64_t e = 0; e < slot_stride; ++e) out[e] = data[slot * slot_stride + off[e]];
    }
    for (size_t n = 0; n < pairs.size(); ++n) {
      const int64_t slot = pairs[n].second;
      const int64_t* off = offsets + (slot % block_size) * slot_stride;
      const T* in = staged.data() + n * slot_stride;
      for (int64_t e = 0; e < slot_stride; ++e) data[slot * slot_stride + off[e]] = in[e];
    }
  }
}

// K/V compaction on vLLM's CPU caches that share one slot layout: copy the slot of flat query
// row src_rows[n] to the slot of row dst_rows[n] (slot_mapping gives each row's slot; a -1 on
// either side skips the pair) in every cache. offsets: [block_size, C] int64, the layout's
// element offsets (CPUKVLayout); flats: the caches viewed flat.
void copy_slots_(at::TensorList flats, const Tensor& offsets, int64_t slot_stride,
                 const Tensor& slot_mapping, const Tensor& src_rows, const Tensor& dst_rows) {
  check_cpu(offsets, "offsets");
  check_cpu(slot_mapping, "slot_mapping");
  check_cpu(src_rows, "src_rows");
  check_cpu(dst_rows, "dst_rows");
  TORCH_CHECK(offsets.scalar_type() == at::kLong && slot_mapping.scalar_type() == at::kLong &&
                  src_rows.scalar_type() == at::kLong && dst_rows.scalar_type() == at::kLong,
              "copy_slots_: int64 index tensors expected");
  TORCH_CHECK(offsets.numel() % slot_stride == 0, "copy_slots_: offsets must be [bs, C]");
  const int64_t block_size = offsets.numel() / slot_stride, n = src_rows.numel();
  TORCH_CHECK(dst_rows.numel() == n, "copy_slots_: src_rows and dst_rows differ in length");
  const int64_t* map = slot_mapping.data_ptr<int64_t>();
  const int64_t* s = src_rows.data_ptr<int64_t>();
  const int64_t* d = dst_rows.data_ptr<int64_t>();
  const int64_t rows = slot_mapping.numel();
  std::vector<std::pair<int64_t, int64_t>> pairs;
  for (int64_t i = 0; i < n; ++i) {
    if (s[i] < 0 || d[i] < 0) continue;
    TORCH_CHECK(s[i] < rows && d[i] < rows, "copy_slots_: row out of range");
    pairs.emplace_back(map[s[i]], map[d[i]]);
  }
  if (pairs.empty()) return;
  std::vector<Tensor> views;
  size_t elem = 0;
  for (const auto& flat : flats) {
    check_cpu(flat, "cache");
    TORCH_CHECK(elem == 0 || elem == flat.element_size(), "copy_slots_: mixed element sizes");
    elem = flat.element_size();
    views.push_back(flat);
  }
  const int64_t* off = offsets.data_ptr<int64_t>();
  if (elem == 2) {
    copy_elements<uint16_t>(views, off, slot_stride, block_size, pairs);
  } else if (elem == 4) {
    copy_elements<uint32_t>(views, off, slot_stride, block_size, pairs);
  } else if (elem == 1) {
    copy_elements<uint8_t>(views, off, slot_stride, block_size, pairs);
  } else {
    TORCH_CHECK(false, "copy_slots_: unsupported element size ", elem);
  }
}

// auto's tree in one op: build_tree's full-width trees (max_budget nodes), auto_budgets over
// their (scores, depths), each tree cut to its budget (first_nodes, in place: the full-width
// trees are this op's own). Equal to the three ops one after the other.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> build_tree_auto(
    const Tensor& values, const Tensor& ids, int64_t max_budget, const Tensor& predicted,
    const Tensor& observed, double prior, const Tensor& sampled, const Tensor& complete,
    const Tensor& xs, const Tensor& ys, double draft_time, double on_overhead,
    double plain_time, const Tensor& node_cost, const Tensor& limit, double tie) {
  auto tree = build_tree(values, ids, max_budget, max_budget);
  Tensor fields[6] = {std::get<0>(tree), std::get<1>(tree), std::get<2>(tree),
                      std::get<3>(tree), std::get<4>(tree), std::get<5>(tree)};
  const Tensor budgets = auto_budgets(fields[3], fields[2], predicted, observed, prior, sampled,
                                      complete, xs, ys, draft_time, on_overhead, plain_time,
                                      node_cost, limit, tie);
  keep_first_nodes(fields, budgets);
  return {fields[0], fields[1], fields[2], fields[3], fields[4], fields[5]};
}

}  // namespace

TORCH_LIBRARY(ddtree, m) {
  m.def("build_tree(Tensor values, Tensor ids, int budget, int max_budget) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("first_nodes(Tensor tokens, Tensor parents, Tensor depths, Tensor scores, "
        "Tensor num_nodes, Tensor mask, Tensor budgets) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("walk(Tensor tokens, Tensor parents, Tensor sampled, int max_depth, int out_width) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("finish_verify(Tensor accepted_rows, Tensor starts, int num_tokens, Tensor(a!) moved) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("store_trees_(Tensor(a!) nodes, Tensor(b!) scores, Tensor(c!) mask, Tensor slots, "
        "Tensor tokens, Tensor parents, Tensor depths, Tensor tree_scores, Tensor tree_mask) "
        "-> Tensor");
  m.def("gather_trees(Tensor nodes, Tensor scores, Tensor mask, Tensor slots, "
        "Tensor token_index) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("reindex_trees_(Tensor(a!) nodes, Tensor(b!) scores, Tensor(c!) mask, Tensor plan) "
        "-> ()");
  m.def("tree_attention_info(Tensor requests, Tensor ancestor_mask, Tensor block_table, "
        "int block_size) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("tree_attention_(Tensor(a!) output, Tensor query, Tensor flat, Tensor offsets, "
        "int slot_stride, Tensor rows, Tensor valid, Tensor slots, Tensor mask, float scale, "
        "bool bf16_probs, bool vectorized=True) -> ()");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def("top_k_(Tensor(a!) values, Tensor(b!) ids, Tensor scores) -> bool");
  m.def("top_log_probs_(Tensor(a!) values, Tensor(b!) ids, Tensor logits, float temperature) "
        "-> bool");
  m.def("auto_budgets(Tensor scores, Tensor depths, Tensor predicted, Tensor observed, "
        "float prior, Tensor sampled, Tensor complete, Tensor xs, Tensor ys, float draft_time, "
        "float on_overhead, float plain_time, Tensor node_cost, Tensor limit, float tie) "
        "-> Tensor");
  m.def("build_tree_auto(Tensor values, Tensor ids, int max_budget, Tensor predicted, "
        "Tensor observed, float prior, Tensor sampled, Tensor complete, Tensor xs, Tensor ys, "
        "float draft_time, float on_overhead, float plain_time, Tensor node_cost, "
        "Tensor limit, float tie) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("calibration_observe_(Tensor(a!) predicted, Tensor(b!) observed, Tensor scores, "
        "Tensor depths, Tensor accepted_nodes, Tensor counted, Tensor sampled, float decay) -> ()");
  m.def("tree_log_factors(Tensor observed, Tensor predicted, float prior, Tensor sampled) "
        "-> Tensor");
  m.def("calibrate_lists(Tensor values, Tensor ids, Tensor log_factors) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("tree_calibration_observe_(Tensor(a!) observed, Tensor(b!) predicted, Tensor top_ids, "
        "Tensor top_probs, Tensor output_tokens, Tensor num_accepted, Tensor counted, "
        "Tensor sampled, float decay) -> ()");
  m.def("copy_slots_(Tensor(a!)[] flats, Tensor offsets, int slot_stride, Tensor slot_mapping, "
        "Tensor src_rows, Tensor dst_rows) -> ()");
  m.def("context_complete(Tensor valid, Tensor block_table, int[] num_computed, "
        "int block_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(ddtree, CPU, m) {
  m.impl("build_tree", &build_tree);
  m.impl("first_nodes", &first_nodes);
  m.impl("walk", &walk);
  m.impl("finish_verify", &finish_verify);
  m.impl("store_trees_", &store_trees_);
  m.impl("gather_trees", &gather_trees);
  m.impl("reindex_trees_", &reindex_trees_);
  m.impl("tree_attention_info", &tree_attention_info);
  m.impl("context_complete", &context_complete);
  m.impl("tree_attention_", &tree_attention_);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("top_k_", &top_k_);
  m.impl("top_log_probs_", &top_log_probs_);
  m.impl("auto_budgets", &auto_budgets);
  m.impl("build_tree_auto", &build_tree_auto);
  m.impl("calibration_observe_", &calibration_observe_);
  m.impl("tree_log_factors", &tree_log_factors);
  m.impl("calibrate_lists", &calibrate_lists);
  m.impl("tree_calibration_observe_", &tree_calibration_observe_);
  m.impl("copy_slots_", &copy_slots_);
}
