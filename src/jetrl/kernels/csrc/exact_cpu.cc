// The exact sums of the `jet_exact` recipe on the CPU, as XLA FFI custom calls
// (jetrl/precision/cpu_kernels.py builds and registers them; docs/numerics.md, "Bitwise
// on-policy", says why every sum here has one value). Two handlers:
//
// JetrlExactFp8Gemm: the batch-invariant FP8 GEMM of jetrl.precision.exact.fp8_fprop,
//   y[m, n] = t_0 + t_1 + ... (float32, left to right), with per K block kb
//   t_kb = float32( dot64(xq[m, kb], q[kb, n]) * (double(sx[m, kb]) * double(sw[kb, n / B])) )
// xq [M, K] and q [K, N] are E4M3 bytes, sx [M, ceil(K/B)] and sw [ceil(K/B), ceil(N/B)]
// float32 scales, B <= 128 the block. Every E4M3 value is an integer multiple of 2^-9 below
// 2^9, so every product is exact in double and every partial sum of a block's at most 128
// products is an exact multiple of 2^-18 below 2^25: the block dot has one value whatever
// the order of its terms or whether they are fused (the micro-kernel below uses FMAs). The
// rest is the formula above in IEEE double and float arithmetic, which this file must be
// compiled not to contract (-ffp-contract=off): the same bits as the XLA computation.
//
// JetrlExactDot: a batched double dot of operands whose every partial sum is exact (the
// fixed-point grids of jetrl.kernels.exact_ops): one value in any order.
//
// Speed: rows of 4 x columns of 32 in 16 AVX-512 (or plain C) double accumulators, the
// weight block of a column strip converted to double once and reused by every row, the work
// split over XLA's intra-op thread pool by column strips (few rows) or row groups (many).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRows = 4;     // rows per micro-kernel call
constexpr int kCols = 32;    // columns per strip (4 vectors of 8 doubles)
constexpr int kMaxBlock = 128;

// E4M3 (fn: no infinities, S.1111.111 is NaN) byte -> double, exactly.
struct E4m3Table {
  double v[256];
  E4m3Table() {
    for (int i = 0; i < 256; ++i) {
      const int e = (i >> 3) & 15, f = i & 7;
      double x;
      if (e == 15 && f == 7) x = NAN;
      else if (e == 0) x = std::ldexp(static_cast<double>(f), -9);
      else x = std::ldexp(static_cast<double>(8 + f), e - 10);
      v[i] = (i & 128) ? -x : x;
    }
  }
};
const E4m3Table kE4m3;

// n E4M3 bytes -> double (exact), eight at a time with AVX-512: |v| = 2^(e - 7) (1 + f / 8)
// built from its bits for e >= 1, f 2^-9 for e = 0; the sign from bit 7; S.1111.111 is NaN.
inline void DecodeE4m3(const uint8_t* q, int64_t n, double* out) {
  int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  const __m512i k15 = _mm512_set1_epi64(15), k7 = _mm512_set1_epi64(7);
  const __m512i k7f = _mm512_set1_epi64(0x7F), bias = _mm512_set1_epi64(1023 - 7);
  const __m512d sub_unit = _mm512_set1_pd(1.0 / 512.0), nan = _mm512_set1_pd(NAN);
  for (; j + 8 <= n; j += 8) {
    const __m512i v = _mm512_cvtepu8_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + j)));
    const __m512i e = _mm512_and_si512(_mm512_srli_epi64(v, 3), k15);
    const __m512i f = _mm512_and_si512(v, k7);
    const __m512i normal = _mm512_or_si512(_mm512_slli_epi64(_mm512_add_epi64(e, bias), 52),
                                           _mm512_slli_epi64(f, 49));
    const __m512d sub = _mm512_mul_pd(_mm512_cvtepi64_pd(f), sub_unit);
    __m512d x = _mm512_mask_blend_pd(_mm512_cmpeq_epi64_mask(e, _mm512_setzero_si512()),
                                     _mm512_castsi512_pd(normal), sub);
    x = _mm512_castsi512_pd(_mm512_or_si512(_mm512_castpd_si512(x),
                                            _mm512_slli_epi64(_mm512_srli_epi64(v, 7), 63)));
    x = _mm512_mask_blend_pd(_mm512_cmpeq_epi64_mask(_mm512_and_si512(v, k7f), k7f), x, nan);
    _mm512_storeu_pd(out + j, x);
  }
#endif
  for (; j < n; ++j) out[j] = kE4m3.v[q[j]];
}

// acc[r][j] += sum_k x[r][k] * panel[k][j] for r < rows (x rows ldx apart), exactly.
inline void MicroKernel(const double* x, int64_t ldx, int rows, const double* panel, int64_t kn,
                        double acc[kRows][kCols]) {
#if defined(__AVX512F__)
  const double* xr[kRows];
  for (int r = 0; r < kRows; ++r) xr[r] = x + (r < rows ? r : 0) * ldx;
  __m512d a[kRows][4];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) a[r][c] = _mm512_loadu_pd(&acc[r][8 * c]);
  for (int64_t k = 0; k < kn; ++k) {
    const double* p = panel + k * kCols;
    const __m512d p0 = _mm512_load_pd(p), p1 = _mm512_load_pd(p + 8);
    const __m512d p2 = _mm512_load_pd(p + 16), p3 = _mm512_load_pd(p + 24);
    for (int r = 0; r < kRows; ++r) {
      const __m512d b = _mm512_set1_pd(xr[r][k]);
      a[r][0] = _mm512_fmadd_pd(b, p0, a[r][0]);
      a[r][1] = _mm512_fmadd_pd(b, p1, a[r][1]);
      a[r][2] = _mm512_fmadd_pd(b, p2, a[r][2]);
      a[r][3] = _mm512_fmadd_pd(b, p3, a[r][3]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_pd(&acc[r][8 * c], a[r][c]);
#else
  for (int r = 0; r < rows; ++r)
    for (int64_t k = 0; k < kn; ++k) {
      const double xv = x[r * ldx + k];
      for (int j = 0; j < kCols; ++j) acc[r][j] += xv * panel[k * kCols + j];
    }
#endif
}

// XLA's intra-op threads, or JETRL_EXACT_CPU_THREADS if set (>= 1).
int64_t Threads(ffi::ThreadPool& pool) {
  static const int64_t forced = [] {
    const char* v = std::getenv("JETRL_EXACT_CPU_THREADS");
    return (v && *v) ? std::max<int64_t>(std::atoll(v), 1) : 0;
  }();
  return forced ? forced : pool.num_threads();
}

// Runs fn(0), ..., fn(n - 1) on the calling thread and up to threads - 1 pool threads. Tasks
// that start after the last chunk was taken return at once (they hold only `state`).
void ParallelFor(ffi::ThreadPool& pool, int64_t n, const std::function<void(int64_t)>& fn) {
  const int64_t threads = std::min<int64_t>(Threads(pool), n);
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    int64_t n = 0;
    const std::function<void(int64_t)>* fn = nullptr;
  };
  auto state = std::make_shared<State>();
  state->n = n;
  state->fn = &fn;
  auto work = [state]() {
    for (int64_t i; (i = state->next.fetch_add(1)) < state->n;) {
      (*state->fn)(i);
      state->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t t = 1; t < threads; ++t) {
    auto task = work;  // Schedule takes the task by value (an rvalue)
    pool.Schedule(std::move(task));
  }
  work();
  while (state->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

ffi::Error ExactFp8GemmImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::U8> x,
                            ffi::Buffer<ffi::F32> sx, ffi::Buffer<ffi::U8> q,
                            ffi::Buffer<ffi::F32> sw, ffi::ResultBuffer<ffi::F32> y,
                            int64_t block) {
  const auto xd = x.dimensions(), qd = q.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || sx.dimensions().size() != 2 ||
      sw.dimensions().size() != 2 || y->dimensions().size() != 2)
    return ffi::Error::InvalidArgument("exact_fp8_gemm: operands must be rank 2");
  const int64_t M = xd[0], K = xd[1], N = qd[1];
  if (block < 1 || block > kMaxBlock)
    return ffi::Error::InvalidArgument("exact_fp8_gemm: block must be in [1, 128]");
  const int64_t nkb = (K + block - 1) / block, nnb = (N + block - 1) / block;
  if (qd[0] != K || sx.dimensions()[0] != M || sx.dimensions()[1] != nkb ||
      sw.dimensions()[0] != nkb || sw.dimensions()[1] != nnb || y->dimensions()[0] != M ||
      y->dimensions()[1] != N)
    return ffi::Error::InvalidArgument("exact_fp8_gemm: inconsistent operand shapes");
  const uint8_t* X = x.typed_data();
  const uint8_t* Q = q.typed_data();
  const float* SX = sx.typed_data();
  const float* SW = sw.typed_data();
  float* Y = y->typed_data();
  const int64_t strips = (N + kCols - 1) / kCols;
  const int64_t threads = std::max<int64_t>(Threads(pool), 1);

  // rows [r0, r1) x strips [s0, s1): the float32 outputs of those rows and columns.
  auto tile = [&](int64_t r0, int64_t r1, int64_t s0, int64_t s1) {
    const int64_t rows = r1 - r0;
    std::vector<double> xf(rows * K);
    DecodeE4m3(X + r0 * K, rows * K, xf.data());
    alignas(64) double panel[kMaxBlock * kCols];
    alignas(64) double acc[kRows][kCols];
    double swj[kCols];
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t n0 = s * kCols, nt = std::min<int64_t>(kCols, N - n0);
      for (int64_t kb = 0; kb < nkb; ++kb) {
        const int64_t k0 = kb * block, kn = std::min<int64_t>(block, K - k0);
        for (int64_t k = 0; k < kn; ++k) {
          const uint8_t* qr = Q + (k0 + k) * N + n0;
          double* pr = panel + k * kCols;
          DecodeE4m3(qr, nt, pr);
          for (int j = static_cast<int>(nt); j < kCols; ++j) pr[j] = 0.0;
        }
        for (int j = 0; j < kCols; ++j)
          swj[j] = j < nt ? static_cast<double>(SW[kb * nnb + (n0 + j) / block]) : 0.0;
        for (int64_t m = 0; m < rows; m += kRows) {
          const int rm = static_cast<int>(std::min<int64_t>(kRows, rows - m));
          std::fill(&acc[0][0], &acc[0][0] + kRows * kCols, 0.0);
          MicroKernel(xf.data() + m * K + k0, K, rm, panel, kn, acc);
          for (int r = 0; r < rm; ++r) {
            const double s = static_cast<double>(SX[(r0 + m + r) * nkb + kb]);
            float* yr = Y + (r0 + m + r) * N + n0;
            for (int j = 0; j < nt; ++j) {
              const float t = static_cast<float>(acc[r][j] * (s * swj[j]));
              yr[j] = kb == 0 ? t : yr[j] + t;
            }
          }
        }
      }
    }
  };

  // Many rows: row groups (each converts only its rows; the weight strips are converted once
  // per group). Few rows: column strips (the weight converted once in all).
  const int64_t min_rows = 64;
  if (M >= 2 * min_rows && threads > 1) {
    const int64_t groups = std::min<int64_t>(4 * threads, M / min_rows);
    const int64_t per = ((M + groups - 1) / groups + kRows - 1) / kRows * kRows;
    const int64_t n = (M + per - 1) / per;
    ParallelFor(pool, n, [&](int64_t i) {
      tile(i * per, std::min<int64_t>(M, (i + 1) * per), 0, strips);
    });
  } else {
    const int64_t n = std::min<int64_t>(strips, 4 * threads);
    ParallelFor(pool, n, [&](int64_t i) {
      tile(0, M, i * strips / n, (i + 1) * strips / n);
    });
  }
  return ffi::Error::Success();
}


// ------------------------------------------------------------------------------ exact dots
//
// c[t, m, n] = sum_k a[t, m, k] * b[t, k, n] (b [T, K, N]) or b[t, n, k] (b_nk: [T, N, K]) in
// double, for operands whose every partial sum is exact in double (jetrl.kernels.exact_ops puts
// them on fixed-point grids for that): the result is the one exact value, whatever the order of
// the terms. a is float32 or float64, b bfloat16 or float32; both are converted exactly.

inline double Bf16ToDouble(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return static_cast<double>(f);
}

// n contiguous values of `src` (of type `type`) -> double, exactly.
void ToDouble(const void* src, ffi::DataType type, int64_t n, double* dst) {
  switch (type) {
    case ffi::DataType::BF16: {
      const uint16_t* p = static_cast<const uint16_t*>(src);
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16) {  // bf16 -> float32 bits -> double, exactly
        const __m512i w = _mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i))),
            16);
        const __m512 f = _mm512_castsi512_ps(w);
        _mm512_storeu_pd(dst + i, _mm512_cvtps_pd(_mm512_castps512_ps256(f)));
        _mm512_storeu_pd(dst + i + 8, _mm512_cvtps_pd(_mm256_castpd_ps(
            _mm512_extractf64x4_pd(_mm512_castps_pd(f), 1))));
      }
#endif
      for (; i < n; ++i) dst[i] = Bf16ToDouble(p[i]);
      break;
    }
    case ffi::DataType::F32: {
      const float* p = static_cast<const float*>(src);
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 8 <= n; i += 8) _mm512_storeu_pd(dst + i, _mm512_cvtps_pd(_mm256_loadu_ps(p + i)));
#endif
      for (; i < n; ++i) dst[i] = static_cast<double>(p[i]);
      break;
    }
    default: {
      const double* p = static_cast<const double*>(src);
      std::copy(p, p + n, dst);
      break;
    }
  }
}

size_t ElementBytes(ffi::DataType type) {
  return type == ffi::DataType::BF16 ? 2 : type == ffi::DataType::F32 ? 4 : 8;
}

// sum_k x[k] * y[k] in eight interleaved partial sums (exact, so their order cannot matter).
inline double Dot(const double* x, const double* y, int64_t n) {
  double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int l = 0; l < 8; ++l) acc[l] += x[k + l] * y[k + l];
  for (; k < n; ++k) acc[0] += x[k] * y[k];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

ffi::Error ExactDotImpl(ffi::ThreadPool pool, ffi::AnyBuffer a, ffi::AnyBuffer b,
                        ffi::ResultBuffer<ffi::F64> c, bool b_nk) {
  const auto ad = a.dimensions(), bd = b.dimensions(), cd = c->dimensions();
  if (ad.size() != 3 || bd.size() != 3 || cd.size() != 3)
    return ffi::Error::InvalidArgument("exact_dot: operands must be rank 3");
  const ffi::DataType at = a.element_type(), bt = b.element_type();
  if ((at != ffi::DataType::F32 && at != ffi::DataType::F64) ||
      (bt != ffi::DataType::BF16 && bt != ffi::DataType::F32))
    return ffi::Error::InvalidArgument("exact_dot: a must be f32 / f64, b bf16 / f32");
  const int64_t T = ad[0], M = ad[1], K = ad[2];
  const int64_t N = b_nk ? bd[1] : bd[2];
  if (bd[0] != T || (b_nk ? bd[2] : bd[1]) != K || cd[0] != T || cd[1] != M || cd[2] != N)
    return ffi::Error::InvalidArgument("exact_dot: inconsistent operand shapes");
  const char* A = static_cast<const char*>(a.untyped_data());
  const char* B = static_cast<const char*>(b.untyped_data());
  const size_t ab = ElementBytes(at), bb = ElementBytes(bt);
  double* C = c->typed_data();
  const int64_t threads = std::max<int64_t>(Threads(pool), 1);

  // b [N, K]: one converted key row at a time, dotted with every row of a.
  auto nk_part = [&](int64_t t, int64_t n0, int64_t n1) {
    std::vector<double> ar(M * K), br(K);
    ToDouble(A + t * M * K * ab, at, M * K, ar.data());
    for (int64_t n = n0; n < n1; ++n) {
      ToDouble(B + (t * N + n) * K * bb, bt, K, br.data());
      for (int64_t m = 0; m < M; ++m) C[(t * M + m) * N + n] = Dot(ar.data() + m * K, br.data(), K);
    }
  };
  // b [K, N]: strips of columns, each converted in chunks of K once for all rows of a.
  auto kn_part = [&](int64_t t, int64_t s0, int64_t s1) {
    const int64_t mb = (M + kRows - 1) / kRows;
    std::vector<double> ar(M * K), accs(mb * kRows * kCols);
    ToDouble(A + t * M * K * ab, at, M * K, ar.data());
    alignas(64) double panel[kMaxBlock * kCols];
    for (int64_t s = s0; s < s1; ++s) {
      const int64_t n0 = s * kCols, nt = std::min<int64_t>(kCols, N - n0);
      std::fill(accs.begin(), accs.end(), 0.0);
      for (int64_t k0 = 0; k0 < K; k0 += kMaxBlock) {
        const int64_t kn = std::min<int64_t>(kMaxBlock, K - k0);
        for (int64_t k = 0; k < kn; ++k) {
          double* pr = panel + k * kCols;
          ToDouble(B + ((t * K + k0 + k) * N + n0) * bb, bt, nt, pr);
          for (int j = static_cast<int>(nt); j < kCols; ++j) pr[j] = 0.0;
        }
        for (int64_t i = 0; i < mb; ++i) {
          const int rm = static_cast<int>(std::min<int64_t>(kRows, M - i * kRows));
          MicroKernel(ar.data() + i * kRows * K + k0, K, rm, panel, kn,
                      reinterpret_cast<double(*)[kCols]>(accs.data() + i * kRows * kCols));
        }
      }
      for (int64_t m = 0; m < M; ++m)
        for (int j = 0; j < nt; ++j) C[(t * M + m) * N + n0 + j] = accs[m * kCols + j];
    }
  };
  const int64_t cols = b_nk ? N : (N + kCols - 1) / kCols;   // keys, or column strips
  // Work items: (t, a range of columns); about 4 per thread, at least 8 columns each.
  const int64_t per_t = std::max<int64_t>(1, std::min<int64_t>(
      (4 * threads + T - 1) / T, cols / (b_nk ? 8 : 1)));
  ParallelFor(pool, T * per_t, [&](int64_t i) {
    const int64_t t = i / per_t, j = i % per_t;
    const int64_t c0 = j * cols / per_t, c1 = (j + 1) * cols / per_t;
    if (b_nk) nk_part(t, c0, c1);
    else kn_part(t, c0, c1);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JetrlExactFp8Gemm, ExactFp8GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("block"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JetrlExactDot, ExactDotImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F64>>()
                                  .Attr<bool>("b_nk"));
