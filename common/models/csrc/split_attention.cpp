// The drafter's block attention as two mask-free flash-attention calls merged
// by log-sum-exp (the ring-attention identity).
//
// A query of block j sees the context before its anchor a_j and the slots of
// its own block. Blocks are grouped (consecutive, anchors sorted); p is the
// smallest anchor of a group. Then
//   part A: every query of a group attends to context [0, p)        (shared)
//   part B: every query of block j attends to context [p, a_j) followed by
//           its own block's slots                                  (per block)
// Each part is one variable-length flash call over keys gathered into
// contiguous runs; no key a query may not see is ever computed, and no mask
// is built. Query heads sharing a kv head are folded into rows (see fold). The merged output is O = sum_i exp(lse_i - L) O_i with
// L = logaddexp(lse_A, lse_B). Flash's backward, given the MERGED O and L,
// returns exactly each part's share of the gradient (its P = exp(S - L) are
// the merged probabilities and its D = rowsum(dO * O) is the merged one), so
// the backward is two flash backward calls and a sum of the gathered key and
// value gradients into their rows: on a GPU one kernel per tensor that the
// Rust side registers (src/gather_sum_cuda.rs; this library is built against
// libtorch's CPU half and cannot launch CUDA itself), else index_add_ in
// f32. tch has no custom autograd functions, hence this file.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <tuple>

// One call of the GPU launcher (src/gather_sum_cuda.rs reads it field by
// field): out[r] = sum of src(order[e]) for e in [offsets[r], offsets[r+1]),
// src(s) = a[s] below rows_a, else b[s - rows_a]; rows of `width` elements.
struct DflashGatherSumCall {
  int32_t device;  // the CUDA ordinal
  int32_t bf16;    // 1: bf16 tensors; 0: f32
  int64_t rows, width, rows_a;
  uint64_t a, b, order, offsets, out;
};

typedef int32_t (*DflashGatherSumLauncher)(const DflashGatherSumCall* call, char* err, int32_t err_len);

namespace {

std::atomic<DflashGatherSumLauncher> gather_sum_launcher{nullptr};

// Which gathered rows sum into which row: the gathered rows of both parts
// (a's, then b's) stably sorted by the row they came from, and each row's
// range of them.
struct Sources {
  at::Tensor order, offsets;
};

Sources sources(const at::Tensor& idx_a, const at::Tensor& idx_b, int64_t rows) {
  auto sorted = at::sort(at::cat({idx_a, idx_b}), /*stable=*/std::optional<bool>(true), /*dim=*/0, /*descending=*/false);
  auto bounds = at::arange(rows + 1, idx_a.options());
  return {std::get<1>(sorted), at::searchsorted(std::get<0>(sorted), bounds)};
}

// The gathered gradients ga (of idx_a's rows) and gb (idx_b's) summed into
// `rows` rows, in their kind: the GPU kernel where the launcher takes it,
// else index_add_ into f32 and a cast back.
at::Tensor sum_gathered(const at::Tensor& ga, const at::Tensor& gb, const at::Tensor& idx_a, const at::Tensor& idx_b,
                        int64_t rows, const Sources* src) {
  const auto kind = ga.scalar_type();
  const auto launcher = gather_sum_launcher.load();
  if (src != nullptr && launcher != nullptr && (kind == at::kBFloat16 || kind == at::kFloat) &&
      gb.scalar_type() == kind && ga.is_contiguous() && gb.is_contiguous()) {
    auto sizes = ga.sizes().vec();
    sizes[0] = rows;
    auto out = at::empty(sizes, ga.options());
    DflashGatherSumCall c{};
    c.device = ga.get_device();
    c.bf16 = kind == at::kBFloat16;
    c.rows = rows, c.width = rows == 0 ? 0 : out.numel() / rows, c.rows_a = ga.size(0);
    c.a = reinterpret_cast<uint64_t>(ga.data_ptr());
    c.b = reinterpret_cast<uint64_t>(gb.data_ptr());
    c.order = reinterpret_cast<uint64_t>(src->order.data_ptr());
    c.offsets = reinterpret_cast<uint64_t>(src->offsets.data_ptr());
    c.out = reinterpret_cast<uint64_t>(out.data_ptr());
    char err[512] = {0};
    const int32_t rc = launcher(&c, err, sizeof(err));
    TORCH_CHECK(rc == 0 || rc == 1, "split attention's gradient sum on cuda:", c.device, ": ", err);
    if (rc == 0) return out;
  }
  auto sizes = ga.sizes().vec();
  sizes[0] = rows;
  auto acc = at::zeros(sizes, ga.options().dtype(at::kFloat));
  acc.index_add_(0, idx_a, ga.to(at::kFloat));
  acc.index_add_(0, idx_b, gb.to(at::kFloat));
  return acc.to(kind);
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Index plan of one part: key rows gathered from cat(context, block) keys,
// and the cumulative query / key counts of its variable-length sequences.
struct Part {
  at::Tensor idx, cu_q, cu_k;
  int64_t max_q, max_k;
};

struct Forward {
  at::Tensor out, lse, rng, unused;
};

Forward flash(const at::Tensor& q, const at::Tensor& k_all, const at::Tensor& v_all, const Part& p, double scale) {
  auto k = k_all.index_select(0, p.idx);
  auto v = v_all.index_select(0, p.idx);
  auto r = at::_flash_attention_forward(q, k, v, p.cu_q, p.cu_k, p.max_q, p.max_k, 0.0, /*is_causal=*/false,
                                        /*return_debug_mask=*/false, scale);
  return {std::get<0>(r), std::get<1>(r), std::get<2>(r), std::get<3>(r)};
}

// The kernel's log-sum-exp as [heads, total_q]. Flash returns [heads, total_q]
// for variable-length calls in recent versions and [seqs, heads, max_q] in
// older ones; the plan makes every sequence of a part exactly max_q long, so
// both convert without gathers.
at::Tensor lse_rows(const at::Tensor& lse, int64_t total_q, int64_t max_q) {
  if (lse.dim() == 2) return lse.narrow(1, 0, total_q);
  TORCH_CHECK(lse.dim() == 3, "split attention: unexpected log-sum-exp shape ", lse.sizes());
  return lse.narrow(2, 0, max_q).permute({1, 0, 2}).reshape({lse.size(1), total_q});
}

// The inverse of lse_rows, in the layout (and padding) of `like`.
at::Tensor lse_like(const at::Tensor& rows, const at::Tensor& like, int64_t max_q) {
  if (like.dim() == 2) {
    if (like.sizes() == rows.sizes()) return rows;  // no padding: the rows themselves
    auto out = at::zeros_like(like);
    out.narrow(1, 0, rows.size(1)).copy_(rows);
    return out;
  }
  auto out = at::zeros_like(like);
  auto seqs = like.size(0);
  out.narrow(2, 0, max_q).copy_(rows.view({rows.size(0), seqs, max_q}).permute({1, 0, 2}));
  return out;
}

// Grouped-query heads folded into rows: q [T, Hq, d] arrives with its heads
// group-major (head g*Hkv + kv reads kv head kv; the drafter reorders q_proj
// and o_proj to match), so [T, G, Hkv, d] is already [T*G, Hkv, d]: row
// t*G + g holds the G-th query head of each kv head, a view, no copy. Each
// flash "sequence" then has G times the rows and Hq/G heads: a block's 16
// queries fill a 64-row tile instead of 16 rows of a tile per head, and the
// backward needs no expanded key gradient summed over the heads of a group.
at::Tensor fold(const at::Tensor& x, int64_t kv) {
  const int64_t t = x.size(0), g = x.size(1) / kv, d = x.size(2);
  return x.reshape({t * g, kv, d});
}

at::Tensor unfold(const at::Tensor& x, int64_t g) {
  const int64_t t = x.size(0) / g, kv = x.size(1), d = x.size(2);
  return x.view({t, g * kv, d});
}

// A part's plan for folded rows: every query count times G.
Part folded(const Part& p, int64_t g) { return {p.idx, p.cu_q * g, p.cu_k, p.max_q * g, p.max_k}; }

struct SplitAttention : public torch::autograd::Function<SplitAttention> {
  // q [T, Hq, d] (heads group-major, see fold); kc, vc [n*S, Hkv, d]; kb, vb [T, Hkv, d]. Returns
  // [T, Hq, d], heads group-major.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                            const at::Tensor& kb, const at::Tensor& vb, const at::Tensor& idx_a,
                            const at::Tensor& cuq_a, const at::Tensor& cuk_a, int64_t maxq_a, int64_t maxk_a,
                            const at::Tensor& idx_b, const at::Tensor& cuq_b, const at::Tensor& cuk_b, int64_t maxq_b,
                            int64_t maxk_b, double scale) {
    const int64_t kv = kc.size(1), g = q.size(1) / kv;
    TORCH_CHECK(q.size(1) == g * kv, "split attention: ", q.size(1), " query heads for ", kv, " kv heads");
    const Part a = folded({idx_a, cuq_a, cuk_a, maxq_a, maxk_a}, g);
    const Part b = folded({idx_b, cuq_b, cuk_b, maxq_b, maxk_b}, g);
    auto qf = fold(q, kv);
    const int64_t rows = qf.size(0);
    auto k_all = at::cat({kc, kb}, 0);
    auto v_all = at::cat({vc, vb}, 0);
    auto fa = flash(qf, k_all, v_all, a, scale);
    auto fb = flash(qf, k_all, v_all, b, scale);
    // Rows whose part has no keys (a group anchored at position 0) come
    // back with a zero output and a log-sum-exp of +inf: read as -inf, they
    // weigh nothing in the merge.
    auto no_keys = [](at::Tensor l) { return l.masked_fill(l == INFINITY, -INFINITY); };
    auto la = no_keys(lse_rows(fa.lse, rows, a.max_q));  // [Hkv, T*G]
    auto lb = no_keys(lse_rows(fb.lse, rows, b.max_q));
    auto merged = at::logaddexp(la, lb);
    // O = wa*Oa + wb*Ob with wa + wb = 1: one lerp (computed in fp32 from
    // the model-dtype outputs; the weight is rounded like the output is).
    auto wb = (lb - merged).exp().t().unsqueeze(-1).to(q.scalar_type());  // [T*G, Hkv, 1]
    auto out_f = at::lerp(fa.out, fb.out, wb);
    ctx->save_for_backward({qf, kc, vc, kb, vb, out_f, idx_a, cuq_a, cuk_a, idx_b, cuq_b, cuk_b,
                            lse_like(merged, fa.lse, a.max_q), lse_like(merged, fb.lse, b.max_q), fa.rng, fa.unused,
                            fb.rng, fb.unused});
    ctx->saved_data["maxq_a"] = maxq_a;
    ctx->saved_data["maxk_a"] = maxk_a;
    ctx->saved_data["maxq_b"] = maxq_b;
    ctx->saved_data["maxk_b"] = maxk_b;
    ctx->saved_data["scale"] = scale;
    return unfold(out_f, g);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = ctx->get_saved_variables();
    const auto &qf = s[0], &kc = s[1], &vc = s[2], &kb = s[3], &vb = s[4], &out_f = s[5];
    const int64_t kv = kc.size(1), g = qf.size(0) / kb.size(0);
    const Part a = folded({s[6], s[7], s[8], ctx->saved_data["maxq_a"].toInt(), ctx->saved_data["maxk_a"].toInt()}, g);
    const Part b = folded({s[9], s[10], s[11], ctx->saved_data["maxq_b"].toInt(), ctx->saved_data["maxk_b"].toInt()}, g);
    const double scale = ctx->saved_data["scale"].toDouble();
    auto d_out = fold(grads[0].contiguous(), kv);
    auto k_all = at::cat({kc, kb}, 0);
    auto v_all = at::cat({vc, vb}, 0);
    auto part = [&](const Part& p, const at::Tensor& lse, const at::Tensor& rng, const at::Tensor& unused) {
      auto k = k_all.index_select(0, p.idx);
      auto v = v_all.index_select(0, p.idx);
      return at::_flash_attention_backward(d_out, qf, k, v, out_f, lse, p.cu_q, p.cu_k, p.max_q, p.max_k, 0.0,
                                           /*is_causal=*/false, rng, unused, scale);
    };
    auto ra = part(a, s[12], s[14], s[15]);
    auto rb = part(b, s[13], s[16], s[17]);
    auto dq = std::get<0>(ra).add_(std::get<0>(rb));
    // Key and value gradients of the shared prefix arrive from every group
    // that reads it: summed in f32, rounded once.
    const int64_t rows = k_all.size(0);
    const auto kind = qf.scalar_type();
    const bool gpu = qf.is_cuda() && (kind == at::kBFloat16 || kind == at::kFloat) && gather_sum_launcher.load() != nullptr;
    const Sources src = gpu ? sources(a.idx, b.idx, rows) : Sources{};
    auto dk_all = sum_gathered(std::get<1>(ra), std::get<1>(rb), a.idx, b.idx, rows, gpu ? &src : nullptr);
    auto dv_all = sum_gathered(std::get<2>(ra), std::get<2>(rb), a.idx, b.idx, rows, gpu ? &src : nullptr);
    const int64_t ctx_rows = kc.size(0);
    auto dkc = dk_all.narrow(0, 0, ctx_rows);
    auto dkb = dk_all.narrow(0, ctx_rows, kb.size(0));
    auto dvc = dv_all.narrow(0, 0, ctx_rows);
    auto dvb = dv_all.narrow(0, ctx_rows, vb.size(0));
    at::Tensor none;
    return {unfold(dq, g), dkc, dvc, dkb, dvb, none, none, none, none, none, none, none, none, none, none, none};
  }
};

at::Tensor& t(void* p) { return *static_cast<at::Tensor*>(p); }

}  // namespace

// Registers the GPU launcher of the gradient sum (once per process; a
// second call replaces it).
extern "C" void dflash_split_attention_set_gather_sum(DflashGatherSumLauncher f) { gather_sum_launcher.store(f); }

// Returns a new at::Tensor* (owned by the caller), or null with `err` filled.
extern "C" void* dflash_split_attention(void* q, void* kc, void* vc, void* kb, void* vb, void* idx_a, void* cuq_a,
                                        void* cuk_a, int64_t maxq_a, int64_t maxk_a, void* idx_b, void* cuq_b,
                                        void* cuk_b, int64_t maxq_b, int64_t maxk_b, double scale, char* err,
                                        int err_len) {
  try {
    auto out = SplitAttention::apply(t(q), t(kc), t(vc), t(kb), t(vb), t(idx_a), t(cuq_a), t(cuk_a), maxq_a, maxk_a,
                                     t(idx_b), t(cuq_b), t(cuk_b), maxq_b, maxk_b, scale);
    return new at::Tensor(std::move(out));
  } catch (const std::exception& e) {
    snprintf(err, err_len, "%s", e.what());
    return nullptr;
  }
}
