// One pass of Adam/AdamW over a streamed chunk on the CPU in mixed precision: the gradient is
// read where it landed (bf16 or fp16, added to the fp32 accumulator when micro-batches
// accumulate), clipped, stored as the fp32 gradient the step leaves behind, and the updated fp32
// master is rounded into the low-precision copy in the same pass. 32 bytes per parameter against
// the 40-48 of landing + torch._fused_adamw_ + copy-back as separate passes; with bf16 moments
// (widened in registers, rounded to nearest when stored) 24 against the separate passes' 56.
//
// A landing that is not updated at once (fp16: the step waits for every chunk's overflow
// check; a norm to clip by; gradient accumulation) is folded into the accumulator, unscaled and
// checked for inf/nan (fp16, at the step's last landing), and the low-precision copy restored
// from the master, in one pass too (`land`): 12 bytes per parameter against 20.
//
// [Note: one-pass arithmetic]
// Every result must equal, bit for bit, what the separate passes give: `acc.copy_(low)` or
// `acc.add_(low)`, `_foreach_mul_(grads, coef)`, `clamp_min_`/`clamp_max_`,
// `torch._fused_adamw_` / `torch._fused_adam_`, and `low.copy_(master)`. So the loop below spells
// out the order and rounding of the operations of torch's vectorised CPU Adam kernel (its
// main loop, over whole vectors of each tensor): decay, or the L2 term by one fused multiply-add
// (torch's compiler fuses it), the first moment as a lerp by one fused multiply-add, the second moment with one fused multiply-add, the denominator, the
// step. It is compiled with -ffp-contract=off so that the compiler adds no fused multiply-add
// of its own. The last elements of each tensor that do not fill a whole vector run through
// torch's own kernel instead (protrain_ops/onepass.py): torch computes them in a scalar loop
// whose roundings depend on how its binary was compiled. `verify()` in onepass.py checks the
// whole claim against torch at load time, and the kernel is not used where it fails.

// The headers are those the kernel uses -- a tensor, ATen's vectors and parallel_for, torch's
// operator registration -- rather than <torch/extension.h> or pybind11 bindings, whose headers
// (the whole C++ API) took 11 of the first build's 22 s here; the operators are called as
// torch.ops.<library>.<name>.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace {

// Loop invariants of one member's update. Absent options are neutral values (a coefficient of
// 1, a clamp at infinity, a sign of +1, a decay of 1) so that the loop has no branch on them;
// multiplying by 1 or -1 and comparing with infinity change no value.
struct Hyper {
  float decay;      // AdamW: 1 - lr * weight_decay (1 without weight decay)
  float l2;         // Adam: the weight-decay factor added to the gradient (only with LEVEL2)
  float sign;       // -1 with maximize, else 1
  bool small_lerp;  // |1 - beta1| < 0.5: the lerp from the moment, else from the gradient
  float lerp_coeff; // 1 - beta1, or (1 - beta1) - 1
  float beta2, one_minus_beta2, bias2_sqrt, eps, neg_step_size;
  float coef, clamp;
};

Hyper make_hyper(double lr, double beta1, double beta2, double weight_decay, double eps, double step,
                 bool decoupled, bool maximize, c10::optional<double> coef, c10::optional<double> clamp) {
  Hyper h{};
  // The bias corrections in double, as torch's kernel computes them.
  double bias1 = 1 - std::pow(beta1, step);
  double bias2 = 1 - std::pow(beta2, step);
  h.decay = decoupled && weight_decay != 0.f ? static_cast<float>(1 - lr * weight_decay) : 1.0f;
  h.l2 = static_cast<float>(weight_decay);
  h.sign = maximize ? -1.0f : 1.0f;
  float weight = static_cast<float>(1 - beta1);
  h.small_lerp = std::abs(weight) < 0.5f;
  h.lerp_coeff = h.small_lerp ? weight : weight - 1.0f;
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1 - beta2);
  h.bias2_sqrt = static_cast<float>(std::sqrt(bias2));
  h.eps = static_cast<float>(eps);
  h.neg_step_size = static_cast<float>(-(lr / bias1));
  h.coef = coef.has_value() ? static_cast<float>(*coef) : 1.0f;
  h.clamp = clamp.has_value() ? static_cast<float>(*clamp) : INFINITY;
  return h;
}

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kBlock = 256;  // bitsandbytes' block-wise block
// Elements per iteration: one vector of bf16 or fp16, two of fp32 (32 with AVX-512, 16 with AVX2).
constexpr int64_t kLanes = at::vec::Vectorized<at::BFloat16>::size();
static_assert(at::vec::Vectorized<at::Half>::size() == kLanes, "bf16 and fp16 vectors of one width");

// Mom: the moments' type, float or bf16 (optimizer_state_format="bf16": widened to fp32 for the
// arithmetic, rounded to nearest when stored, as the separate passes' copies do).
template <typename Low, typename Mom>
struct Member {
  float* p;
  Low* low;           // the bf16/fp16 span: the gradient in (READ_LOW), the rounded master out
  float* acc;         // the fp32 gradient: added to (READ_ACC), the clipped one out (WRITE_ACC)
  Mom* m;
  Mom* v;
  float* vmax;        // AMSGRAD only (fp32 moments)
};

// kLanes moments at `p` as two fp32 vectors, and back.
inline std::tuple<fVec, fVec> load_moments(const float* p) { return {fVec::loadu(p), fVec::loadu(p + fVec::size())}; }
inline std::tuple<fVec, fVec> load_moments(const at::BFloat16* p) {
  return at::vec::convert_to_float<at::BFloat16>(at::vec::Vectorized<at::BFloat16>::loadu(p));
}
inline void store_moments(float* p, const fVec& a, const fVec& b) {
  a.store(p);
  b.store(p + fVec::size());
}
inline void store_moments(at::BFloat16* p, const fVec& a, const fVec& b) {
  at::vec::convert_from_float<at::BFloat16>(a, b).store(p);
}

// The gradient left in the accumulator is not read again in this step: with STREAM (the
// member's accumulator aligned to whole vectors) it bypasses the cache, which saves reading the
// line before writing it (a fifth of the pass's memory traffic).
template <bool STREAM>
inline void store_gradient(float* dst, const fVec& g) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (STREAM) return _mm512_stream_ps(dst, g);
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (STREAM) return _mm256_stream_ps(dst, g);
#endif
  g.store(dst);
}

// One vector of one member at `i`: `g` is its gradient, `m` and `v` its moments (updated in
// place); returns the updated master.
template <bool WRITE_ACC, bool STREAM, bool LEVEL2, bool AMSGRAD, typename Low, typename Mom>
inline fVec update_vector(const Hyper& h, const Member<Low, Mom>& t, int64_t i, fVec g, fVec& m, fVec& v) {
  g = g * fVec(h.coef);                      // _foreach_mul_ by clip_grad_norm_'s coefficient
  g = at::vec::clamp_min(g, fVec(-h.clamp));  // clamp_min_ / clamp_max_: a NaN stays
  g = at::vec::clamp_max(g, fVec(h.clamp));
  if constexpr (WRITE_ACC) store_gradient<STREAM>(t.acc + i, g);
  g = g * fVec(h.sign);
  fVec param = fVec::loadu(t.p + i);
  if constexpr (LEVEL2) g = at::vec::fmadd(param, fVec(h.l2), g);
  else param = param * fVec(h.decay);
  m = at::vec::fmadd(fVec(h.lerp_coeff), g - m, h.small_lerp ? m : g);
  v = at::vec::fmadd(fVec(h.one_minus_beta2) * g, g, v * fVec(h.beta2));
  fVec vmax = v;
  if constexpr (AMSGRAD) {
    vmax = at::vec::maximum(fVec::loadu(t.vmax + i), v);
    vmax.store(t.vmax + i);
  }
  // (bf16 moments: the fp32 values step the master, as the separate passes' fp32 copies do)
  fVec denom = vmax.sqrt() / fVec(h.bias2_sqrt) + fVec(h.eps);
  param = param + fVec(h.neg_step_size) * m / denom;
  param.store(t.p + i);
  return param;
}

// Elements [begin, end) of one member, a multiple of kLanes.
template <typename Low, typename Mom, bool READ_LOW, bool READ_ACC, bool WRITE_ACC, bool STREAM, bool LEVEL2,
          bool AMSGRAD>
void update_range(const Hyper h, const Member<Low, Mom> t, int64_t begin, int64_t end) {
  constexpr int64_t half = fVec::size();
  for (int64_t i = begin; i < end; i += kLanes) {
    fVec g0, g1;
    if constexpr (READ_LOW) {
      std::tie(g0, g1) = at::vec::convert_to_float<Low>(at::vec::Vectorized<Low>::loadu(t.low + i));
      if constexpr (READ_ACC) {
        g0 = fVec::loadu(t.acc + i) + g0;
        g1 = fVec::loadu(t.acc + i + half) + g1;
      }
    } else {
      g0 = fVec::loadu(t.acc + i);
      g1 = fVec::loadu(t.acc + i + half);
    }
    auto [m0, m1] = load_moments(t.m + i);
    auto [v0, v1] = load_moments(t.v + i);
    fVec p0 = update_vector<WRITE_ACC, STREAM, LEVEL2, AMSGRAD>(h, t, i, g0, m0, v0);
    fVec p1 = update_vector<WRITE_ACC, STREAM, LEVEL2, AMSGRAD>(h, t, i + half, g1, m1, v1);
    store_moments(t.m + i, m0, m1);
    store_moments(t.v + i, v0, v1);
    at::vec::convert_from_float<Low>(p0, p1).store(t.low + i);
  }
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (STREAM) _mm_sfence();  // streamed stores are visible to every thread after this
#endif
}

template <typename Low, typename Mom>
using RangeFn = void (*)(const Hyper, const Member<Low, Mom>, int64_t, int64_t);

template <typename Low, typename Mom, bool READ_LOW, bool READ_ACC, bool WRITE_ACC, bool STREAM>
RangeFn<Low, Mom> pick(bool level2, bool amsgrad) {
  if (level2) return amsgrad ? update_range<Low, Mom, READ_LOW, READ_ACC, WRITE_ACC, STREAM, true, true>
                             : update_range<Low, Mom, READ_LOW, READ_ACC, WRITE_ACC, STREAM, true, false>;
  return amsgrad ? update_range<Low, Mom, READ_LOW, READ_ACC, WRITE_ACC, STREAM, false, true>
                 : update_range<Low, Mom, READ_LOW, READ_ACC, WRITE_ACC, STREAM, false, false>;
}

// What the gradient is: landed in the bf16 or fp16 span (added to the accumulator when micro-batches
// accumulate; streamed out when `stream`), or already in the accumulator (written back only when
// clipping changed it).
template <typename Low, typename Mom>
RangeFn<Low, Mom> pick(bool landed, bool accumulate, bool write_acc, bool stream, bool level2, bool amsgrad) {
  if (landed && !accumulate) {
    return stream ? pick<Low, Mom, true, false, true, true>(level2, amsgrad)
                  : pick<Low, Mom, true, false, true, false>(level2, amsgrad);
  }
  if (landed) return pick<Low, Mom, true, true, true, false>(level2, amsgrad);
  return write_acc ? pick<Low, Mom, false, true, true, false>(level2, amsgrad)
                   : pick<Low, Mom, false, true, false, false>(level2, amsgrad);
}

template <typename Low, typename Mom>
void run_member(const Hyper& h, const at::Tensor& param, const at::Tensor& low, const at::Tensor& acc,
                const at::Tensor& m, const at::Tensor& v, const at::Tensor* vmax, int64_t length, bool landed,
                bool accumulate, bool write_acc, bool level2) {
  const bool aligned = reinterpret_cast<uintptr_t>(acc.data_ptr<float>()) % sizeof(fVec) == 0;
  const RangeFn<Low, Mom> fn = pick<Low, Mom>(landed, accumulate, write_acc || landed, aligned, level2, vmax != nullptr);
  const Member<Low, Mom> t{param.data_ptr<float>(), low.data_ptr<Low>(), acc.data_ptr<float>(), m.data_ptr<Mom>(),
                           v.data_ptr<Mom>(), vmax != nullptr ? vmax->data_ptr<float>() : nullptr};
  at::parallel_for(0, length / kLanes, 16384 / kLanes, [&](int64_t begin, int64_t end) { fn(h, t, begin * kLanes, end * kLanes); });
}

// One param group's members: each list holds one tensor per member (``max_exp_avg_sqs`` empty
// without amsgrad); `lengths[k]` elements of member k are updated (its whole vectors: the caller
// runs the rest through torch).
void adam_onepass(std::vector<at::Tensor> params, std::vector<at::Tensor> lows, std::vector<at::Tensor> accs,
                  std::vector<at::Tensor> exp_avgs, std::vector<at::Tensor> exp_avg_sqs,
                  std::vector<at::Tensor> max_exp_avg_sqs, std::vector<int64_t> lengths, std::vector<double> steps,
                  double lr, double beta1, double beta2, double weight_decay, double eps, bool decoupled,
                  bool amsgrad, bool maximize, c10::optional<double> coef, c10::optional<double> clamp,
                  bool landed, bool accumulate, bool write_acc) {
  const size_t n = params.size();
  TORCH_CHECK(lows.size() == n && accs.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                  lengths.size() == n && steps.size() == n && (!amsgrad || max_exp_avg_sqs.size() == n),
              "adam_onepass: one tensor per member in every list");
  const bool level2 = !decoupled && weight_decay != 0.f;
  for (size_t k = 0; k < n; ++k) {
    const bool bf16_moments = exp_avgs[k].scalar_type() == at::kBFloat16;
    std::vector<const at::Tensor*> fp32 = {&params[k], &accs[k]};
    if (!bf16_moments) fp32.insert(fp32.end(), {&exp_avgs[k], &exp_avg_sqs[k]});
    if (amsgrad) fp32.push_back(&max_exp_avg_sqs[k]);
    for (const at::Tensor* t : fp32) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu() &&
                      t->numel() >= lengths[k], "adam_onepass: fp32 contiguous CPU tensors");
    }
    if (bf16_moments) {
      for (const at::Tensor* t : {&exp_avgs[k], &exp_avg_sqs[k]}) {
        TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->is_contiguous() && t->numel() >= lengths[k],
                    "adam_onepass: both moments bf16 and contiguous");
      }
      TORCH_CHECK(!amsgrad, "adam_onepass: bf16 moments without amsgrad");
    }
    const bool half = lows[k].scalar_type() == at::kHalf;
    TORCH_CHECK((half || lows[k].scalar_type() == at::kBFloat16) && lows[k].is_contiguous() &&
                    lows[k].numel() >= lengths[k], "adam_onepass: the low-precision span is bf16 or fp16 and contiguous");
    const Hyper h = make_hyper(lr, beta1, beta2, weight_decay, eps, steps[k], decoupled, maximize, coef, clamp);
    TORCH_CHECK(lengths[k] % kLanes == 0, "adam_onepass: lengths are multiples of lanes()");
    const at::Tensor* vmax = amsgrad ? &max_exp_avg_sqs[k] : nullptr;
    using Run = void (*)(const Hyper&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, const at::Tensor*, int64_t, bool, bool, bool, bool);
    const Run run = half ? (bf16_moments ? run_member<at::Half, at::BFloat16> : run_member<at::Half, float>)
                         : (bf16_moments ? run_member<at::BFloat16, at::BFloat16> : run_member<at::BFloat16, float>);
    run(h, params[k], lows[k], accs[k], exp_avgs[k], exp_avg_sqs[k], vmax, lengths[k], landed, accumulate, write_acc,
        level2);
  }
}

// ----- landing without an update --------------------------------------------------------------
// Elements [begin, end) of one piece: the landed gradient into the accumulator (`acc.copy_(low)`
// or `acc.add_(low)`); with UNSCALE also `torch._amp_foreach_non_finite_check_and_unscale_`'s
// check (of the folded value) and multiplication by the inverse scale; then `low.copy_(master)`.
// Each is one rounding of one operation, so the scalar loop for the last elements gives what
// torch's gives. Returns whether an inf/nan was found (only looked for with UNSCALE).
template <typename Low, bool ACCUMULATE, bool UNSCALE>
bool land_range(const float* master, Low* low, float* acc, float inv_scale, int64_t begin, int64_t end) {
  using lVec = at::vec::Vectorized<Low>;
  constexpr int64_t half = fVec::size();
  bool found = false;
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    auto [g0, g1] = at::vec::convert_to_float<Low>(lVec::loadu(low + i));
    if constexpr (ACCUMULATE) {
      g0 = fVec::loadu(acc + i) + g0;
      g1 = fVec::loadu(acc + i + half) + g1;
    }
    if constexpr (UNSCALE) {
      found = found || g0.has_inf_nan() || g1.has_inf_nan();
      g0 = g0 * fVec(inv_scale);
      g1 = g1 * fVec(inv_scale);
    }
    g0.store(acc + i);
    g1.store(acc + i + half);
    at::vec::convert_from_float<Low>(fVec::loadu(master + i), fVec::loadu(master + i + half)).store(low + i);
  }
  for (; i < end; ++i) {
    float g = static_cast<float>(low[i]);
    if constexpr (ACCUMULATE) g = acc[i] + g;
    if constexpr (UNSCALE) {
      found = found || !std::isfinite(g);
      g = g * inv_scale;
    }
    acc[i] = g;
    low[i] = static_cast<Low>(master[i]);
  }
  return found;
}

template <typename Low>
bool land_piece(const at::Tensor& master, const at::Tensor& low, const at::Tensor& acc, bool accumulate,
                c10::optional<double> inv_scale) {
  using Fn = bool (*)(const float*, Low*, float*, float, int64_t, int64_t);
  const Fn fn = accumulate ? (inv_scale ? land_range<Low, true, true> : land_range<Low, true, false>)
                           : (inv_scale ? land_range<Low, false, true> : land_range<Low, false, false>);
  const float inv = inv_scale ? static_cast<float>(*inv_scale) : 1.0f;
  const float* m = master.data_ptr<float>();
  Low* l = low.data_ptr<Low>();
  float* a = acc.data_ptr<float>();
  std::atomic<bool> found{false};
  at::parallel_for(0, master.numel(), 16384, [&](int64_t begin, int64_t end) {
    if (fn(m, l, a, inv, begin, end)) found.store(true, std::memory_order_relaxed);
  });
  return found.load();
}

// Pieces of a chunk's span (views of the master, the low-precision copy and the accumulator
// alike): returns whether an inf/nan was found in a folded gradient (with `inv_scale` only).
bool land(std::vector<at::Tensor> masters, std::vector<at::Tensor> lows, std::vector<at::Tensor> accs,
          bool accumulate, c10::optional<double> inv_scale) {
  TORCH_CHECK(lows.size() == masters.size() && accs.size() == masters.size(), "land: one tensor per piece in every list");
  bool found = false;
  for (size_t k = 0; k < masters.size(); ++k) {
    const int64_t n = masters[k].numel();
    for (const at::Tensor* t : {&masters[k], &accs[k]}) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu() && t->numel() == n,
                  "land: fp32 contiguous CPU tensors of one size");
    }
    const bool half = lows[k].scalar_type() == at::kHalf;
    TORCH_CHECK((half || lows[k].scalar_type() == at::kBFloat16) && lows[k].is_contiguous() && lows[k].numel() == n,
                "land: the low-precision piece is bf16 or fp16, contiguous, of the master's size");
    const bool f = half ? land_piece<at::Half>(masters[k], lows[k], accs[k], accumulate, inv_scale)
                        : land_piece<at::BFloat16>(masters[k], lows[k], accs[k], accumulate, inv_scale);
    found = found || f;
  }
  return found;
}


// ----- 8-bit block-wise moments ---------------------------------------------------------------
// [Note: 8-bit moments in one pass]
// bitsandbytes' AdamW8bit on the CPU (its 0.50 backend) dequantises each moment (code[q] times
// the absmax of the element's block of 256), steps with torch operators -- m * beta1 then
// add(g, alpha=1 - beta1); v * beta2 then addcmul(g, g, value=1 - beta2); sqrt(v) / c2 + eps;
// p * (1 - lr * wd) when wd > 0; addcdiv(m, denom, value=-lr / c1) -- and quantises each moment
// again: a block's absmax, each element divided by it, the nearest code. Here a streamed
// chunk's whole update is one pass per block, as `adam_onepass` is for wider moments: the
// gradient read where it landed (added to the accumulator, clipped, stored as the fp32
// gradient the step leaves behind), both moments dequantised, stepped and quantised again, the
// master stepped and rounded into the low-precision copy -- 20 bytes per parameter against the
// 28 of landing, update and copy-back as separate passes. The landing, clipping and copy are
// single roundings, equal bit for bit to the separate passes; the update has the roundings of
// torch's kernels here (add with alpha and addcmul are fused multiply-adds, addcdiv is not).
// Two differences from bitsandbytes, each within an ulp or a code: the square root is the
// correctly rounded one (torch's sqrt operator, through MKL here, is not always), and the
// nearest code is found exactly ([Note: the nearest code without a gather]) where bitsandbytes'
// binary search picks a farther code for some values: within about 1e-5 of a midpoint, and the
// second moment's values below about 1e-5 of their block's scale (among its tiny codes near 0):
// 0.1 % and 3 % of the codes after a first step, in a measurement. tests/test_onepass.py holds
// the kernel to bitsandbytes within those bounds, and a training run to bitsandbytes' own within
// the distance bitsandbytes keeps from fp32 moments.
//
// [Note: the nearest code without a gather]
// The nearest code of v is the number of midpoints between codes below v (ties go down). A
// table of at most 512 buckets gives that number for the least value of v's bucket: its sign,
// its binade (all binades below the map's least midpoint are one), and as many leading mantissa
// bits as that binade needs for no bucket to hold two midpoints (at most 7, so that the top half
// of v's bits decides its bucket; bitsandbytes' maps: 444 and 497 buckets); one comparison with
// the midpoint above finishes. With AVX-512 VBMI the keys are computed 32 at a time on the top
// halves, and the lookups -- the bucket's start among 512 bytes, the midpoint and the
// dequantised code among 256 floats held as four planes of bytes -- are byte permutes of 64
// lanes at once. A 16-lane gather instead cost more than the rest of the update together on the
// 2-core Zen 5 VM (the kernel at 340 M parameters/s with two gathers per moment, 1,820 without).
// Without VBMI: scalar lookups of the same tables, with the same results.
#if defined(__AVX512VBMI__)
// out[r] (natural order): the floats of `planes` (byte k of entry i: planes[k][i / 64] lane i % 64)
// at the 64 byte indices `idx`.
inline void lookup64(const __m512i (&planes)[4][4], __m512i idx, __m512 (&out)[4]) {
  // Unpacking bytes into floats interleaves within 128-bit lanes: permute the indices first so
  // that the floats come out in order.
  alignas(64) static const uint8_t order[64] = {
      0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39,
      52, 53, 54, 55, 8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31,
      44, 45, 46, 47, 60, 61, 62, 63};
  idx = _mm512_permutexvar_epi8(_mm512_load_si512(order), idx);
  const __mmask64 high = _mm512_movepi8_mask(idx);
  __m512i b[4];
  for (int k = 0; k < 4; ++k) {
    b[k] = _mm512_mask_blend_epi8(high, _mm512_permutex2var_epi8(planes[k][0], idx, planes[k][1]),
                                  _mm512_permutex2var_epi8(planes[k][2], idx, planes[k][3]));
  }
  const __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
  const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
}

inline void byte_planes(const float* values, __m512i (&planes)[4][4]) {
  alignas(64) uint8_t b[4][256];
  for (int i = 0; i < 256; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &values[i], sizeof bits);
    for (int k = 0; k < 4; ++k) b[k][i] = static_cast<uint8_t>(bits >> (8 * k));
  }
  for (int k = 0; k < 4; ++k) {
    for (int r = 0; r < 4; ++r) planes[k][r] = _mm512_load_si512(b[k] + 64 * r);
  }
}

inline __mmask64 join(__mmask16 a, __mmask16 b, __mmask16 c, __mmask16 d) {
  return _mm512_kunpackd(_mm512_kunpackw(d, c), _mm512_kunpackw(b, a));
}
#endif

// One of bitsandbytes' maps of 256 sorted codes: their values, and the search for the nearest.
class alignas(64) Map {
 public:
  explicit Map(const float* table) {
    std::copy(table, table + 256, code_);
    for (int i = 0; i < 255; ++i) mid_[i] = ((i == 0 ? -1.0f : code_[i]) + code_[i + 1]) / 2.0f;  // (code 0 taken
    mid_[255] = INFINITY;                                                  // as -1, as bitsandbytes' search does)
    int least = 255;  // the least binade holding a midpoint
    for (int i = 0; i < 255; ++i) {
      if (mid_[i] != 0.0f) least = std::min(least, static_cast<int>((bits_of(mid_[i]) >> 23) & 0xFF));
    }
    TORCH_CHECK(least >= 129 - 32, "adam8bit: a map with midpoints below 2^-30 of its largest code");
    base_ = least - 1;  // slot 0: every binade below `least`; slot j: binade least + j - 1 (the last: 2^0 and up)
    slots_ = 129 - least;
    uint32_t next = 0;
    for (uint32_t sign = 0; sign < 2; ++sign) {
      for (int j = 0; j < 32; ++j) {
        if (j >= slots_) {
          slot_[sign * 32 + j] = 7u << 9;
          continue;
        }
        const bool whole = j == 0 || j == slots_ - 1;  // (several binades: one bucket)
        const uint32_t first = j == 0 ? 0u : static_cast<uint32_t>(base_ + j) << 23;
        const uint32_t last = j == 0 ? (static_cast<uint32_t>(least) << 23) - 1 : j == slots_ - 1 ? 0x7F7FFFFFu
                                                                                            : first | 0x7FFFFFu;
        uint32_t r = 0;  // (at most 7 bits: a float's top half decides its bucket)
        while (!fits(sign, first, last, r)) {
          TORCH_CHECK(!whole && ++r <= 7, "adam8bit: a map whose midpoints 7 mantissa bits do not separate");
        }
        TORCH_CHECK(next + (1u << r) <= 512, "adam8bit: a map needing more than 512 buckets");
        slot_[sign * 32 + j] = static_cast<uint16_t>(next | ((7 - r) << 9));
        for (uint32_t b = 0; b < (1u << r); ++b) {
          start_[next + b] = static_cast<uint8_t>(below(bucket_value(sign, first, last, r, b, true)));
        }
        next += 1u << r;
      }
    }
#if defined(__AVX512VBMI__)
    byte_planes(code_, code_planes_);
    byte_planes(mid_, mid_planes_);
    for (int r = 0; r < 8; ++r) start_vec_[r] = _mm512_loadu_si512(start_ + 64 * r);
    for (int r = 0; r < 2; ++r) slot_vec_[r] = _mm512_loadu_si512(slot_ + 32 * r);
#endif
  }

  // The nearest code to v (NaN: code 0, as bitsandbytes gives).
  uint8_t find(float v) const {
    if (std::isnan(v)) return 0;
    const uint8_t s = start_[key(bits_of(v))];
    return static_cast<uint8_t>(s + (v > mid_[s]));
  }

  // `len` (<= 256) values of a block from their codes and scale.
  void dequantise(const uint8_t* q, float scale, float* out, int64_t len) const {
    int64_t i = 0;
#if defined(__AVX512VBMI__)
    for (; i + 64 <= len; i += 64) {
      __m512 c[4];
      lookup64(code_planes_, _mm512_loadu_si512(q + i), c);
      for (int r = 0; r < 4; ++r) _mm512_storeu_ps(out + i + 16 * r, _mm512_mul_ps(c[r], _mm512_set1_ps(scale)));
    }
#endif
    for (; i < len; ++i) out[i] = code_[q[i]] * scale;
  }

  // `len` (<= 256) values of a block into codes; returns the block's scale (its absmax).
  float quantise(const float* x, uint8_t* q, int64_t len) const {
    float absmax = -FLT_MAX;
    int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
    __m512 most = _mm512_set1_ps(-FLT_MAX);
    for (; i + 16 <= len; i += 16) {  // (a NaN is passed over, as fmax does: max_ps gives its second operand)
      most = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), most);
    }
    absmax = _mm512_reduce_max_ps(most);
#endif
    for (; i < len; ++i) absmax = std::fmax(absmax, std::fabs(x[i]));
    i = 0;
#if defined(__AVX512VBMI__)
    for (; i + 64 <= len; i += 64) {
      __m512 v[4], mid[4];
      __mmask16 ordered[4];
      for (int r = 0; r < 4; ++r) {
        v[r] = _mm512_div_ps(_mm512_loadu_ps(x + i + 16 * r), _mm512_set1_ps(absmax));
        ordered[r] = _mm512_cmp_ps_mask(v[r], v[r], _CMP_ORD_Q);
      }
      // The keys of 32 values at once from their top halves, then their low bytes in order and their ninth bits.
      const __m512i k01 = key32(top_halves(v[0], v[1])), k23 = key32(top_halves(v[2], v[3]));
      const __m512i key = low_bytes(k01, k23);
      const __mmask64 b7 = _mm512_movepi8_mask(key);
      const __mmask64 b8 = _mm512_kunpackd(_mm512_test_epi16_mask(k23, _mm512_set1_epi16(256)),
                                           _mm512_test_epi16_mask(k01, _mm512_set1_epi16(256)));
      const __m512i lo = _mm512_mask_blend_epi8(b7, _mm512_permutex2var_epi8(start_vec_[0], key, start_vec_[1]),
                                                _mm512_permutex2var_epi8(start_vec_[2], key, start_vec_[3]));
      const __m512i hi = _mm512_mask_blend_epi8(b7, _mm512_permutex2var_epi8(start_vec_[4], key, start_vec_[5]),
                                                _mm512_permutex2var_epi8(start_vec_[6], key, start_vec_[7]));
      const __m512i start = _mm512_mask_blend_epi8(b8, lo, hi);
      lookup64(mid_planes_, start, mid);
      __mmask16 up[4];
      for (int r = 0; r < 4; ++r) up[r] = _mm512_cmp_ps_mask(v[r], mid[r], _CMP_GT_OQ);
      const __m512i code = _mm512_mask_add_epi8(start, join(up[0], up[1], up[2], up[3]), start, _mm512_set1_epi8(1));
      _mm512_storeu_si512(q + i, _mm512_maskz_mov_epi8(join(ordered[0], ordered[1], ordered[2], ordered[3]), code));
    }
#endif
    alignas(64) float v[kBlock];  // (divided in vectors by the compiler, then searched one by one)
    for (int64_t j = i; j < len; ++j) v[j] = x[j] / absmax;
    for (; i < len; ++i) q[i] = find(v[i]);
    return absmax;
  }

 private:
  static uint32_t bits_of(float x) {
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof bits);
    return bits;
  }
  static float float_of(uint32_t bits) {
    float x;
    std::memcpy(&x, &bits, sizeof x);
    return x;
  }
  int below(float x) const { return static_cast<int>(std::lower_bound(mid_, mid_ + 255, x) - mid_); }

  // The least (`least`) or greatest value of bucket b of 2^r over magnitudes [first, last].
  static float bucket_value(uint32_t sign, uint32_t first, uint32_t last, uint32_t r, uint32_t b, bool least) {
    const uint32_t width = r == 0 ? last - first : (1u << (23 - r)) - 1;
    const uint32_t lo = first + (r == 0 ? 0 : b << (23 - r)), hi = lo + width;
    return float_of((sign << 31) | ((least != (sign == 1)) ? lo : hi));
  }

  // No bucket of 2^r over magnitudes [first, last] of this sign holds two midpoints.
  bool fits(uint32_t sign, uint32_t first, uint32_t last, uint32_t r) const {
    for (uint32_t b = 0; b < (1u << r); ++b) {
      if (below(bucket_value(sign, first, last, r, b, false)) - below(bucket_value(sign, first, last, r, b, true)) > 1)
        return false;
    }
    return true;
  }

  // A value's bucket, from the top half of its bits: sign, exponent, 7 mantissa bits.
  uint32_t key(uint32_t bits) const {
    const uint32_t top = bits >> 16;
    const uint16_t slot = slot_[(top >> 15) * 32 + std::clamp(static_cast<int>((top >> 7) & 0xFF) - base_, 0, slots_ - 1)];
    return (slot & 0x1FFu) + ((top & 0x7Fu) >> (slot >> 9));
  }

#if defined(__AVX512VBMI__)
  // The top halves of 32 floats, in order.
  static __m512i top_halves(__m512 a, __m512 b) {
    alignas(64) static const uint16_t odd[32] = {1,  3,  5,  7,  9,  11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31,
                                                 33, 35, 37, 39, 41, 43, 45, 47, 49, 51, 53, 55, 57, 59, 61, 63};
    return _mm512_permutex2var_epi16(_mm512_castps_si512(a), _mm512_load_si512(odd), _mm512_castps_si512(b));
  }
  // `key` of 32 top halves.
  __m512i key32(__m512i top) const {
    __m512i slot = _mm512_subs_epu16(_mm512_and_si512(_mm512_srli_epi16(top, 7), _mm512_set1_epi16(0xFF)),
                                     _mm512_set1_epi16(static_cast<int16_t>(base_)));
    slot = _mm512_min_epu16(slot, _mm512_set1_epi16(static_cast<int16_t>(slots_ - 1)));
    slot = _mm512_mask_add_epi16(slot, _mm512_movepi16_mask(top), slot, _mm512_set1_epi16(32));
    const __m512i entry = _mm512_permutex2var_epi16(slot_vec_[0], slot, slot_vec_[1]);
    const __m512i mantissa = _mm512_and_si512(top, _mm512_set1_epi16(0x7F));
    return _mm512_add_epi16(_mm512_and_si512(entry, _mm512_set1_epi16(0x1FF)),
                            _mm512_srlv_epi16(mantissa, _mm512_srli_epi16(entry, 9)));
  }
  // The low bytes of two vectors of 32 keys: byte 2j of the pair.
  static __m512i low_bytes(__m512i a, __m512i b) {
    alignas(64) static const uint8_t even[64] = {
        0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36, 38, 40, 42,
        44, 46, 48, 50, 52, 54, 56, 58, 60, 62, 64, 66, 68, 70, 72, 74, 76, 78, 80, 82, 84, 86,
        88, 90, 92, 94, 96, 98, 100, 102, 104, 106, 108, 110, 112, 114, 116, 118, 120, 122, 124, 126};
    return _mm512_permutex2var_epi8(a, _mm512_load_si512(even), b);
  }
  __m512i code_planes_[4][4], mid_planes_[4][4], start_vec_[8], slot_vec_[2];
#endif
  float code_[256];
  float mid_[256];         // mid_[i]: between codes i and i + 1 (mid_[255]: +inf)
  int base_, slots_;       // slot of a binade e: clamp(e - base_, 0, slots_ - 1)
  uint16_t slot_[64];      // by sign * 32 + slot: its first bucket | the shift of the top 7 mantissa bits << 9
  uint8_t start_[512]{};   // by bucket: the midpoints below its least value
};

// The maps seen so far (two in practice), built once each.
const Map& map_for(const at::Tensor& qmap) {
  static std::mutex lock;
  static std::vector<std::pair<std::vector<float>, std::unique_ptr<Map>>> built;
  std::vector<float> key(qmap.data_ptr<float>(), qmap.data_ptr<float>() + 256);
  std::lock_guard<std::mutex> guard(lock);
  for (auto& [table, map] : built) {
    if (table == key) return *map;
  }
  built.emplace_back(key, std::make_unique<Map>(key.data()));
  return *built.back().second;
}

struct Hyper8 {
  float beta1, omb1, beta2, omb2, c2, eps, decay, neg_step;
  float coef, clamp;  // clipping (neutral: 1 and infinity, as in `Hyper`)
  bool decays, landed, accumulate, write_acc;
};

// One member's piece: its fp32 master, its low-precision span (nullptr: none), its fp32
// gradient (`acc`), its codes and their block scales.
template <typename Low>
struct Piece8 {
  float* p;
  Low* low;
  float* acc;
  uint8_t *q1, *q2;
  float *a1, *a2;
};

// The gradient of `len` elements from `at` into `g`: where it landed (added to the accumulator
// when micro-batches accumulate) or in the accumulator, clipped, and stored into the accumulator
// where it changed -- the separate passes' fold, `_foreach_mul_` and clamps.
template <typename Low>
void gradient8(const Hyper8& h, const Piece8<Low>& t, int64_t at, int64_t len, float* g) {
  constexpr int64_t half = fVec::size();
  float* acc = t.acc + at;
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    fVec g0, g1;
    if (h.landed) {
      std::tie(g0, g1) = at::vec::convert_to_float<Low>(at::vec::Vectorized<Low>::loadu(t.low + at + i));
      if (h.accumulate) {
        g0 = fVec::loadu(acc + i) + g0;
        g1 = fVec::loadu(acc + i + half) + g1;
      }
    } else {
      g0 = fVec::loadu(acc + i);
      g1 = fVec::loadu(acc + i + half);
    }
    g0 = at::vec::clamp_max(at::vec::clamp_min(g0 * fVec(h.coef), fVec(-h.clamp)), fVec(h.clamp));
    g1 = at::vec::clamp_max(at::vec::clamp_min(g1 * fVec(h.coef), fVec(-h.clamp)), fVec(h.clamp));
    if (h.write_acc) {
      g0.store(acc + i);
      g1.store(acc + i + half);
    }
    g0.store(g + i);
    g1.store(g + i + half);
  }
  for (; i < len; ++i) {
    float x = h.landed ? static_cast<float>(t.low[at + i]) : acc[i];
    if (h.landed && h.accumulate) x = acc[i] + x;
    x = x * h.coef;
    if (x < -h.clamp) x = -h.clamp;  // (a NaN stays)
    if (x > h.clamp) x = h.clamp;
    if (h.write_acc) acc[i] = x;
    g[i] = x;
  }
}

// Block b of `len` (<= 256) elements: the gradient, the moments dequantised, stepped with the
// master, quantised again; the master rounded into the low-precision span.
template <typename Low>
void block8(const Hyper8& h, const Piece8<Low>& t, int64_t b, int64_t len, const Map& map1, const Map& map2) {
  const int64_t at = b * kBlock;
  alignas(64) float g[kBlock], m[kBlock], v[kBlock];
  gradient8(h, t, at, len, g);
  map1.dequantise(t.q1 + at, t.a1[b], m, len);
  map2.dequantise(t.q2 + at, t.a2[b], v, len);
  float* p = t.p + at;
  int64_t i = 0;
  for (; i + fVec::size() <= len; i += fVec::size()) {
    const fVec gv = fVec::loadu(g + i);
    const fVec mv = at::vec::fmadd(gv, fVec(h.omb1), fVec::loadu(m + i) * fVec(h.beta1));
    const fVec vv = at::vec::fmadd(fVec(h.omb2) * gv, gv, fVec::loadu(v + i) * fVec(h.beta2));
    const fVec denom = vv.sqrt() / fVec(h.c2) + fVec(h.eps);
    fVec pv = fVec::loadu(p + i);
    if (h.decays) pv = pv * fVec(h.decay);
    pv = pv + fVec(h.neg_step) * mv / denom;
    pv.store(p + i);
    mv.store(m + i);
    vv.store(v + i);
  }
  for (; i < len; ++i) {  // torch's scalar loop rounds alike (fused where its vectors are)
    m[i] = std::fma(g[i], h.omb1, m[i] * h.beta1);
    v[i] = std::fma(h.omb2 * g[i], g[i], v[i] * h.beta2);
    const float denom = std::sqrt(v[i]) / h.c2 + h.eps;
    const float pv = h.decays ? p[i] * h.decay : p[i];
    p[i] = pv + h.neg_step * m[i] / denom;
  }
  if (t.low != nullptr) {
    i = 0;
    for (; i + kLanes <= len; i += kLanes) {
      at::vec::convert_from_float<Low>(fVec::loadu(p + i), fVec::loadu(p + i + fVec::size())).store(t.low + at + i);
    }
    for (; i < len; ++i) t.low[at + i] = static_cast<Low>(p[i]);
  }
  t.a1[b] = map1.quantise(m, t.q1 + at, len);
  t.a2[b] = map2.quantise(v, t.q2 + at, len);
}

template <typename Low>
void run_piece8(const Hyper8& h, const Piece8<Low>& t, int64_t numel, const Map& map1, const Map& map2) {
  at::parallel_for(0, (numel + kBlock - 1) / kBlock, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) block8(h, t, b, std::min(kBlock, numel - b * kBlock), map1, map2);
  });
}

// Members' pieces (each starting at a block boundary of its member) with their step counts
// after this step: bitsandbytes' optimizer_update_8bit_blockwise("adam", ...) of each, in one
// pass ([Note: 8-bit moments in one pass]). `lows` empty: the gradients are in `accs` and no
// low-precision copy is written; else as `adam_onepass` takes them (`landed`, `accumulate`,
// clipping by `coef` and `clamp`).
void adam8bit(std::vector<at::Tensor> params, std::vector<at::Tensor> lows, std::vector<at::Tensor> accs,
              std::vector<at::Tensor> states1, std::vector<at::Tensor> states2, std::vector<at::Tensor> absmax1,
              std::vector<at::Tensor> absmax2, at::Tensor qmap1, at::Tensor qmap2, std::vector<double> steps,
              double lr, double beta1, double beta2, double eps, double weight_decay, c10::optional<double> coef,
              c10::optional<double> clamp, bool landed, bool accumulate) {
  const size_t n = params.size();
  TORCH_CHECK(accs.size() == n && states1.size() == n && states2.size() == n && absmax1.size() == n &&
                  absmax2.size() == n && steps.size() == n && (lows.empty() || lows.size() == n),
              "adam8bit: one tensor per member in every list");
  TORCH_CHECK(!lows.empty() || !landed, "adam8bit: a landed gradient needs the low-precision spans");
  TORCH_CHECK(qmap1.scalar_type() == at::kFloat && qmap1.numel() == 256 && qmap1.is_contiguous() &&
                  qmap2.scalar_type() == at::kFloat && qmap2.numel() == 256 && qmap2.is_contiguous(),
              "adam8bit: two maps of 256 fp32 codes");
  const Map& map1 = map_for(qmap1);
  const Map& map2 = map_for(qmap2);
  for (size_t k = 0; k < n; ++k) {
    const int64_t numel = params[k].numel(), blocks = (numel + kBlock - 1) / kBlock;
    TORCH_CHECK(params[k].scalar_type() == at::kFloat && accs[k].scalar_type() == at::kFloat &&
                    params[k].is_contiguous() && accs[k].is_contiguous() && accs[k].numel() == numel,
                "adam8bit: fp32 contiguous params and gradients of one size");
    TORCH_CHECK(states1[k].scalar_type() == at::kByte && states2[k].scalar_type() == at::kByte &&
                    states1[k].is_contiguous() && states2[k].is_contiguous() && states1[k].numel() == numel &&
                    states2[k].numel() == numel, "adam8bit: uint8 contiguous states of the param's size");
    TORCH_CHECK(absmax1[k].scalar_type() == at::kFloat && absmax2[k].scalar_type() == at::kFloat &&
                    absmax1[k].is_contiguous() && absmax2[k].is_contiguous() && absmax1[k].numel() == blocks &&
                    absmax2[k].numel() == blocks, "adam8bit: one fp32 scale per block of 256");
    const bool half = !lows.empty() && lows[k].scalar_type() == at::kHalf;
    TORCH_CHECK(lows.empty() || ((half || lows[k].scalar_type() == at::kBFloat16) && lows[k].is_contiguous() &&
                                 lows[k].numel() == numel),
                "adam8bit: the low-precision span is bf16 or fp16, contiguous, of the param's size");
    // The scalars as torch takes them from Python's doubles.
    const double step = steps[k];
    Hyper8 h{};
    h.beta1 = static_cast<float>(beta1);
    h.omb1 = static_cast<float>(1.0 - beta1);
    h.beta2 = static_cast<float>(beta2);
    h.omb2 = static_cast<float>(1.0 - beta2);
    h.c2 = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, step)));
    h.eps = static_cast<float>(eps);
    h.decays = weight_decay > 0.0;
    h.decay = static_cast<float>(1.0 - lr * weight_decay);
    h.neg_step = static_cast<float>(-lr / (1.0 - std::pow(beta1, step)));
    h.coef = coef.has_value() ? static_cast<float>(*coef) : 1.0f;
    h.clamp = clamp.has_value() ? static_cast<float>(*clamp) : INFINITY;
    h.landed = landed;
    h.accumulate = accumulate;
    h.write_acc = landed || coef.has_value() || clamp.has_value();
    float* p = params[k].data_ptr<float>();
    float* acc = accs[k].data_ptr<float>();
    uint8_t* q1 = states1[k].data_ptr<uint8_t>();
    uint8_t* q2 = states2[k].data_ptr<uint8_t>();
    float* a1 = absmax1[k].data_ptr<float>();
    float* a2 = absmax2[k].data_ptr<float>();
    if (half) {
      run_piece8<at::Half>(h, {p, lows[k].data_ptr<at::Half>(), acc, q1, q2, a1, a2}, numel, map1, map2);
    } else {
      at::BFloat16* low = lows.empty() ? nullptr : lows[k].data_ptr<at::BFloat16>();
      run_piece8<at::BFloat16>(h, {p, low, acc, q1, q2, a1, a2}, numel, map1, map2);
    }
  }
}

// Elements per iteration: lengths given to adam_onepass are multiples of it.
int64_t lanes() { return kLanes; }

}  // namespace

// Called from Python, torch's dispatcher converts the arguments with the GIL held and releases it
// for the call: the CPU worker runs them beside Python threads (the autograd thread's hooks, a
// recomputation). The library's name is the build's (a digest of its source and flags).
TORCH_LIBRARY(TORCH_EXTENSION_NAME, library) {
  library.def("adam_onepass", &adam_onepass);  // one-pass Adam/AdamW of a chunk's members in mixed precision
  library.def("land", &land);  // a landing folded into the accumulator (unscaled and checked), the copy restored
  library.def("adam8bit", &adam8bit);  // bitsandbytes' block-wise 8-bit Adam of members' pieces, in one pass
  library.def("lanes", &lanes);
}
